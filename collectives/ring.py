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

With p = 2 on one node the two steps go through the shared-memory pair
(:mod:`collectives.shm`) instead of MPI point-to-point messages: each rank
copies the half its peer owns into its slot and combines the peer's copy of
its own half from the peer's slot, then publishes its reduced half and
copies the peer's. Halves go in pieces of at most ``SHARED_PIECE_BYTES``,
each piece all-gathered right after its reduce-scatter, while it is still in
cache (this kept 11-16 GB/s busbw at 16-64 MiB, where whole-slot pieces
reduced first and gathered after fell to 6 GB/s). Each copy into a slot is
cached or streaming (non-temporal stores, straight to memory), chosen call
by call from measured times (:mod:`collectives.copy_mode`): which one
hands a piece to the other core faster depends on whether the two cores
share a cache, and on a virtual machine that changes while a job runs.

With p >= 3 ranks all on one node the same ring runs through the node's
shared window (:mod:`collectives.shm_group`): each step is a copy (or a
combine) into this rank's slot, a published step counter, and a read from
the left neighbour's slot. The buffer goes around in segments of
``shm_group.SEGMENT_BYTES``, each a whole reduce-scatter and all-gather.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from collectives import futex
from collectives.context import PlanContext, chunk_bounds, split
from collectives.errors import AllreduceError
from collectives.registry import register
from collectives.shm import copy_mode_for, exchange_step, in_sequence, paired, slot_pieces
from collectives.shm_group import FAILED, grouped


def _shared(ctx: PlanContext) -> bool:
    return paired(ctx) or grouped(ctx)


@register("ring", summary="reduce-scatter + all-gather around a ring (bandwidth-optimal)",
          messages="2(p-1) messages of n/p elements", host_only=_shared)
def plan_ring(ctx: PlanContext) -> Callable[[Any], Callable[[], None]]:
    p, r, n = ctx.size, ctx.rank, ctx.n
    if p == 1:
        return lambda view: (lambda: None)
    if paired(ctx):
        return _plan_shared(ctx)
    if grouped(ctx):
        return _plan_group(ctx)
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


#: Largest piece of a half exchanged at once through the shared pair (512 KiB:
#: with 4 MiB pieces the ring fell to 6.2-6.4 GB/s busbw at 16-64 MiB, with
#: 0.5-1 MiB pieces it kept 11.5-15.6; `mpidp bench allreduce`, 2 ranks). Each
#: piece's all-gather follows its reduce-scatter, so the piece just reduced is
#: still in cache when it is published.
SHARED_PIECE_BYTES = 1 << 19


