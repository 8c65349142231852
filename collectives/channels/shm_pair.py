"""The shared-memory pair: a channel between the two ranks of a 2-rank communicator on one node.

It serves schedules whose every round is one exchange with the peer (send a
range, receive a range that is combined or copied): at two ranks that is
``recursive_doubling``, ``ring`` and ``rabenseifner``. On one node an MPI
point-to-point round trip costs more than MPICH's whole shared-memory
``MPI_Allreduce``, so the pair exchanges through an MPI-3 shared window
instead (``MPI_Win_allocate_shared``): each rank copies what it sends into
its own slot, publishes a sequence number, waits for the peer's, and
combines (or copies) straight from the peer's slot.

Layout per rank: a 64-byte header of int64 ``[sequence, tag of even calls,
tag of odd calls, copy mode, blind-call words]`` (the copy mode: rank 0's
decision, :mod:`collectives.channels.copy_mode`; the blind-call words:
:data:`collectives.core.consistency.BLIND_WORDS`) and two
slots, used by alternate exchanges, so a rank may publish exchange s+1 while
its peer still reads exchange s; it cannot reach s+2 before the peer has
published s+1, i.e. finished reading s. On x86 (total store order) the data
stores are visible before the sequence store; the header's tag lets the
reader check that the peer's exchange belongs to the same call signature,
so a mismatch is an error here too.

How a schedule is cut: a round goes through in slot-sized pieces; two
rounds where the second sends back what the first combined and receives
what the first sent (a reduce-scatter and its all-gather) go through
together, piece by piece (:data:`PIPELINED_PIECE_BYTES`), each piece
handed back while it is still in cache. Each copy into a slot is cached or
streaming (non-temporal stores), chosen call by call from measured times
(:mod:`collectives.channels.copy_mode`): which one hands a piece to the
other core faster depends on whether the two cores share a cache, and on a
virtual machine that changes while a job runs.

A rank waiting here cannot see point-to-point messages, so every few
milliseconds it looks for what would mean the peer is not coming: a message
of another call waiting for this rank (``Iprobe``), or the peer counted
into a blind call this rank never made
(:meth:`collectives.core.peers.Peers.peer_blocked`). It spins without giving
up its core unless the node is oversubscribed (see ``sleep``).
"""
from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from collectives.channels import copy_mode, futex, streaming
from collectives.channels.copy_mode import DECISION, PairChoices, PairCopyMode
from collectives.channels.shm_window import shared_window, wait_until
from collectives.core.consistency import BLIND_WORDS
from collectives.core.context import PlanContext
from collectives.runtime import MPI
from collectives.schedule import COPY, REDUCE_INCOMING_FIRST, REDUCTIONS, Round, Schedule, split

#: Bytes of one slot: the largest piece exchanged at once (larger messages go
#: through in slot-sized pieces). The window (two slots per rank) costs twice
#: this per rank, touched only as far as calls use it.
SLOT_BYTES = 4 * 1024 * 1024
#: Largest piece of a pipelined pair of rounds: small enough that the piece
#: just combined is still in cache when it is handed back.
PIPELINED_PIECE_BYTES = 1 << 19
#: Smallest piece whose copies may stream: below, a piece costs a few
#: microseconds either way.
STREAMING_MIN_PIECE_BYTES = 64 * 1024
_HEADER = 64
_BLIND = 4  # first blind-call word of the header

Runner = Callable[[], None]


