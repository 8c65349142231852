"""Threads per rank: one rank per core unless told otherwise."""
from __future__ import annotations

import numba
import torch

from collectives.runtime import MPI, launch_info, node_share


def configure_threads(requested: int | None, comm: "MPI.Intracomm | None" = None
                      ) -> tuple[int, int]:
    """Threads per rank unless ``requested``: the cores a launcher bound this
    rank to, or else this node's cores divided by its ranks (at least 1;
    :attr:`collectives.runtime.CoreShare.threads`).

    Alone, a rank judges from the launcher's count of ranks on its node and
    its own affinity mask (:func:`collectives.runtime.launch_info`); with
    ``comm`` (then a collective over it) the ranks compare their masks, which
    is exact where ``comm`` holds every rank of the node
    (:func:`collectives.runtime.node_share`: a launcher that announced no
    count, a wrapper script bound with its rank). Applies to torch and Numba,
    and turns on flush-to-zero for denormals. Returns (threads, ranks on this
    node).
    """
    launch = node_share(comm) if comm is not None and comm.Get_size() > 1 else launch_info()
    local = launch.local_ranks or 1
    threads = requested or launch.threads
    torch.set_num_threads(threads)
    # Flush denormals to zero: once a model fits well, softmax gradients of
    # confident examples underflow into the denormal range, where x86 float
    # arithmetic is many times slower. Values below 1.2e-38 change nothing.
    torch.set_flush_denormal(True)
    numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))
    return threads, local
