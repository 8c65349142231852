"""What the two CUDA ``gaussian_stream`` back-ends share: the Philox state and
the launch shape.

Both kernels (Numba ``@cuda.jit`` in :mod:`kernels.numba_cuda.gaussian`, CUDA C in
``kernels/cupy/gaussian.cu``) draw the same stream: thread b computes Philox
block ``counter + b`` and adds four normals to ``buf[4b:4b+4]``. A subclass
only launches its kernel (:meth:`PhiloxDeviceStream._launch`).
"""
from __future__ import annotations

import numpy as np
import torch

from kernels.common import philox
from kernels.common.cuda_shapes import check_flat, grid_1d


class PhiloxDeviceStream:
    """A reproducible N(0, 1) stream added into CUDA tensors in place."""

    backend = ""

    def __init__(self, seed_sequence: np.random.SeedSequence, device=None):
        self._state = philox.PhiloxState(seed_sequence)

    def add_(self, buf: torch.Tensor, std: float) -> None:
        """``buf += std * N(0, 1)`` (1-D contiguous float32/float64 tensor)."""
        n = buf.shape[0]
        if n == 0:
            return
        check_flat(buf, "gaussian_stream.add_")
        counter = self._state.take(n)
        blocks, threads = grid_1d(-(-n // 4))
        self._launch(buf, float(std), counter, blocks, threads)

    def _launch(self, buf: torch.Tensor, std: float, counter: int, blocks: int,
                threads: int) -> None:
        raise NotImplementedError

    def get_state(self) -> list[int]:
        return self._state.get_state()

    def set_state(self, state: list[int]) -> None:
        """Restore :meth:`get_state`; ValueError for the state of another kind of stream."""
        self._state.set_state(state)
