"""``auto`` by measurement: each signature tries the candidate algorithms and keeps the fastest.

A static table of thresholds wins on the machine it was measured on and can
lose on the next one (another CPU, another MPI, another rank layout;
docs/design/auto-static-table.md, docs/design/auto-tuner.md). So ``auto``
measures where it runs: a :class:`Tuner` per call signature (length,
dtype, op) times the candidates on the calls themselves and, every few
calls, the ranks agree on the estimates with one small
all-reduce (the slowest rank's time counts), so every rank makes the same
choice at the same call without any other message.

* It starts from the static table's choice (:mod:`collectives.auto.table`), or from
  what an earlier run measured on this machine (the tuning file, below).
* Exploration: each candidate is tried on a few calls (the first one
  untimed: it builds the candidate's plan), also those the file knows: an
  entry can be stale or noisy, and a run of large messages makes too few
  calls for a trial to correct it.
* Then it keeps the candidate with the lowest agreed time, times a few calls
  of each period between agreements (periods grow while the choice holds),
  and tries each other candidate again now and then (a trial: the first
  calls of a period, two untimed to warm it up, then four timed), spaced
  so that the trials together cost about ``BUDGET`` of the time: a
  candidate is tried again after its last trial's measured cost over the
  choice's (warm-up included: the first calls of an algorithm that has not
  run for a while can cost many of the choice's small calls), divided by
  ``BUDGET / (k - 1)`` of a call (before its first trial, its estimated
  ratio r stands in: 6 (r - 1) calls). It switches when a trial beats the
  current estimate by more than ``MARGIN`` (a host that moves the ranks to
  other cores can change the best one). Estimates are medians of the
  period's timed calls.

The tuning file (``MPIDP_ALLREDUCE_TUNING_FILE``, default
``allreduce-tuning.json`` in mpidp's cache folder, ``$XDG_CACHE_HOME/mpidp``
or ``~/.cache/mpidp``: :func:`kernels.files.cache_file`; ``none`` for no
file) keeps the agreed times per machine (host, CPU model, MPI library),
rank layout and message size; JSON, to inspect, delete or ship. Rank 0
reads it when a communicator is first used and shares it; it writes it at
exit.
``MPIDP_ALLREDUCE_TUNING=0`` (or a table in ``MPIDP_ALLREDUCE_AUTO``) keeps
the static table.
"""
from __future__ import annotations

import atexit
import itertools
import json
import math
import operator
import os
import socket
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

import kernels.files
from collectives.machine import cpu_model, mpi_library

#: Candidates, in the order of exploration. ``naive`` (the seed project's
#: baseline) is never faster than these.
CANDIDATES = ("native", "recursive_doubling", "ring", "rabenseifner")
#: Share of the time that trials of the other candidates may cost, together.
BUDGET = 0.04
#: A trial must beat the current estimate by this factor to switch.
MARGIN = 0.95
#: Calls between agreements at first and after a switch; each agreement that
#: keeps the choice doubles the period, up to MAX_PERIOD calls or
#: PERIOD_SECONDS of the choice's calls, whichever is fewer. An agreement, and
#: the timed calls and trial a period holds, cost about 10 us of Python and one
#: small all-reduce: at 1 us calls, one in 32 would cost a tenth of the time
#: and one in 1024 still 5% with the timing; the time cap keeps a choice of
#: slow calls (large messages) re-checked every second or so.
PERIOD = 32
MAX_PERIOD = 8192
PERIOD_SECONDS = 1.0
#: Timed calls of the current choice: one in max(TIME_EVERY, period / TIMED_PER_PERIOD).
TIME_EVERY = 8
TIMED_PER_PERIOD = 16
#: Timed calls per candidate while exploring (after one untimed call: it
#: builds the candidate's plan).
EXPLORE_CALLS = 4
#: A later trial of a candidate: WARM_CALLS untimed calls, then TRIAL_TIMED
#: timed. The first calls of an algorithm after another ran a while find its
#: memory cold and the ranks out of step: timed, they made it look several
#: times slower than it is, and auto kept a slower choice for whole runs.
WARM_CALLS = 2
TRIAL_TIMED = 4
TRIAL_CALLS = WARM_CALLS + TRIAL_TIMED
#: Most calls between trials of a candidate.
MAX_GAP = 4096

