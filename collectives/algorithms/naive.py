"""``naive``: every rank sends its whole buffer to every other rank.

The seed project's "from scratch" all-reduce, kept as the baseline. In one
round each rank sends its buffer to the p-1 others and receives theirs
(2(p-1) messages of n elements per rank, p-1 buffers of n elements of
temporary memory), then combines all p contributions in rank order, so the
result is the same sequence of operations, hence bit-identical, on every
rank.
"""
from __future__ import annotations

from collectives.registry import register
from collectives.schedule import STASH, Recv, Round, Schedule, Send


@register("naive", summary="every rank sends its buffer to every other rank; sum in rank order",
          messages="2(p-1) messages of n elements")
def schedule(rank: int, size: int, n: int) -> Schedule:
    if size == 1:
        return Schedule(())
    others = [q for q in range(size) if q != rank]
    return Schedule((Round(tuple(Send(q, 0, n) for q in others),
                           tuple(Recv(q, 0, n, STASH) for q in others)),), stash=True)
