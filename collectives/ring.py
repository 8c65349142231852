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
2(p-1) latencies for small ones. Each chunk is reduced once, along the ring,
and then copied, so every rank holds bit-identical values. A chunk longer
than the segment size is sent in pieces, each combined right after it
arrives, while it is still in cache.
"""
from __future__ import annotations

from typing import Any, Callable

from collectives.context import PlanContext, chunk_bounds
from collectives.registry import register


@register("ring", summary="reduce-scatter + all-gather around a ring (bandwidth-optimal)",
          messages="2(p-1) messages of n/p elements")
def plan_ring(ctx: PlanContext) -> Callable[[Any], Callable[[], None]]:
    p, r, n = ctx.size, ctx.rank, ctx.n
    if p == 1:
        return lambda view: (lambda: None)
    right, left = (r + 1) % p, (r - 1) % p
    bounds = chunk_bounds(n, p)

    def chunk(c: int) -> tuple[int, int]:
        return bounds[c % p], bounds[c % p + 1]

    # Every rank cuts every chunk into the same number of pieces.
    count = ctx.piece_count(max(bounds[c + 1] - bounds[c] for c in range(p)))
    reduce_steps = [ctx.pieces(chunk(r - s), chunk(r - s - 1), count) for s in range(p - 1)]
    gather_steps = [(chunk(r + 1 - s), chunk(r - s)) for s in range(p - 1)]
    longest = max((hi - lo for step in reduce_steps for _, (lo, hi) in step), default=0)
    tmp = ctx.empty(longest)
    combine, exchange = ctx.combine, ctx.make_exchange()

    def bind(view: Any) -> Callable[[], None]:
        reduce_ops = []
        for step in reduce_steps:
            for (slo, shi), (rlo, rhi) in step:
                t = tmp[:rhi - rlo]
                mine = view[rlo:rhi]
                # The incoming partial comes from lower in the chain: first operand.
                reduce_ops.append((ctx.spec(view[slo:shi]), ctx.spec(t), t, mine))
        gather_ops = [(ctx.spec(view[slo:shi]), ctx.spec(view[rlo:rhi]))
                      for (slo, shi), (rlo, rhi) in gather_steps]

        def run() -> None:
            for send, recv, t, mine in reduce_ops:
                exchange(send, right, recv, left)
                combine(t, mine, mine)
            for send, recv in gather_ops:
                exchange(send, right, recv, left)

        return run

    return bind
