"""``native``: the MPI library's own ``MPI_Allreduce``, the reference."""
from __future__ import annotations

import numpy as np

from collectives.registry import register
from collectives.runtime import MPI


@register("native")
def allreduce_native(buf: np.ndarray, comm: "MPI.Comm", op: "MPI.Op") -> None:
    """In-place ``MPI_Allreduce`` of ``buf`` over ``comm`` (every rank calls it)."""
    comm.Allreduce(MPI.IN_PLACE, buf, op=op)
