"""``sgd_update`` on CUDA with Numba ``@cuda.jit``: SGD with momentum in one launch.

Contract in :mod:`kernels`; the twin of ``kernels/cupy/sgd_update.cu`` (the
same grid-stride loop and launch shape): ``velocity = momentum * velocity +
scale * grad``, then ``params -= lr * velocity``, element by element, equal
to torch's three ops to float rounding.
"""
from __future__ import annotations

from types import SimpleNamespace

import numba
import numpy as np
import torch
from numba import cuda

from kernels.common.cuda_shapes import numpy_dtype, update_launch
from kernels.numba_cuda.launch import array, stream
from kernels.registry import register


def _build(ft):
    """The kernel for element type ``ft``."""

    @cuda.jit
    def update(params, velocity, grad, scale, lr, momentum):
        start, step = cuda.grid(1), cuda.gridsize(1)
        for i in range(start, params.shape[0], step):
            v = momentum * velocity[i] + scale * grad[i]
            velocity[i] = v
            params[i] -= lr * v

    return SimpleNamespace(update=update)


KERNELS = {np.dtype(np.float32): _build(numba.float32),
           np.dtype(np.float64): _build(numba.float64)}


def signatures(dtype) -> dict[str, tuple]:
    """Argument types of every kernel for ``dtype`` (for ahead-of-time PTX checks)."""
    ft = numba.from_dtype(np.dtype(dtype))
    return {"update": (ft[:], ft[:], ft[:], ft, ft, ft)}


@register("sgd_update", backend="numba_cuda")
def sgd_update(params: torch.Tensor, velocity: torch.Tensor, grad: torch.Tensor, scale: float,
               lr: float, momentum: float) -> None:
    """SGD with momentum in place (contract in :mod:`kernels`)."""
    n, blocks, threads = update_launch(params, velocity, grad)
    if n == 0:
        return
    ft = numpy_dtype(params).type
    KERNELS[numpy_dtype(params)].update[blocks, threads, stream(params)](
        array(params), array(velocity), array(grad), ft(scale), ft(lr), ft(momentum))
