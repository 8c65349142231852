"""``softmax_xent`` as a Numba CPU kernel: loss and gradient in one pass per row."""
from __future__ import annotations

import math

import torch

from kernels.registry import register
from kernels.shared_compiles import cached_njit


@cached_njit
def check_labels(labels, classes):
    """IndexError unless every label is in 0 .. classes - 1 (a write out of
    bounds otherwise). A caller that runs the kernel inside a parallel loop
    calls it first: an exception raised there is lost."""
    for i in range(labels.shape[0]):
        if labels[i] < 0 or labels[i] >= classes:
            raise IndexError("a label is outside 0 .. classes - 1")


@cached_njit(fastmath=False)
def _softmax_xent(logits, labels, grad):
    check_labels(labels, logits.shape[1])
    total = 0.0
    for i in range(logits.shape[0]):
        total += _row(logits, labels, grad, i)
    return total


@cached_njit(fastmath=False)
def _softmax_xent_rows(logits, labels, grad, losses):
    check_labels(labels, logits.shape[1])
    for i in range(logits.shape[0]):
        losses[i] = _row(logits, labels, grad, i)


@cached_njit(fastmath=False, inline="always")
def _row(logits, labels, grad, i):
    """Row i's gradient into ``grad[i]``; returns its loss."""
    m = logits[i, 0]
    for j in range(1, logits.shape[1]):
        m = max(m, logits[i, j])
    y = labels[i]
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
    return lse - logits[i, y]


@register("softmax_xent", backend="numba_cpu")
def softmax_xent(logits: torch.Tensor, labels: torch.Tensor, grad: torch.Tensor,
                 losses: torch.Tensor | None = None) -> float | None:
    """Per-row cross-entropy: ``grad = softmax - onehot``; returns the summed loss
    (or, with ``losses``, writes the rows' losses there and returns None)."""
    if losses is None:
        return _bind(logits, labels, grad)()
    k = logits.shape[0]
    if k:
        _softmax_xent_rows(logits.numpy(), labels.numpy(), grad.numpy(), losses[:k].numpy())
    return None


def _bind(logits: torch.Tensor, labels: torch.Tensor, grad: torch.Tensor):
    """``softmax_xent`` on these buffers: numpy views made once (``registry.bind``)."""
    if logits.shape[0] == 0:
        return lambda: 0.0
    z, y, g = logits.numpy(), labels.numpy(), grad.numpy()
    return lambda: float(_softmax_xent(z, y, g))


softmax_xent.bind = _bind
