"""Marks that a rank's program has ended, seen by the ranks of its node.

MPI cannot tell a rank that a peer is gone: a rank waiting for a call its
peer will never make waits for ever. So every rank's program leaves a mark
when it ends (:func:`mark_ended`, from the interpreter's exit hooks), an
empty file in ``/dev/shm`` named after its launch (the parent process
shared by the ranks of one launch on a node: the launcher's proxy or
slurmstepd, with its start time) and its world rank; a rank that waits
where it can poll (:func:`wait_for_peers`: the first all-reduce on a
communicator, every :func:`engine.train`) looks for its peers' marks
(:func:`ended`). Ranks on other nodes leave no mark it can
see. A mark outlives its job until a later job's mark removes it (its
launcher is gone).
"""
from __future__ import annotations

import os
import sys
import time

#: Seconds a rank waits in :func:`wait_for_peers` before it says so (once).
NOTICE_S = 30.0
#: Seconds it polls with 50 us naps before it sleeps longer between polls.
YIELD_S = 0.1
#: Seconds a rank that saw a peer's mark still polls its barrier: that peer
#: may have made the call and ended just after (its part of the barrier done).
GRACE_S = 1.0

SHM = "/dev/shm"
#: ``{prefix}{launcher pid}-{its start time}-{world rank}``
ENDED_PREFIX = "mpidp-ended-"


def launch_key() -> tuple[int, str]:
    """(pid, start time) of this rank's parent: the launcher's proxy or
    slurmstepd, which the ranks of one launch on a node share, and whose
    start time no later process with that pid has. Raises OSError or
    IndexError where /proc cannot say."""
    ppid = os.getppid()
    with open(f"/proc/{ppid}/stat") as f:
        return ppid, f.read().rsplit(")", 1)[1].split()[19]  # field 22: start time


def remove_stale_markers(keep: str, prefix: str) -> None:
    """Unlink the /dev/shm markers ``{prefix}{ppid}-...`` whose launcher has
    ended, all but ``keep``."""
    for name in os.listdir(SHM):
        if not name.startswith(prefix):
            continue
        path = os.path.join(SHM, name)
        ppid = name[len(prefix):].split("-")[0]
        if path != keep and not os.path.exists(f"/proc/{ppid}"):
            try:
                os.unlink(path)
            except OSError:
                pass


def marker(world_rank: int) -> str | None:
    """The path of ``world_rank``'s mark in this launch; None where /proc
    cannot say what the launch is."""
    try:
        ppid, start = launch_key()
    except (OSError, IndexError):
        return None
    return os.path.join(SHM, f"{ENDED_PREFIX}{ppid}-{start}-{world_rank}")


def mark_ended(world_rank: int) -> None:
    """Leave the mark that this rank's program ended (local, never waits;
    errors ignored: a missing /dev/shm only means no peer learns it)."""
    path = marker(world_rank)
    if path is None:
        return
    try:
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
        remove_stale_markers(path, ENDED_PREFIX)
    except OSError:
        pass


def ended(world_ranks: list[int]) -> list[int]:
    """Those of ``world_ranks`` (of this launch, on this node) whose program
    has ended."""
    found = []
    for rank in world_ranks:
        path = marker(rank)
        if path is not None and os.path.exists(path):
            found.append(rank)
    return found


def _world_ranks(comm) -> list[int]:
    """COMM_WORLD ranks of ``comm``'s other members."""
    from collectives.runtime import MPI

    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        ranks = MPI.Group.Translate_ranks(group, list(range(comm.Get_size())), world)
    finally:
        group.Free()
        world.Free()
    me = MPI.COMM_WORLD.Get_rank()
    return [int(r) for r in ranks if r != MPI.UNDEFINED and r != me]


def _completes(request, grace_s: float = GRACE_S) -> bool:
    """Whether ``request`` completes within ``grace_s``. A peer that ended
    after its part of the barrier (its last call) has made the call: every
    rank entered the barrier, and ours completes once its messages are in."""
    end = time.monotonic() + grace_s
    while time.monotonic() < end:
        if request.Test():
            return True
        time.sleep(0.001)
    return bool(request.Test())


def wait_for_peers(comm, what: str, this_call: str = "this call",
                   notice_s: float | None = None) -> None:
    """Collective: return once every rank of ``comm`` has come to this call.

    A call some ranks never make would leave the others waiting in its
    first collective for ever. This one is a nonblocking barrier, polled
    with naps of 50 us for :data:`YIELD_S`, then with sleeps up to 20 ms (a
    waiting rank gives its core away); while it waits, a peer whose program
    ended (its mark) and whose part of the barrier does not come within
    :data:`GRACE_S` is an error, and a wait longer than
    ``notice_s`` (:data:`NOTICE_S`) is one line on stderr (the rank waits
    on: a peer may be slow to come, or on another node, where no mark is
    seen).

    Raises:
        PeerEnded: (this rank only) the program of a peer on this node ended
            without making the call (``this_call`` names it in the message);
            ``comm`` is then out of step (this rank's barrier is pending).
    """
    from collectives.errors import PeerEnded
    from collectives.runtime import MPI

    if comm.Get_size() == 1:
        return
    notice_s = NOTICE_S if notice_s is None else notice_s
    request = comm.Ibarrier()
    peers = _world_ranks(comm)
    start, pause, noticed, looked = time.monotonic(), 0.001, False, 0.0
    while not request.Test():
        now = time.monotonic()
        if now - looked >= 0.05:  # a few stat calls, 20 times a second
            looked = now
            gone = ended(peers)
            if gone and _completes(request):
                break
            if gone:
                raise PeerEnded(
                    f"{what}: the program of world rank {gone[0]} ended without making "
                    f"{this_call}: every rank of the communicator must call {what}, as "
                    "many times (a call under `if rank == 0:` waits for the other ranks "
                    "for ever)")
        if not noticed and now - start >= notice_s:
            noticed = True
            sys.stderr.write(f"[rank {MPI.COMM_WORLD.Get_rank()}] mpidp: {what} has waited "
                             f"{now - start:.0f} s for the other ranks of its communicator "
                             "to call it; every rank must call it (still waiting)\n")
            sys.stderr.flush()
        if now - start < YIELD_S:
            time.sleep(0.00005)  # a short nap: more ranks than cores give theirs away
        else:
            time.sleep(pause)
            pause = min(2 * pause, 0.02)
