"""``sgd_update`` on CUDA with CuPy: ``sgd_update.cu`` beside it.

SGD with momentum on flat buffers in one launch (contract in
:mod:`kernels`); the same operations as the Numba twin,
:mod:`kernels.numba_cuda.sgd_update`, and as torch's three ops, equal to
them to float rounding (the compiler may fuse a multiply-add).
"""
from __future__ import annotations

import numpy as np
import torch

from kernels.common.cuda_shapes import numpy_dtype, update_launch
from kernels.cupy.launch import function, launch, pointer
from kernels.registry import register


@register("sgd_update", backend="cupy")
def sgd_update(params: torch.Tensor, velocity: torch.Tensor, grad: torch.Tensor, scale: float,
               lr: float, momentum: float) -> None:
    """SGD with momentum in place (contract in :mod:`kernels`)."""
    n, blocks, threads = update_launch(params, velocity, grad)
    if n == 0:
        return
    scalar = numpy_dtype(params).type
    launch(function("sgd_update", "sgd_update", params), params, (blocks,), (threads,),
           (pointer(params), pointer(velocity), pointer(grad), np.int64(n),
            scalar(scale), scalar(lr), scalar(momentum)))
