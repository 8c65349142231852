"""``rabenseifner``: reduce-scatter by recursive halving, all-gather by doubling.

Rabenseifner's algorithm ("Optimization of collective reduction operations",
ICCS 2004; Thakur, Rabenseifner and Gropp, IJHPCA 2005). With p' = 2^k ranks
and the buffer cut into p' chunks: at each of k halving steps a rank
exchanges half of its current range with the partner v XOR 2^j and keeps
the combined other half, until it holds the reduction of one chunk; k
doubling steps then gather the chunks back. When p is not a power of two the
extra ranks are folded in and out as in ``recursive_doubling``.

Messages per rank: 2 log2(p') (+2 for folded ranks), sending
2(p'-1)/p' * n elements: as little data as the ring in log2 instead of
p-1 steps, which pays when each step is expensive (oversubscribed ranks
wait for the scheduler at every step). Each chunk is reduced on exactly one
rank and copied, so the result is bit-identical everywhere.
"""
from __future__ import annotations

from collectives.algorithms.recursive_doubling import fold_in, fold_out, roles
from collectives.registry import register
from collectives.schedule import (COPY, REDUCE_INCOMING_FIRST, REDUCE_MINE_FIRST, Round,
                                  Schedule, chunk_bounds, exchange)


@register("rabenseifner",
          summary="reduce-scatter by recursive halving + all-gather by recursive doubling",
          messages="2 log2(p') messages of n/2, n/4, ... elements (+2 for folded ranks)")
def schedule(rank: int, size: int, n: int) -> Schedule:
    p, r = size, rank
    if p == 1:
        return Schedule(())
    role, partners = roles(r, p)  # partners[j] = real rank of v XOR 2^j
    pof2 = 1 << (p.bit_length() - 1)
    rem = p - pof2
    steps = pof2.bit_length() - 1
    rounds = [fold_in(r, role, n)] if rem else []
    if role == "out":
        rounds += [Round()] * (2 * steps)
    else:
        virtual = r // 2 if r < 2 * rem else r - rem
        bounds = chunk_bounds(n, pof2)

        def elements(first: int, last: int) -> tuple[int, int]:
            return bounds[first], bounds[last]

        lo, hi = 0, pof2
        for j in reversed(range(steps)):  # halving: give one half, keep the other
            mid = (lo + hi) // 2
            keep, give = ((lo, mid), (mid, hi)) if not virtual >> j & 1 else ((mid, hi), (lo, mid))
            partner = partners[j]
            action = REDUCE_INCOMING_FIRST if partner < r else REDUCE_MINE_FIRST
            rounds.append(exchange(partner, elements(*give), elements(*keep), action))
            lo, hi = keep
        for j, partner in enumerate(partners):  # doubling: copies only
            width = 1 << j
            mine = virtual // width * width
            theirs = (virtual ^ width) // width * width
            rounds.append(exchange(partner, elements(mine, mine + width),
                                   elements(theirs, theirs + width), COPY, span=None))
    if rem:
        rounds.append(fold_out(r, role, n))
    return Schedule(tuple(rounds))
