"""``naive``: every rank sends its whole buffer to every other rank.

The seed project's "from scratch" all-reduce, kept as the baseline. Each rank
posts its buffer to the p-1 others and receives theirs (2(p-1) messages of n
elements per rank, p-1 buffers of n elements of temporary memory), then
combines all p contributions in rank order, so the result is the same
sequence of operations, hence bit-identical, on every rank.
"""
from __future__ import annotations

from typing import Any, Callable

from collectives.context import PlanContext
from collectives.registry import register
from collectives.runtime import MPI


@register("naive", summary="every rank sends its buffer to every other rank; sum in rank order",
          messages="2(p-1) messages of n elements")
def plan_naive(ctx: PlanContext) -> Callable[[Any], Callable[[], None]]:
    p, r, n = ctx.size, ctx.rank, ctx.n
    if p == 1:
        return lambda view: (lambda: None)
    others = [q for q in range(p) if q != r]
    # Row q holds rank q's contribution; our own row is only needed when we
    # come third or later (the running result overwrites our buffer).
    rows = ctx.empty(p * n).reshape(p, n)
    combine, tag, comm = ctx.combine, ctx.tag, ctx.comm
    isend, irecv, any_tag = comm.Isend, comm.Irecv, MPI.ANY_TAG
    waitall = MPI.Request.Waitall

    def bind(view: Any) -> Callable[[], None]:
        send = ctx.spec(view)
        recvs = [(ctx.spec(rows[q]), q) for q in others]
        statuses = [MPI.Status() for _ in range(2 * len(others))]
        keep_own = r >= 2
        own_row = rows[r]
        contribution = [rows[q] if q != r else (own_row if keep_own else view)
                        for q in range(p)]
        first, second = contribution[0], contribution[1]
        rest = contribution[2:]

        def run() -> None:
            requests = [irecv(spec, q, any_tag) for spec, q in recvs]
            requests += [isend(send, q, tag) for q in others]
            try:
                waitall(requests, statuses)
            except MPI.Exception as error:
                ctx.fail(None, None, error)
            ctx.check_statuses(statuses, others)
            if keep_own:
                own_row[...] = view
            combine(first, second, view)
            for part in rest:
                combine(view, part, view)

        return run

    return bind
