"""What happens when an all-reduce fails, in a user's own mpi4py program.

MPI cannot interrupt a rank blocked in a collective or a receive, so an error
seen by some ranks only would leave the others waiting forever. The rules:

1. **Arguments are checked before any message.** A bad algorithm name, op,
   buffer or communicator raises on the rank that passed it
   (:class:`UnknownAlgorithm`, :class:`UnknownOp`,
   :class:`UnsupportedBuffer`, :class:`AllreduceError`).
2. **Ranks that disagree are found** (:mod:`collectives.consistency`): on the
   first call of a signature every rank raises :class:`AllreduceMismatch`
   (``collective = True``); later, the ranks that see a message, a slot or a
   counter of another call raise it.
3. **An error raised on every rank alike** (``collective = True``) leaves the
   communicator usable: no rank is inside a call.
4. **Any other error ends the job** when the communicator has more than one
   rank: it is printed (``[rank r] ...``) and the job is aborted
   (``MPI_Abort``, exit code 2 for the errors above, 1 for anything else, a
   bug of ours). That is what ``mpidp`` does for every command, and the only
   way to free ranks blocked inside MPI. :func:`abort_on_error` turns it off
   (or ``MPIDP_ABORT_ON_ERROR=0``): the error is then raised, and a
   communicator on which a call failed midway refuses further calls
   (ranks may be out of step and messages of that call may still arrive;
   use ``comm.Dup()``).
5. **Nothing is collective at interpreter exit**: a rank leaving with an
   error never waits for its peers (the OS reclaims the shared windows). An
   uncaught exception under ``python -m mpi4py`` therefore aborts the job as
   in a plain mpi4py program. Before aborting, and at exit after an uncaught
   exception, the rank unlinks the files MPICH keeps in ``/dev/shm`` for
   this job (they would otherwise outlive it).
"""
from __future__ import annotations

import atexit
import os
import sys
import time
from typing import Any

from collectives.errors import AllreduceError
from collectives.runtime import MPI

#: Seconds between printing the error and MPI_Abort: the launcher reads the
#: rank's output asynchronously and could tear the job down before
#: forwarding the message.
ABORT_GRACE_S = 0.25
_abort = os.environ.get("MPIDP_ABORT_ON_ERROR", "").strip() != "0"


def abort_on_error(enabled: bool = True) -> bool:
    """Whether an error seen by some ranks only ends the job (rule 4 of the
    module docstring); returns the previous setting. Local: call it on every
    rank (the ``mpidp`` commands turn it off and end the job themselves)."""
    global _abort
    previous, _abort = _abort, bool(enabled)
    return previous


def handle(error: BaseException, comm: Any, midway: bool) -> None:
    """Apply the rules to ``error``, raised by a call on ``comm`` (``None``:
    ``COMM_WORLD``); ``midway``: raised after the call's first message.
    Returns when the caller should re-raise; never returns when it aborts."""
    if isinstance(error, AllreduceError) and error.collective:
        return
    if getattr(error, "_collectives_handled", False):  # by a nested call (a retry)
        return
    try:
        error._collectives_handled = True
    except AttributeError:  # an exception without a __dict__
        pass
    from collectives import plans  # deferred: plans imports this module's users

    state = plans.existing_state(comm)
    if midway and state is not None and state.broken is None:
        state.broken = f"{type(error).__name__} on rank {state.rank}"
    if isinstance(error, (KeyboardInterrupt, SystemExit)) or not _abort:
        return
    size = state.size if state is not None else _size(comm)
    if size > 1:
        code = getattr(type(error), "exit_code", 1)
        abort_job(code if isinstance(code, int) else 1,
                  f"{type(error).__name__}: {error}")


def _size(comm: Any) -> int:
    try:
        return (MPI.COMM_WORLD if comm is None else comm).Get_size()
    except Exception:  # noqa: BLE001 - a freed or foreign communicator
        return MPI.COMM_WORLD.Get_size()


def abort_job(code: int, message: str | None = None) -> None:
    """Print ``message`` tagged with the rank, remove this job's MPICH files in
    ``/dev/shm``, and abort every rank of the job (``MPI_Abort``)."""
    world = MPI.COMM_WORLD
    if message:
        rank = world.Get_rank()
        text = "".join(f"[rank {rank}] {line}\n" for line in message.splitlines())
        sys.stderr.write(text + f"[rank {rank}] collectives: ending the job so that no rank "
                         "waits for this one (collectives.abort_on_error(False) to raise "
                         "instead)\n")
    sys.stdout.flush()
    sys.stderr.flush()
    remove_shm_files()
    time.sleep(ABORT_GRACE_S)
    world.Abort(code)


def remove_shm_files() -> list[str]:
    """Unlink the MPICH files in ``/dev/shm`` that this process has mapped and
    that still have a name (local; Linux). Returns the paths removed."""
    removed = []
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.read().splitlines()
    except OSError:
        return removed
    for line in lines:
        fields = line.split()
        path = fields[-1] if len(fields) >= 6 else ""
        if path.startswith("/dev/shm/mpich_") and path not in removed:
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                pass
    return removed


@atexit.register
def _after_uncaught_exception() -> None:
    # Local: an uncaught exception ends this rank; the job is about to be
    # aborted (python -m mpi4py) or to lose this rank.
    if getattr(sys, "last_value", None) is not None and MPI.Is_initialized() \
            and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
        remove_shm_files()
