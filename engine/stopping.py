"""When a run stops before its last epoch: on a signal, or by mlbench's rules.

**Signals** (:class:`StopRequest`): SIGTERM / SIGUSR1 stop the run at the
next step boundary (and checkpoint). The handler only records the request;
the training loop carries it in the step's all-reduce buffer (one extra
float), so every rank learns of a signal received by any rank in the same
step and all stop after that step's update, together. Slurm sends SIGTERM at
the time limit (or SIGUSR1 with ``--signal=USR1@120``); mpiexec forwards both
to the ranks.

**Early-stop rules** (:func:`stop_reason`): mlbench's time-to-accuracy and
accuracy-after-time rules, checked at epoch boundaries on the per-epoch
records of :class:`engine.trainer.Trainer` (``--target-accuracy``,
``--time-budget``):

* **target accuracy**: stop after the first evaluated epoch whose test
  accuracy is at least the target (time to accuracy, mlbench's main metric);
* **time budget**: stop at the first epoch boundary where the training time
  so far reaches the budget (accuracy after time). The clock is the
  *training* time: the sum of the epochs' times, which exclude evaluation,
  checkpoints and start-up, so the rule measures the training and not the
  test set's size. Checked at boundaries, a run overshoots by less than one
  epoch; the benchmark reports the accuracy reached *within* the budget.

Every value the rules read (test accuracy, epoch time) comes out of an
all-reduce that leaves the same bits on every rank, so every rank takes the
same decision at the same step without another message.
"""
from __future__ import annotations

import signal

#: The signals that request a stop at the next step boundary.
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

TARGET_ACCURACY = "target_accuracy"
TIME_BUDGET = "time_budget"


def stop_reason(record: dict, target_accuracy: float | None,
                time_budget: float | None) -> str | None:
    """Why training should stop after the epoch of ``record``, or None.

    ``record`` needs ``train_time_s`` (cumulative training seconds) and, on
    evaluated epochs, ``test_accuracy``. The target is checked first: an
    epoch that reaches it within the budget counts as reaching it.
    """
    accuracy = record.get("test_accuracy")
    if target_accuracy is not None and accuracy is not None and accuracy >= target_accuracy:
        return TARGET_ACCURACY
    elapsed = record.get("train_time_s")
    if time_budget is not None and elapsed is not None and elapsed >= time_budget:
        return TIME_BUDGET
    return None


def time_to_accuracy(history: list[dict], target: float) -> tuple[float, int] | None:
    """(training seconds, epochs) until the first evaluated epoch at ``target``
    or better; None if no epoch of ``history`` reached it."""
    for record in history:
        accuracy = record.get("test_accuracy")
        if accuracy is not None and accuracy >= target:
            return float(record["train_time_s"]), int(record["epoch"])
    return None


def accuracy_after_time(history: list[dict], budget: float) -> tuple[float, float] | None:
    """(test accuracy, training seconds) of the last evaluated epoch that ended
    within ``budget`` training seconds; None if none did."""
    best = None
    for record in history:
        accuracy = record.get("test_accuracy")
        if accuracy is not None and record["train_time_s"] <= budget:
            best = (float(accuracy), float(record["train_time_s"]))
    return best


class StopRequest:
    """Records SIGTERM/SIGUSR1 while installed (a context manager).

    Install it on every rank from the main thread (elsewhere the handlers
    cannot be set and the request is never recorded); ``requested`` turns
    true when this rank received one of :data:`SIGNALS`.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handler(self, signum, frame) -> None:
        self.signum = signum

    def __enter__(self) -> "StopRequest":
        for sig in SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handler)
            except ValueError:  # not the main thread
                pass
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
