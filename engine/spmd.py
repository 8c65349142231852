"""Run one SPMD entry point so that a failing rank ends the whole job.

MPI has no notion of "one rank crashed": the other ranks block forever in the
next collective. :func:`run_spmd` therefore turns any uncaught exception on
any rank into ``MPI_Abort`` after printing the traceback once, tagged with the
rank, so ``mpiexec``/``srun`` exits non-zero within about a second.

Errors that the user can act on (bad input, impossible settings) are classes
with an integer ``exit_code`` attribute; they print as one line, without a
traceback. When such an error is known to be raised identically on every
rank (``collective = True`` on the instance, e.g. after the ranks agreed on a
check), only rank 0 prints it and the ranks exit normally with its code.

A stop signal turned into an exception (:class:`engine.stopping.Interrupted`,
or a plain ``KeyboardInterrupt``) ends the job with one line (from the first
rank of each node to handle it, :func:`_first_to_say_so`) and
exit code 128 + the signal's number: every rank leaves through
``MPI_Abort`` with that code (:func:`_leave`), without the collective
``MPI_Finalize`` (a rank still inside a collective would make it wait
forever); the launcher ends the ranks still inside MPI and reports the
code. No rank dies *by* the signal, so mpiexec prints no "BAD TERMINATION"
banner. An error raised after such an exception went into running code
(:func:`engine.stopping.interrupt_raised`) ends the job the same way: native
code that called back into Python can swallow the interrupt and fail with
an error of its own, which is the stop, not a bug to print.

Exit codes (the table: docs/lifecycle.md): 0 success, 1 internal error (a
traceback was printed), 2 bad input, 128 + n stopped by signal n, others as
documented by the command that returns them (e.g. 75, checkpoint written).
"""
from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from typing import Callable

import collectives
from collectives import MPI
from collectives.core.ended import launch_key, remove_stale_markers
from collectives.core.failures import ABORT_GRACE_S, remove_shm_files
from engine import stopping
from engine.errors import out_of_memory

EXIT_INTERNAL_ERROR = 1
EXIT_INTERRUPTED = 128 + signal.SIGINT


def _tag(text: str, rank: int, size: int) -> str:
    if size <= 1:
        return text
    prefix = f"[rank {rank}] "
    return "".join(prefix + line for line in text.splitlines(keepends=True))


def _emit(text: str) -> None:
    if not text.endswith("\n"):
        text += "\n"
    sys.stderr.write(text)
    sys.stderr.flush()


def _end_job(code: int, comm: "MPI.Comm") -> "None":
    sys.stdout.flush()
    sys.stderr.flush()
    if comm.Get_size() > 1:
        remove_shm_files()  # MPICH's files in /dev/shm would outlive the aborted job
        time.sleep(ABORT_GRACE_S)
        comm.Abort(code)
    raise SystemExit(code)


#: Marker files of :func:`_first_to_say_so` (in /dev/shm: node-local, in memory).
STOP_MARKER = "/dev/shm/mpidp-stop-{ppid}-{start}"


def _first_to_say_so(rank: int) -> bool:
    """Whether this rank is the first of its node to report a stop signal.

    Every rank of a job gets the signal, and the first to leave ends the job,
    so the line cannot be left to rank 0: it may be waiting in a collective
    for a rank that already left, unable to run Python's handler. The ranks
    of one launch on a node share a parent (the launcher's proxy or
    slurmstepd): the first to create that parent's marker file says it. One
    line per node; where there is no /dev/shm or /proc, rank 0 says it.
    """
    try:
        ppid, start = launch_key()
        path = STOP_MARKER.format(ppid=ppid, start=start)
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    except (OSError, IndexError):
        return rank == 0
    remove_stale_markers(path, "mpidp-stop-")
    return True


def _leave(code: int, comm: "MPI.Comm", speaker: bool = True) -> "None":
    """End the job with ``code`` now, without MPI_Finalize (see module docstring).

    With more than one rank this is ``MPI_Abort(code)``, not ``os._exit``: a
    rank that leaves on its own makes the launcher kill the ranks still
    waiting inside MPI (where Python cannot run its signal handler), and
    MPICH's mpiexec then reports one of *those* (exit 9, SIGKILL) as often as
    the stop's 130; an abort carries its code to the launcher. The library's
    own "application called MPI_Abort" line is sent to /dev/null: the job's
    one line was printed already. Every rank waits before its abort, as
    :func:`_end_job` does: the rank that printed the line
    :data:`ABORT_GRACE_S`, so the launcher forwards the line before it tears
    the job down (a busy machine lost it otherwise), and the others twice
    that, so their aborts cannot end the job before the line is out.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    if comm.Get_size() > 1:
        remove_shm_files()
        time.sleep(ABORT_GRACE_S if speaker else 2 * ABORT_GRACE_S)
        _silence_stderr()
        comm.Abort(code)
        os._exit(code)  # not reached: Abort does not return
    raise SystemExit(code)


def _silence_stderr() -> None:
    """Point file descriptor 2 at /dev/null (what the MPI library prints on abort)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
    except OSError:
        pass


