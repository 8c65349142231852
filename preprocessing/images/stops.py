"""The write phase of ``mpidp prep --format``: a stop signal ends it at once, leaving nothing.

``mpidp prep`` turns a stop signal (SIGINT, SIGTERM, SIGUSR1) into an
exception raised from the signal handler (:mod:`engine.stopping`). During
the write phase that handler often runs inside h5py's clean-up callbacks (a
weak reference dying as an HDF5 object is closed), where Python cannot
raise: the exception is reported as unraisable and lost, and the write went
on to finish and exit 0. So for the write phase :class:`WritePhase` puts a
handler in its place that raises nothing: it removes the temporary file at
once (a rank the launcher kills next still leaves no partial output) and
records the signal. The writer calls :meth:`WritePhase.check` between
pieces, in its own code; there the signal goes to the handler that was
installed before (engine's raises its stop exception, which ends the run
with one line and 128 + the signal's number), or, where that handler
returned, :class:`Stopped` is raised. A signal that comes after the last
check (the file is then complete and committed) is handed over the same way
when the phase ends. Signals that were ignored stay ignored.

This module names the signals itself: ``preprocessing`` imports nothing of
``engine``.
"""
from __future__ import annotations

import signal
import threading
from types import TracebackType

from preprocessing import atomic

#: The stop signals of :mod:`engine.stopping`.
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class Stopped(KeyboardInterrupt):
    """The write phase ended by a stop signal whose previous handler did not
    raise; ``signum`` as :class:`engine.stopping.Interrupted` has it, so
    :func:`engine.spmd.run_spmd` ends the run as stopped by that signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class WritePhase:
    """Within ``with WritePhase(temporary) as phase:`` a stop signal removes
    ``temporary`` and :meth:`check` then stops (module docstring). Local; a
    no-op outside the main thread, where handlers cannot be set."""

    def __init__(self, temporary: str) -> None:
        self.temporary = temporary
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "WritePhase":
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                previous = signal.getsignal(signum)
                if previous is not signal.SIG_IGN:
                    self._previous[signum] = signal.signal(signum, self._record)
        return self

    def _record(self, signum: int, frame: object) -> None:
        if self.signum is None:
            self.signum = signum
        atomic.discard(self.temporary)

    def check(self) -> None:
        """Stop here if a stop signal came (see the module docstring).

        Raises:
            BaseException: what the previous handler raises (for ``mpidp prep``,
                engine's stop exception), else :class:`Stopped`.
        """
        if self.signum is None:
            return
        signum, previous = self.signum, self._previous.get(self.signum)
        self._restore()
        atomic.discard(self.temporary)
        if callable(previous):
            previous(signum, None)
        elif previous == signal.SIG_DFL:
            signal.raise_signal(signum)  # what it would have done: end the process
        raise Stopped(signum)

    def _restore(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if self._previous and self.signum is not None:
            self.check()  # a signal after the last check: the run still stops
        self._restore()
