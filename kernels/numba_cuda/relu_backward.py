"""``relu_backward`` on CUDA with Numba ``@cuda.jit`` (twin of ``kernels/cupy/relu_backward.cu``).

``grad[i, j] = grad[i, j] if out[i, j] > 0 else 0`` in place (a select,
branch-free on the GPU; masked entries become +0, as the CPU Numba kernel
makes them). ``out`` may be a strided view (the ReLU output inside the next
layer's activation buffer).
"""
from __future__ import annotations

from types import SimpleNamespace

import numba
import numpy as np
import torch
from numba import cuda

from kernels.common.cuda_shapes import grid_2d, leading, numpy_dtype
from kernels.numba_cuda.launch import array, stream
from kernels.registry import register


def _build(ft):
    zero = ft(0)

    @cuda.jit
    def relu_backward(grad, out):
        j, i0 = cuda.grid(2)
        if j < grad.shape[1]:
            for i in range(i0, grad.shape[0], cuda.gridDim.y * cuda.blockDim.y):
                if not out[i, j] > zero:
                    grad[i, j] = zero

    return SimpleNamespace(relu_backward=relu_backward)


KERNELS = {np.dtype(np.float32): _build(numba.float32),
           np.dtype(np.float64): _build(numba.float64)}


def signatures(dtype) -> dict[str, tuple]:
    """Argument types of every kernel for ``dtype`` (for ahead-of-time PTX checks)."""
    ft = numba.from_dtype(np.dtype(dtype))
    return {"relu_backward": (ft[:, :], ft[:, :])}


@register("relu_backward", backend="numba_cuda")
def relu_backward(grad: torch.Tensor, out: torch.Tensor) -> None:
    """Zero ``grad`` where the ReLU output ``out`` is not positive, in place."""
    k, d = grad.shape
    if k == 0 or d == 0:
        return
    leading(grad, "grad")
    leading(out, "out")
    grid, block = grid_2d(k, d)
    KERNELS[numpy_dtype(grad)].relu_backward[grid, block, stream(grad)](array(grad), array(out))
