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

Groups (households: ``--privacy-unit household``) are clipped as one: a
term's :meth:`LayerTerm.group_sq_norms` gives each group's squared norm of
its summed gradient, for Linear from the Gram products of its rows,
``|sum_i b_i a_i^T|^2 = sum_{i,j} (a_i . a_j)(b_i . b_j)`` (plus
``sum_{i,j} b_i . b_j`` for the bias), since the norm of a sum is not the
sum of the norms.
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

    def group_sq_norms(self, groups: torch.Tensor) -> torch.Tensor:
        """``[H]`` squared norms of each group's summed gradient; ``groups`` is
        int64 ``[H+1]`` row offsets (group h: rows ``groups[h] .. groups[h+1]-1``)."""


def padded_index(groups: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index [H, S], sizes [H])``: row s of group h, or ``k`` past its end (a
    padding row), S the largest group; for gathering groups into padded blocks."""
    starts = groups.to(torch.int64)
    sizes = starts[1:] - starts[:-1]
    width = int(sizes.max()) if sizes.numel() else 0
    slot = torch.arange(width, device=starts.device)
    index = starts[:-1, None] + slot[None, :]
    index = torch.where(slot[None, :] < sizes[:, None], index, torch.full_like(index, k))
    return index, sizes


def _blocks(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x`` ([k, d]) gathered into padded group blocks ``[H, S, d]`` (zero padding)."""
    return torch.cat([x, x.new_zeros(1, x.shape[1])])[index]


def _gram_sum(a: torch.Tensor, b: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``sum_{i,j in h} (a_i . a_j)(b_i . b_j)`` per group h."""
    pa, pb = _blocks(a, index), _blocks(b, index)
    return ((pa @ pa.transpose(1, 2)) * (pb @ pb.transpose(1, 2))).sum((1, 2))


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

    def group_sq_norms(self, groups: torch.Tensor) -> torch.Tensor:
        index, _ = padded_index(groups, self.a.shape[0])
        a = self.a
        if self.has_bias:  # the bias is a weight column on an input of ones
            a = torch.cat([a, a.new_ones(a.shape[0], 1)], 1)
        return _gram_sum(a, self.b, index)


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

    def group_sq_norms(self, groups: torch.Tensor) -> torch.Tensor:
        return group_sq_norms_of(self.grads.values(), groups)


def group_sq_norms_of(grads, groups: torch.Tensor) -> torch.Tensor:
    """``[H]`` squared norms of each group's summed per-example gradients
    (``grads``: tensors ``[k, ...]``)."""
    starts = groups.to(torch.int64)
    sizes = starts[1:] - starts[:-1]
    owner = torch.repeat_interleave(torch.arange(sizes.shape[0], device=starts.device), sizes)
    sq = None
    for g in grads:
        flat = g.reshape(g.shape[0], -1)
        sums = flat.new_zeros(sizes.shape[0], flat.shape[1]).index_add_(0, owner, flat)
        part = sums.square().sum(1)
        sq = part if sq is None else sq + part
    return sq if sq is not None else torch.zeros(sizes.shape[0])
