"""``native``: the MPI library's own ``MPI_Allreduce``, the reference.

Messages: whatever the library chooses (MPICH on one node: shared-memory
collectives for small buffers, reduce-scatter + all-gather for large ones).
Special float values follow the rule of :mod:`collectives.core.combine` like every
other algorithm: a sum's NaNs are made canonical after the call (MPI adds in
an order that differs between ranks), and max/min on floats use a
user-defined operation with the rule (``MPI_MAX`` keeps or drops a NaN
depending on operand order), which runs on host memory.

Like every algorithm, ``native`` publishes each call's signature tag; where
the ranks share memory, each rank then reads its peers' tags of the same
call, so ranks that made different calls of equal byte counts (which MPI
cannot tell apart) raise :class:`~collectives.errors.AllreduceMismatch` on
every rank instead of returning wrong numbers
(:mod:`collectives.core.consistency`, point 4). There it also registers a
*release*: a rank that leaves the communicator while a peer waits in this
call's ``MPI_Allreduce`` joins it with scratch data, and the peer's check
raises instead of waiting for ever.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from collectives.core.combine import mpi_op
from collectives.core.context import PlanContext
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
    # a float max/min: the one shared operation of (op, dtype), freed at MPI_Finalize
    operation = mpi_op(ctx.op, ctx.dtype, MPI) if _user_op(ctx) else ctx.mpi_op
    canonical = ctx.space.canonicalizer(ctx.dtype) if ctx.op == "sum" else None
    enter, verify = ctx.enter_blind, ctx.verify_blind
    if ctx.releases is not None:
        releases, tag = ctx.releases, ctx.tag
        releases[tag] = _release(ctx, operation)
        ctx.on_release.append(lambda: releases.pop(tag, None))

    def bind(view: Any) -> Callable[[], None]:
        spec = ctx.typed_spec(view)

        def run() -> None:
            call = enter()  # peers may read it (collectives.core.consistency, points 3 and 4)
            try:
                allreduce(in_place, spec, operation)
            except MPI.Exception as error:
                ctx.fail(None, None, error)
            if canonical is not None:
                canonical(view)
            verify(call)

        return run

    return bind


def _release(ctx: PlanContext, operation: "MPI.Op") -> Callable[[Callable[[], int]], None]:
    """``release(mark)``: join a peer's ``MPI_Allreduce`` of this signature
    with scratch data, after ``mark()`` published this rank's blind call of
    that number as :data:`~collectives.core.consistency.RELEASE_TAG` (the peer's
    order check then raises). On host memory: MPI matches by type and
    count only."""
    allreduce, in_place = ctx.comm.Allreduce, MPI.IN_PLACE
    n, dtype, mpi_type = ctx.n, ctx.dtype, ctx.mpi_type

    def release(mark: Callable[[], int]) -> None:
        scratch = np.zeros(n, dtype=dtype)
        mark()
        allreduce(in_place, [scratch, mpi_type], operation)

    return release
