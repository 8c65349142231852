"""Cached or streaming copies into the shared pair: chosen call by call, from measured times.

The shared pair hands every piece from one core to the other. Whether an
ordinary (cached) copy or a streaming one
(:mod:`collectives.channels.streaming`) hands it over faster depends on
where the host runs the two ranks' cores, which can change at any moment;
measured side by side, no fixed choice was within a factor two of the best
in both cases (docs/design/cached-or-streaming-copies.md).

So rank 0 times each call of a plan and keeps a :class:`Chooser`: it uses
the mode that was faster when last measured, tries the other one now and
then (spaced so that the trials cost about 5% of the time), and tries it at
once when the current mode suddenly slows. A new plan starts in the
pair's last choice and tries the other mode on its fourth call.

Rank 0 publishes the mode of each call in
its header word ``DECISION`` as ``2 * tag + streaming``; both ranks read
that word before each copy, so they copy alike (a rank that reads a word of
another plan copies cached). A mode affects only speed: each reader reads
whatever its peer wrote, however it was written.

``MPIDP_ALLREDUCE_STREAMING`` fixes the choice: ``auto`` (the default),
``on`` (always stream) or ``off`` (always cached).
"""
from __future__ import annotations

import math
import os

from collectives.channels import streaming
from collectives.errors import AllreduceError

CACHED, STREAMING = 0, 1
#: Index of rank 0's decision word in the pair's header (:mod:`collectives.channels.shm_pair`).
DECISION = 3
SETTINGS = ("auto", "on", "off")


def setting() -> str:
    """``MPIDP_ALLREDUCE_STREAMING`` (``auto``, ``on`` or ``off``; default ``auto``).

    Raises :class:`AllreduceError` for any other value.
    """
    text = os.environ.get("MPIDP_ALLREDUCE_STREAMING", "").strip().lower() or "auto"
    aliases = {"1": "on", "0": "off", "yes": "on", "no": "off", "true": "on", "false": "off"}
    text = aliases.get(text, text)
    if text not in SETTINGS:
        raise AllreduceError(f"MPIDP_ALLREDUCE_STREAMING={text!r}: use auto, on or off")
    return text


class Chooser:
    """Picks a mode (:data:`CACHED` or :data:`STREAMING`) per call from the times of calls.

    Call :meth:`next_mode` before a call and :meth:`record` with its mode
    and duration after it. The mode in use (``mode``) changes only when a
    trial of the other mode is faster than the current mode's estimate by
    more than ``margin``. A trial costs one call in the slower mode (several
    times slower at worst: docs/design/cached-or-streaming-copies.md), so
    trials are spaced to spend about ``budget`` of the time on them: after
    a comparison in which one mode took
    ``ratio`` times the other's time, the next trial comes ``(ratio - 1) /
    budget`` calls later (within ``min_gap`` and ``max_gap``). Two calls in
    a row of the current mode more than ``jump`` times slower than its
    estimate (the host moved a rank; one slow call is noise) replace the
    estimate and bring the trial forward to the next call; a call that much
    faster replaces it at once. Otherwise the estimate is a running mean.
    The first trial comes after ``first_gap`` calls: a new plan may start
    in a mode chosen for another size, or before the host moved a rank.
    """

    def __init__(self, mode: int = CACHED, first_gap: int = 3, min_gap: int = 8,
                 max_gap: int = 128, budget: float = 0.05, margin: float = 0.95,
                 jump: float = 1.3) -> None:
        self.mode = mode
        self.ratio: float | None = None
        self.min_gap, self.max_gap, self.budget = min_gap, max_gap, budget
        self.margin, self.jump = margin, jump
        self.estimate: list[float | None] = [None, None]
        self.countdown = first_gap
        self.slow_calls = 0
        self.trials = self.switches = 0

    def gap(self) -> int:
        """Calls until the next trial, from the last ratio between the modes."""
        if self.ratio is None:
            return self.min_gap
        calls = math.ceil((self.ratio - 1) / self.budget)
        return max(self.min_gap, min(self.max_gap, calls))

    def next_mode(self) -> int:
        """The mode of the coming call: a trial of the other mode when one is due."""
        return 1 - self.mode if self.countdown <= 0 else self.mode

    def record(self, mode: int, seconds: float) -> None:
        """Account for a call made in ``mode`` that took ``seconds``."""
        if mode != self.mode:
            self._trial(mode, seconds)
            return
        estimate = self.estimate[mode]
        self.countdown -= 1
        slow = estimate is not None and seconds > estimate * self.jump
        self.slow_calls = self.slow_calls + 1 if slow else 0
        if estimate is None or seconds < estimate / self.jump:
            self.estimate[mode] = seconds
        elif self.slow_calls >= 2:
            self.estimate[mode] = seconds
            self.countdown = 0
        elif not slow:
            self.estimate[mode] = 0.75 * estimate + 0.25 * seconds

    def _trial(self, mode: int, seconds: float) -> None:
        self.trials += 1
        self.slow_calls = 0
        self.estimate[mode] = seconds
        current = self.estimate[self.mode]
        if current is None or seconds < current * self.margin:
            self.mode = mode
            self.switches += 1
            self.ratio = current / seconds if current is not None and seconds > 0 else None
        else:
            self.ratio = seconds / current if current > 0 else None
        self.countdown = self.gap()


class PairCopyMode:
    """One plan's copy mode on a shared pair (see the module docstring).

    ``head`` is rank 0's header (its own on rank 0, the peer's on rank 1)
    and ``streaming_word`` the value of its :data:`DECISION` word that means
    "stream this call". Rank 0 calls :meth:`begin` before each call (it
    publishes the mode) and :meth:`end` with the call's duration; on rank 1
    both do nothing. ``copier(dst, src)`` builds a streaming copy runner.
    """

    def __init__(self, head: memoryview, rank: int, tag: int, choice: str,
                 shared: "PairChoices | None" = None) -> None:
        self.head = head
        self.copier = streaming.streaming_copy
        self.base_word = 2 * tag  # + the mode
        self.streaming_word = self.base_word + STREAMING
        self.shared = shared if shared is not None else PairChoices()
        self.mode = STREAMING if choice == "on" else CACHED
        self.chooser = None
        if rank == 0 and choice == "auto":  # a new plan starts where the pair's last choice is
            self.chooser = Chooser(self.shared.mode)
        self.deciding = rank == 0

    def begin(self) -> None:
        """Decide and publish this call's mode (rank 0)."""
        if not self.deciding:
            return
        if self.chooser is not None:
            self.mode = self.chooser.next_mode()
        self.shared.calls[self.mode] += 1
        self.head[DECISION] = self.base_word + self.mode

    def end(self, seconds: float) -> None:
        """Account for the call just made (rank 0 choosing automatically)."""
        if self.chooser is not None:
            self.chooser.record(self.mode, seconds)
            self.shared.mode = self.chooser.mode


class PairChoices:
    """What a pair's plans chose, on rank 0: ``mode``, the last choice (new
    plans start in it), and ``calls``, how many calls copied cached and
    streaming (all plans; ``mpidp bench allreduce`` reports the share that
    streamed)."""

    def __init__(self) -> None:
        self.mode = CACHED
        self.calls = [0, 0]
