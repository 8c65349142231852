"""All-reduce algorithms over mpi4py, the channels they run over, and their micro-benchmark.

``allreduce(buf, comm, algorithm="auto", op="sum")`` reduces a contiguous
1-D buffer in place on every rank (numpy, torch CPU, or a device array).
An algorithm (``collectives/algorithms/``: ``naive``,
``recursive_doubling``, ``ring``, ``rabenseifner``, and ``native``, the MPI
library's own) says what is exchanged when; a channel
(``collectives/channels/``: MPI point-to-point, a shared-memory pair, a
node-wide shared window) moves the bytes; ``auto`` picks the algorithm.

Example (every rank runs it)::

    import numpy as np
    import collectives
    grad = np.ones(100_000, dtype=np.float32)
    collectives.allreduce(grad, algorithm="ring")   # grad now holds the sum

Import MPI from here (``from collectives import MPI``) or import
``collectives`` before ``mpi4py``: the MPI settings of
:mod:`collectives.runtime` only take effect before MPI initialises.
"""
from __future__ import annotations

from collectives.runtime import MPI  # first: MPI settings before MPI_Init

from collectives import algorithms  # noqa: F401,E402 - registers the algorithms, in order
from collectives import auto  # noqa: F401,E402 - registers the selector
from collectives.describe import describe  # noqa: E402
from collectives.dispatch import algorithm_for, allreduce, forget  # noqa: E402
from collectives.errors import (AllreduceError, AllreduceMismatch, UnknownAlgorithm,  # noqa: E402
                                UnknownOp, UnsupportedBuffer)
from collectives.failures import abort_on_error  # noqa: E402
from collectives.registry import get, names  # noqa: E402

__all__ = ["MPI", "allreduce", "algorithm_for", "abort_on_error", "describe", "names", "get",
           "forget",
           "AllreduceError", "AllreduceMismatch", "UnknownAlgorithm", "UnknownOp",
           "UnsupportedBuffer"]
