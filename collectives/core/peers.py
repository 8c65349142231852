"""The blind-call words of a communicator: where each rank is, for the failure rules.

A *blind call* is one whose waits cannot see a peer's message of another
call (``MPI_Allreduce``, a shared-memory exchange;
:mod:`collectives.core.consistency`). Each rank counts the blind calls it
enters and the tag of the last ones in a few words its peers can read: in
the node's shared window where every rank is on one node (plain loads), else
in a window read with one-sided MPI. :class:`Peers` holds this rank's words
and reads the peers': why a peer cannot be joining this rank's call
(:meth:`Peers.peer_blocked`), this rank leaving a communicator
(:meth:`Peers.leave`), and the evidence at exit
(:mod:`collectives.core.failures`). :class:`collectives.core.plans.CommState`
owns one per communicator.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from collectives.core.consistency import (BLIND_WORDS, GONE, GONE_FAILED, RELEASE_TAG,
                                          gone_reason, last_blind_tag, make_enter, make_verify,
                                          make_verify_mpi, verify_everywhere)
from collectives.runtime import MPI


class Peers:
    """This rank's blind-call words on ``comm`` and its peers' (see module docstring).

    Args:
        comm: the private communicator (collective: the window is allocated
            here when the ranks share no window).
        channels: the communicator's channels; the first with ``blind_calls``
            holds the words.
        explain: ``tag -> words`` naming a call, for messages.
    """

    def __init__(self, comm: "MPI.Intracomm", channels: list[Any],
                 explain: Callable[[int], str]) -> None:
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.explain = explain
        # for ranks all on one node in their shared window (plain loads: a
        # one-sided Get would wait for the peer to enter MPI, which a
        # shared-memory wait never does), otherwise in a window read with
        # one-sided MPI.
        self.window = None
        self.shared = next((c for c in channels if c.blind_calls is not None), None)
        nbytes = 8 * BLIND_WORDS
        if self.shared is not None:
            self.blind_calls = self.shared.blind_calls
        else:
            self.blind_calls = memoryview(bytearray(nbytes)).cast("q")
        if self.shared is None and self.size > 1:
            try:
                self.window = MPI.Win.Allocate(nbytes, 8, comm=self.comm)
                self.blind_calls = memoryview(self.window.tomemory()).cast("B").cast("q")
            except MPI.Exception:
                self.window = None
        for i in range(BLIND_WORDS):
            self.blind_calls[i] = 0
        #: ``{tag: release(enter)}`` of the signatures whose calls wait inside
        #: ``MPI_Allreduce`` (see :meth:`leave`); kept where the peers check
        #: the order of such calls (shared memory) only.
        self.releases: dict[int, Callable] = {}
        self._suspects: dict[int, tuple[int, int]] = {}

    def free(self) -> None:
        """Release the window (collective) and keep private words."""
        self.blind_calls = memoryview(bytearray(8 * BLIND_WORDS)).cast("q")
        if self.window is not None:
            self.window.Free()
            self.window = None
        self.shared = None

    def clear_suspects(self) -> None:
        """Forget the peers suspected on one probe (a new wait starts afresh)."""
        self._suspects.clear()

    def peer_words(self, peer: int) -> tuple[int, int, int] | None:
        """``(blind calls entered, gone, tag of the last one)`` of ``peer``
        (:mod:`collectives.core.consistency`), or None where they cannot be read."""
        if self.shared is not None:
            words = self.shared.peer_blind(peer)
        elif self.window is not None:
            words = np.zeros(BLIND_WORDS, dtype=np.int64)
            try:
                self.window.Lock(peer, MPI.LOCK_SHARED)
                self.window.Get([words, MPI.INT64_T], peer)
                self.window.Unlock(peer)
            except MPI.Exception:
                return None
        else:
            return None
        count, their_tag = last_blind_tag(words)
        return count, int(words[GONE]), their_tag

    def peer_blocked(self, peer: int, tag: int, entered: bool = False) -> str | None:
        """Why ``peer`` cannot be joining this rank's call of ``tag``, or None.

        Compares the blind calls (see :class:`~collectives.core.context.PlanContext`) each rank has
        entered: this rank's call is number ``mine`` (+1 unless ``entered``).
        A peer further ahead, or at the same number in a call of another
        tag, waits where our messages cannot reach it, in a call this rank
        is not making; a peer marked *gone* (its call failed, or its program
        is ending) makes no call any more. Reported only when two probes in
        a row see the same state (a peer that progresses changes it, and a
        peer that finished its part of this call before it left has
        delivered it by the next probe).
        """
        words = self.peer_words(peer)
        if words is None:
            return None
        count, gone, their_tag = words
        expected = self.blind_calls[0] + (0 if entered else 1)
        if not gone and (count < expected or (count == expected and their_tag == tag)):
            self._suspects.pop(peer, None)
            return None
        if self._suspects.get(peer) != words:
            self._suspects[peer] = words  # confirm on the next probe
            return None
        if gone:
            return f"gone from this communicator ({gone_reason(gone)})"
        return (f"blocked in blind call number {count} on this communicator "
                f"({self.explain(their_tag)}: MPI_Allreduce or a shared-memory exchange) "
                f"while this rank is at {expected}")

    def leave(self, gone: int) -> None:
        """Mark this rank *gone* from the communicator (``gone``: why, see
        :data:`collectives.core.consistency.GONE`), so that peers waiting for it
        raise instead of waiting; and where a peer waits inside
        ``MPI_Allreduce`` of a call this rank will never make, with every
        other rank in that call too, join it (a *release*: the peer's order
        check raises). Local; never waits for a rank that is not already
        waiting for this one."""
        if self.size == 1 or self.comm == MPI.COMM_NULL:
            return
        self.publish(GONE, gone)
        self.release_waiting()

    def release_waiting(self) -> None:
        """The release of :meth:`leave`, for a rank already marked gone: a peer
        may enter ``MPI_Allreduce`` of a call this rank never makes after it
        left (a rank ending its program repeats this while it waits,
        :func:`collectives.core.failures.leave_at_exit`). Local; does nothing
        once the peers' call is released."""
        if self.size == 1 or self.comm == MPI.COMM_NULL:
            return
        mine = self.blind_calls[0]
        seen = [self.peer_words(q) for q in range(self.size) if q != self.rank]
        if not seen or any(w is None or w[1] for w in seen):
            return  # a peer gone is in no call any more: nothing to join
        count, _, tag = seen[0]
        release = self.releases.get(tag)
        if release is None or not all(w[0] == count and w[2] == tag for w in seen):
            return
        words = self.blind_calls
        if count == mine + 1:  # this rank never entered call `count`
            release(make_enter(words, RELEASE_TAG))
        elif count == mine and words[2 + (mine & 1)] not in (tag, RELEASE_TAG) \
                and words[2 + (mine & 1)] not in self.releases:
            # this rank's call `count` was not an MPI_Allreduce (that would
            # have matched the peer's): a shared-memory exchange it left

            def mark() -> int:
                words[2 + (mine & 1)] = RELEASE_TAG
                return mine

            release(mark)

    def publish(self, index: int, value: int) -> None:
        """Store one of this rank's words where every peer reads it: a plain
        store in the node's shared window; in an MPI window, inside an
        exclusive lock epoch on this rank, which makes the store visible to
        the peers' one-sided reads (a plain store there may never be)."""
        if self.window is None:
            self.blind_calls[index] = value
            return
        self.window.Lock(self.rank, MPI.LOCK_EXCLUSIVE)
        try:
            self.blind_calls[index] = value
        finally:
            self.window.Unlock(self.rank)

    @property
    def coherent(self) -> bool:
        """Whether the peers' words are read with plain loads (one node), so
        that waiting on them cannot depend on another process calling MPI."""
        return self.shared is not None

    def evidence(self) -> str | None:
        """Why a peer is inside a call this rank has not made (for a rank
        that makes no more calls: at exit), or None: a message for this rank
        that it never received, or a peer counted into more blind calls.
        A peer marked *gone* waits for nothing and gives none."""
        status = MPI.Status()
        if self.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status) \
                and not self._gone(status.source):
            return (f"rank {status.source} sent it a message of "
                    f"{self.explain(status.tag)}, which it never received")
        mine = self.blind_calls[0]
        for q in range(self.size):
            words = None if q == self.rank else self.peer_words(q)
            if words is not None and words[0] > mine and not words[1]:
                return (f"rank {q} is inside blind call number {words[0]} on this "
                        f"communicator ({self.explain(words[2])}: MPI_Allreduce or a "
                        f"shared-memory exchange), and this rank made {mine}")
        return None

    def _gone(self, peer: int) -> bool:
        words = self.peer_words(peer)
        return words is not None and bool(words[1])

    def peer_failed(self) -> bool:
        """Whether a peer marked itself gone after a failed call of its own."""
        for q in range(self.size):
            words = None if q == self.rank else self.peer_words(q)
            if words is not None and words[1] == GONE_FAILED:
                return True
        return False

    def peers_gone(self) -> bool:
        """Whether every peer has marked itself gone (or cannot be read)."""
        for q in range(self.size):
            words = None if q == self.rank else self.peer_words(q)
            if words is not None and not words[1]:
                return False
        return True

    def verifier(self, tag: int, description: str, known: dict[int, int]
                 ) -> Callable[[int], None]:
        """Point 4 of :mod:`collectives.core.consistency` for this signature
        (``known``: the bytes of each tag's signature)."""
        peers = [q for q in range(self.size) if q != self.rank]
        if self.shared is not None:
            nbytes = known.get(tag)
            return make_verify([self.shared.peer_blind(q) for q in peers], tag, self.rank,
                               peers, description, self.explain,
                               lambda theirs: known.get(theirs) == nbytes)
        if self.size > 1 and verify_everywhere():
            return make_verify_mpi(self.comm, tag, self.rank, description)
        return lambda call: None

    def watcher(self, tag: int) -> Callable[[int, bool], str | None]:
        def watch(peer: int, first: bool) -> str | None:
            if first:
                self._suspects.clear()
            return self.peer_blocked(peer, tag)

        return watch

    def blocked_in_call(self, peer: int, tag: int, first: bool) -> str | None:
        if first:  # a new wait: no suspicion carried over from an earlier one
            self._suspects.clear()
        return self.peer_blocked(peer, tag, entered=True)
