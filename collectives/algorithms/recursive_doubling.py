"""``recursive_doubling``: log2(p) pairwise exchanges of the whole buffer.

At step k (k = 0 .. log2(p)-1) rank v exchanges its buffer with rank
v XOR 2^k and both combine the two, so after log2(p) steps every rank holds
the reduction of all p buffers (Thakur, Rabenseifner and Gropp, "Optimization
of Collective Communication Operations in MPICH", IJHPCA 2005). When p is
not a power of two, with p' the largest power of two below p and
r = p - p', the first 2r ranks pair up: each even one hands its buffer to
the odd one above it and sits out, and gets the result back at the end.

Messages per rank: log2(p') exchanges of n elements (+1 for the ranks
folded in and out, +1 for their partners). Latency-optimal for small
buffers; sends n log2(p) elements, so not for large ones. Both partners of
an exchange combine the same two operands in the same order (the lower
rank's first), so every rank ends with bit-identical values.
"""
from __future__ import annotations

from collectives.registry import register
from collectives.schedule import (COPY, REDUCE_INCOMING_FIRST, REDUCE_MINE_FIRST, Recv, Round,
                                  Schedule, Send, exchange)


def roles(rank: int, size: int) -> tuple[str, list[int]]:
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


def fold_in(rank: int, role: str, n: int) -> Round:
    """The round before the exchanges: folded ranks hand their buffers over."""
    if role == "out":
        return Round(sends=(Send(rank + 1, 0, n),))
    if role == "host":  # the folded rank r-1 is lower: its operand first
        return Round(recvs=(Recv(rank - 1, 0, n, REDUCE_INCOMING_FIRST),))
    return Round()


def fold_out(rank: int, role: str, n: int) -> Round:
    """The round after the exchanges: hosts return the result."""
    if role == "out":
        return Round(recvs=(Recv(rank + 1, 0, n, COPY),))
    if role == "host":
        return Round(sends=(Send(rank - 1, 0, n),))
    return Round()


@register("recursive_doubling",
          summary="log2(p) pairwise exchanges of the whole buffer; extra ranks folded in",
          messages="log2(p') exchanges of n elements (+2 for the folded ranks)")
def schedule(rank: int, size: int, n: int) -> Schedule:
    if size == 1:
        return Schedule(())
    role, partners = roles(rank, size)
    pof2 = 1 << (size.bit_length() - 1)
    rounds = []
    if pof2 != size:
        rounds.append(fold_in(rank, role, n))
    for k in range(pof2.bit_length() - 1):
        if role == "out":
            rounds.append(Round())
            continue
        partner = partners[k]
        action = REDUCE_INCOMING_FIRST if partner < rank else REDUCE_MINE_FIRST
        rounds.append(exchange(partner, (0, n), (0, n), action))
    if pof2 != size:
        rounds.append(fold_out(rank, role, n))
    return Schedule(tuple(rounds))
