"""``softmax_xent`` as a Numba CPU kernel: loss and gradient in one pass per row.

``bind_norms`` (the fused form of :mod:`kernels`) also writes each gradient
row's squared norm, which per-example clipping needs.
"""
from __future__ import annotations

import math

import numba
import numpy as np
import torch

from kernels.registry import register


@numba.njit(fastmath=False, cache=True)
def _softmax_xent(logits, labels, grad, grad_sq):
    """Loss summed over the rows; ``grad = softmax - onehot``; ``grad_sq[i] =
    |grad[i]|^2`` when ``grad_sq`` is not empty."""
    norms = grad_sq.shape[0] > 0
    total = 0.0
    for i in range(logits.shape[0]):
        m = logits[i, 0]
        for j in range(1, logits.shape[1]):
            m = max(m, logits[i, j])
        y = labels[i]
        if y < 0 or y >= logits.shape[1]:  # a write out of bounds otherwise
            raise IndexError("a label is outside 0 .. classes - 1")
        s = 0.0
        for j in range(logits.shape[1]):  # each exp once: they are most of the time
            e = math.exp(logits[i, j] - m)
            grad[i, j] = e
            s += e
        lse = m + math.log(s)
        inv = 1.0 / s
        for j in range(logits.shape[1]):
            grad[i, j] = grad[i, j] * inv
        grad[i, y] -= 1.0
        if norms:
            sq = 0.0
            for j in range(logits.shape[1]):
                sq += grad[i, j] * grad[i, j]
            grad_sq[i] = sq
        total += lse - logits[i, y]
    return total


@register("softmax_xent", backend="numba_cpu")
def softmax_xent(logits: torch.Tensor, labels: torch.Tensor, grad: torch.Tensor) -> float:
    """Per-row cross-entropy: ``grad = softmax - onehot``; returns the summed loss."""
    return _bind(logits, labels, grad)()


def _bind(logits: torch.Tensor, labels: torch.Tensor, grad: torch.Tensor):
    """``softmax_xent`` on these buffers: numpy views made once (``registry.bind``)."""
    if logits.shape[0] == 0:
        return lambda: 0.0
    z, y, g = logits.numpy(), labels.numpy(), grad.numpy()
    none = np.zeros(0, dtype=np.float64)
    return lambda: float(_softmax_xent(z, y, g, none))


def _bind_norms(logits: torch.Tensor, labels: torch.Tensor, grad: torch.Tensor,
                grad_sq: torch.Tensor):
    """The fused form (contract in :mod:`kernels`): ``softmax_xent`` that also
    writes the gradient rows' squared norms into ``grad_sq``."""
    if logits.shape[0] == 0:
        return lambda: 0.0
    z, y, g, sq = logits.numpy(), labels.numpy(), grad.numpy(), grad_sq.numpy()
    return lambda: float(_softmax_xent(z, y, g, sq))


softmax_xent.bind = _bind
softmax_xent.bind_norms = _bind_norms