def _line(exc: BaseException) -> str:
    """The one line that reports a user-facing exception."""
    if getattr(exc, "is_error", True):
        return f"mpidp: error: {exc}"
    return f"mpidp: {exc}"


def is_user_error(exc: BaseException) -> bool:
    """True for exceptions meant for the user: an ``exit_code`` and a message."""
    return isinstance(getattr(type(exc), "exit_code", None), int)


def _stopped(signum: int, comm: "MPI.Comm") -> "None":
    """End the job as stopped by ``signum``: one line per node, exit 128 + n."""
    code = 128 + signum
    rank, size = comm.Get_rank(), comm.Get_size()
    speaker = size == 1 or _first_to_say_so(rank)
    if speaker:
        _emit(f"mpidp: stopped by {signal.Signals(signum).name} (exit code {code})")
    _leave(code, comm, speaker)


#: The last line printed by :func:`end_job_on_error`.
ENDING = ("mpidp: ending the job so that no rank waits for this one "
          "(collectives.abort_on_error(False) before the call to raise instead)")


def end_job_on_error(exc: BaseException, comm: "MPI.Comm | None" = None) -> None:
    """For a library call every rank makes (:func:`engine.train`): what
    :func:`run_spmd` does for a command, unless the user turned it off.

    Returns (the caller re-raises ``exc``) when ``exc`` was raised on every
    rank alike (``collective = True``), is a stop (``KeyboardInterrupt``,
    ``SystemExit``), ``comm`` (default ``COMM_WORLD``) has one rank, or
    :func:`collectives.abort_on_error` is off (``MPIDP_ABORT_ON_ERROR=0``).
    Otherwise prints it tagged with the rank (one line for a user error, the
    traceback for anything else) and ends the job (``MPI_Abort``, the
    error's ``exit_code`` or 1): its peers would otherwise wait for this
    rank in their next collective for ever.
    """
    from collectives.core import failures  # the one switch for the library's failure rule

    comm = MPI.COMM_WORLD if comm is None else comm
    if isinstance(exc, (KeyboardInterrupt, SystemExit)) or getattr(exc, "collective", False):
        return
    if not failures.aborting() or comm.Get_size() <= 1:
        return
    rank, size = comm.Get_rank(), comm.Get_size()
    if is_user_error(exc):
        text, code = _line(exc), int(exc.exit_code)
    else:
        text, code = "".join(traceback.format_exception(exc)), EXIT_INTERNAL_ERROR
    _emit(_tag(text.rstrip("\n") + "\n" + ENDING, rank, size))
    _end_job(code, comm)


def run_spmd(main: Callable[[], int | None], comm: "MPI.Comm | None" = None) -> int:
    """Call ``main()`` on this rank; on failure, bring every rank down.

    Must be called by every rank of ``comm`` (default ``COMM_WORLD``).
    Returns ``main``'s exit code (``None`` means 0) when it succeeds; never
    returns when it fails with more than one rank (the job is aborted), and
    raises ``SystemExit`` with the code when it fails on a single rank.
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    rank, size = comm.Get_rank(), comm.Get_size()
    collectives.abort_on_error(False)  # errors end the job here, printed as mpidp's
    try:
        code = main()
        return 0 if code is None else int(code)
    except SystemExit as exc:  # argparse errors, explicit exits
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
        if isinstance(exc.code, str):
            _emit(_tag(exc.code, rank, size))
        if code == 0:
            return 0
        _end_job(code, comm)
    except KeyboardInterrupt as exc:  # Ctrl-C, or engine.stopping.Interrupted
        _stopped(int(getattr(exc, "signum", signal.SIGINT)), comm)
    except BaseException as exc:  # noqa: B902 - every failure must end the job
        signum = stopping.interrupt_raised()
        if signum is not None:  # the interrupt, turned into this error by native code
            _stopped(signum, comm)
        exc = out_of_memory(exc) or exc
        if is_user_error(exc):
            code = int(exc.exit_code)
            if getattr(exc, "collective", False):
                if rank == 0:
                    _emit(_line(exc))
                sys.stdout.flush()
                raise SystemExit(code) from None
            _emit(_tag(_line(exc), rank, size))
            _end_job(code, comm)
        _emit(_tag("".join(traceback.format_exception(exc)), rank, size))
        _end_job(EXIT_INTERNAL_ERROR, comm)
    return EXIT_INTERNAL_ERROR  # unreachable; keeps type checkers content
