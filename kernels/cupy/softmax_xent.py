"""``softmax_xent`` on CUDA with CuPy: ``softmax_xent.cu`` beside it.

One thread per row; per-row losses go to a reused device buffer and torch
sums them in float64 (fixed order: reproducible). Returning the loss as a
Python float synchronizes torch's current stream; with ``losses`` given the
per-row losses go there and nothing is read back (a CUDA graph can hold
the call).
"""
from __future__ import annotations

import numpy as np
import torch

from kernels.common.cuda_shapes import check_row_losses, grid_1d, leading, scratch
from kernels.cupy.launch import function, launch, pointer
from kernels.registry import register


@register("softmax_xent", backend="cupy")
def softmax_xent(logits: torch.Tensor, labels: torch.Tensor, grad: torch.Tensor,
                 losses: torch.Tensor | None = None) -> float | None:
    """Per-row cross-entropy: ``grad = softmax - onehot``; returns the summed loss
    (or, with ``losses``, writes the rows' losses there and returns None)."""
    k, c = logits.shape
    if k == 0:
        return 0.0 if losses is None else None
    if labels.dtype != torch.int64 or labels.dim() != 1 or labels.stride(0) != 1:
        raise ValueError("labels: the CUDA kernels need a contiguous 1-D int64 tensor")
    rows = scratch(logits, k, logits.dtype, "losses") if losses is None \
        else check_row_losses(losses, logits)
    blocks, threads = grid_1d(k)
    launch(function("softmax_xent", "softmax_xent", logits), logits, (blocks,), (threads,),
           (pointer(logits), np.int64(leading(logits, "logits")), pointer(labels),
            pointer(grad), np.int64(leading(grad, "grad")), pointer(rows), np.int64(k),
            np.int64(c)))
    return None if losses is not None else float(rows.sum(dtype=torch.float64))
