"""Optimizers on the flat parameter vector: SGD with momentum, and Adam.

Differential privacy is entirely in the gradient they receive (clipped,
noised, summed over ranks, divided by the expected batch size); the update
rules are the usual ones, written on one flat buffer so a step is two to six
vector operations without per-parameter Python loops. They match
``torch.optim.SGD`` and ``torch.optim.Adam`` (tests check it), including
``weight_decay``: L2 regularisation, ``lambda * params`` added to the
gradient, i.e. the loss plus ``lambda/2 |params|^2`` (all parameters, biases
included, as torch does). It is added after the noise and depends on no
example, so it costs no privacy. DP-SGD with momentum and DP-Adam are these
optimizers fed DP gradients.
"""
from __future__ import annotations

import torch

from engine.choices import OPTIMIZERS as NAMES
from kernels import registry


class SGD:
    """``v = m v + g``; ``p -= lr v`` (PyTorch's momentum convention), or with
    ``nesterov``, ``p -= lr (g + m v)`` (PyTorch's Nesterov form).

    The momentum update is one ``sgd_update`` kernel (:mod:`kernels.registry`),
    bound to the gradient buffer of the first step: pass the same buffer every
    step (the trainer does), a different one re-binds.
    """

    def __init__(self, params: torch.Tensor, lr: float, momentum: float = 0.0,
                 weight_decay: float = 0.0, backend: str | None = None,
                 nesterov: bool = False):
        if nesterov and not momentum:
            raise ValueError("Nesterov momentum needs a momentum above 0")
        self.params, self.lr, self.momentum = params, float(lr), float(momentum)
        self.nesterov = nesterov
        self.weight_decay = float(weight_decay)
        self.velocity = torch.zeros_like(params) if momentum else None
        self._g = torch.empty_like(params) if weight_decay else None
        self._started = False
        self._kernel = registry.get_or_best("sgd_update", params.device, backend)
        self._bound_to: torch.Tensor | None = None
        self._update = None

    def step(self, grad: torch.Tensor, scale: float = 1.0) -> None:
        """Update with gradient ``scale * grad + weight_decay * params``
        (``grad`` is left unchanged)."""
        if self._g is not None:
            grad = torch.mul(grad, scale, out=self._g).add_(self.params,
                                                           alpha=self.weight_decay)
            scale = 1.0
        if self.velocity is None:
            self.params.add_(grad, alpha=-self.lr * scale)
            return
        self._started = True
        if self.nesterov:  # torch ops: the fused kernel has the classic form only
            self.velocity.mul_(self.momentum).add_(grad, alpha=scale)
            self.params.add_(grad, alpha=-self.lr * scale)
            self.params.add_(self.velocity, alpha=-self.lr * self.momentum)
            return
        if grad is not self._bound_to:
            self._update = registry.bind(self._kernel, params=self.params,
                                         velocity=self.velocity, grad=grad)
            self._bound_to = grad
        # The velocity starts at zero, so the first step gives v = scale * grad.
        self._update(scale=scale, lr=self.lr, momentum=self.momentum)

    def state_dict(self) -> dict:
        return {"name": "sgd", "lr": self.lr, "momentum": self.momentum,
                "started": self._started,
                "velocity": None if self.velocity is None else self.velocity.clone()}

    def load_state_dict(self, state: dict) -> None:
        self._started = bool(state["started"])
        if self.velocity is not None:
            self.velocity.copy_(state["velocity"])


class Adam:
    """Adam (Kingma & Ba 2015) with bias correction, as ``torch.optim.Adam``."""

    def __init__(self, params: torch.Tensor, lr: float, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0):
        self.params, self.lr, self.eps = params, float(lr), float(eps)
        self.weight_decay = float(weight_decay)
        self.beta1, self.beta2 = float(betas[0]), float(betas[1])
        self.m = torch.zeros_like(params)
        self.v = torch.zeros_like(params)
        self._g = torch.empty_like(params)
        self._denom = torch.empty_like(params)
        self.t = 0

    def step(self, grad: torch.Tensor, scale: float = 1.0) -> None:
        self.t += 1
        g = torch.mul(grad, scale, out=self._g)
        if self.weight_decay:
            g.add_(self.params, alpha=self.weight_decay)
        self.m.lerp_(g, 1.0 - self.beta1)
        self.v.mul_(self.beta2).addcmul_(g, g, value=1.0 - self.beta2)
        bc1 = 1.0 - self.beta1 ** self.t
        bc2 = 1.0 - self.beta2 ** self.t
        torch.sqrt(self.v, out=self._denom).div_(bc2 ** 0.5).add_(self.eps)
        self.params.addcdiv_(self.m, self._denom, value=-self.lr / bc1)

    def state_dict(self) -> dict:
        return {"name": "adam", "lr": self.lr, "betas": (self.beta1, self.beta2),
                "eps": self.eps, "t": self.t, "m": self.m.clone(), "v": self.v.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.t = int(state["t"])
        self.m.copy_(state["m"])
        self.v.copy_(state["v"])


def build(name: str, params: torch.Tensor, lr: float, momentum: float = 0.9,
          weight_decay: float = 0.0, backend: str | None = None, nesterov: bool = False):
    """The optimizer called ``name`` (``sgd`` or ``adam``) over ``params``;
    ``backend`` forces a kernel back-end (``"torch"``) where one is used;
    ``nesterov`` (SGD only) Nesterov momentum."""
    if name == "sgd":
        return SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay,
                   backend=backend, nesterov=nesterov)
    if name == "adam":
        return Adam(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"optimizer {name!r} not in {NAMES}")
