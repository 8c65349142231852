"""``native``: the MPI library's own ``MPI_Allreduce``, the reference.

Messages: whatever the library chooses (MPICH on one node: shared-memory
collectives for small buffers, reduce-scatter + all-gather for large ones).
Special float values follow the rule of :mod:`collectives.combine` like every
other algorithm: a sum's NaNs are made canonical after the call (MPI adds in
an order that differs between ranks), and max/min on floats use a
user-defined operation with the rule (``MPI_MAX`` keeps or drops a NaN
depending on operand order), which runs on host memory.

Like every algorithm, ``native`` publishes each call's signature tag; where
the ranks share memory, each rank then reads its peers' tags of the same
call, so ranks that made different calls of equal byte counts (which MPI
cannot tell apart) raise :class:`~collectives.errors.AllreduceMismatch` on
every rank instead of returning wrong numbers
(:mod:`collectives.consistency`, point 4).
"""
from __future__ import annotations

from typing import Any, Callable

from collectives.combine import mpi_op
from collectives.context import PlanContext
from collectives.registry import register_library
from collectives.runtime import MPI


def _user_op(ctx: PlanContext) -> bool:
    return ctx.dtype.kind == "f" and ctx.op != "sum"


@register_library("native", summary="the MPI library's MPI_Allreduce (in place), the reference",
                  messages="chosen by the MPI library", host_only=_user_op)
def plan_native(ctx: PlanContext) -> Callable[[Any], Callable[[], None]]:
    """In-place ``MPI_Allreduce`` over the private communicator."""
    if ctx.size == 1 or ctx.n == 0:
        # Nothing to combine; and a zero-length MPI_Allreduce need not wait
        # for the peers, so it would break the order check's premise.
        return lambda view: (lambda: None)
    allreduce, in_place = ctx.comm.Allreduce, MPI.IN_PLACE
    operation = mpi_op(ctx.op, ctx.dtype, MPI) if _user_op(ctx) else ctx.mpi_op
    if _user_op(ctx):
        ctx.on_release.append(operation.Free)
    canonical = ctx.space.canonicalizer(ctx.dtype) if ctx.op == "sum" else None
    enter, verify = ctx.enter_blind, ctx.verify_blind

    def bind(view: Any) -> Callable[[], None]:
        spec = ctx.typed_spec(view)

        def run() -> None:
            call = enter()  # peers may read it (collectives.consistency, points 3 and 4)
            try:
                allreduce(in_place, spec, operation)
            except MPI.Exception as error:
                ctx.fail(None, None, error)
            if canonical is not None:
                canonical(view)
            verify(call)

        return run

    return bind
