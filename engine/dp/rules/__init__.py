"""Per-layer rules for per-example gradient norms and clipped sums.

Given a layer's input ``a`` (k examples, recorded by a forward hook) and the
loss gradient at its output ``b``, a *rule* returns a :class:`LayerTerm`:
each example's squared gradient norm for that layer's own parameters and,
once the clip factors ``c`` are known, the clipped sum ``sum_i c_i * grad_i``
per parameter. Every rule is exact (the per-example loop's numbers up to
rounding) and accepts k = 0.

Rules are registered per layer type by decorator (the Opacus way), one
module per family, all imported at the end of this file:

* :mod:`.linear`: ``nn.Linear``, book-keeping (``|a_i|^2 |b_i|^2``, one GEMM
  for the sum) on ``[k, d]`` inputs, ghost norm or per-example outer products
  on ``[k, ..., d]`` inputs;
* :mod:`.embedding`: ``nn.Embedding``, from the rows each example looks up;
* :mod:`.norms`: ``nn.LayerNorm``, ``nn.GroupNorm``, ``nn.RMSNorm`` (affine
  parameters, from the recomputed normalised input);
* :mod:`.conv`: ``nn.Conv1d``, ``nn.Conv2d``, a Linear map of unfolded patches.

Layers that break per-example privacy (BatchNorm mixes the examples, an
Embedding with ``max_norm`` rewrites its weights from the data, ...) are
refused with the reason: :func:`refusal`.

A layer type without a rule (or an input its rule declines) falls back to
:class:`FuncRule`, which materialises per-example gradients with
``torch.func`` (vmap over grad): exact, slower, and announced by the
clipper with a :class:`SlowPathWarning` naming the layer.

Groups (households: ``--privacy-unit household``) are clipped as one: a
term's :meth:`LayerTerm.group_sq_norms` gives each group's squared norm of
its summed gradient, computed from Gram products of the group's rows or from
materialised per-example gradients (:func:`group_sq_norms_of`), since the
norm of a sum is not the sum of the norms. Norms add over parameters, so a
rule may treat weight and bias separately.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable, Protocol

import torch
from torch import nn


class SlowPathWarning(UserWarning):
    """A layer's per-example gradients go through ``torch.func``: exact, but
    slower and hungrier than a per-layer rule (see :func:`register_rule`)."""


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


def blocks(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x`` (``[k, ...]``) gathered into padded group blocks ``[H, S, ...]``
    (zero padding), ``index`` from :func:`padded_index`."""
    return torch.cat([x, x.new_zeros(1, *x.shape[1:])])[index]


def group_owner(groups: torch.Tensor) -> torch.Tensor:
    """``[k]`` the group of each row."""
    starts = groups.to(torch.int64)
    sizes = starts[1:] - starts[:-1]
    return torch.repeat_interleave(torch.arange(sizes.shape[0], device=starts.device), sizes)


def _rows(g: torch.Tensor) -> torch.Tensor:
    """``[k, ...]`` as ``[k, rest]`` (also for k = 0, where ``reshape(0, -1)`` fails)."""
    return g.reshape(g.shape[0], math.prod(g.shape[1:]))


def group_sq_norms_of(grads: Iterable[torch.Tensor], groups: torch.Tensor) -> torch.Tensor:
    """``[H]`` squared norms of each group's summed per-example gradients
    (``grads``: tensors ``[k, ...]``)."""
    owner = group_owner(groups)
    n_groups = groups.shape[0] - 1
    sq = None
    for g in grads:
        flat = _rows(g)
        sums = flat.new_zeros(n_groups, flat.shape[1]).index_add_(0, owner, flat)
        part = sums.square().sum(1)
        sq = part if sq is None else sq + part
    return sq if sq is not None else torch.zeros(n_groups)


class GradsTerm:
    """A term from materialised per-example gradients ``{name: [k, *shape]}``
    (cheap when the parameters are small: norm layers, biases)."""

    def __init__(self, grads: dict[str, torch.Tensor], k: int, like: torch.Tensor):
        self.grads = grads
        sq = like.new_zeros(k)
        for g in grads.values():
            sq = sq + _rows(g).square().sum(1)
        self.sq_norms = sq

    def clipped_sum(self, factors: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: torch.tensordot(factors, g, dims=([0], [0]))
                for name, g in self.grads.items()}

    def group_sq_norms(self, groups: torch.Tensor) -> torch.Tensor:
        return group_sq_norms_of(self.grads.values(), groups)


def refusal(module: nn.Module) -> str | None:
    """Why DP-SGD cannot train a model holding ``module``, and what to use
    instead (a phrase that follows the layer's name); None when it can.

    Per-example privacy needs each example's gradient to depend on that
    example alone, and every use of the data to go through clipping and noise.
    """
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return ("mixes the examples of a batch (it normalises by the batch's statistics), "
                "so per-example gradients do not exist; use GroupNorm or LayerNorm")
    if isinstance(module, nn.modules.instancenorm._InstanceNorm) and \
            module.track_running_stats:
        return ("keeps running statistics of the training rows, which the model would "
                "release without clipping or noise; set track_running_stats=False")
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        if module.max_norm is not None:
            return ("has max_norm set: it renormalises the rows a batch looks up in place "
                    "during the forward pass, a change of the weights that depends on the "
                    "data and escapes clipping and noise; use max_norm=None")
        if module.scale_grad_by_freq:
            return ("has scale_grad_by_freq=True: each row's gradient is divided by its "
                    "count in the batch, so one example's gradient depends on the others; "
                    "use scale_grad_by_freq=False")
    return None


Rule = Callable[[nn.Module, torch.Tensor, torch.Tensor], LayerTerm]

_RULES: dict[type, Rule] = {}


def register_rule(*layer_types: type) -> Callable[[Rule], Rule]:
    """Decorator: ``rule(layer, a, b) -> LayerTerm`` for these layer types
    (exact types: a subclass needs its own registration). A rule that cannot
    serve an input returns ``FuncRule(layer, a, b)``."""

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


class FuncRule(GradsTerm):
    """Fallback for any layer that treats examples independently.

    Example i's gradient is ``d/dθ <layer_θ(a_i, *more_i), b_i>`` (a
    vector-Jacobian product), computed for all i at once with
    ``torch.func.vmap(grad(...))``. ``more``: the layer's further positional
    inputs (tensors ``[k, ...]``, batched like ``a``; anything else as is).
    """

    def __init__(self, layer: nn.Module, a: torch.Tensor, b: torch.Tensor,
                 more: tuple = ()):
        # deferred: only this rule needs torch.func
        from torch.func import functional_call, grad, vmap

        params = {name: p.detach() for name, p in layer.named_parameters(recurse=False)}
        k = a.shape[0]
        if k == 0:
            grads = {name: p.new_zeros((0, *p.shape)) for name, p in params.items()}
        else:
            batched = [torch.is_tensor(x) for x in more]

            def inner(theta, a_i, b_i, *more_i):
                args = [x.unsqueeze(0) if is_t else x for x, is_t in zip(more_i, batched)]
                out = functional_call(layer, theta, (a_i.unsqueeze(0), *args))
                return (out * b_i.unsqueeze(0)).sum()

            in_dims = (None, 0, 0, *(0 if is_t else None for is_t in batched))
            more = tuple(x.detach() if is_t else x for x, is_t in zip(more, batched))
            grads = vmap(grad(inner), in_dims=in_dims)(params, a.detach(), b.detach(), *more)
        super().__init__(grads, k, b)


# The built-in rules register themselves on import (after the names above exist).
from engine.dp.rules import conv, embedding, linear, norms  # noqa: E402,F401
