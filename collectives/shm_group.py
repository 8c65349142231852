"""A shared-memory channel among all ranks of a one-node communicator (p >= 3).

Used by ``ring`` when every rank of the communicator shares one node (two
ranks use :class:`collectives.shm.SharedPair`). It replaces each MPI
point-to-point step of the ring by a copy into a slot of an MPI-3 shared
window, a published step counter, and a read from the left neighbour's slot:
no MPI progress engine, no rendezvous, and on an oversubscribed node a
waiting rank sleeps in the kernel (:mod:`collectives.futex`) until its
neighbour publishes, instead of polling through MPICH's yield loop
(4 ranks on 2 cores: 1.5-3.6x ``MPI_Allreduce`` at 1-16 MiB, where the
point-to-point ring measured 0.8-1.2x; README, "Collectives").

Layout per rank: a header of int64 words ``[steps published, blind calls
entered, tag of the last blind call, failed, tag of slot 0, ..., tag of
slot k-1]`` and ``k = min(p + 1, MAX_SLOTS)`` slots of ``slot_bytes``. Every rank
numbers the steps it publishes, across calls: step ``g`` goes to slot
``g mod k``, its slot tag is written, then the counter (x86 keeps stores in
order, so a reader that sees the counter sees the data and tag). The right
neighbour reads step ``g`` and only then publishes its step ``g + 1``, so a
writer may reuse the slot of step ``g - k`` once the right neighbour has
published ``g - k + 2`` (the *back-pressure* check; with ``k = p + 1`` the
ring's own data flow always satisfies it, so it never waits). The slot tag
lets the reader check that the data belong to its own call.

Waiting sees no MPI messages, so the wait is *blind*, like ``MPI_Allreduce``
(:mod:`collectives.consistency`); every 10 ms it looks for what would mean
the call cannot complete: a message from a rank that has not finished this
call (it is in another one), or the awaited rank counted into a blind call
this rank is not making, or the awaited rank marked as *failed*: a rank
that raises inside a call sets that word before the error leaves the call,
so its neighbours raise too instead of waiting for steps that will never
come, and so on around the ring. Either raises :class:`AllreduceMismatch`.
A failed call leaves the step counters of the ranks apart: later calls on
that communicator's shared window raise at once.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from collectives.runtime import MPI
from collectives.shm import shared_window, wait_until

#: Bytes of buffer one pass of the ring covers: each rank's chunk of it goes
#: through one slot (4 MiB: 1 MiB slots for 4 ranks; 2 and 8 MiB measured
#: within noise of it at 4 ranks on 2 cores, 1 MiB slower at 8-16 MiB).
SEGMENT_BYTES = 4 * 1024 * 1024
#: Most slots per rank (p + 1 below that): bounds the window on big nodes.
MAX_SLOTS = 9
_FIXED_WORDS = 4  # steps, blind calls, tag of the last blind call, failed
FAILED = 3  #: header word: 1 once this rank raised inside a call


class SharedGroup:
    """The shared window of a one-node communicator (create with :meth:`create`)."""

    def __init__(self, window: "MPI.Win", rank: int, size: int, slot_bytes: int,
                 slots: int) -> None:
        self.window = window
        self.rank, self.size = rank, size
        self.left, self.right = (rank - 1) % size, (rank + 1) % size
        self.slot_bytes, self.slot_count = slot_bytes, slots
        #: Sleep in the kernel while waiting (set by the communicator's state when
        #: the node is oversubscribed and futexes are available), else spin.
        self.sleep = False
        self.status = MPI.Status()  # of the probes while waiting
        self.heads: list[memoryview] = []
        self.slots: list[list[np.ndarray]] = []
        self.addresses: list[int] = []
        header = header_bytes(slots)
        for q in range(size):
            memory, _ = window.Shared_query(q)
            raw = np.frombuffer(memory, dtype=np.uint8)
            self.heads.append(memoryview(raw[:header]).cast("q"))
            self.slots.append([raw[header + i * slot_bytes:header + (i + 1) * slot_bytes]
                               for i in range(slots)])
            self.addresses.append(raw.ctypes.data)
        mine = self.heads[rank]
        for i in range(len(mine)):
            mine[i] = 0

    @classmethod
    def create(cls, comm: "MPI.Intracomm") -> "SharedGroup | None":
        """The channel when all of ``comm``'s >= 3 ranks share a node, else None (collective)."""
        size = comm.Get_size()
        if size < 3:
            return None
        slots = min(size + 1, MAX_SLOTS)
        slot_bytes = max(64, SEGMENT_BYTES // size // 64 * 64)
        window = shared_window(comm, header_bytes(slots) + slots * slot_bytes)
        if window is None:
            return None
        group = cls(window, comm.Get_rank(), size, slot_bytes, slots)
        comm.Barrier()  # every header zeroed before anyone reads one
        return group

    def free(self) -> None:
        """Release the window (collective); the views must not be used after."""
        del self.heads, self.slots
        self.window.Free()

    @property
    def steps(self) -> int:
        """Steps this rank has published, over all calls (its counter)."""
        return self.heads[self.rank][0]

    @property
    def blind_calls(self) -> memoryview:
        """This rank's ``[blind calls entered, tag of the last one]`` (see PlanContext)."""
        return self.heads[self.rank][1:3]

    def slot_tags(self, q: int) -> memoryview:
        """Rank ``q``'s tag of each slot's current content."""
        return self.heads[q][_FIXED_WORDS:_FIXED_WORDS + self.slot_count]

    def typed_slots(self, q: int, dtype: np.dtype) -> list[np.ndarray]:
        """Rank ``q``'s slots as whole arrays of ``dtype``."""
        whole = self.slot_bytes // dtype.itemsize * dtype.itemsize
        return [slot[:whole].view(dtype) for slot in self.slots[q]]

    def wait(self, q: int, count: int, ctx: Any, end: int) -> None:
        """Wait until rank ``q`` has published ``count`` steps.

        ``ctx`` is the call's :class:`collectives.context.PlanContext` and
        ``end`` the step count at which every rank has finished the call: a
        message from a rank short of it means that rank makes another call.
        Raises :class:`AllreduceMismatch` through ``ctx.fail`` /
        ``ctx.fail_blocked`` (see the module docstring).
        """
        wait_until(self.heads[q], count, self.addresses[q], self.sleep, self._check, q, ctx, end)

    def _check(self, first: bool, q: int, ctx: Any, end: int) -> None:
        status = self.status
        if self.heads[q][FAILED]:
            ctx.fail_peer_error(q)
        if ctx.comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status) \
                and self.heads[status.source][0] < end:
            ctx.fail(status.source, status.tag)
        reason = ctx.blocked(q, ctx.tag, first)
        if reason:
            ctx.fail_blocked(q, reason)


def header_bytes(slots: int) -> int:
    """Bytes of a rank's header with ``slots`` slot tags (a multiple of 64)."""
    return -(-(_FIXED_WORDS + slots) * 8 // 64) * 64


def grouped(ctx: Any) -> bool:
    """All ranks (>= 3) on one node: the plan goes through this channel."""
    return ctx.group is not None
