"""User-facing errors of the trainer, and how the ranks agree on them.

Every class has an integer ``exit_code`` (see :mod:`engine.spmd`): the error
prints as one line ``mpidp: error: ...`` and the job exits with that code.
An error detected identically on every rank sets ``collective = True`` so
that only rank 0 prints it and no rank aborts the job; an error detected by
some ranks only goes through :func:`agree` first, which makes it collective.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collectives import MPI

#: Exit codes of mpidp (one table: docs/lifecycle.md). 2 is for bad input only.
EXIT_USER_ERROR = 2
EXIT_DIVERGED = 3
EXIT_CLAIM_REFUTED = 4  # mpidp audit --attack canary: the run leaks more than its epsilon says
EXIT_CANNOT_REFUTE = 5  # mpidp audit --attack canary: these settings cannot reach the claim
EXIT_OUT_OF_MEMORY = 71  # EX_OSERR: the machine refused an allocation
EXIT_LOCKED = 73  # EX_CANTCREAT: the checkpoint directory is in use by another run
EXIT_WRITE_FAILED = 74  # EX_IOERR: an output could not be written midway (disk full, read-only)
EXIT_CHECKPOINTED = 75  # EX_TEMPFAIL: interrupted, checkpoint written; rerun with --resume


class MpidpError(Exception):
    """Base class: a message a user can act on, and an exit code."""

    exit_code = EXIT_USER_ERROR

    def __init__(self, message: str, collective: bool = False):
        super().__init__(message)
        self.collective = collective


class DataError(MpidpError):
    """The data file is missing, unreadable, of the wrong schema or too small."""


class ConfigError(MpidpError):
    """Options that contradict each other or cannot work."""


class PrivacyError(MpidpError):
    """An impossible privacy target, or a run that would exceed its budget."""


class CheckpointError(MpidpError):
    """A checkpoint that is missing, corrupt, or belongs to another run."""


class GroupError(MpidpError):
    """A per-group request that cannot be answered: an unknown attribute, one the
    file does not keep, or a table whose every group is too small to publish."""


class OutputError(MpidpError):
    """An output path that cannot be written, found before any work: bad input."""


class DirectoryLocked(MpidpError):
    """The checkpoint directory is held by another run (its lock names the holder)."""

    exit_code = EXIT_LOCKED


class WriteFailed(MpidpError):
    """Writing an output failed midway (disk full, file system turned read-only);
    what was written before is intact."""

    exit_code = EXIT_WRITE_FAILED


class DivergedError(MpidpError):
    """The loss or the parameters became NaN or infinite."""

    exit_code = EXIT_DIVERGED


class OutOfMemory(MpidpError):
    """An allocation this machine refused: numpy's ``MemoryError``, or torch's."""

    exit_code = EXIT_OUT_OF_MEMORY


#: What torch's allocators say when they refuse (a RuntimeError on the CPU, its
#: subclass torch.OutOfMemoryError on a GPU).
_TORCH_REFUSALS = ("can't allocate memory", "out of memory")


def out_of_memory(exc: BaseException) -> OutOfMemory | None:
    """The one-line error for ``exc`` when it is a refused allocation, else None.

    A model, batch or file too large for the machine is the user's to change,
    not a bug: it must not print as a traceback from wherever the allocation
    happened to be.
    """
    if isinstance(exc, MemoryError):
        reason = str(exc) or "MemoryError"
    elif isinstance(exc, RuntimeError) and any(w in str(exc) for w in _TORCH_REFUSALS):
        reason = str(exc)
    else:
        return None
    reason = " ".join(reason.split())
    reason = reason if len(reason) <= 160 else reason[:157] + "..."
    return OutOfMemory(f"out of memory ({reason}): the model (--hidden, the data file's "
                       "n_classes), the batch or this rank's share of the data is too large "
                       "for this machine")


def agree(comm: "MPI.Comm", error: MpidpError | None) -> None:
    """Collective: if any rank has an error, raise one on every rank.

    Every rank of ``comm`` must call it. The first failing rank's error (by
    rank) is re-raised everywhere with ``collective = True`` and the same
    class, so every rank exits with the same code and rank 0 prints it once.
    """
    errors = comm.allgather(None if error is None else (type(error), str(error)))
    for rank, item in enumerate(errors):
        if item is not None:
            cls, message = item
            if comm.Get_size() > 1 and rank != 0:
                message = f"{message} (on rank {rank})"
            raise cls(message, collective=True)
