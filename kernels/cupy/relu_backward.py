"""``relu_backward`` on CUDA with CuPy: ``relu_backward.cu`` beside it.

``grad[i, j] = 0`` where ``out[i, j] <= 0``, in place (masked entries
become +0, as with the CPU Numba kernel); ``out`` may be a strided view with
contiguous rows.
"""
from __future__ import annotations

import numpy as np
import torch

from kernels.common.cuda_shapes import grid_2d, leading
from kernels.cupy.launch import function, launch, pointer
from kernels.registry import register


@register("relu_backward", backend="cupy")
def relu_backward(grad: torch.Tensor, out: torch.Tensor) -> None:
    """Zero ``grad`` where the ReLU output ``out`` is not positive, in place."""
    k, d = grad.shape
    if k == 0 or d == 0:
        return
    grid, block = grid_2d(k, d)
    launch(function("relu_backward", "relu_backward", grad), grad, grid, block,
           (pointer(grad), np.int64(leading(grad, "grad")), pointer(out),
            np.int64(leading(out, "out")), np.int64(k), np.int64(d)))
