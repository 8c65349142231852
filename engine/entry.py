"""Every rank calls :func:`engine.train`: the check at its entry.

A user's program that calls ``engine.train`` on some ranks only (under
``if rank == 0:``, or once more on one rank than on another) would leave
the ranks that did call it waiting in its first collective for ever: MPI
cannot say that a peer will never come. So the call starts with a
nonblocking barrier over ``comm`` (:func:`wait_for_peers`), polled with
short sleeps (a waiting rank yields its core instead of spinning), and
while it waits:

* **A peer whose program has ended** (its mark:
  :mod:`collectives.core.ended`, left at interpreter exit by every rank
  that imported ``engine`` or ``collectives``) makes the waiting rank raise
  :class:`EntryError` naming it; as for any error on some ranks only, the
  job then ends with exit code 2. Only ranks of the same node are seen.
* **A peer that has not come** after :data:`NOTICE_S` seconds (still busy,
  or on another node) gets one line on stderr naming the wait; the rank
  waits on, since a peer may be slow to arrive (loading its data).
"""
from __future__ import annotations

import sys
import time

from collectives import MPI
from collectives.core.ended import ended
from engine.errors import MpidpError

#: Seconds a rank waits for its peers before it says so (once).
NOTICE_S = 30.0
_calls = 0


class EntryError(MpidpError):
    """A peer's program ended without making this call."""


def _world_ranks(comm) -> list[int]:
    """COMM_WORLD ranks of ``comm``'s other members."""
    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        ranks = MPI.Group.Translate_ranks(group, list(range(comm.Get_size())), world)
    finally:
        group.Free()
        world.Free()
    me = MPI.COMM_WORLD.Get_rank()
    return [int(r) for r in ranks if r != MPI.UNDEFINED and r != me]


def wait_for_peers(comm, what: str = "engine.train()", notice_s: float = NOTICE_S) -> None:
    """Collective: return once every rank of ``comm`` has made this call.

    Raises:
        EntryError: (this rank only) the program of a peer on this node
            ended before it made the call; ``comm`` is then out of step (a
            barrier of this rank is pending on it).
    """
    global _calls
    _calls += 1
    if comm.Get_size() == 1:
        return
    request = comm.Ibarrier()
    peers = _world_ranks(comm)
    start, pause, noticed, looked = time.monotonic(), 0.0002, False, 0.0
    while not request.Test():
        now = time.monotonic()
        if now - looked >= 0.05:  # a few stat calls, 20 times a second
            looked = now
            gone = ended(peers)
            if gone:
                calls = f"its call number {_calls} here" if _calls > 1 else "this call"
                raise EntryError(
                    f"{what}: the program of world rank {gone[0]} ended without making "
                    f"{calls}: every rank of comm must call {what}, as many times (a "
                    "call under `if rank == 0:` waits for the other ranks for ever)")
        if not noticed and now - start >= notice_s:
            noticed = True
            sys.stderr.write(f"[rank {MPI.COMM_WORLD.Get_rank()}] mpidp: {what} has waited "
                             f"{now - start:.0f} s for the other ranks of comm to call it; "
                             "every rank must call it (still waiting)\n")
            sys.stderr.flush()
        time.sleep(pause)
        pause = min(2 * pause, 0.02)
