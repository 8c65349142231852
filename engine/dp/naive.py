"""The naive per-example loop: the reference every clipping engine is tested
against, and the slowest method of ``mpidp bench dpsgd``.

One forward and one backward per example, gradient norm, clip, accumulate:
the textbook DP-SGD of Abadi et al. (2016), "Deep learning with differential
privacy", Algorithm 1, without the noise.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def naive_clipped_sum(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                      max_norm: float | None) -> tuple[torch.Tensor, float, int]:
    """``sum_i min(1, C/|g_i|) g_i`` over the batch, by an explicit loop.

    Args:
        model: any torch module; its ``.grad`` fields are overwritten.
        x, y: ``[k, ...]`` inputs and int64 labels (k may be 0).
        max_norm: C, or None for the plain sum.

    Returns:
        (flat summed gradient of the trainable parameters, in
        ``model.parameters()`` order, summed loss, number of clipped examples).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    total = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype)
    loss_sum, clipped = 0.0, 0
    for i in range(x.shape[0]):
        for p in params:
            p.grad = None
        loss = F.cross_entropy(model(x[i:i + 1]), y[i:i + 1], reduction="sum")
        loss.backward()
        g = torch.cat([torch.zeros(p.numel(), dtype=p.dtype) if p.grad is None  # not reached
                       else p.grad.reshape(-1) for p in params])
        norm = float(g.norm())
        factor = 1.0
        if max_norm is not None and norm > max_norm:
            factor = max_norm / norm
            clipped += 1
        total += factor * g
        loss_sum += float(loss.detach())
    return total, loss_sum, clipped
