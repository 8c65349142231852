"""``relu_backward`` with torch ops: the generic kernel for any device."""
from __future__ import annotations

import torch

from kernels.registry import register


@register("relu_backward", backend="torch")
def relu_backward(grad: torch.Tensor, out: torch.Tensor) -> None:
    """Zero ``grad`` where the ReLU output ``out`` is not positive, in place."""
    grad.mul_(out > 0)
