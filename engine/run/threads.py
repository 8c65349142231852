"""Threads per rank: one rank per core unless told otherwise."""
from __future__ import annotations

import numba
import torch

from collectives.runtime import launch_info


def configure_threads(requested: int | None) -> tuple[int, int]:
    """Threads per rank unless ``requested``: the cores a launcher bound this
    rank to, or else this node's cores divided by its ranks (at least 1;
    :attr:`collectives.runtime.CoreShare.threads`).

    Applies to torch and Numba, and turns on flush-to-zero for denormals.
    Returns (threads, ranks on this node).
    """
    launch = launch_info()
    local = launch.local_ranks or 1
    threads = requested or launch.threads
    torch.set_num_threads(threads)
    # Flush denormals to zero: once a model fits well, softmax gradients of
    # confident examples underflow into the denormal range, where x86 float
    # arithmetic is many times slower. Values below 1.2e-38 change nothing.
    torch.set_flush_denormal(True)
    numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))
    return threads, local
