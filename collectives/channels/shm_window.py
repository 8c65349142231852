"""What both shared-memory channels stand on: the window, and waiting on a peer's counter.

Shared-memory channels publish data and then a counter with plain stores,
and a reader that sees the counter must see the data: true on x86-64 (total
store order), not on AArch64 or POWER, where Python cannot issue the fences
needed. So they are used on x86-64 only, and ``MPIDP_ALLREDUCE_SHM=0`` turns
them off anywhere (e.g. where ``/dev/shm`` is too small for the windows);
the schedules then run over MPI point-to-point messages.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable

from collectives.channels import futex
from collectives.runtime import MPI, x86_64

#: Busy checks before the periodic checks start (a fraction of a millisecond).
SPINS = 2000
#: Seconds between looks for a peer that is not coming.
CHECK_EVERY = 0.01


def usable() -> bool:
    """Whether shared-memory channels may be used on this machine (local call;
    see the module docstring)."""
    if os.environ.get("MPIDP_ALLREDUCE_SHM", "").strip() == "0":
        return False
    return x86_64()


def shared_window(comm: "MPI.Intracomm", nbytes: int) -> "MPI.Win | None":
    """An MPI-3 shared window of ``nbytes`` per rank when every rank of ``comm``
    shares one node and :func:`usable` agrees on every rank, else None
    (collective over ``comm``)."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    together = node.Get_size() == comm.Get_size()
    node.Free()
    if not comm.allreduce(int(together and usable()), op=MPI.MIN):
        return None
    try:
        return MPI.Win.Allocate_shared(nbytes, 1, comm=comm)
    except MPI.Exception:
        return None


def wait_until(head: memoryview, count: int, address: int, sleep: bool,
               check: Callable[..., None], *args: Any) -> None:
    """Wait until ``head[0] >= count`` (a peer's counter in a shared window).

    Spins, or with ``sleep`` sleeps on the futex at ``address`` (the
    counter's; the writer wakes it). Every :data:`CHECK_EVERY` seconds calls
    ``check(first, *args)``, which raises to give up the wait (``first``:
    its first call in this wait). Nothing is built before the spinning: at
    small sizes the peer is usually a fraction of a microsecond away.
    """
    if not sleep:
        for _ in range(SPINS):
            if head[0] >= count:
                return
    first = True
    next_check = time.monotonic() + 0.002
    while True:
        seen = head[0]
        if seen >= count:
            return
        if sleep:
            futex.wait(address, seen, CHECK_EVERY)
        now = time.monotonic()
        if now < next_check:
            continue
        next_check = now + CHECK_EVERY
        if head[0] >= count:
            return
        check(first, *args)
        first = False
