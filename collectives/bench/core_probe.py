"""Copy bandwidth from one core to another: the path every all-reduce on one node takes.

An all-reduce between ranks of one node moves data from one core's caches
to another's; a single-process copy never does. On a virtual machine the
host may run the two vCPUs on cores that share a cache or on cores that do
not (another chiplet or socket), and may switch between the two at any
time; every all-reduce on the node then slows, while the one-process copy
bandwidth does not change (docs/design/cached-or-streaming-copies.md).

:class:`CoreProbe` measures it between ranks 0 and 1 (when they share a
node): rank 0 copies a buffer into a shared window and raises a flag, rank
1 copies it out and answers, a few times. ``mpidp bench allreduce`` runs it
before and after every message size, so a reader (and ``--summarize
--min-xcore``) can tell a slow spell of the host from a slow algorithm.
"""
from __future__ import annotations

import time

import numpy as np

from collectives.runtime import MPI

HANDOFF_BYTES = 1 << 20
HANDOFFS = 8
_FLAGS = 64  # bytes before the data: rank 0's and rank 1's counters


class CoreProbe:
    """The probe of a communicator's ranks 0 and 1 (create with :meth:`create`)."""

    def __init__(self, comm: "MPI.Intracomm", two: "MPI.Intracomm | None",
                 window: "MPI.Win | None") -> None:
        self.comm, self.two, self.window = comm, two, window
        self.rank = comm.Get_rank()
        self.count = 0
        if window is not None:
            memory, _ = window.Shared_query(0)
            raw = np.frombuffer(memory, dtype=np.uint8)
            self.flags = raw[:_FLAGS].view(np.int64)
            self.data = raw[_FLAGS:_FLAGS + HANDOFF_BYTES]
            self.mine = np.ones(HANDOFF_BYTES, dtype=np.uint8)
            if self.rank == 0:
                self.flags[:] = 0

    @classmethod
    def create(cls, comm: "MPI.Intracomm") -> "CoreProbe":
        """Set up the probe (collective over ``comm``); :meth:`measure` returns
        None unless ranks 0 and 1 exist and share a node."""
        rank, size = comm.Get_rank(), comm.Get_size()
        if size < 2:
            return cls(comm, None, None)
        two = comm.Split(0 if rank < 2 else MPI.UNDEFINED, rank)
        together = True  # ranks >= 2 take no part: they agree with anything
        if two != MPI.COMM_NULL:
            node = two.Split_type(MPI.COMM_TYPE_SHARED)
            together = node.Get_size() == 2
            node.Free()
        window = None
        if comm.allreduce(int(together), op=MPI.MIN) and rank < 2:
            window = MPI.Win.Allocate_shared(_FLAGS + HANDOFF_BYTES if rank == 0 else 0, 1,
                                             comm=two)
        # Rank 0 zeroes the flags here; each measurement starts with a barrier of the two.
        return cls(comm, two if two != MPI.COMM_NULL else None, window)

    def measure(self) -> float | None:
        """GB/s from rank 0 to rank 1 (collective over ``comm``; the same value on
        every rank), or None when ranks 0 and 1 do not share a node."""
        if self.comm.Get_size() < 2:
            return None
        value = self._handoffs() if self.window is not None else None
        return self.comm.bcast(value, root=1)

    def _handoffs(self) -> float | None:
        """Rank 1's measurement (None on rank 0); ranks 0 and 1 only."""
        flags, data, mine = self.flags, self.data, self.mine
        self.two.Barrier()
        start = 0.0
        for i in range(HANDOFFS + 1):  # the first is a warm-up, untimed
            self.count += 1
            seq = self.count
            if self.rank == 0:
                data[:] = mine
                flags[0] = seq
                while flags[1] != seq:
                    pass
            else:
                while flags[0] != seq:
                    pass
                mine[:] = data
                flags[1] = seq
            if i == 0:
                start = time.perf_counter()
        elapsed = time.perf_counter() - start
        return HANDOFFS * HANDOFF_BYTES / elapsed / 1e9 if self.rank == 1 else None

    def free(self) -> None:
        """Release the window and sub-communicator (collective over ``comm``)."""
        if self.window is not None:
            del self.flags, self.data
            self.window.Free()
            self.window = None
        if self.two is not None:
            self.two.Free()
            self.two = None
