"""The node window: a channel among all ranks (p >= 3) of a one-node communicator.

It serves *ring-shaped* schedules, whose every round sends one range to the
right neighbour and receives one range from the left (``ring``), and
replaces each MPI point-to-point step by a copy into a slot of an MPI-3
shared window, a published step counter, and a read from the left
neighbour's slot: no MPI progress engine, no rendezvous, and on an
oversubscribed node a waiting rank sleeps in the kernel
(:mod:`collectives.channels.futex`) until its neighbour publishes, instead
of polling through MPICH's yield loop.

Layout per rank: a header of int64 words ``[steps published, failed,
blind-call words (:data:`collectives.core.consistency.BLIND_WORDS`), tag of slot
0, ..., tag of slot k-1]`` and ``k = min(p + 1, MAX_SLOTS)`` slots of ``slot_bytes``. Every
rank numbers the rounds it publishes, across calls: round ``g`` goes to
slot ``g mod k``, its slot tag is written, then the counter (x86 keeps
stores in order, so a reader that sees the counter sees the data and tag).
The right neighbour reads round ``g`` and only then publishes its round
``g + 1``, so a writer may reuse the slot of round ``g - k`` once the right
neighbour has published ``g - k + 2`` (the *back-pressure* check). The slot
tag lets the reader check that the data belong to its own call.

The buffer goes around in segments, each a whole run of the schedule,
sized so that every message of a segment fits a slot. A combined range
that the next round sends on, and that a later round overwrites by a copy
before anything else reads it (the reduce-scatter's partial sums), is
combined straight into the next round's slot and never stored in the
buffer.

Waiting sees no MPI messages, so the wait is *blind*, like ``MPI_Allreduce``
(:mod:`collectives.core.consistency`); every 10 ms it looks for what would mean
the call cannot complete: a message from a rank that has not finished this
call (it is in another one), or the awaited rank counted into a blind call
this rank is not making, or the awaited rank marked as *failed*: a rank
that raises inside a call sets that word before the error leaves the call,
so its neighbours raise too instead of waiting for rounds that will never
come, and so on around the ring. Either raises :class:`AllreduceMismatch`.
A failed call leaves the step counters of the ranks apart: later calls on
that communicator's shared window raise at once.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from collectives.channels import futex
from collectives.channels.shm_window import shared_window, wait_until
from collectives.core.consistency import BLIND_WORDS
from collectives.core.context import PlanContext
from collectives.errors import AllreduceError
from collectives.runtime import MPI
from collectives.schedule import COPY, REDUCE_INCOMING_FIRST, REDUCTIONS, Round, Schedule

#: Bytes of buffer one pass of a ring covers: each rank's chunk of it goes
#: through one slot of SEGMENT_BYTES / p.
SEGMENT_BYTES = 4 * 1024 * 1024
#: Most slots per rank (p + 1 below that): bounds the window on big nodes.
MAX_SLOTS = 9
FAILED = 1  #: header word: 1 once this rank raised inside a call
_BLIND = 2  # first blind-call word
_FIXED_WORDS = _BLIND + BLIND_WORDS  # steps, failed, the blind-call words
#: What a round does with what it receives (see :func:`_program`).
_COPY, _REDUCE, _REDUCE_FORWARD = 0, 1, 2

Runner = Callable[[], None]


class SharedGroup:
    """The channel of a one-node communicator of >= 3 ranks (create with :meth:`create`)."""

    name = "shm-group"
    #: Its plans need host memory (device buffers are staged).
    host_only = True

    def __init__(self, window: "MPI.Win", rank: int, size: int, slot_bytes: int,
                 slots: int) -> None:
        self.window = window
        self.rank, self.size = rank, size
        self.left, self.right = (rank - 1) % size, (rank + 1) % size
        self.slot_bytes, self.slot_count = slot_bytes, slots
        #: Sleep in the kernel while waiting (set by the communicator's state when
        #: the node is oversubscribed and futexes are available), else spin.
        self.sleep = False
        self.status = MPI.Status()  # of the probes while waiting
        self.heads: list[memoryview] = []
        self.slots: list[list[np.ndarray]] = []
        self.addresses: list[int] = []
        header = header_bytes(slots)
        for q in range(size):
            memory, _ = window.Shared_query(q)
            raw = np.frombuffer(memory, dtype=np.uint8)
            self.heads.append(memoryview(raw[:header]).cast("q"))
            self.slots.append([raw[header + i * slot_bytes:header + (i + 1) * slot_bytes]
                               for i in range(slots)])
            self.addresses.append(raw.ctypes.data)
        mine = self.heads[rank]
        for i in range(len(mine)):
            mine[i] = 0

    @classmethod
    def create(cls, comm: "MPI.Intracomm") -> "SharedGroup | None":
        """The channel when all of ``comm``'s >= 3 ranks share a node, else None (collective)."""
        size = comm.Get_size()
        if size < 3:
            return None
        slots = min(size + 1, MAX_SLOTS)
        slot_bytes = max(64, SEGMENT_BYTES // size // 64 * 64)
        window = shared_window(comm, header_bytes(slots) + slots * slot_bytes)
        if window is None:
            return None
        group = cls(window, comm.Get_rank(), size, slot_bytes, slots)
        comm.Barrier()  # every header zeroed before anyone reads one
        return group

    def free(self) -> None:
        """Release the window (collective); the views must not be used after."""
        del self.heads, self.slots
        self.window.Free()

    @property
    def steps(self) -> int:
        """Rounds this rank has published, over all calls (its counter)."""
        return self.heads[self.rank][0]

    # ------------------------------------------------------------ blind calls
    @property
    def blind_calls(self) -> memoryview:
        """This rank's blind-call words (:mod:`collectives.core.consistency`)."""
        return self.heads[self.rank][_BLIND:_FIXED_WORDS]

    def peer_blind(self, peer: int) -> memoryview:
        """Rank ``peer``'s blind-call words (plain loads: shared memory)."""
        return self.heads[peer][_BLIND:_FIXED_WORDS]

    def slot_tags(self, q: int) -> memoryview:
        """Rank ``q``'s tag of each slot's current content."""
        return self.heads[q][_FIXED_WORDS:_FIXED_WORDS + self.slot_count]

    def typed_slots(self, q: int, dtype: np.dtype) -> list[np.ndarray]:
        """Rank ``q``'s slots as whole arrays of ``dtype``."""
        whole = self.slot_bytes // dtype.itemsize * dtype.itemsize
        return [slot[:whole].view(dtype) for slot in self.slots[q]]

    # ----------------------------------------------------------------- plans
    def serves(self, schedule: Schedule) -> bool:
        """Every round sends one range right and receives one from the left."""
        for rnd in schedule.rounds:
            pair = rnd.exchange
            if pair is None or pair[0].peer != self.right or pair[1].peer != self.left \
                    or pair[1].action not in REDUCTIONS + (COPY,):
                return False
        return True

    def segment_length(self, schedule_of: Callable[[int], Schedule], n: int,
                       itemsize: int) -> int:
        """The longest segment (<= n) whose every message fits a slot."""
        room = self.slot_bytes // itemsize
        if schedule_of(n).longest_send() <= room:
            return max(n, 1)
        lo, hi = 1, n  # the longest message grows with the segment
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if schedule_of(mid).longest_send() <= room:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def plan(self, ctx: PlanContext, schedule_of: Callable[[int], Schedule]
             ) -> Callable[[Any], Runner]:
        """The binder of the schedule over this window, segment by segment."""
        n = ctx.n
        if n == 0:  # the length is part of the signature: every rank skips
            return lambda view: (lambda: None)
        span = self.segment_length(schedule_of, n, ctx.dtype.itemsize)
        segments = [(lo, min(lo + span, n)) for lo in range(0, n, span)]
        shapes = {hi - lo: _program(schedule_of(hi - lo).rounds) for lo, hi in segments}
        rounds_per_call = sum(len(shapes[hi - lo]) for lo, hi in segments)
        return self._binder(ctx, segments, shapes, rounds_per_call)

    def _binder(self, ctx: PlanContext, segments: list[tuple[int, int]], shapes: dict,
                rounds_per_call: int) -> Callable[[Any], Runner]:
        r, slots, right, left = self.rank, self.slot_count, self.right, self.left
        mine, theirs = self.typed_slots(r, ctx.dtype), self.typed_slots(left, ctx.dtype)
        head, right_head, left_head = self.heads[r], self.heads[right], self.heads[left]
        my_tags, left_tags = self.slot_tags(r), self.slot_tags(left)
        combine, tag, enter, wait, fail = ctx.combine, ctx.tag, ctx.enter_blind, self.wait, ctx.fail
        wake, address = futex.wake, self.addresses[r]
        sleeping = self.sleep

        def reserve(g: int, end: int) -> None:  # round g's slot is free once right read g - slots
            need = g - slots + 2
            if right_head[0] < need:
                wait(right, need, ctx, end)

        def receive(g: int, end: int, length: int) -> Any:  # the left neighbour's round g
            if left_head[0] <= g:
                wait(left, g + 1, ctx, end)
            k = g % slots
            if left_tags[k] != tag:
                fail(left, left_tags[k])
            return theirs[k][:length]

        def bind(view: Any) -> Runner:
            program = []
            for lo, hi in segments:
                seg = view[lo:hi]
                program += [(prefilled, seg[slo:shi], kind, incoming_first, seg[rlo:rhi])
                            for prefilled, (slo, shi), kind, incoming_first, (rlo, rhi)
                            in shapes[hi - lo]]

            def run() -> None:
                if head[FAILED]:
                    raise AllreduceError(
                        f"rank {r}: an earlier allreduce on this communicator failed inside "
                        "its shared-memory ring, so the ranks' step counters no longer agree; "
                        "use a new communicator (e.g. comm.Dup()) for further all-reduces.")
                try:
                    steps(head[0])
                except BaseException:
                    head[FAILED] = 1  # the neighbours waiting on this rank raise too
                    raise

            def steps(g: int) -> None:
                end = g + rounds_per_call
                enter()  # a blind call: peers may look (collectives.core.consistency)
                for prefilled, send, kind, incoming_first, target in program:
                    if not prefilled:
                        reserve(g, end)
                        mine[g % slots][:send.size] = send
                    my_tags[g % slots] = tag  # round g's data are in its slot: tag, counter
                    head[0] = g + 1
                    if sleeping:
                        wake(address)
                    incoming = receive(g, end, target.size)
                    g += 1
                    if kind == _COPY:
                        target[...] = incoming
                        continue
                    if kind == _REDUCE_FORWARD:  # straight into the next round's slot
                        reserve(g, end)
                        out = mine[g % slots][:target.size]
                    else:
                        out = target
                    if incoming_first:
                        combine(incoming, target, out)
                    else:
                        combine(target, incoming, out)

            return run

        return bind

    # --------------------------------------------------------------- waiting
    def wait(self, q: int, count: int, ctx: Any, end: int) -> None:
        """Wait until rank ``q`` has published ``count`` rounds.

        ``ctx`` is the call's :class:`collectives.core.context.PlanContext` and
        ``end`` the round count at which every rank has finished the call: a
        message from a rank short of it means that rank makes another call.
        Raises :class:`AllreduceMismatch` through ``ctx.fail`` /
        ``ctx.fail_blocked`` (see the module docstring).
        """
        wait_until(self.heads[q], count, self.addresses[q], self.sleep, self._check, q, ctx, end)

    def _check(self, first: bool, q: int, ctx: Any, end: int) -> None:
        status = self.status
        if self.heads[q][FAILED]:
            ctx.fail_peer_error(q)
        if ctx.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status) \
                and self.heads[status.source][0] < end:
            ctx.fail(status.source, status.tag)
        reason = ctx.blocked(q, ctx.tag, first)
        if reason:
            ctx.fail_blocked(q, reason)


