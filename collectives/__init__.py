"""All-reduce algorithms over mpi4py and their micro-benchmark.

``allreduce(buf, comm, algorithm="auto", op="sum")`` reduces a contiguous
1-D buffer in place on every rank (numpy, torch CPU, or a device array).
Algorithms are registered by name in :mod:`collectives.registry`, one module
each: ``naive``, ``recursive_doubling``, ``ring``, ``rabenseifner``,
``native`` and ``auto``.

Example (every rank runs it)::

    import numpy as np
    import collectives
    grad = np.ones(100_000, dtype=np.float32)
    collectives.allreduce(grad, algorithm="ring")   # grad now holds the sum
"""
from __future__ import annotations

# Registration order is the order of `names()` and of the benchmark's table.
from collectives import naive, recursive_doubling, ring, rabenseifner, native  # noqa: F401
from collectives import auto  # noqa: F401
from collectives.dispatch import algorithm_for, allreduce, forget
from collectives.errors import (AllreduceError, AllreduceMismatch, UnknownAlgorithm,
                                UnknownOp, UnsupportedBuffer)
from collectives.registry import get, names
from collectives.runtime import MPI

__all__ = ["MPI", "allreduce", "algorithm_for", "names", "get", "forget", "AllreduceError",
           "AllreduceMismatch", "UnknownAlgorithm", "UnknownOp", "UnsupportedBuffer"]
