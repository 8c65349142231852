"""``gaussian_stream`` on CUDA with CuPy: ``gaussian.cu`` beside it.

Philox4x64-10 and Box-Muller, the same stream as the Numba twin
(:mod:`kernels.numba_cuda.gaussian`) and as the host reference
(:mod:`kernels.common.philox`, whose state class this stream uses): thread b adds
the four normals of block ``counter + b`` to ``buf[4b:4b+4]``.
"""
from __future__ import annotations

import numpy as np
import torch

from kernels.common import philox
from kernels.common.philox_stream import PhiloxDeviceStream
from kernels.cupy.launch import function, launch, pointer
from kernels.registry import register


class CupyGaussianStream(PhiloxDeviceStream):
    """A reproducible N(0, 1) stream added into CUDA tensors in place."""

    backend = "cupy"

    def _launch(self, buf: torch.Tensor, std: float, counter: int, blocks: int,
                threads: int) -> None:
        k0, k1 = self._state.key
        launch(function("gaussian", "philox_normal_add", buf), buf, (blocks,), (threads,),
               (pointer(buf), np.int64(buf.shape[0]), np.float64(std), np.uint64(k0),
                np.uint64(k1), np.uint64(counter & philox.MASK64), np.uint64(counter >> 64)))

    def _launch_at(self, buf: torch.Tensor, std: float, counter: torch.Tensor, offset: int,
                   blocks: int, threads: int) -> None:
        k0, k1 = self._state.key
        launch(function("gaussian", "philox_normal_add_at", buf), buf, (blocks,), (threads,),
               (pointer(buf), np.int64(buf.shape[0]), np.float64(std), np.uint64(k0),
                np.uint64(k1), pointer(counter), np.uint64(offset & philox.MASK64)))


@register("gaussian_stream", backend="cupy")
def gaussian_stream(seed_sequence: np.random.SeedSequence, device=None) -> CupyGaussianStream:
    """A CUDA Gaussian stream (see module docstring)."""
    return CupyGaussianStream(seed_sequence, device)
