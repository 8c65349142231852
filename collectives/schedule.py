"""What an algorithm is: a *schedule*, the rounds of messages one rank takes part in.

An all-reduce algorithm (``collectives/algorithms/*.py``) says only what is
exchanged when: for rank ``rank`` of ``size`` and a buffer of ``n``
elements, a :class:`Schedule` of :class:`Round` s. In a round a rank sends
ranges of its buffer to peers and receives ranges from peers, each received
range either combined into the rank's own range (with the op of the call)
or copied over it. How the bytes move is a *channel*'s business
(``collectives/channels/``: MPI point-to-point, a shared-memory pair, a
node-wide shared window); a channel runs any schedule whose shape it can
serve, so an algorithm never names a channel and a channel never names an
algorithm (the design of NCCL's ``src/transport/`` under its
``all_reduce.h``).

The rules a schedule obeys, which channels rely on (checked by
:func:`validate`):

* Rounds are aligned across ranks: round ``k`` of rank ``a`` sends to
  rank ``b`` exactly what round ``k`` of rank ``b`` receives from ``a``
  (same length). A rank with nothing to do in a round has an empty round.
* Within a round, every send reads the buffer as it was when the round
  began; a range received with ``COPY`` does not overlap a range sent in
  the same round.
* ``span``: the length by which the two ends of every message of the round
  cut it into pieces (a channel may send a long message piecewise, each
  piece combined on arrival while in cache); both ends must see the same
  value. Zero means "the longest message of the round"; None means the
  round's messages are only copied on arrival, so cutting them gains
  nothing.
* Bit-identical results: both ends of a reduction combine their operands
  in the same order (``REDUCE_INCOMING_FIRST`` on one side,
  ``REDUCE_MINE_FIRST`` on the other, or one side reduces and the other
  later receives the result by ``COPY``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

#: Receive actions: ``out = incoming (op) mine``, ``out = mine (op) incoming``,
#: ``out = incoming``, and ``STASH``: keep the incoming buffer for the
#: schedule's final combination in rank order (see :attr:`Schedule.stash`).
REDUCE_INCOMING_FIRST = "reduce-incoming-first"
REDUCE_MINE_FIRST = "reduce-mine-first"
COPY = "copy"
STASH = "stash"
ACTIONS = (REDUCE_INCOMING_FIRST, REDUCE_MINE_FIRST, COPY, STASH)
REDUCTIONS = (REDUCE_INCOMING_FIRST, REDUCE_MINE_FIRST)


@dataclass(frozen=True)
class Send:
    """Send elements ``[lo, hi)`` of the buffer to rank ``peer``."""

    peer: int
    lo: int
    hi: int

    @property
    def length(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class Recv:
    """Receive ``hi - lo`` elements from rank ``peer`` and apply ``action`` to ``[lo, hi)``."""

    peer: int
    lo: int
    hi: int
    action: str

    @property
    def length(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class Round:
    """One round of this rank: its sends and receives (see the module docstring)."""

    sends: tuple[Send, ...] = ()
    recvs: tuple[Recv, ...] = ()
    span: int | None = 0

    def cut_basis(self) -> int | None:
        """The length both ends cut this round's messages by, or None: not cut."""
        if self.span is None or self.span:
            return self.span
        return max([s.length for s in self.sends] + [r.length for r in self.recvs], default=0)

    @property
    def exchange(self) -> tuple[Send, Recv] | None:
        """``(send, recv)`` when the round is one send and one receive, else None."""
        if len(self.sends) == 1 and len(self.recvs) == 1:
            return self.sends[0], self.recvs[0]
        return None


@dataclass(frozen=True)
class Schedule:
    """A rank's rounds. With ``stash``, every ``STASH`` receive keeps the
    sender's whole buffer and, after the last round, the buffer becomes the
    combination of all ranks' buffers in rank order (what ``naive`` does)."""

    rounds: tuple[Round, ...]
    stash: bool = False

    def actions(self) -> set[str]:
        return {r.action for rnd in self.rounds for r in rnd.recvs}

    def longest_send(self) -> int:
        return max((s.length for rnd in self.rounds for s in rnd.sends), default=0)


#: ``schedule(rank, size, n) -> Schedule``: what an algorithm module registers.
Scheduler = Callable[[int, int, int], Schedule]


def chunk_bounds(n: int, parts: int) -> list[int]:
    """Boundaries of ``parts`` near-equal chunks of ``range(n)`` (sizes differ by <= 1).

    Chunk ``i`` is ``[b[i], b[i+1])``; with ``n < parts`` some chunks are empty.
    """
    return [n * i // parts for i in range(parts + 1)]


def split(lo: int, hi: int, pieces: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut into ``pieces`` near-equal consecutive ranges (some may be empty)."""
    b = chunk_bounds(hi - lo, pieces)
    return [(lo + b[i], lo + b[i + 1]) for i in range(pieces)]


def exchange(peer: int, send: tuple[int, int], recv: tuple[int, int], action: str,
             span: int | None = 0) -> Round:
    """The common round: send ``send`` to ``peer`` and receive ``recv`` from it."""
    return Round((Send(peer, *send),), (Recv(peer, *recv, action),), span)


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1] and a[0] < a[1] and b[0] < b[1]


def validate(schedules: Iterable[Schedule], n: int) -> None:
    """Check the rules of the module docstring over every rank's schedule
    (``schedules[q]`` is rank ``q``'s). Raises AssertionError naming the
    first broken rule; for tests and for a new algorithm's author."""
    everyone = list(schedules)
    size = len(everyone)
    count = {len(s.rounds) for s in everyone}
    assert len(count) == 1, f"ranks have different numbers of rounds: {count}"
    for k in range(count.pop()):
        for a, sched in enumerate(everyone):
            rnd = sched.rounds[k]
            for s in rnd.sends:
                assert 0 <= s.peer < size and s.peer != a, f"round {k}: rank {a} sends to {s.peer}"
                assert 0 <= s.lo <= s.hi <= n, f"round {k}: rank {a} sends [{s.lo}, {s.hi})"
                theirs = [r for r in everyone[s.peer].rounds[k].recvs if r.peer == a]
                assert len(theirs) == 1, (f"round {k}: rank {a} sends to {s.peer}, which "
                                          f"receives {len(theirs)} messages from it")
                assert theirs[0].length == s.length, (
                    f"round {k}: rank {a} sends {s.length} elements, rank {s.peer} expects "
                    f"{theirs[0].length}")
                assert everyone[s.peer].rounds[k].cut_basis() == rnd.cut_basis(), (
                    f"round {k}: ranks {a} and {s.peer} cut their messages differently")
            for r in rnd.recvs:
                assert r.action in ACTIONS, f"round {k}: unknown action {r.action!r}"
                assert any(s.peer == a for s in everyone[r.peer].rounds[k].sends), (
                    f"round {k}: rank {a} waits for rank {r.peer}, which sends it nothing")
                if r.action == COPY:
                    for s in rnd.sends:
                        assert not _overlap((r.lo, r.hi), (s.lo, s.hi)), (
                            f"round {k}: rank {a} copies over [{r.lo}, {r.hi}) while sending "
                            f"[{s.lo}, {s.hi})")
                if r.action == STASH:
                    assert sched.stash and (r.lo, r.hi) == (0, n), (
                        f"round {k}: rank {a} stashes a partial buffer")
