"""``softmax_xent`` as a Numba CPU kernel: loss and gradient in one pass per row."""
from __future__ import annotations

import math

import numba
import torch

from kernels.dispatch import register


@numba.njit(fastmath=False, cache=True)
def _softmax_xent(logits, labels, grad):
    total = 0.0
    for i in range(logits.shape[0]):
        m = logits[i, 0]
        for j in range(1, logits.shape[1]):
            m = max(m, logits[i, j])
        s = 0.0
        for j in range(logits.shape[1]):
            s += math.exp(logits[i, j] - m)
        lse = m + math.log(s)
        y = labels[i]
        for j in range(logits.shape[1]):
            grad[i, j] = math.exp(logits[i, j] - lse)
        grad[i, y] -= 1.0
        total += lse - logits[i, y]
    return total


@register("softmax_xent", "cpu", backend="numba")
def softmax_xent(logits: torch.Tensor, labels: torch.Tensor, grad: torch.Tensor) -> float:
    """Per-row cross-entropy: ``grad = softmax - onehot``; returns the summed loss."""
    if logits.shape[0] == 0:
        return 0.0
    return float(_softmax_xent(logits.numpy(), labels.numpy(), grad.numpy()))
