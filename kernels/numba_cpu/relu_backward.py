"""``relu_backward`` as a Numba CPU kernel: one branch-free pass, no boolean temporary."""
from __future__ import annotations

import numba
import torch

from kernels.registry import register


@numba.njit(fastmath=True, cache=True)
def _relu_backward(grad, out):
    for i in range(grad.shape[0]):
        for j in range(grad.shape[1]):
            # Multiply by the 0/1 mask: a conditional store compiles to a branch,
            # mispredicted half the time since the signs are random.
            grad[i, j] = grad[i, j] * (out[i, j] > 0)


@register("relu_backward", backend="numba_cpu")
def relu_backward(grad: torch.Tensor, out: torch.Tensor) -> None:
    """Zero ``grad`` where the ReLU output ``out`` is not positive, in place."""
    _bind(grad, out)()


def _bind(grad: torch.Tensor, out: torch.Tensor):
    """``relu_backward`` on these buffers: numpy views made once (``registry.bind``)."""
    if grad.shape[0] == 0:
        return lambda: None
    g, o = grad.numpy(), out.numpy()
    return lambda: _relu_backward(g, o)


relu_backward.bind = _bind
