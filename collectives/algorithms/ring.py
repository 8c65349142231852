"""``ring``: reduce-scatter then all-gather around a ring of p chunks.

The buffer is cut into p near-equal chunks. In the reduce-scatter, at step
s = 0 .. p-2 rank r sends chunk (r - s) mod p to rank r+1 and receives chunk
(r - s - 1) mod p from rank r-1, which it combines into its own: after p-1
steps rank r holds the full reduction of chunk (r + 1) mod p. The all-gather
passes the reduced chunks around the ring in p-1 more steps (Patarasuk and
Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
workstations", JPDC 2009).

Messages per rank: 2(p-1) of n/p elements, i.e. 2(p-1)/p * n elements sent,
the minimum for an all-reduce: bandwidth-optimal for large buffers, but
2(p-1) latencies for small ones. Each chunk is reduced once, along the ring
(the incoming partial, from lower in the chain, first), and then copied, so
every rank holds bit-identical values.
"""
from __future__ import annotations

from collectives.registry import register
from collectives.schedule import COPY, REDUCE_INCOMING_FIRST, Recv, Round, Schedule, Send, \
    chunk_bounds


@register("ring", summary="reduce-scatter + all-gather around a ring (bandwidth-optimal)",
          messages="2(p-1) messages of n/p elements")
def schedule(rank: int, size: int, n: int) -> Schedule:
    p, r = size, rank
    if p == 1:
        return Schedule(())
    right, left = (r + 1) % p, (r - 1) % p
    bounds = chunk_bounds(n, p)
    # Every rank cuts every message by the longest chunk, so the two ends of
    # a message always agree on its pieces.
    span = max(bounds[c + 1] - bounds[c] for c in range(p))

    def chunk(c: int) -> tuple[int, int]:
        return bounds[c % p], bounds[c % p + 1]

    rounds = [Round((Send(right, *chunk(r - s)),),
                    (Recv(left, *chunk(r - s - 1), REDUCE_INCOMING_FIRST),), span)
              for s in range(p - 1)]
    rounds += [Round((Send(right, *chunk(r + 1 - s)),), (Recv(left, *chunk(r - s), COPY),), None)
               for s in range(p - 1)]  # copied on arrival: not cut
    return Schedule(tuple(rounds))
