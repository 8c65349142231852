"""Per-layer rules for per-example gradient norms and clipped sums.

Given a layer's input activations ``a`` (k examples) and the loss gradient
at its output ``b``, a *rule* returns each example's squared gradient norm
for that layer's parameters and, once the clip factors ``c`` are known, the
clipped sum ``sum_i c_i * grad_i`` per parameter. Rules are registered per
layer type by decorator (the Opacus way); a layer type without one falls
back to :class:`FuncRule`, which materialises per-example gradients with
``torch.func`` (vmap over grad) — slower, but every layer works.

Linear, the book-keeping / ghost-norm rule (Goodfellow 2015, "Efficient
per-example gradient computations"; Li et al. 2022, "Large language models
can be strong differentially private learners"; Bu et al. 2023,
"Differentially private optimization on large model at small cost"): example
i's weight gradient is the outer product ``b_i a_i^T``, so its squared norm
is ``|a_i|^2 |b_i|^2`` (plus ``|b_i|^2`` for the bias), and the clipped sum is
the single GEMM ``(c * b)^T a``. No per-example gradient is ever formed.
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch
from torch import nn


class LayerTerm(Protocol):
    """One layer's contribution for one batch."""

    sq_norms: torch.Tensor  # [k] per-example squared norms of this layer's gradients

    def clipped_sum(self, factors: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{param name: sum_i factors[i] * grad_i}`` for the layer's own parameters."""


Rule = Callable[[nn.Module, torch.Tensor, torch.Tensor], LayerTerm]

_RULES: dict[type, Rule] = {}


def register_rule(*layer_types: type) -> Callable[[Rule], Rule]:
    """Decorator: ``rule(layer, a, b) -> LayerTerm`` for these layer types."""

    def decorate(rule: Rule) -> Rule:
        for layer_type in layer_types:
            _RULES[layer_type] = rule
        return rule

    return decorate


def rule_for(layer: nn.Module) -> Rule:
    """The registered rule for ``type(layer)``, else :class:`FuncRule`."""
    return _RULES.get(type(layer), FuncRule)


def has_fast_rule(layer: nn.Module) -> bool:
    return type(layer) in _RULES


class _LinearTerm:
    def __init__(self, layer: nn.Linear, a: torch.Tensor, b: torch.Tensor):
        self.a, self.b, self.has_bias = a, b, layer.bias is not None
        b_sq = b.square().sum(1)
        self.sq_norms = a.square().sum(1) * b_sq
        if self.has_bias:
            self.sq_norms = self.sq_norms + b_sq

    def clipped_sum(self, factors: torch.Tensor) -> dict[str, torch.Tensor]:
        cb = self.b * factors[:, None]
        out = {"weight": cb.t() @ self.a}
        if self.has_bias:
            out["bias"] = cb.sum(0)
        return out


@register_rule(nn.Linear)
def linear_rule(layer: nn.Module, a: torch.Tensor, b: torch.Tensor) -> LayerTerm:
    """Book-keeping rule for ``nn.Linear`` on 2-D inputs (else the fallback)."""
    if a.dim() != 2:
        return FuncRule(layer, a, b)
    return _LinearTerm(layer, a, b)


class FuncRule:
    """Fallback for any layer that treats examples independently.

    Example i's gradient is ``d/dθ <layer_θ(a_i), b_i>`` (a vector-Jacobian
    product), computed for all i at once with ``torch.func.vmap(grad(...))``.
    """

    def __init__(self, layer: nn.Module, a: torch.Tensor, b: torch.Tensor):
        # deferred: only this rule needs torch.func
        from torch.func import functional_call, grad, vmap

        params = {name: p.detach() for name, p in layer.named_parameters(recurse=False)}
        k = a.shape[0]
        if k == 0:
            self.grads = {name: p.new_zeros((0, *p.shape)) for name, p in params.items()}
        else:
            def inner(theta, a_i, b_i):
                out = functional_call(layer, theta, (a_i.unsqueeze(0),))
                return (out * b_i.unsqueeze(0)).sum()

            self.grads = vmap(grad(inner), in_dims=(None, 0, 0))(params, a.detach(),
                                                                  b.detach())
        dtype = a.dtype if a.is_floating_point() else b.dtype
        sq = torch.zeros(k, dtype=dtype, device=b.device)
        for g in self.grads.values():
            sq = sq + g.reshape(k, -1).square().sum(1)
        self.sq_norms = sq

    def clipped_sum(self, factors: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: torch.tensordot(factors, g, dims=([0], [0]))
                for name, g in self.grads.items()}
