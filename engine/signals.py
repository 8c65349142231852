"""SIGTERM / SIGUSR1: stop at the next step boundary (and checkpoint).

The handler only records the request; the training loop carries it in the
step's all-reduce buffer (one extra float), so every rank learns of a signal
received by any rank in the same step and all stop after that step's update,
together. Slurm sends SIGTERM at the time limit (or SIGUSR1 with
``--signal=USR1@120``); mpiexec forwards both to the ranks.
"""
from __future__ import annotations

import signal

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """Records SIGTERM/SIGUSR1 while installed (a context manager)."""

    def __init__(self):
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
