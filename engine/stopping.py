"""When a run stops before its last epoch: on a signal, or by mlbench's rules.

**Signals.** A run handles SIGINT (Ctrl-C; mpiexec forwards it to every
rank), SIGTERM (``scancel``, Slurm's time limit, preemption) and SIGUSR1
(Slurm's ``--signal`` warning). The handlers only *record* a signal: raising
from a handler would surface inside whatever runs at that moment (an import,
Numba's compiler, an MPI call) as a traceback from every rank, so the
program decides at places where stopping is clean:

* **before the first step** (:func:`check_startup`, called by the trainer
  between its start-up phases on every rank): SIGINT ends the run at the
  next phase boundary with one line and exit code 130; nothing was trained
  or written. SIGTERM and SIGUSR1 stop the run after its first step instead
  (a checkpoint, exit 75) when it has a checkpoint directory, so a job
  warned during its start-up still leaves a point to resume from;
  without one they end it like SIGINT (exit 128 + the signal's number).
* **during training** (:class:`StopRequest`): any of the three stops the run
  at the next step boundary. The loop carries the request in the step's
  all-reduce buffer (one extra float), so every rank learns of a signal
  received by any rank in the same step and all stop after that step's
  update, together; the trainer then checkpoints and exits 75.
* **other commands** (prep, audit, benchmarks: no step boundary) raise
  :class:`Interrupted` from the handler once the command runs
  (:func:`raise_on_signals`); :func:`engine.spmd.run_spmd` ends every rank
  with one line and exit code 128 + the signal's number. Raised inside a
  call from native code (polars calling back into Python while it reads a
  CSV block), the exception may be swallowed there, Python reporting it as
  "Exception ignored", and the native code fail with an error of its own:
  the hook :func:`_unraisable` keeps the swallowed interrupt quiet, and
  :func:`interrupt_raised` lets ``run_spmd`` report the error that follows
  as the stop it is.

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

import contextlib
import os
import signal
import sys
import threading
from typing import TYPE_CHECKING, Iterator

from engine.errors import MpidpError

if TYPE_CHECKING:
    from collectives import MPI

#: The signals that stop a run (module docstring).
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)

#: Exit code of a run stopped by SIGINT before its first step (128 + 2, the shell's rule).
EXIT_INTERRUPTED = 128 + signal.SIGINT

#: Signals received by this process while the recording handlers were installed,
#: in order (the handlers append; the program reads).
_received: list[int] = []
_raising = False
#: The signal whose Interrupted a handler raised into running code, if any.
_raised: int | None = None
#: Signals recorded since the program started; never forgotten (a caller that
#: runs several trainers in turn, as ``mpidp tune``, asks whether one came
#: during a run that forgot it on the way out).
_count = 0


def signal_name(signum: int | None) -> str:
    """``SIGTERM`` for 15; ``a signal`` for None."""
    if signum is None:
        return "a signal"
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class Interrupted(KeyboardInterrupt):
    """A stop signal turned into an exception (commands without step boundaries).

    A KeyboardInterrupt subclass, so library code that catches ``Exception``
    lets it through, as it does Ctrl-C.
    """

    def __init__(self, signum: int):
        super().__init__(signal_name(signum))
        self.signum = signum


class StartupInterrupted(MpidpError):
    """A stop signal received before the first step; raised on every rank alike.

    Its exit code is 128 + the signal's number (an instance attribute; the
    class's is SIGINT's).
    """

    exit_code = EXIT_INTERRUPTED
    is_error = False  # printed as "mpidp: stopped by ...", not as an error

    def __init__(self, message: str, collective: bool = True, signum: int = signal.SIGINT):
        super().__init__(message, collective=collective)
        self.signum = signum
        self.exit_code = 128 + int(signum)


def _record(signum, frame) -> None:
    global _count, _raised
    _received.append(signum)
    _count += 1
    if _raising:
        _raised = signum
        raise Interrupted(signum)


def _unraisable(unraisable) -> None:
    """``sys.unraisablehook``: an :class:`Interrupted` that native code swallowed
    (it was raised in a callback from there) is not reported; the signal is
    recorded, and the error the native code raises next is reported as the
    stop. Anything else goes to the previous hook."""
    if isinstance(unraisable.exc_value, Interrupted):
        return
    _previous_unraisable_hook(unraisable)


_previous_unraisable_hook = sys.unraisablehook


def interrupt_raised() -> int | None:
    """The signal whose :class:`Interrupted` a handler raised into running code
    in this process, or None: an error after it may be that interrupt,
    turned into another exception by native code it crossed."""
    return _raised


def record_signals() -> bool:
    """Install the recording handlers for :data:`SIGNALS` (local; main thread).

    Returns False where handlers cannot be installed (not the main thread).
    """
    global _raising
    if threading.current_thread() is not threading.main_thread():
        return False
    _raising = False
    for sig in SIGNALS:
        signal.signal(sig, _record)
    sys.unraisablehook = _unraisable
    return True


def is_mpidp_program() -> bool:
    """Whether this process is the ``mpidp`` program (the console script or
    ``python -m engine.cli``), not a program that imports the engine."""
    if os.path.basename(sys.argv[0] if sys.argv else "") == "mpidp":
        return True  # the console script (sys.argv[0] is its path)
    # python -m engine.cli: while the engine package is imported, sys.argv[0]
    # is still "-m"; the interpreter's own command line names the module.
    argv = list(getattr(sys, "orig_argv", sys.argv))
    return any(a == "-m" and b == "engine.cli" for a, b in zip(argv, argv[1:]))


def raise_on_signals() -> None:
    """From now on a signal of :data:`SIGNALS` raises :class:`Interrupted`
    (local; main thread); one already recorded raises at once."""
    global _raising
    if record_signals():
        _raising = True
        if _received:
            raise Interrupted(_received[0])


@contextlib.contextmanager
def handled_signals(raising: bool) -> Iterator[None]:
    """Record (``raising=False``) or raise on (``True``) :data:`SIGNALS` inside
    the block; the previous handlers return after it (local; a no-op outside
    the main thread)."""
    global _raising
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
    was_raising = _raising
    try:
        if raising:
            raise_on_signals()
        else:
            record_signals()
        yield
    finally:
        _raising = was_raising
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def received() -> list[int]:
    """The signals recorded so far (a copy)."""
    return list(_received)


def signal_count() -> int:
    """How many stop signals this process has recorded in all (local;
    :func:`forget_signals` does not reset it)."""
    return _count


def forget_signals() -> None:
    """Forget the recorded signals (tests; a process that handled them)."""
    global _raised
    _received.clear()
    _raised = None


def check_startup(comm: "MPI.Comm", stop_on_any: bool, resume_hint: str = "") -> None:
    """Collective (every rank of ``comm``): end the run if a rank was told to stop.

    Called between the start-up phases of a run. SIGINT always ends it here;
    SIGTERM and SIGUSR1 only when ``stop_on_any`` (a run without a checkpoint
    directory: stopping after the first step would save nothing).

    Raises:
        StartupInterrupted: on every rank, exit code 128 + the signal.
    """
    mine = next((s for s in _received if s == signal.SIGINT or stop_on_any), None)
    everyone = comm.allgather(mine) if comm.Get_size() > 1 else [mine]
    signum = next((s for s in everyone if s is not None), None)
    if signum is None:
        return
    forget_signals()  # handled here: an in-process caller may start another run
    raise StartupInterrupted(
        f"stopped by {signal_name(signum)} during start-up, before the first "
        "step: nothing was trained or written" + (f"; {resume_hint}" if resume_hint else "")
        + f" (exit code {128 + signum})", signum=signum)


TARGET_ACCURACY = "target_accuracy"
TIME_BUDGET = "time_budget"


def monitored_accuracy(record: dict) -> float | None:
    """The accuracy training watches in an epoch's record: ``val_accuracy`` when the
    run scores a validation split (the test split is then read once, at the end),
    else ``test_accuracy`` (a file without one); None on an epoch not evaluated."""
    if "val_accuracy" in record:
        return record["val_accuracy"]
    return record.get("test_accuracy")


def stop_reason(record: dict, target_accuracy: float | None,
                time_budget: float | None) -> str | None:
    """Why training should stop after the epoch of ``record``, or None.

    ``record`` needs ``train_time_s`` (cumulative training seconds) and, on
    evaluated epochs, ``val_accuracy`` (``test_accuracy`` for a file without
    a validation split: :func:`monitored_accuracy`). The target is checked
    first: an epoch that reaches it within the budget counts as reaching it.
    """
    accuracy = monitored_accuracy(record)
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
    """Records :data:`SIGNALS` while installed (a context manager).

    Install it on every rank from the main thread (elsewhere the handlers
    cannot be set and the request is never recorded); ``requested`` turns
    true when this rank received one of :data:`SIGNALS`, also before it was
    installed while :func:`record_signals` was in force (a signal during the
    start-up of ``mpidp train``). On exit the previous handlers return.
    """

    def __init__(self) -> None:
        self._previous: dict = {}
        self._raising = False

    @property
    def signum(self) -> int | None:
        """The first signal this rank received, or None."""
        return _received[0] if _received else None

    @property
    def requested(self) -> bool:
        return bool(_received)

    def __enter__(self) -> "StopRequest":
        global _raising
        if threading.current_thread() is threading.main_thread():
            self._raising, _raising = _raising, False
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, _record)
        return self

    def __exit__(self, *exc) -> None:
        global _raising
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        if self._previous:
            _raising = self._raising
        self._previous.clear()
