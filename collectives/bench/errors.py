"""The one-line errors of ``mpidp bench allreduce`` (printed without a traceback).

Both are raised alike on every rank (``collective = True``: rank 0 prints
the line once) and carry the command's exit status. They live apart from
:mod:`collectives.bench.allreduce` so that :mod:`collectives.bench.report`
(which the command imports) can raise them too; the command re-exports them.
"""
from __future__ import annotations


class BenchUsageError(ValueError):
    """A benchmark option that cannot work, or saved runs that cannot be read together."""

    exit_code = 2
    collective = True


class BenchWriteError(OSError):
    """An output that could not be written at the end (checked before the run)."""

    exit_code = 74
    collective = True
