"""All-reduce algorithms over mpi4py and their micro-benchmark.

``allreduce(buf, comm, algorithm="auto", op="sum")`` reduces a contiguous
1-D buffer in place on every rank. Algorithms are registered by name in
:mod:`collectives.registry`, one module each.
"""
from __future__ import annotations

import numpy as np

from collectives import auto, native  # noqa: F401  (register themselves)
from collectives.registry import get, names
from collectives.runtime import MPI

__all__ = ["allreduce", "names"]

_OPS = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}


def allreduce(buf: np.ndarray, comm: "MPI.Comm | None" = None, algorithm: str = "auto",
              op: str = "sum") -> np.ndarray:
    """Reduce ``buf`` in place over ``comm`` (default COMM_WORLD); returns ``buf``.

    Every rank of ``comm`` must call it with a contiguous 1-D numpy array of
    the same length and dtype. Raises ``UnknownAlgorithm`` (an unregistered
    name) and ``ValueError`` (a buffer that is not contiguous and 1-D, an
    unknown op).
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    if not isinstance(buf, np.ndarray) or buf.ndim != 1 or not buf.flags.c_contiguous:
        raise ValueError("allreduce needs a contiguous 1-D numpy array")
    if op not in _OPS:
        raise ValueError(f"unknown op {op!r}; choose from {', '.join(_OPS)}")
    get(algorithm)(buf, comm, _OPS[op])
    return buf
