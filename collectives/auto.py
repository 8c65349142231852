"""``auto``: picks an algorithm by message size and number of ranks.

Placeholder until the thresholds are measured (issue 3): delegates to
``native``. Every rank must make the same choice, so the pick depends only
on values that are equal on all ranks (length, dtype, communicator size).
"""
from __future__ import annotations

import numpy as np

from collectives.native import allreduce_native
from collectives.registry import register
from collectives.runtime import MPI


@register("auto")
def allreduce_auto(buf: np.ndarray, comm: "MPI.Comm", op: "MPI.Op") -> None:
    """In-place all-reduce with the algorithm best for ``buf.nbytes`` (see module)."""
    allreduce_native(buf, comm, op)
