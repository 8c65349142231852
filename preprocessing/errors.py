"""User-facing errors of ``mpidp prep`` and ``mpidp synth``.

Every error a user can fix is a :class:`PrepError`: one line that names the
file (and the line in it, where one applies) and says what to do. The
``exit_code`` class attribute makes :func:`engine.spmd.run_spmd` print it as
``mpidp: error: ...`` without a traceback; ``collective = True`` on an
instance means every rank raises the same error (after the ranks agreed on
it), so only rank 0 prints it and no rank aborts the job.
"""
from __future__ import annotations


class PrepError(Exception):
    """Bad input or settings: one actionable line, exit code 2."""

    exit_code = 2

    def __init__(self, message: str, *, collective: bool = False) -> None:
        super().__init__(message)
        self.collective = collective


def where(path: str, line: int | None = None) -> str:
    """``"path"`` or ``"path, line N"``: the prefix of every message about a file."""
    return f"{path}, line {line}" if line is not None else str(path)
