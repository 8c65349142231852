"""``nn.Conv1d`` and ``nn.Conv2d``: a Linear map of unfolded patches.

A convolution is, per group of channels, a Linear layer applied at every
output position p to the input patch ``u_p`` that position sees (``F.unfold``,
after the layer's padding; Conv1d as a Conv2d of height 1). So example i's
weight gradient is ``sum_p b_ip u_ip^T`` (``[out/groups, in/groups * kernel]``
per group) and its squared norm either the ghost norm ``sum_{p,q} (u_ip .
u_iq)(b_ip . b_iq)`` or that of the materialised gradient, whichever is
smaller (:class:`~engine.dp.rules.linear.OuterSums`); the bias gradient is
``sum_p b_ip``. Any stride, dilation, groups, padding (numbers, ``'same'``,
``'valid'``) and padding mode.

The per-example weight gradients can also come straight from the
convolution's own weight-gradient kernel, run once over the batch as a
grouped convolution with ``k * groups`` groups (example i's input channels
against its output gradient channels): no unfolded patches, which cost more
than the GEMMs on a CPU's 3x3 convolutions of many channels but less for a
3-channel stem. Which of the two ways is faster depends on the layer's shape
and the machine, so the first batch of each layer shape times both
(:class:`Chooser`) and the run keeps the faster; both are exact.
"""
from __future__ import annotations

import time

import torch
from torch import nn
from torch.nn import functional as F

from engine.dp.rules import FuncRule, GradsTerm, LayerTerm, register_rule
from engine.dp.rules.linear import OuterSums, OuterTerm


def _pads(layer: nn.Module) -> list[int]:
    """The layer's padding as ``F.pad`` takes it (last dim first, left then right)."""
    pads: list[int] = []
    for i in reversed(range(len(layer.kernel_size))):
        if layer.padding == "same":  # torch puts the odd one on the right
            total = layer.dilation[i] * (layer.kernel_size[i] - 1)
            pads += [total // 2, total - total // 2]
        elif layer.padding == "valid":
            pads += [0, 0]
        else:
            pads += [layer.padding[i]] * 2
    return pads


class Chooser:
    """The faster of the two ways (``"unfold"``, ``"grouped"``) per layer shape,
    timed on the first batch of at least :attr:`MIN_ROWS` rows (smaller
    batches take ``"unfold"`` untimed: they are cheap, and unrepresentative).

    ``forced`` (a class attribute) makes every layer take one way: for tests,
    which check both.
    """

    forced: str | None = None
    MIN_ROWS = 8
    #: layer shape -> the way chosen on this machine (one process, one run)
    chosen: dict[tuple, str] = {}

    @classmethod
    def term(cls, layer: nn.Module, a: torch.Tensor, b: torch.Tensor) -> LayerTerm:
        ways = {"unfold": _unfold_term, "grouped": _grouped_term}
        if cls.forced is not None:
            return ways[cls.forced](layer, a, b)
        if a.shape[0] < cls.MIN_ROWS:
            return _unfold_term(layer, a, b)
        key = (layer.weight.shape, layer.stride, layer.dilation, str(layer.padding),
               layer.padding_mode, layer.groups, layer.bias is not None,
               tuple(a.shape[1:]), a.device.type, a.dtype)
        way = cls.chosen.get(key)
        if way is not None:
            return ways[way](layer, a, b)
        timed = {name: _timed(way, layer, a, b) for name, way in ways.items()}
        cls.chosen[key] = min(timed, key=lambda name: timed[name][0])
        return timed[cls.chosen[key]][1]


def _timed(way, layer: nn.Module, a: torch.Tensor, b: torch.Tensor) -> tuple[float, LayerTerm]:
    """The fastest of three runs of ``way`` with its clipped sum (the first run
    pays one-time set-up), and a term."""
    best, term = float("inf"), None
    factors = a.new_ones(a.shape[0])
    for _ in range(3):
        if a.is_cuda:
            torch.cuda.synchronize(a.device)
        start = time.perf_counter()
        term = way(layer, a, b)
        term.clipped_sum(factors)
        if a.is_cuda:
            torch.cuda.synchronize(a.device)
        best = min(best, time.perf_counter() - start)
    return best, term


@register_rule(nn.Conv1d, nn.Conv2d)
def conv_rule(layer: nn.Module, a: torch.Tensor, b: torch.Tensor) -> LayerTerm:
    """Batched inputs ``[k, C, L]`` / ``[k, C, H, W]`` (unbatched: the fallback)."""
    if a.dim() != len(layer.kernel_size) + 2:
        return FuncRule(layer, a, b)
    return Chooser.term(layer, a, b)


def _padded(layer: nn.Module, a: torch.Tensor) -> torch.Tensor:
    """The input as the layer convolves it: padded by its padding and mode."""
    pads = _pads(layer)
    if any(pads):
        mode = "constant" if layer.padding_mode == "zeros" else layer.padding_mode
        a = F.pad(a, pads, mode=mode)
    return a


def _bias_rows(layer: nn.Module, b: torch.Tensor) -> torch.Tensor | None:
    """Per-example bias gradients ``[k, out]`` (None without a bias)."""
    if layer.bias is None:
        return None
    return b.flatten(2).sum(2)


def _unfold_term(layer: nn.Module, a: torch.Tensor, b: torch.Tensor) -> LayerTerm:
    """Unfolded patches, then ghost norms or materialised gradients by size."""
    dims = len(layer.kernel_size)
    a = _padded(layer, a)
    kernel, dilation, stride = layer.kernel_size, layer.dilation, layer.stride
    if dims == 1:
        a = a.unsqueeze(2)
        kernel, dilation, stride = (1, *kernel), (1, *dilation), (1, *stride)
    patches = F.unfold(a, kernel, dilation=dilation, stride=stride)  # [k, C kernel, P]
    k, groups, out = a.shape[0], layer.groups, layer.out_channels
    positions = patches.shape[-1]
    sums = OuterSums(patches.reshape(k, groups, patches.shape[1] // groups, positions),
                     b.reshape(k, groups, out // groups, positions))
    return OuterTerm(sums, layer.weight.shape, _bias_rows(layer, b))


def _grouped_term(layer: nn.Module, a: torch.Tensor, b: torch.Tensor) -> LayerTerm:
    """Materialised gradients from one grouped weight-gradient convolution."""
    k = a.shape[0]
    if k == 0:
        return _unfold_term(layer, a, b)
    dims = len(layer.kernel_size)
    if layer.padding_mode == "zeros" and not isinstance(layer.padding, str):
        padding = list(layer.padding)  # the kernel pads; no padded copy of the input
    else:
        a, padding = _padded(layer, a), [0] * dims
    out, groups = layer.out_channels, layer.groups
    weight_shape = (k * out, *layer.weight.shape[1:])
    grads = torch.ops.aten.convolution_backward(
        b.reshape(1, k * out, *b.shape[2:]), a.reshape(1, k * a.shape[1], *a.shape[2:]),
        a.new_empty(weight_shape), None, list(layer.stride), padding,
        list(layer.dilation), False, [0] * dims, k * groups, [False, True, False])[1]
    rows = {"weight": grads.reshape(k, *layer.weight.shape)}
    bias = _bias_rows(layer, b)
    if bias is not None:
        rows["bias"] = bias
    return GradsTerm(rows, k, a)
