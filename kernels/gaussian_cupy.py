"""``gaussian_stream`` on CUDA with CuPy: ``kernels/cuda/gaussian.cu``.

Philox4x64-10 and Box-Muller, the same stream as the Numba twin
(:mod:`kernels.gaussian_cuda`) and as the host reference
(:mod:`kernels.philox`, whose state class this stream uses): thread b adds
the four normals of block ``counter + b`` to ``buf[4b:4b+4]``.
"""
from __future__ import annotations

import numpy as np
import torch

from kernels import philox
from kernels.cuda_shapes import check_flat, grid_1d
from kernels.cupy_launch import function, launch, pointer
from kernels.dispatch import register


class CupyGaussianStream:
    """A reproducible N(0, 1) stream added into CUDA tensors in place."""

    backend = "cupy"

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
        k0, k1 = self._state.key
        launch(function("gaussian", "philox_normal_add", buf), buf, (blocks,), (threads,),
               (pointer(buf), np.int64(n), np.float64(std), np.uint64(k0), np.uint64(k1),
                np.uint64(counter & philox.MASK64), np.uint64(counter >> 64)))

    def get_state(self) -> list[int]:
        return self._state.get_state()

    def set_state(self, state: list[int]) -> None:
        """Restore :meth:`get_state`; ValueError for the state of another kind of stream."""
        self._state.set_state(state)


@register("gaussian_stream", "cuda", backend="cupy")
def gaussian_stream(seed_sequence: np.random.SeedSequence, device=None) -> CupyGaussianStream:
    """A CUDA Gaussian stream (see module docstring)."""
    return CupyGaussianStream(seed_sequence, device)