def _plan_shared(ctx: PlanContext) -> Callable[[Any], Callable[[], None]]:
    """p = 2 on one node: both ring steps through :class:`collectives.shm.SharedPair`.

    Rank r owns half 1 - r after the reduce-scatter (as in the ring above):
    it sends half r and combines the peer's half 1 - r into its own (the
    incoming partial first), then sends its reduced half and copies the
    peer's reduced half r, piece by piece. Both ranks cut both halves into
    the same number of pieces, so they run the same sequence of exchanges.
    """
    r, bounds = ctx.rank, chunk_bounds(ctx.n, 2)
    halves = [(bounds[0], bounds[1]), (bounds[1], bounds[2])]
    longest = max(hi - lo for lo, hi in halves)
    count = slot_pieces(ctx, longest, SHARED_PIECE_BYTES)
    sent, owned = split(*halves[r], count), split(*halves[1 - r], count)
    combine = ctx.combine
    mode = copy_mode_for(ctx, -(-longest // count) * ctx.dtype.itemsize)

    def bind(view: Any) -> Callable[[], None]:
        runs = []
        for (slo, shi), (olo, ohi) in zip(sent, owned):
            mine, into = view[olo:ohi], view[slo:shi]
            runs.append(exchange_step(ctx, into, mine.size, combine,  # reduce-scatter
                                      lambda other: (other, mine, mine), first=not runs,
                                      mode=mode))
            runs.append(exchange_step(ctx, mine, into.size, np.copyto,  # its all-gather,
                                      lambda other: (into, other), first=False,  # in cache
                                      mode=mode))
        return in_sequence(runs, mode)

    return bind


def _plan_group(ctx: PlanContext) -> Callable[[Any], Callable[[], None]]:
    """p >= 3 ranks on one node: the ring through :class:`collectives.shm_group.SharedGroup`.

    Per segment of the buffer, as in the point-to-point ring: reduce-scatter
    steps s = 0 .. p-2 (publish chunk r - s, combine the left neighbour's
    partial of chunk r - s - 1 into ours, the incoming partial first, and
    publish the result as the next step's data straight from the combine),
    then p - 1 all-gather steps passing the reduced chunks on. Every rank
    publishes 2(p-1) steps per segment, so the step counters stay equal
    across ranks from call to call.
    """
    group, p, r, n = ctx.group, ctx.size, ctx.rank, ctx.n
    if n == 0:  # the length is part of the signature: every rank skips
        return lambda view: (lambda: None)
    span = group.slot_bytes // ctx.dtype.itemsize * p  # elements per segment
    segments = [(lo, min(lo + span, n)) for lo in range(0, n, span)]
    steps_per_call = 2 * (p - 1) * len(segments)
    slots, left, right = group.slot_count, group.left, group.right
    mine, theirs = group.typed_slots(r, ctx.dtype), group.typed_slots(left, ctx.dtype)
    head, right_head, left_head = group.heads[r], group.heads[right], group.heads[left]
    my_tags, left_tags = group.slot_tags(r), group.slot_tags(left)
    combine, tag, calls, wait, fail = ctx.combine, ctx.tag, ctx.blind_calls, group.wait, ctx.fail
    wake, address = futex.wake, group.addresses[r]
    sleeping = group.sleep

    def reserve(g: int, end: int) -> None:  # step g's slot is free once right read g - slots
        need = g - slots + 2
        if right_head[0] < need:
            wait(right, need, ctx, end)

    def publish(g: int) -> None:  # step g's data are in its slot: tag, then counter
        my_tags[g % slots] = tag
        head[0] = g + 1
        if sleeping:
            wake(address)

    def receive(g: int, end: int, length: int) -> Any:  # the left neighbour's step g
        if left_head[0] <= g:
            wait(left, g + 1, ctx, end)
        k = g % slots
        if left_tags[k] != tag:
            fail(left, left_tags[k])
        return theirs[k][:length]

    def bind(view: Any) -> Callable[[], None]:
        chunks = []
        for lo, hi in segments:
            b = chunk_bounds(hi - lo, p)
            chunks.append([view[lo + b[c]:lo + b[c + 1]] for c in range(p)])

        def run() -> None:
            if head[FAILED]:
                raise AllreduceError(
                    f"rank {r}: an earlier allreduce on this communicator failed inside its "
                    "shared-memory ring, so the ranks' step counters no longer agree; use a "
                    "new communicator (e.g. comm.Dup()) for further all-reduces.")
            try:
                steps(head[0])
            except BaseException:
                head[FAILED] = 1  # the neighbours waiting on this rank raise too
                raise

        def steps(g: int) -> None:
            end = g + steps_per_call
            calls[1] = tag  # a blind call: peers may look (collectives.consistency)
            calls[0] += 1
            for chunk in chunks:
                reserve(g, end)  # reduce-scatter
                own = chunk[r]
                mine[g % slots][:own.size] = own
                publish(g)
                for s in range(p - 1):
                    target = chunk[(r - s - 1) % p]
                    incoming = receive(g, end, target.size)
                    g += 1
                    if s < p - 2:
                        reserve(g, end)
                        combine(incoming, target, mine[g % slots][:target.size])
                        publish(g)
                    else:  # chunk r + 1, fully reduced
                        combine(incoming, target, target)
                for s in range(p - 1):  # all-gather
                    reserve(g, end)
                    out = chunk[(r + 1 - s) % p]
                    mine[g % slots][:out.size] = out
                    publish(g)
                    into = chunk[(r - s) % p]
                    into[...] = receive(g, end, into.size)
                    g += 1

        return run

    return bind
