"""A shared-memory channel between the two ranks of a 2-rank communicator.

Used by ``recursive_doubling`` (one exchange of the whole buffer) and
``ring`` (reduce-scatter and all-gather of halves) when p = 2 on one node:
both build their steps with :func:`exchange_step`.

On one node, one MPICH point-to-point round trip (``Sendrecv``, 1.8-2.1 us
on the development machine) costs more than twice MPICH's whole
shared-memory ``MPI_Allreduce`` (0.8-1.1 us), so the pairwise exchange of
``recursive_doubling`` with p = 2 and a small buffer goes through an MPI-3
shared-memory window instead (``MPI_Win_allocate_shared``): each rank copies
its buffer into its own slot, publishes a sequence number, waits for the
peer's, and combines straight from the peer's slot.

Layout per rank: a 64-byte header of int64 ``[sequence, tag of even calls,
tag of odd calls, blind calls entered, tag of the last, copy mode]`` (the
last: rank 0's decision, :mod:`collectives.copy_mode`) and two slots,
used by alternate calls, so a rank may publish call s+1 while its peer
still reads call s; it cannot reach call s+2 before the peer has published
s+1, i.e. finished reading s. On x86 (total
store order) the data stores are visible before the sequence store; the
header's tag lets the reader check that the peer's call is the same
signature, so a mismatch is an error here too.

A rank waiting here cannot see point-to-point messages, so every few
milliseconds it looks for what would
mean the peer is not coming: a message of another call waiting for this
rank (``Iprobe``), or the peer counted into a blind call this rank never
made (:meth:`collectives.plans.CommState.peer_blocked`). It spins without
giving up its core unless the node is oversubscribed (see ``sleep``).
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable

import numpy as np

from collectives import copy_mode, futex
from collectives.copy_mode import DECISION, PairChoices, PairCopyMode
from collectives.runtime import MPI, x86_64

#: Bytes of one slot: the largest piece exchanged at once through shared memory
#: (larger buffers go through in slot-sized chunks). Beyond 4 MiB per slot the
#: slots and buffers stop fitting the cache; the window (two slots per rank)
#: costs 8 MiB of shared memory per communicator, touched only as far as
#: calls use it.
SLOT_BYTES = 4 * 1024 * 1024
_HEADER = 64
_SPINS = 2000  # busy checks before the periodic checks start (~0.1-0.2 ms)
_CHECK_EVERY = 0.01  # seconds between looks for a peer that is not coming


def usable() -> bool:
    """Whether shared-memory exchanges may be used on this machine (local call).

    They rely on stores becoming visible in program order (x86-64's total
    store order: data before the counter that publishes it); Python cannot
    issue the fences weaker memory models (AArch64, POWER) would need, so
    elsewhere the algorithms use MPI point-to-point messages.
    ``MPIDP_ALLREDUCE_SHM=0`` turns the shared-memory channels off anywhere
    (e.g. where /dev/shm is too small for the windows). The ranks of a
    communicator agree on the outcome: if any rank says no, none uses them.
    """
    if os.environ.get("MPIDP_ALLREDUCE_SHM", "").strip() == "0":
        return False
    return x86_64()


def shared_window(comm: "MPI.Intracomm", nbytes: int) -> "MPI.Win | None":
    """An MPI-3 shared window of ``nbytes`` per rank when every rank of ``comm``
    shares one node and :func:`usable` agrees on every rank, else None
    (collective over ``comm``)."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    together = node.Get_size() == comm.Get_size()
    node.Free()
    if not comm.allreduce(int(together and usable()), op=MPI.MIN):
        return None
    try:
        return MPI.Win.Allocate_shared(nbytes, 1, comm=comm)
    except MPI.Exception:
        return None


