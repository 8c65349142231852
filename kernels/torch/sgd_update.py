"""``sgd_update`` with torch ops: the generic kernel for any device."""
from __future__ import annotations

import torch

from kernels.registry import register


@register("sgd_update", backend="torch")
def sgd_update(params: torch.Tensor, velocity: torch.Tensor, grad: torch.Tensor, scale: float,
               lr: float, momentum: float) -> None:
    """SGD with momentum in place (contract in :mod:`kernels`)."""
    velocity.mul_(momentum).add_(grad, alpha=scale)
    params.add_(velocity, alpha=-lr)
