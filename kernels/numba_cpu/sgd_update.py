"""``sgd_update`` as one Numba CPU loop: momentum and parameter update in one pass.

The torch version is three ops (scale-and-add into the velocity, then into
the parameters) whose cost is mostly torch's per-op dispatch, which one loop
pays once. The same operations as the torch ops, element by element, without
fast-math reordering (equal to them within float rounding: torch may fuse
the multiply-add; the tests compare with ``torch.optim.SGD``).

Serial on purpose: the update is memory-bound and short, and as a Numba
parallel region between torch's multi-threaded GEMMs it slowed a 2-thread
training step below the torch ops (``mpidp bench dpsgd --threads 2``).
"""
from __future__ import annotations

import torch

from kernels.registry import register
from kernels.shared_compiles import cached_njit


@cached_njit
def _sgd_update(params, velocity, grad, scale, lr, momentum):
    s = params.dtype.type(scale)
    a = params.dtype.type(lr)
    m = params.dtype.type(momentum)
    for i in range(params.shape[0]):
        v = m * velocity[i] + s * grad[i]
        velocity[i] = v
        params[i] -= a * v


@register("sgd_update", backend="numba_cpu")
def sgd_update(params: torch.Tensor, velocity: torch.Tensor, grad: torch.Tensor, scale: float,
               lr: float, momentum: float) -> None:
    """SGD with momentum in place (contract in :mod:`kernels`)."""
    _bind(params, velocity, grad)(scale=scale, lr=lr, momentum=momentum)


def _bind(params: torch.Tensor, velocity: torch.Tensor, grad: torch.Tensor):
    """``sgd_update`` on these buffers: numpy views made once (``registry.bind``)."""
    p, v, g = params.numpy(), velocity.numpy(), grad.numpy()

    def update(scale: float, lr: float, momentum: float) -> None:
        _sgd_update(p, v, g, float(scale), float(lr), float(momentum))

    return update


sgd_update.bind = _bind
