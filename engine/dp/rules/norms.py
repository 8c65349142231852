"""Normalisation layers' affine parameters: ``nn.LayerNorm``, ``nn.GroupNorm``,
``nn.RMSNorm``.

The layer computes ``y = x̂ * weight + bias`` with ``x̂`` the input normalised
per example (the layer's own statistics and ``eps``), so example i's weight
gradient is ``sum b_i * x̂_i`` and its bias gradient ``sum b_i``, summed over
the dims the parameters are broadcast along (positions before LayerNorm's and
RMSNorm's normalised shape; GroupNorm's spatial dims). ``x̂`` is recomputed
from the recorded input by the functional form without the affine part. The
per-example gradients are the parameters' size (``[k, C]``), so they are
materialised (:class:`~engine.dp.rules.GradsTerm`), groups included.
"""
from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from engine.dp.rules import GradsTerm, LayerTerm, register_rule


def _affine_grads(layer: nn.Module, x_hat: torch.Tensor, b: torch.Tensor, lead: int,
                  shape: tuple[int, ...], trail: int) -> GradsTerm:
    """Per-example ``weight`` / ``bias`` gradients ``[k, *shape]``: ``b * x̂`` and
    ``b`` viewed as ``[k, lead, *shape, trail]``, summed over lead and trail."""
    k = b.shape[0]
    view = (k, lead, math.prod(shape), trail)
    grads = {}
    if layer.weight is not None:
        grads["weight"] = (b * x_hat).reshape(view).sum((1, 3)).reshape(k, *shape)
    if getattr(layer, "bias", None) is not None:
        grads["bias"] = b.reshape(view).sum((1, 3)).reshape(k, *shape)
    return GradsTerm(grads, k, b)


@register_rule(nn.LayerNorm)
def layer_norm_rule(layer: nn.Module, a: torch.Tensor, b: torch.Tensor) -> LayerTerm:
    """``[k, ..., *normalized_shape]``: sums over the positions ``...``."""
    shape = tuple(layer.normalized_shape)
    x_hat = F.layer_norm(a, shape, None, None, layer.eps)
    lead = math.prod(a.shape[1:a.dim() - len(shape)])
    return _affine_grads(layer, x_hat, b, lead, shape, 1)


@register_rule(nn.RMSNorm)
def rms_norm_rule(layer: nn.Module, a: torch.Tensor, b: torch.Tensor) -> LayerTerm:
    """``[k, ..., *normalized_shape]``: sums over the positions ``...``."""
    shape = tuple(layer.normalized_shape)
    x_hat = F.rms_norm(a, shape, None, layer.eps)
    lead = math.prod(a.shape[1:a.dim() - len(shape)])
    return _affine_grads(layer, x_hat, b, lead, shape, 1)


@register_rule(nn.GroupNorm)
def group_norm_rule(layer: nn.Module, a: torch.Tensor, b: torch.Tensor) -> LayerTerm:
    """``[k, C, *spatial]``: sums over the spatial dims."""
    x_hat = F.group_norm(a, layer.num_groups, None, None, layer.eps)
    return _affine_grads(layer, x_hat, b, 1, (layer.num_channels,), math.prod(a.shape[2:]))
