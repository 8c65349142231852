"""``softmax_xent`` on CUDA with Numba ``@cuda.jit`` (twin of ``kernels/cupy/softmax_xent.cu``).

One thread per row (the classes are few): ``grad = softmax(z) - onehot(y)``
and the row's loss ``logsumexp(z) - z_y``, max-shifted as on the CPU. The
per-row losses go to a reused device buffer and are summed by torch in
float64 (a fixed order, so the loss is reproducible); returning the sum as a
Python float synchronizes torch's current stream. With ``losses`` given the
per-row losses go there and nothing is read back (a CUDA graph can hold the
call).
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import numba
import numpy as np
import torch
from numba import cuda

from kernels.common.cuda_shapes import check_row_losses, grid_1d, leading, numpy_dtype, scratch
from kernels.numba_cuda.launch import array, stream
from kernels.registry import register


def _build(ft):
    zero, one = ft(0), ft(1)

    @cuda.jit
    def softmax_xent(logits, labels, grad, row_loss):
        i = cuda.grid(1)
        if i < logits.shape[0]:
            c = logits.shape[1]
            m = logits[i, 0]
            for j in range(1, c):
                v = logits[i, j]
                if v > m:
                    m = v
            s = zero
            for j in range(c):
                s += math.exp(logits[i, j] - m)
            lse = m + math.log(s)
            y = labels[i]
            for j in range(c):
                grad[i, j] = math.exp(logits[i, j] - lse)
            grad[i, y] -= one
            row_loss[i] = lse - logits[i, y]

    return SimpleNamespace(softmax_xent=softmax_xent)


KERNELS = {np.dtype(np.float32): _build(numba.float32),
           np.dtype(np.float64): _build(numba.float64)}


def signatures(dtype) -> dict[str, tuple]:
    """Argument types of every kernel for ``dtype`` (for ahead-of-time PTX checks)."""
    ft = numba.from_dtype(np.dtype(dtype))
    return {"softmax_xent": (ft[:, :], numba.int64[:], ft[:, :], ft[:])}


@register("softmax_xent", backend="numba_cuda")
def softmax_xent(logits: torch.Tensor, labels: torch.Tensor, grad: torch.Tensor,
                 losses: torch.Tensor | None = None) -> float | None:
    """Per-row cross-entropy: ``grad = softmax - onehot``; returns the summed loss
    (or, with ``losses``, writes the rows' losses there and returns None)."""
    k = logits.shape[0]
    if k == 0:
        return 0.0 if losses is None else None
    leading(logits, "logits")
    leading(grad, "grad")
    rows = scratch(logits, k, logits.dtype, "losses") if losses is None \
        else check_row_losses(losses, logits)
    blocks, threads = grid_1d(k)
    KERNELS[numpy_dtype(logits)].softmax_xent[blocks, threads, stream(logits)](
        array(logits), array(labels), array(grad), array(rows))
    return None if losses is not None else float(rows.sum(dtype=torch.float64))
