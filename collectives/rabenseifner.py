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

from typing import Any, Callable

from collectives.context import PlanContext, chunk_bounds
from collectives.recursive_doubling import schedule
from collectives.registry import register


@register("rabenseifner",
          summary="reduce-scatter by recursive halving + all-gather by recursive doubling",
          messages="2 log2(p') messages of n/2, n/4, ... elements (+2 for folded ranks)")
def plan_rabenseifner(ctx: PlanContext) -> Callable[[Any], Callable[[], None]]:
    p, r, n = ctx.size, ctx.rank, ctx.n
    if p == 1:
        return lambda view: (lambda: None)
    role, partners = schedule(r, p)  # partners[j] = real rank of v XOR 2^j
    pof2 = 1 << (p.bit_length() - 1)
    rem = p - pof2
    virtual = r // 2 if r < 2 * rem else r - rem
    bounds = chunk_bounds(n, pof2)

    def elements(chunks: tuple[int, int]) -> tuple[int, int]:
        return bounds[chunks[0]], bounds[chunks[1]]

    halving = []  # (partner, send range, keep range)
    lo, hi = 0, pof2
    for j in reversed(range(len(partners))):
        mid = (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if not virtual >> j & 1 else ((mid, hi), (lo, mid))
        halving.append((partners[j], ctx.pieces(elements(give), elements(keep))))
        lo, hi = keep
    doubling = []  # (partner, send range, receive range)
    for j, partner in enumerate(partners):
        size = 1 << j
        mine = (virtual // size * size, virtual // size * size + size)
        theirs = (virtual ^ size) // size * size
        doubling.append((partner, elements(mine), elements((theirs, theirs + size))))

    longest = max((b - a for _, step in halving for _, (a, b) in step), default=0)
    tmp = ctx.empty(n if role == "host" else longest) if role != "out" else None
    fold = [lo_hi for lo_hi, _ in ctx.pieces((0, n), (0, n))]
    combine = ctx.combine
    exchange, send, recv = ctx.make_exchange(), ctx.make_send(), ctx.make_recv()

    def bind(view: Any) -> Callable[[], None]:
        ops: list[tuple[Callable, tuple]] = []
        whole = [(ctx.spec(view[a:b]), a, b) for a, b in fold]
        if role == "out":
            ops += [(send, (spec, r + 1)) for spec, _, _ in whole]
            ops += [(recv, (spec, r + 1)) for spec, _, _ in whole]
        else:
            if role == "host":  # rank r-1 is folded into this one; its operand first
                for spec, a, b in whole:
                    t, part = tmp[:b - a], view[a:b]
                    ops += [(recv, (ctx.spec(t), r - 1)), (combine, (t, part, part))]
            for partner, step in halving:
                for (sa, sb), (ka, kb) in step:
                    t, part = tmp[:kb - ka], view[ka:kb]
                    operands = (t, part, part) if partner < r else (part, t, part)
                    ops += [(exchange, (ctx.spec(view[sa:sb]), partner, ctx.spec(t), partner)),
                            (combine, operands)]
            for partner, (sa, sb), (ra, rb) in doubling:  # copies only: never cut
                ops.append((exchange, (ctx.spec(view[sa:sb]), partner,
                                       ctx.spec(view[ra:rb]), partner)))
            if role == "host":
                ops += [(send, (spec, r - 1)) for spec, _, _ in whole]

        def run() -> None:
            for fn, args in ops:
                fn(*args)

        return run

    return bind