class SharedPair:
    """The channel of a 2-rank communicator on one node (create with :meth:`create`)."""

    name = "shm-pair"
    #: Its plans need host memory (device buffers are staged).
    host_only = True

    def __init__(self, window: "MPI.Win", rank: int) -> None:
        self.window = window
        self.peer = 1 - rank
        self.seq = 0
        #: Sleep in the kernel while waiting (:mod:`collectives.channels.futex`),
        #: woken by the peer's publication: set by the communicator's state when
        #: ranks outnumber cores and futexes are available. With a core each,
        #: giving the core away hands it to whatever else runs there, and the
        #: peer then waits for this rank's next time slice; MPICH's own
        #: shared-memory collectives spin too.
        self.sleep = False
        #: What this pair's plans chose (:mod:`collectives.channels.copy_mode`).
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

    # ------------------------------------------------------------ blind calls
    @property
    def blind_calls(self) -> memoryview:
        """This rank's blind-call words (:mod:`collectives.core.consistency`)."""
        return self.my_head[_BLIND:_BLIND + BLIND_WORDS]

    def peer_blind(self, peer: int) -> memoryview:
        """The peer's blind-call words (plain loads: shared memory)."""
        return self.their_head[_BLIND:_BLIND + BLIND_WORDS]

    # ----------------------------------------------------------------- plans
    def serves(self, schedule: Schedule) -> bool:
        """Every round is one exchange with the peer, combined or copied (or empty)."""
        for rnd in schedule.rounds:
            if not rnd.sends and not rnd.recvs:
                continue
            pair = rnd.exchange
            if pair is None or pair[0].peer != self.peer or pair[1].peer != self.peer \
                    or pair[1].action not in REDUCTIONS + (COPY,):
                return False
        return True

    def plan(self, ctx: PlanContext, schedule_of: Callable[[int], Schedule]
             ) -> Callable[[Any], Runner]:
        """The binder of ``schedule_of(ctx.n)`` over this pair (see the module docstring)."""
        stages = _stages([r for r in schedule_of(ctx.n).rounds if r.sends or r.recvs])
        cuts = [_cut(stage, ctx.dtype.itemsize) for stage in stages]
        largest = max((hi - lo for steps in cuts for step in steps for lo, hi in step[:2]),
                      default=0)
        mode = copy_mode_for(self, ctx, largest * ctx.dtype.itemsize)
        combine = ctx.combine

        def bind(view: Any) -> Runner:
            runs: list[Runner] = []
            for steps in cuts:
                for (slo, shi), (rlo, rhi), action in steps:
                    runs.append(self._step(ctx, view, (slo, shi), (rlo, rhi), action, combine,
                                           first=not runs, mode=mode))
            return in_sequence(runs, mode)

        return bind

    def _step(self, ctx: PlanContext, view: Any, send: tuple[int, int], recv: tuple[int, int],
              action: str, combine: Callable, first: bool, mode: Any) -> Runner:
        out = view[recv[0]:recv[1]]
        if action == COPY:
            return exchange_step(self, ctx, view[send[0]:send[1]], out.size, np.copyto,
                                 lambda other: (out, other), first=first, mode=mode)
        incoming_first = action == REDUCE_INCOMING_FIRST
        return exchange_step(self, ctx, view[send[0]:send[1]], out.size, combine,
                             lambda other: (other, out, out) if incoming_first
                             else (out, other, out), first=first, mode=mode)

    # --------------------------------------------------------------- waiting
    def wait(self, seq: int, tag: int, ctx: Any) -> None:
        """Wait until the peer has published exchange ``seq``.

        ``ctx`` is the call's :class:`collectives.core.context.PlanContext`: its
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


def _stages(rounds: list[Round]) -> list[list[Round]]:
    """Rounds grouped into stages: a round alone, or a reduce round with the
    round that sends its result back and receives what it sent (pipelined)."""
    stages, i = [], 0
    while i < len(rounds):
        if i + 1 < len(rounds):
            (sa, ra), (sb, rb) = rounds[i].exchange, rounds[i + 1].exchange
            if ra.action in REDUCTIONS and rb.action == COPY \
                    and (sb.lo, sb.hi) == (ra.lo, ra.hi) and (rb.lo, rb.hi) == (sa.lo, sa.hi):
                stages.append(rounds[i:i + 2])
                i += 2
                continue
        stages.append(rounds[i:i + 1])
        i += 1
    return stages


def _cut(stage: list[Round], itemsize: int) -> list[tuple[tuple[int, int], tuple[int, int], str]]:
    """The exchanges of a stage as ``(send range, receive range, action)``, in
    order: a round in slot-sized pieces, a pipelined pair piece by piece.
    Both ranks cut alike (the count depends on the longer range of the
    exchange, the same at both ends)."""
    exchanges = [rnd.exchange for rnd in stage]
    longest = max(max(s.length, r.length) for s, r in exchanges)
    piece = PIPELINED_PIECE_BYTES if len(stage) == 2 else SLOT_BYTES
    count = slot_pieces(longest, itemsize, piece)
    cut = [list(zip(split(s.lo, s.hi, count), split(r.lo, r.hi, count), [r.action] * count))
           for s, r in exchanges]
    return [step for pieces in zip(*cut) for step in pieces]


def slot_pieces(longest: int, itemsize: int, piece_bytes: int = SLOT_BYTES) -> int:
    """How many pieces of at most ``piece_bytes`` (and at most a slot) a range
    of ``longest`` elements of ``itemsize`` bytes needs (>= 1)."""
    step = max(1, min(piece_bytes, SLOT_BYTES) // itemsize)
    return max(1, -(-longest // step))


def exchange_step(pair: SharedPair, ctx: PlanContext, send: np.ndarray, receive: int,
                  finish: Callable, operands: Callable[[np.ndarray], tuple], first: bool,
                  mode: Any = None) -> Runner:
    """One exchange through the pair's slots, every name bound (the hot path).

    ``run()`` copies ``send`` into this rank's slot of the exchange's parity,
    publishes it (tag, then sequence number), waits for the peer's, checks
    that the peer is in the same call (its tag) and calls
    ``finish(*operands(theirs))``, where ``theirs`` is the peer's slot of that
    parity as ``receive`` elements of ``send``'s dtype (``operands`` is called
    once per parity, here), e.g. ``combine(theirs, part, part)``. ``first``:
    the call's first exchange, which marks the call as blind
    (:mod:`collectives.core.consistency`). ``mode``: a
    :class:`collectives.channels.copy_mode.PairCopyMode`, whose decision word
    says whether this call copies into the slot with streaming stores (else,
    and without ``mode``, an ordinary copy). Both ranks must run the same
    sequence of exchanges.
    """
    tag = ctx.tag
    head, their_head = pair.my_head, pair.their_head
    sleeping, wake, address = pair.sleep, futex.wake, pair.my_address
    enter, wait, fail = ctx.enter_blind, pair.wait, ctx.fail
    nbytes = send.size * send.itemsize
    mine = [s[:nbytes].view(send.dtype) for s in pair.my_slots]
    theirs = [s[:receive * send.itemsize].view(send.dtype) for s in pair.their_slots]
    args = [operands(other) for other in theirs]
    # Byte memoryviews: slice assignment is the cheapest copy for small
    # pieces (a fraction of np.copyto's call overhead), and memcpy for large.
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
            enter()  # a blind call: peers may look (collectives.core.consistency)
        if their_head[0] < seq:
            wait(seq, tag, ctx)
        if their_head[1 + parity] != tag:
            fail(pair.peer, their_head[1 + parity])
        finish(*args[parity])

    return run


def in_sequence(runs: list[Runner], mode: Any = None) -> Runner:
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


def copy_choice(pair: SharedPair) -> tuple[str, str]:
    """How ``pair``'s plans may copy into its slots: ``(setting, why)``, the
    setting ``auto``, ``on`` or ``off`` (:mod:`collectives.channels.copy_mode`)
    and, when it is ``off`` whatever was asked, the reason: ranks sharing a
    core (asleep while waiting: the bytes never leave it) or no streaming
    stores here. Raises :class:`AllreduceError` for a bad
    ``MPIDP_ALLREDUCE_STREAMING``.
    """
    choice = copy_mode.setting()
    if pair.sleep:
        return "off", "the ranks share a core"
    if not streaming.available():
        return "off", "streaming stores need x86-64 and Numba"
    return choice, ""


def copy_mode_for(pair: SharedPair, ctx: PlanContext, piece_bytes: int
                  ) -> "PairCopyMode | None":
    """The copy mode of a plan whose largest piece is ``piece_bytes``, or None
    when its copies are always cached: pieces under
    :data:`STREAMING_MIN_PIECE_BYTES`, or :func:`copy_choice` says ``off``."""
    choice, _ = copy_choice(pair)
    if choice == "off" or piece_bytes < STREAMING_MIN_PIECE_BYTES:
        return None
    head = pair.my_head if ctx.rank == 0 else pair.their_head
    return PairCopyMode(head, ctx.rank, ctx.tag, choice, pair.choices)
