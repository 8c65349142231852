"""Threads per rank: one rank per core unless told otherwise."""
from __future__ import annotations

import numba
import torch

from dataclasses import replace

from collectives.runtime import MPI, launch_info


def configure_threads(requested: int | None, comm: "MPI.Intracomm | None" = None
                      ) -> tuple[int, int]:
    """Threads per rank unless ``requested``: the cores a launcher bound this
    rank to, or else this node's cores divided by its ranks (at least 1;
    :attr:`collectives.runtime.CoreShare.threads`).

    The ranks on this node are the launcher's count; with ``comm`` (then a
    collective over it), where the launcher announced none, the ranks of
    ``comm`` that share this node. Applies to torch and Numba, and turns on
    flush-to-zero for denormals. Returns (threads, ranks on this node).
    """
    launch = launch_info()
    if comm is not None and comm.Get_size() > 1:
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        here = node.Get_size()  # collective on every rank alike, whatever it announced
        node.Free()
        if launch.local_ranks is None:
            launch = replace(launch, local_ranks=here)
    local = launch.local_ranks or 1
    threads = requested or launch.threads
    torch.set_num_threads(threads)
    # Flush denormals to zero: once a model fits well, softmax gradients of
    # confident examples underflow into the denormal range, where x86 float
    # arithmetic is many times slower. Values below 1.2e-38 change nothing.
    torch.set_flush_denormal(True)
    numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))
    return threads, local