def _program(rounds: tuple[Round, ...]) -> list[tuple]:
    """Per round ``(prefilled, send range, kind, incoming first, receive range)``.

    A reduction is *forwarded* (combined straight into the next round's
    slot, the next round ``prefilled``) when the next round sends exactly
    the combined range and the first later round that touches that range
    overwrites all of it by a copy: the combined values are never read from
    the buffer.
    """
    steps = []
    prefilled = False
    for k, rnd in enumerate(rounds):
        (send,), (recv,) = rnd.sends, rnd.recvs
        kind = _COPY if recv.action == COPY else _REDUCE
        if kind == _REDUCE and _forwarded(rounds, k):
            kind = _REDUCE_FORWARD
        steps.append((prefilled, (send.lo, send.hi), kind,
                      recv.action == REDUCE_INCOMING_FIRST, (recv.lo, recv.hi)))
        prefilled = kind == _REDUCE_FORWARD
    return steps


def _forwarded(rounds: tuple[Round, ...], k: int) -> bool:
    recv = rounds[k].recvs[0]
    target = (recv.lo, recv.hi)
    if recv.lo == recv.hi:
        return False
    if k + 1 >= len(rounds) or (rounds[k + 1].sends[0].lo, rounds[k + 1].sends[0].hi) != target:
        return False
    for later in rounds[k + 2:]:
        send, into = later.sends[0], later.recvs[0]
        if _overlap((send.lo, send.hi), target):
            return False
        if _overlap((into.lo, into.hi), target):
            return (into.lo, into.hi) == target and into.action == COPY
    return False


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def header_bytes(slots: int) -> int:
    """Bytes of a rank's header with ``slots`` slot tags (a multiple of 64)."""
    return -(-(_FIXED_WORDS + slots) * 8 // 64) * 64
