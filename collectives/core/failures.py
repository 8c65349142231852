"""What happens when an all-reduce fails, in a user's own mpi4py program.

MPI cannot interrupt a rank blocked in a collective or a receive, so an error
seen by some ranks only would leave the others waiting forever. The rules:

1. **Arguments are checked before any message.** A bad algorithm name, op,
   buffer or communicator, or a thread that may not call MPI, raises on the
   rank that passed it (:class:`UnknownAlgorithm`, :class:`UnknownOp`,
   :class:`UnsupportedBuffer`, :class:`AllreduceError`).
2. **Ranks that disagree are found** (:mod:`collectives.core.consistency`): on the
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
   use ``comm.Dup()``). The rank also *leaves* that communicator
   (:meth:`collectives.core.peers.Peers.leave`): peers waiting for it in a
   wait of ours raise, and a peer inside ``MPI_Allreduce`` of a call it
   will not make is released where the ranks share a node and every other
   rank is in that call.
5. **A call that fails once its data moved leaves the buffer filled with
   NaN** (0 for integers; :func:`collectives.core.dispatch.wipe`): it may hold a
   mix of calls or of ranks' numbers, which must neither pass for a result
   nor show this rank another rank's data.
6. **Nothing is collective at interpreter exit, and no rank leaves a peer
   in MPI_Allreduce.** A rank whose program fails (an uncaught exception)
   after it used a communicator of several ranks ends the job at exit, as
   ``python -m mpi4py`` does, unless :func:`abort_on_error` is off: its
   peers could enter a call it never makes at any later time. Otherwise
   every rank marks itself gone on each communicator it used, and until
   every peer has done so too, it watches them (:func:`leave_at_exit`):
   a peer that enters ``MPI_Allreduce`` of a call this rank never makes is
   released (rule 4), and one that stays where the mark cannot be seen
   (inside ``MPI_Allreduce`` with another peer missing, or behind a message
   this rank never received: one rank made more calls than another) ends
   the job. First of all it leaves a mark that its program ended, which
   ranks of its node waiting where they can poll look for
   (:mod:`collectives.core.ended`). Before aborting, and at exit after an
   uncaught exception, the rank unlinks the files MPICH keeps in
   ``/dev/shm`` for this job (they would otherwise outlive it).
"""
from __future__ import annotations

import atexit
import os
import sys
import time
from typing import Any

from collectives.core import ended
from collectives.core.consistency import GONE_EXITED, GONE_FAILED
from collectives.errors import AllreduceError
from collectives.runtime import MPI

#: Seconds between printing the error and MPI_Abort: the launcher reads the
#: rank's output asynchronously and could tear the job down before
#: forwarding the message.
ABORT_GRACE_S = 0.25
#: How long an ending rank sees a peer inside a call it will never make
#: before it ends the job (:func:`leave_at_exit`): time for a peer whose
#: waits watch the ranks' marks to notice this one is gone and raise.
STUCK_S = 2.0
_abort = os.environ.get("MPIDP_ABORT_ON_ERROR", "").strip() != "0"


def abort_on_error(enabled: bool = True) -> bool:
    """Whether an error seen by some ranks only ends the job (rule 4 of the
    module docstring); returns the previous setting. Local: call it on every
    rank (the ``mpidp`` commands turn it off and end the job themselves)."""
    global _abort
    previous, _abort = _abort, bool(enabled)
    return previous


def aborting() -> bool:
    """The setting of :func:`abort_on_error` (the engine's Python API follows it too)."""
    return _abort


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
    from collectives.core import plans  # deferred: plans imports this module's users

    state = plans.existing_state(comm)
    if midway and state is not None and state.broken is None:
        state.broken = f"{type(error).__name__} on rank {state.rank}"
    if isinstance(error, (KeyboardInterrupt, SystemExit)) or not _abort:
        if midway and state is not None:
            state.peers.leave(GONE_FAILED)  # no peer waits for this rank for ever
            if isinstance(error, (KeyboardInterrupt, SystemExit)):
                state.stopped_midway = type(error).__name__
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


#: The last line of :func:`abort_job`'s report, after the error's.
ENDING = ("collectives: ending the job so that no rank waits for this one "
          "(collectives.abort_on_error(False) to raise instead)")


def abort_job(code: int, message: str | None = None, ending: str = ENDING) -> None:
    """Print ``message`` tagged with the rank, then ``ending``; remove this
    job's MPICH files in ``/dev/shm``, and abort every rank of the job
    (``MPI_Abort``)."""
    world = MPI.COMM_WORLD
    if message:
        rank = world.Get_rank()
        text = "".join(f"[rank {rank}] {line}\n" for line in (message + "\n" + ending)
                       .splitlines())
        sys.stderr.write(text)
    sys.stdout.flush()
    sys.stderr.flush()
    remove_shm_files()
    time.sleep(ABORT_GRACE_S)
    world.Abort(code)
    os._exit(code)  # MPICH's MPI_Abort has been seen to return: never run on


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


#: The last line of the report of a rank whose program failed (:func:`leave_at_exit`).
FAILED_ENDING = ("collectives: this rank's program failed; ending the job so that no rank "
                 "waits for it in a call it will never make (collectives.abort_on_error(False): "
                 "they raise there instead)")