Runner = Callable[[], None]


def enabled() -> bool:
    """Whether ``auto`` tunes by measurement (local; the same settings on every rank
    are checked with the signature)."""
    if os.environ.get("MPIDP_ALLREDUCE_AUTO", "").strip():
        return False
    return os.environ.get("MPIDP_ALLREDUCE_TUNING", "").strip() not in ("0", "off", "no")


class Tuner:
    """The choice among ``names`` for one signature (see the module docstring).

    Deterministic given the agreed estimates: every rank computes the same
    schedule of trials from the call count. Call :meth:`pick` before a call,
    :meth:`record` with its duration after, and when :meth:`due` says so,
    :meth:`agree` with the ranks' collected times reduced by ``MAX``.
    """

    def __init__(self, names: list[str], first: str, prior: dict[str, float] | None = None
                 ) -> None:
        self.names = list(names)
        self.choice = self.names.index(first) if first in self.names else 0
        k = len(self.names)
        #: Agreed time per call (seconds) per candidate, None until measured.
        self.estimate: list[float | None] = [None] * k
        if prior:
            for i, name in enumerate(self.names):
                if prior.get(name) is not None:
                    self.estimate[i] = float(prior[name])
            self._choose()
        self.calls = 0
        self.used = [0] * k
        self.switches = 0
        #: The exploration: (candidate, timed) for the first calls. Every
        #: candidate's first call is untimed: it pays one-time set-up
        #: (buffers, compiled kernels) that would otherwise be measured as its
        #: speed. Then a few timed calls of each, known from the file or not:
        #: one noisy entry in the file (a candidate measured 3x slower than it
        #: is) kept auto off the best algorithm for a whole run at 16 MiB,
        #: where a run makes too few calls for the trial to come round.
        self.plan: list[tuple[int, bool]] = []
        for i in range(k):
            self.plan.append((i, False))
            self.plan += [(i, True)] * EXPLORE_CALLS
        #: Agreed seconds of a candidate's last trial over what the current
        #: choice would have taken for as many calls (None: none yet).
        self.trial_excess: list[float | None] = [None] * k
        #: Seconds of this period's trial so far, all its calls (warm-up included).
        self._trial_spent = 0.0
        self.next_trial = [0] * k
        self._space_trials(list(range(k)))
        #: Timed calls since the last agreement, per candidate.
        self._samples: list[list[float]] = [[] for _ in range(k)]
        #: The current period: its first call, its length, its agreement (after
        #: call ``_agree_at - 1``) and the spacing of its timed calls.
        self.period = PERIOD
        self._period_start = 0
        self._agree_at = len(self.plan) or PERIOD
        self._time_every = TIME_EVERY
        #: The candidate tried in the first calls of this period, if any.
        self._trial: int | None = None

    def _choose(self) -> None:
        known = [(t, i) for i, t in enumerate(self.estimate) if t is not None]
        if known:
            self.choice = min(known)[1]

    def _space_trials(self, which: list[int]) -> None:
        """Schedule the next trial of the candidates ``which`` from what one costs
        over the current choice: measured (its last trial, warm-up calls
        included: the first calls of an algorithm that has not run for a while
        can cost 50 calls of the choice), else estimated from their ratio."""
        best = self.estimate[self.choice]
        for i in which:
            t = self.estimate[i]
            if i == self.choice or t is None or best is None or best <= 0:
                continue
            share = BUDGET / max(1, len(self.names) - 1)
            excess = self.trial_excess[i]
            if excess is not None:
                cost = excess / best  # in calls of the choice
            else:
                cost = TRIAL_CALLS * (max(1.0, t / best) - 1)
            gap = min(MAX_GAP, max(PERIOD, math.ceil(cost / share)))
            self.next_trial[i] = self.calls + gap

    def pick(self) -> tuple[int, bool]:
        """``(candidate index, time this call)`` for the coming call."""
        c = self.calls
        if c < len(self.plan):
            return self.plan[c]
        into = c - self._period_start
        if self._trial is not None and into < TRIAL_CALLS:  # the period's first calls
            return self._trial, into >= WARM_CALLS
        return self.choice, into % self._time_every == 1

    def _due_trial(self) -> int | None:
        due = [i for i in range(len(self.names))
               if i != self.choice and self.next_trial[i] <= self.calls]
        return min(due, key=lambda i: self.next_trial[i]) if due else None

    def record(self, index: int, timed: bool, seconds: float) -> None:
        """Account for the call just made (``seconds``: its duration, timed or not;
        an untimed call's counts only towards its trial's cost)."""
        if index == self._trial and self.calls - self._period_start < TRIAL_CALLS:
            self._trial_spent += seconds
        self.calls += 1
        self.used[index] += 1
        if timed:
            self._samples[index].append(seconds)

    def due(self) -> bool:
        """Whether the ranks agree now (after this call; the same call on every rank)."""
        return self.calls >= self._agree_at

    def plain_calls(self) -> int:
        """How many of the coming calls are the current choice's with no trial
        before them and no agreement after them: :class:`TunedPlan`'s runner
        makes those without asking :meth:`pick` and :meth:`due` (the same calls
        they would give): up to the next timed call, trial or agreement."""
        c = self.calls
        if c < len(self.plan):
            return 0
        start, every = self._period_start, self._time_every
        if self._trial is not None and c - start < TRIAL_CALLS:
            return 0
        timed = c + (1 - (c - start)) % every  # the next timed call, at or after c
        end = min(timed, self._agree_at - 1)  # the call after which the ranks agree: not plain
        return max(0, end - c)

    def collected(self, out: np.ndarray | None = None) -> np.ndarray:
        """What this rank measured since the last agreement, to reduce by MAX
        (``2 k`` floats, -1 for nothing; into ``out`` when given: no
        allocation): the median time per candidate, then the seconds of the
        period's trial for its candidate. A median, not a mean: one call that
        the OS delayed by 100 us must not make a 1 us algorithm look slower
        than the rest."""
        k = len(self.names)
        out = np.empty(2 * k) if out is None else out
        for i, samples in enumerate(self._samples):
            out[i] = statistics.median(samples) if samples else -1.0
        out[k:] = -1.0
        if self._trial is not None:
            out[k + self._trial] = self._trial_spent
        return out

    def agree(self, slowest: np.ndarray) -> None:
        """Update the estimates from the MAX over ranks of :meth:`collected`."""
        chosen = self.choice
        k = len(self.names)
        measured = []
        for i in range(k):
            spent = float(slowest[k + i])
            if spent >= 0 and self.estimate[chosen] is not None:
                self.trial_excess[i] = max(0.0, spent - TRIAL_CALLS * self.estimate[chosen])
        self._trial_spent = 0.0
        explored = self.calls == len(self.plan)  # the exploration's agreement
        for i, t in enumerate(slowest[:k]):
            if t < 0:
                continue
            t, old = float(t), self.estimate[i]
            if old is None:
                self.estimate[i] = t
            elif explored:
                # Against the file's time, the exploration's few calls keep the
                # lower: noise only ever slows a call, and a file's time that is
                # too low is corrected by the choice's own timed calls.
                self.estimate[i] = min(old, t)
            elif i == chosen:  # the current choice averages its last two periods
                self.estimate[i] = 0.5 * old + 0.5 * t
            else:  # a trial replaces the estimate
                self.estimate[i] = t
            measured.append(i)
        best = min((t, i) for i, t in enumerate(self.estimate) if t is not None)
        switched = best[1] != chosen and (self.estimate[chosen] is None
                                          or best[0] < self.estimate[chosen] * MARGIN)
        if switched:
            self.choice = best[1]
            self.switches += 1
            measured = list(range(k))  # every ratio changed
        self._space_trials(measured)
        for samples in self._samples:
            samples.clear()
        self.period = PERIOD if switched else min(self._longest_period(), 2 * self.period)
        self._period_start = self.calls
        self._agree_at = self.calls + self.period
        self._time_every = max(TIME_EVERY, self.period // TIMED_PER_PERIOD)
        self._trial = self._due_trial()

    def _longest_period(self) -> int:
        """MAX_PERIOD calls, or fewer: about PERIOD_SECONDS of the choice's calls
        (never under PERIOD)."""
        t = self.estimate[self.choice]
        if t is None or t <= 0:
            return MAX_PERIOD
        return max(PERIOD, min(MAX_PERIOD, int(PERIOD_SECONDS / t)))

    def times(self) -> dict[str, float]:
        """Agreed seconds per call, per measured candidate."""
        return {n: t for n, t in zip(self.names, self.estimate) if t is not None}


class TunedPlan:
    """``auto`` for one signature: candidate plans chosen call by call by a :class:`Tuner`.

    ``candidate(name)`` returns the checked plan of a candidate (collective the
    first time: every rank asks for the same candidate at the same call);
    ``agreement`` is the plan of a small float64 MAX all-reduce over the same
    communicator.
    """

    def __init__(self, ctx: Any, names: list[str], first: str,
                 candidate: Callable[[str], Any], agreement: Callable[[], Any],
                 prior: dict[str, float] | None) -> None:
        self.ctx = ctx
        self.algorithm = "auto"
        self.tuner = Tuner(names, first, prior)
        self._candidate = candidate
        self._agreement = agreement
        self.host_only = True  # some candidates need host memory: device buffers are staged
        self.channel = None
        #: Counts the calls of the newest runner's stretch so far into the tuner.
        self.settle: Callable[[], None] = lambda: None

    @property
    def runs(self) -> Any:
        """The algorithm in use now (the tuner's choice)."""
        return self._candidate(self.tuner.names[self.tuner.choice]).runs

    def release(self) -> None:
        pass  # the candidate plans are plans of the communicator: released with them

    def runner(self, key_obj: Any, view: Any, space: Any = None, extra: Any = None,
               hold: Any = None) -> Runner:
        self.settle()  # the runner this one replaces is called no more
        tuner, names, candidate = self.tuner, self.tuner.names, self._candidate
        bound: list[Runner | None] = [None] * len(names)
        slowest = np.zeros(2 * len(names))
        agreement: list[Runner] = []
        clock = time.perf_counter

        def run_candidate(i: int) -> Runner:
            run = bound[i]
            if run is None:
                run = bound[i] = candidate(names[i]).runner(key_obj, view, space, extra, hold)
            return run

        def agree() -> None:
            if not agreement:
                agreement.append(self._agreement().runner(slowest, slowest))
            tuner.collected(slowest)
            agreement[0]()
            tuner.agree(slowest)

        # The steady state (Tuner.plain_calls): a stretch of calls of the
        # current choice, untimed, with no trial or agreement, made without
        # asking the tuner; they are counted into it when the stretch ends
        # (settle). The calls come from one endless iterator of runners: the
        # slow call, then ``repeat(chosen, length)``, then the next slow call...
        # Calling ``next(calls)()`` walks a stretch in C, with no frame of ours:
        # the dispatcher does that itself (collectives.core.dispatch), since a
        # Python frame per call cost 5% of a 1 us call.
        length, chosen_index = 0, 0
        current: Iterable[Runner] = ()

        def settle() -> None:
            nonlocal length
            left = operator.length_hint(current)
            made = length - left
            if made:
                tuner.calls += made
                tuner.used[chosen_index] += made
                length = left

        def slow() -> None:
            nonlocal length, chosen_index, current
            settle()
            i, timed = tuner.pick()
            call = run_candidate(i)
            start = clock()
            call()
            tuner.record(i, timed, clock() - start)
            if tuner.due():
                agree()
            length = tuner.plain_calls()
            if length:
                chosen_index = tuner.choice
                current = itertools.repeat(run_candidate(chosen_index), length)
            else:
                current = ()

        slow_call = (slow,)

        def stretches() -> Iterator[Iterable[Runner]]:
            while True:
                yield slow_call
                yield current  # made by the slow call just before

        calls = itertools.chain.from_iterable(stretches())

        def run() -> None:
            next(calls)()

        run.calls = calls  # type: ignore[attr-defined]
        self.settle = settle
        return run


# ---------------------------------------------------------------- the file
def machine_key(size: int, nodes: int, placement: str) -> str:
    """Host, CPU model, MPI library and rank layout: what a tuning depends on."""
    return (f"{socket.gethostname()}|{cpu_model()}|{mpi_library()}|{size} ranks on {nodes} "
            f"node(s)|{placement}")


def tuning_file() -> Path | None:
    """Where tunings are kept, or None (``MPIDP_ALLREDUCE_TUNING_FILE=none``)."""
    return kernels.files.cache_file("allreduce-tuning.json", "MPIDP_ALLREDUCE_TUNING_FILE")


def bucket(nbytes: int, dtype: np.dtype, op: str) -> str:
    """The tuning key of a signature: power-of-two size class, dtype and op."""
    return f"{1 << max(0, (nbytes - 1).bit_length())} B {dtype} {op}"


def _times(bucket_entry: object) -> dict[str, float] | None:
    """A bucket's ``{candidate: seconds}``, or None where it is damaged."""
    if not isinstance(bucket_entry, dict):
        return None
    try:
        times = {str(n): float(t) for n, t in bucket_entry.items()}
    except (TypeError, ValueError):
        return None
    return times if all(math.isfinite(t) and t >= 0 for t in times.values()) else None


def read(path: Path | None, key: str) -> dict[str, dict[str, float]]:
    """The tunings of ``key`` in the file (empty if none or unreadable). A
    damaged part (the machine's entry not an object, a bucket whose times are
    not numbers) counts as absent: the file is a cache, rewritten at exit."""
    if path is None:
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    entry = data.get(key) if isinstance(data, dict) else None
    if not isinstance(entry, dict):
        return {}
    known = {str(b): _times(v) for b, v in entry.items()}
    return {b: t for b, t in known.items() if t is not None}


def write(path: Path | None, key: str, tunings: dict[str, dict[str, float]]) -> None:
    """Merge ``tunings`` into the file under ``key`` (atomically; errors ignored:
    a tuning file is a cache). A damaged file, or a damaged entry of ``key``
    (not an object), is replaced; other machines' entries are kept as they are."""
    if path is None or not tunings:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {}
        if not isinstance(data, dict):
            data = {}
        entry = data.get(key)
        if not isinstance(entry, dict):
            entry = data[key] = {}
        entry.update(tunings)
        kernels.files.replace_file(path, json.dumps(data, indent=1, sort_keys=True))
    except (OSError, TypeError, ValueError):
        pass  # a cache: never a traceback at exit


class Store:
    """A communicator's tunings: read once (rank 0, shared), written by rank 0 at exit."""

    def __init__(self, key: str, known: dict[str, dict[str, float]], writer: bool) -> None:
        self.key, self.known, self.writer = key, known, writer
        self.tuners: dict[str, Tuner] = {}
        if writer:
            _STORES.append(self)

    def prior(self, name: str) -> dict[str, float] | None:
        return self.known.get(name)

    def keep(self, name: str, tuner: Tuner) -> None:
        """Write what ``tuner`` measured under ``name`` at exit (rank 0)."""
        self.tuners[name] = tuner

    def measured(self) -> dict[str, dict[str, float]]:
        return {name: tuner.times() for name, tuner in self.tuners.items() if tuner.times()}


_STORES: list[Store] = []


@atexit.register
def _save() -> None:  # local: files only
    path = tuning_file()
    for store in _STORES:
        write(path, store.key, store.measured())
