"""``native``: the MPI library's own ``MPI_Allreduce``, the reference.

Messages: whatever the library chooses (MPICH on one node: shared-memory
collectives for small buffers, reduce-scatter + all-gather for large ones).
"""
from __future__ import annotations

from typing import Any, Callable

from collectives.context import PlanContext
from collectives.registry import register_library
from collectives.runtime import MPI


@register_library("native", summary="the MPI library's MPI_Allreduce (in place), the reference",
                  messages="chosen by the MPI library")
def plan_native(ctx: PlanContext) -> Callable[[Any], Callable[[], None]]:
    """In-place ``MPI_Allreduce`` over the private communicator."""
    allreduce, in_place, mpi_op = ctx.comm.Allreduce, MPI.IN_PLACE, ctx.mpi_op
    calls, tag = ctx.blind_calls, ctx.tag

    def bind(view: Any) -> Callable[[], None]:
        spec = ctx.typed_spec(view)

        def run() -> None:
            calls[1] = tag  # peers may read these (collectives.consistency, point 3)
            calls[0] += 1
            allreduce(in_place, spec, mpi_op)

        return run

    return bind