def leave_at_exit(error: BaseException | None = None, poll_s: float = 0.001) -> None:
    """What every rank does when its program ends, before ``MPI_Finalize``
    (rule 6); ``error``: the exception that ended it uncaught, if any.

    A program that failed on a rank that used a communicator of several
    ranks ends the job (``MPI_Abort``: exit code 1, 130 after a
    KeyboardInterrupt, as ``python -m mpi4py`` does), unless
    :func:`abort_on_error` is off: its peers could otherwise enter a call
    it never makes at any later time, after it had checked them.

    Otherwise (a normal end, or a failure with :func:`abort_on_error` off)
    it marks itself gone on each communicator it used, so that peers
    waiting for it in a call it will never make raise; then, until every
    peer has marked itself gone too, it releases a peer that enters
    ``MPI_Allreduce`` of a call this rank never makes (there it cannot see
    the mark), and if a peer stays inside such a call where no release
    reaches it (another peer is not in it, or a message for this rank that
    it never received: one rank made more calls than the other) for
    :data:`STUCK_S` (a peer that can see the mark raises and leaves before),
    it prints why and ends the job (exit code 2, whatever
    :func:`abort_on_error` says: there is no call left to raise from). A
    rank that went on to ``MPI_Finalize`` while a peer could still enter
    ``MPI_Allreduce`` would leave that peer there for ever. The
    communicators are marked first and watched together (a peer may wait on
    any of them); their windows are freed in ``MPI_Finalize`` after that.
    Under ``python -m mpi4py`` a failed program's job is aborted by mpi4py
    right after this: it only marks itself gone."""
    from collectives.core import plans  # deferred: plans imports this module's users

    used = [state for state in list(plans._STATES)
            if state.size > 1 and state.comm != MPI.COMM_NULL]
    ending = error is not None and bool(used) and _abort
    if ending and not any(state.stopped_midway for state in used):
        _end_after_failure(error)
    watched, stopped = [], []
    for state in used:
        if not state.peers.coherent:
            # Ranks on several nodes read each other's words with one-sided
            # MPI, whose locks complete only while the peer drives MPI's
            # progress: a rank already past this point (in MPI_Finalize, or
            # gone) would leave the others waiting here for ever. Across nodes
            # the exit check is left out (docs/collectives.md, rule 6).
            continue
        state.peers.leave(GONE_EXITED)
        if state.broken is not None or state.peers.peer_failed():
            # A failed call was reported (raised with abort_on_error off) and
            # the ranks are out of step: its leftovers are no news.
            if state.stopped_midway is not None:
                stopped.append(state)
            continue
        watched.append(state)
    for state in stopped:
        _end_unless_peers_leave(state, poll_s)
    if ending:
        _end_after_failure(error)
    if error is not None and "mpi4py.run" in sys.modules:
        return  # python -m mpi4py aborts the job next
    _watch_until_peers_leave(watched, poll_s)


def _end_after_failure(error: BaseException) -> None:
    """End the job after ``error`` ended this rank's program (never returns)."""
    code = 130 if isinstance(error, KeyboardInterrupt) else 1
    abort_job(code, f"{type(error).__name__}: {error}", FAILED_ENDING)


def _watch_until_peers_leave(states: list, poll_s: float) -> None:
    """The watch of :func:`leave_at_exit` over the communicators ``states``
    (this rank already marked gone on each), until every peer of each has
    left; ends the job if one stays in a call this rank never makes."""
    seen: dict[int, tuple[str | None, float]] = {}
    while states:
        for state in states:
            state.peers.release_waiting()  # a peer that entered MPI_Allreduce since
            reason = state.peers.evidence()
            previous = seen.get(id(state))
            if previous is None or previous[0] != reason:
                seen[id(state)] = previous = (reason, time.monotonic())
            # A peer whose waits watch this rank's mark raises and leaves within
            # a few probes; only one that stays put (inside MPI_Allreduce with
            # another peer missing, or behind an unreceived message) ends the job.
            if reason is not None and time.monotonic() - previous[1] >= STUCK_S:
                abort_job(2, f"AllreduceMismatch: rank {state.rank}'s program is ending while "
                          f"{reason}: one rank made more allreduce calls than another (a "
                          "call skipped, or one too many). Every rank must make the same "
                          "sequence of calls.",
                          "collectives: ending the job so that no rank waits for this one")
        states = [state for state in states if not state.peers.peers_gone()]
        if states:
            time.sleep(poll_s)


def _end_unless_peers_leave(state, poll_s: float) -> None:
    """After a stop left a call midway on this rank: give the peers
    :data:`STUCK_S` to mark themselves gone (those that can see this rank's
    mark raise and leave), else end the job (130 after a KeyboardInterrupt,
    else 2): a peer inside ``MPI_Allreduce`` of a call this rank never ends
    cannot see the mark, and would keep the job (and ``MPI_Finalize``) waiting."""
    deadline = time.monotonic() + STUCK_S
    while not state.peers.peers_gone():
        if time.monotonic() >= deadline:
            abort_job(130 if state.stopped_midway == "KeyboardInterrupt" else 2,
                      f"{state.stopped_midway} on rank {state.rank} in the middle of an "
                      "allreduce, while a peer is still inside it",
                      "collectives: ending the job so that no rank waits for this one")
        time.sleep(poll_s)


@atexit.register
def _at_exit() -> None:
    # Local (rule 6): no collective work (a release joins only an
    # MPI_Allreduce that every peer is already in). After an uncaught
    # exception python -m mpi4py aborts the job once this has run.
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return
    if MPI.COMM_WORLD.Get_size() > 1:  # first: leave_at_exit may wait for peers
        ended.mark_ended(MPI.COMM_WORLD.Get_rank())
    error = getattr(sys, "last_value", None)  # set by an uncaught exception
    leave_at_exit(error)
    if error is not None and MPI.COMM_WORLD.Get_size() > 1:
        remove_shm_files()