class SharedPair:
    """The shared window of a 2-rank communicator (create with :meth:`create`)."""

    def __init__(self, window: "MPI.Win", rank: int) -> None:
        self.window = window
        self.peer = 1 - rank
        self.seq = 0
        #: Sleep in the kernel while waiting (:mod:`collectives.futex`), woken by
        #: the peer's publication: set by the communicator's state when ranks
        #: outnumber cores and futexes are available. With a core
        #: each, giving the core away hands it to whatever else runs there and
        #: the peer then waits for this rank's next time slice (measured with a
        #: competing process: p99 latency 1.7 us -> 12-18 ms); MPICH's own
        #: shared-memory collectives spin too.
        self.sleep = False
        #: What this pair's plans chose (:mod:`collectives.copy_mode`).
        self.choices = PairChoices()
        mine, _ = window.Shared_query(rank)
        theirs, _ = window.Shared_query(self.peer)
        self.my_head, self.my_slots = self._views(mine)
        self.their_head, self.their_slots = self._views(theirs)
        self.my_address = np.frombuffer(mine, dtype=np.uint8).ctypes.data
        self.their_address = np.frombuffer(theirs, dtype=np.uint8).ctypes.data
        self.status = MPI.Status()  # of the probes while waiting
        for i in range(len(self.my_head)):
            self.my_head[i] = 0

    @staticmethod
    def _views(memory: Any) -> tuple[memoryview, list[np.ndarray]]:
        raw = np.frombuffer(memory, dtype=np.uint8)
        head = memoryview(raw[:_HEADER]).cast("q")  # item access ~2x faster than numpy's
        slots = [raw[_HEADER + k * SLOT_BYTES:_HEADER + (k + 1) * SLOT_BYTES] for k in (0, 1)]
        return head, slots

    @classmethod
    def create(cls, comm: "MPI.Intracomm") -> "SharedPair | None":
        """The channel when ``comm`` has two ranks sharing memory, else None (collective)."""
        if comm.Get_size() != 2:
            return None
        window = shared_window(comm, _HEADER + 2 * SLOT_BYTES)
        return None if window is None else cls(window, comm.Get_rank())

    def free(self) -> None:
        """Release the window (collective); the views must not be used after."""
        del self.my_head, self.my_slots, self.their_head, self.their_slots
        self.window.Free()

    def slot_views(self, nbytes: int, dtype: np.dtype) -> tuple[list, list]:
        """This rank's and the peer's two slots as arrays of ``nbytes`` of ``dtype``."""
        mine = [s[:nbytes].view(dtype) for s in self.my_slots]
        theirs = [s[:nbytes].view(dtype) for s in self.their_slots]
        return mine, theirs

    def wait(self, seq: int, tag: int, ctx: Any) -> None:
        """Wait until the peer has published call ``seq`` (see module docstring).

        ``ctx`` is the call's :class:`collectives.context.PlanContext`: its
        communicator is probed for messages of other calls, ``ctx.blocked``
        tells whether the peer sits in another blind call, and the failures
        raise through ``ctx.fail`` / ``ctx.fail_blocked``.
        """
        wait_until(self.their_head, seq, self.their_address, self.sleep, self._check, tag, ctx)

    def _check(self, first: bool, tag: int, ctx: Any) -> None:
        status, peer = self.status, self.peer
        if ctx.comm.Iprobe(peer, MPI.ANY_TAG, status):
            ctx.fail(peer, status.tag)
        reason = ctx.blocked(peer, tag, first)
        if reason:
            ctx.fail_blocked(peer, reason)


def wait_until(head: memoryview, count: int, address: int, sleep: bool,
               check: Callable[..., None], *args: Any) -> None:
    """Wait until ``head[0] >= count`` (a peer's counter in a shared window).

    Spins, or with ``sleep`` sleeps on the futex at ``address`` (the
    counter's; the writer wakes it). Every ``_CHECK_EVERY`` seconds calls
    ``check(first, *args)``, which raises to give up the wait (``first``:
    its first call in this wait). Nothing is built before the spinning: at
    small sizes the peer is usually a fraction of a microsecond away.
    """
    if not sleep:
        for _ in range(_SPINS):
            if head[0] >= count:
                return
    first = True
    next_check = time.monotonic() + 0.002
    while True:
        seen = head[0]
        if seen >= count:
            return
        if sleep:
            futex.wait(address, seen, _CHECK_EVERY)
        now = time.monotonic()
        if now < next_check:
            continue
        next_check = now + _CHECK_EVERY
        if head[0] >= count:
            return
        check(first, *args)
        first = False


def paired(ctx: Any) -> bool:
    """Two ranks on one node: the plan exchanges through this channel."""
    return ctx.pair is not None and ctx.size == 2


