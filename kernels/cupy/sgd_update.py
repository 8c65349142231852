"""``sgd_update`` on CUDA with CuPy: ``sgd_update.cu`` beside it.

SGD with momentum on flat buffers in one launch (contract in
:mod:`kernels`); the same operations as the Numba twin,
:mod:`kernels.numba_cuda.sgd_update`, and as torch's three ops, equal to
them to float rounding (the compiler may fuse a multiply-add).
"""
from __future__ import annotations

import numpy as np
import torch

from kernels.common.cuda_shapes import check_flat, grid_1d, numpy_dtype
from kernels.cupy.launch import function, launch, pointer
from kernels.registry import register

#: Most blocks of a launch; the kernel strides over the rest.
MAX_BLOCKS = 4096


@register("sgd_update", backend="cupy")
def sgd_update(params: torch.Tensor, velocity: torch.Tensor, grad: torch.Tensor, scale: float,
               lr: float, momentum: float) -> None:
    """SGD with momentum in place (contract in :mod:`kernels`)."""
    for t, name in ((params, "params"), (velocity, "velocity"), (grad, "grad")):
        check_flat(t, name)
    n = params.shape[0]
    if velocity.shape[0] != n or grad.shape[0] != n:
        raise ValueError(f"sgd_update: params, velocity and grad differ in length "
                         f"({n}, {velocity.shape[0]}, {grad.shape[0]})")
    if n == 0:
        return
    blocks, threads = grid_1d(n, 256)
    scalar = numpy_dtype(params).type
    launch(function("sgd_update", "sgd_update", params), params, (min(blocks, MAX_BLOCKS),),
           (threads,), (pointer(params), pointer(velocity), pointer(grad), np.int64(n),
                        scalar(scale), scalar(lr), scalar(momentum)))
