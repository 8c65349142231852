"""``recursive_doubling``: log2(p) pairwise exchanges of the whole buffer.

At step k (k = 0 .. log2(p)-1) rank v exchanges its buffer with rank
v XOR 2^k and both combine the two, so after log2(p) steps every rank holds
the reduction of all p buffers (Thakur, Rabenseifner and Gropp, "Optimization
of Collective Communication Operations in MPICH", IJHPCA 2005). When p is
not a power of two, with p' the largest power of two below p and
r = p - p', the first 2r ranks pair up: each even one hands its buffer to
the odd one above it and sits out, and gets the result back at the end.

Messages per rank: log2(p') exchanges of n elements (+1 send for the ranks
folded in and out, +1 for their partners). Latency-optimal for small
buffers; sends n*log2(p) elements, so not for large ones. Both partners of
an exchange combine the same two operands in the same order (the lower
rank's first), so every rank ends with bit-identical values.
"""
from __future__ import annotations

from typing import Any, Callable

from collectives.context import PlanContext, split
from collectives.registry import register
from collectives.runtime import MPI
from collectives.shm import copy_mode_for, exchange_step, in_sequence, paired, slot_pieces


def schedule(rank: int, size: int) -> tuple[str, list[int]]:
    """This rank's role and exchange partners (as real ranks).

    Role ``"out"``: folded out (send to rank+1 first, receive the result from
    it at the end); ``"host"``: receives a folded rank's buffer first and
    returns the result at the end; ``"plain"``: exchanges only.
    """
    pof2 = 1 << (size.bit_length() - 1)
    rem = size - pof2
    if rank < 2 * rem and rank % 2 == 0:
        return "out", []
    if rank < 2 * rem:
        role, virtual = "host", rank // 2
    else:
        role, virtual = "plain", rank - rem

    def real(v: int) -> int:
        return 2 * v + 1 if v < rem else v + rem

    partners = []
    mask = 1
    while mask < pof2:
        partners.append(real(virtual ^ mask))
        mask <<= 1
    return role, partners


@register("recursive_doubling",
          summary="log2(p) pairwise exchanges of the whole buffer; extra ranks folded in",
          messages="log2(p') exchanges of n elements (+2 for the folded ranks)",
          host_only=paired)
def plan_recursive_doubling(ctx: PlanContext) -> Callable[[Any], Callable[[], None]]:
    p, r, n = ctx.size, ctx.rank, ctx.n
    if p == 1:
        return lambda view: (lambda: None)
    if paired(ctx):
        return _plan_shared(ctx)
    role, partners = schedule(r, p)
    tmp = ctx.empty(n) if role != "out" else None
    combine = ctx.combine
    exchange, send, recv = ctx.make_exchange(), ctx.make_send(), ctx.make_recv()
    pieces = [lo_hi for lo_hi, _ in ctx.pieces((0, n), (0, n))]

    def bind(view: Any) -> Callable[[], None]:
        ops: list[tuple[Callable, tuple]] = []
        specs = [(ctx.spec(view[lo:hi]), view[lo:hi]) for lo, hi in pieces]
        if role == "out":
            ops += [(send, (spec, r + 1)) for spec, _ in specs]
            ops += [(recv, (spec, r + 1)) for spec, _ in specs]
        else:
            temps = [(ctx.spec(tmp[lo:hi]), tmp[lo:hi]) for lo, hi in pieces]
            if role == "host":  # the folded rank r-1 is lower: its operand first
                for (_, part), (tspec, t) in zip(specs, temps):
                    ops += [(recv, (tspec, r - 1)), (combine, (t, part, part))]
            for partner in partners:
                for (spec, part), (tspec, t) in zip(specs, temps):
                    operands = (t, part, part) if partner < r else (part, t, part)
                    ops += [(exchange, (spec, partner, tspec, partner)), (combine, operands)]
            if role == "host":
                ops += [(send, (spec, r - 1)) for spec, _ in specs]
        if len(ops) == 2 and ops[0][0] is exchange:  # p = 2, one piece: the hot case
            (_, xargs), (_, cargs) = ops
            a, b, out = cargs
            send_spec, dest, recv_spec, source = xargs
            # exchange() inlined: one Python call less on the latency-critical path.
            sendrecv, tag, any_tag, status = ctx.comm.Sendrecv, ctx.tag, MPI.ANY_TAG, MPI.Status()

            def run_pair() -> None:
                try:
                    sendrecv(send_spec, dest, tag, recv_spec, source, any_tag, status)
                except MPI.Exception as error:
                    ctx.fail(source, None, error)
                if status.tag != tag:
                    ctx.fail(source, status.tag)
                combine(a, b, out)

            return run_pair

        def run() -> None:
            for fn, args in ops:
                fn(*args)

        return run

    return bind


def _plan_shared(ctx: PlanContext) -> Callable[[Any], Callable[[], None]]:
    """p = 2 on one node: the exchange through :class:`collectives.shm.SharedPair`.

    A buffer larger than a slot goes through in consecutive slot-sized
    chunks, each one exchange (its own sequence number); the two slots
    alternate, so a rank copies chunk c+1 in while its peer still combines
    chunk c.
    """
    pieces = split(0, ctx.n, slot_pieces(ctx, ctx.n))
    peer_first = ctx.pair.peer < ctx.rank  # the lower rank's operand first, on both ranks
    combine = ctx.combine
    mode = copy_mode_for(ctx, max(hi - lo for lo, hi in pieces) * ctx.dtype.itemsize)

    def bind(view: Any) -> Callable[[], None]:
        runs = []
        for c, (lo, hi) in enumerate(pieces):
            part = view[lo:hi]
            runs.append(exchange_step(
                ctx, part, part.size, combine,
                lambda other: (other, part, part) if peer_first else (part, other, part),
                first=c == 0, mode=mode))
        return in_sequence(runs, mode)

    return bind
