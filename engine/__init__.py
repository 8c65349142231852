"""mpidp engine: the SPMD trainer, its command line and its run-time helpers.

Layout: the DP components in :mod:`engine.dp`, the model and its optimizers
in :mod:`engine.nn`, the one DP-SGD step that composes them in
:mod:`engine.step`, the loop around it in :mod:`engine.trainer`; benchmarks
in :mod:`engine.bench`, attacks in :mod:`engine.audit`.

In the ``mpidp`` program (not in programs that import the engine), stop
signals are recorded from here on, the first of its modules to run, so a
Ctrl-C in the first instants never becomes a traceback (:mod:`engine.stopping`).
"""
from engine import stopping as _stopping

if _stopping.is_mpidp_program():
    _stopping.record_signals()

from importlib.metadata import PackageNotFoundError, version  # noqa: E402

try:
    # The version lives in setup.py only; an installed copy knows it.
    __version__ = version("mpidp")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["__version__"]