def slot_pieces(ctx: Any, longest: int, piece_bytes: int | None = None) -> int:
    """How many pieces of at most ``piece_bytes`` (default and at most: a slot)
    a range of ``longest`` elements needs (>= 1)."""
    limit = SLOT_BYTES if piece_bytes is None else min(piece_bytes, SLOT_BYTES)
    step = max(1, limit // ctx.dtype.itemsize)
    return max(1, -(-longest // step))


def exchange_step(ctx: Any, send: np.ndarray, receive: int, finish: Callable,
                  operands: Callable[[np.ndarray], tuple], first: bool,
                  mode: Any = None) -> Callable[[], None]:
    """One exchange through the pair's slots, every name bound (the hot path).

    ``run()`` copies ``send`` into this rank's slot of the call's parity,
    publishes it (tag, then sequence number), waits for the peer's, checks
    that the peer is in the same call (its tag) and calls
    ``finish(*operands(theirs))``, where ``theirs`` is the peer's slot of that
    parity as ``receive`` elements of ``send``'s dtype (``operands`` is called
    once per parity, here), e.g. ``combine(theirs, part, part)``. ``first``:
    the call's first exchange, which marks the call as blind
    (:mod:`collectives.consistency`). ``mode``: a
    :class:`collectives.copy_mode.PairCopyMode`, whose decision word says
    whether this call copies into the slot with streaming stores (else, and
    without ``mode``, an ordinary copy). Both ranks must run the same
    sequence of steps.
    """
    pair, tag = ctx.pair, ctx.tag
    head, their_head = pair.my_head, pair.their_head
    sleeping, wake, address = pair.sleep, futex.wake, pair.my_address
    calls, wait, fail = ctx.blind_calls, pair.wait, ctx.fail
    mine, _ = pair.slot_views(send.size * send.itemsize, send.dtype)
    _, theirs = pair.slot_views(receive * send.itemsize, send.dtype)
    args = [operands(other) for other in theirs]
    # Byte memoryviews: slice assignment copies 512 B in 0.07 us, np.copyto in
    # 0.27 us (a fifth of the whole exchange at that size); both are memcpy
    # for large buffers.
    source = memoryview(send).cast("B")
    slots = [memoryview(slot).cast("B") for slot in mine]
    decision, streaming_word, streams = None, 0, []
    if mode is not None:
        decision, streaming_word = mode.head, mode.streaming_word
        raw = np.frombuffer(source, dtype=np.uint8)
        streams = [mode.copier(np.frombuffer(slot, dtype=np.uint8), raw) for slot in slots]

    def run() -> None:
        seq = pair.seq + 1
        pair.seq = seq
        parity = seq & 1
        if decision is not None and decision[DECISION] == streaming_word:
            streams[parity]()
        else:
            slots[parity][:] = source
        head[1 + parity] = tag  # data and tag before the sequence number
        head[0] = seq
        if sleeping:
            wake(address)
        if first:
            calls[1] = tag  # a blind call: peers may look (collectives.consistency)
            calls[0] += 1
        if their_head[0] < seq:
            wait(seq, tag, ctx)
        if their_head[1 + parity] != tag:
            fail(pair.peer, their_head[1 + parity])
        finish(*args[parity])

    return run


def in_sequence(runs: list[Callable[[], None]], mode: Any = None) -> Callable[[], None]:
    """One runner that calls ``runs`` in order (the runner itself if there is one).

    With a copy ``mode`` (:func:`copy_mode_for`) it also lets the mode
    decide the call's copies first and times the call for it: from the end
    of the first exchange (once both ranks are in) when there are several,
    else the whole exchange.
    """
    if mode is None:
        if len(runs) == 1:
            return runs[0]

        def run() -> None:
            for step in runs:
                step()

        return run
    begin, end, clock = mode.begin, mode.end, time.perf_counter
    first, rest = (runs[0], runs[1:]) if len(runs) > 1 else (None, runs)

    def run_timed() -> None:
        begin()
        if first is not None:
            first()
        start = clock()
        for step in rest:
            step()
        end(clock() - start)

    return run_timed


#: Smallest piece whose copies may stream (:mod:`collectives.copy_mode`): below,
#: a piece costs a few microseconds either way.
STREAMING_MIN_PIECE_BYTES = 64 * 1024


def copy_choice(pair: SharedPair) -> tuple[str, str]:
    """How ``pair``'s plans may copy into its slots: ``(setting, why)``, the
    setting ``auto``, ``on`` or ``off`` (:mod:`collectives.copy_mode`) and,
    when it is ``off`` whatever was asked, the reason: ranks sharing a core
    (asleep while waiting: the bytes never leave it) or no streaming stores
    here. Raises :class:`AllreduceError` for a bad ``MPIDP_ALLREDUCE_STREAMING``.
    """
    from collectives import streaming

    choice = copy_mode.setting()
    if pair.sleep:
        return "off", "the ranks share a core"
    if not streaming.available():
        return "off", "streaming stores need x86-64 and Numba"
    return choice, ""


def copy_mode_for(ctx: Any, piece_bytes: int) -> "PairCopyMode | None":
    """The copy mode of a plan whose largest piece is ``piece_bytes``, or None
    when its copies are always cached: pieces under
    :data:`STREAMING_MIN_PIECE_BYTES`, or :func:`copy_choice` says ``off``."""
    choice, _ = copy_choice(ctx.pair)
    if choice == "off" or piece_bytes < STREAMING_MIN_PIECE_BYTES:
        return None
    head = ctx.pair.my_head if ctx.rank == 0 else ctx.pair.their_head
    return PairCopyMode(head, ctx.rank, ctx.tag, choice, ctx.pair.choices)
