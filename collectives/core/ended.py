"""Marks that a rank's program has ended, seen by the ranks of its node.

MPI cannot tell a rank that a peer is gone: a rank waiting for a call its
peer will never make waits for ever. So every rank's program leaves a mark
when it ends (:func:`mark_ended`, from the interpreter's exit hooks), an
empty file in ``/dev/shm`` named after its launch (the parent process
shared by the ranks of one launch on a node: the launcher's proxy or
slurmstepd, with its start time) and its world rank; a rank that waits
where it can poll (:func:`engine.entry.wait_for_peers`) looks for its
peers' marks (:func:`ended`). Ranks on other nodes leave no mark it can
see. A mark outlives its job until a later job's mark removes it (its
launcher is gone).
"""
from __future__ import annotations

import os

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
