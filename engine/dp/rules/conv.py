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
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from engine.dp.rules import FuncRule, LayerTerm, register_rule
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


@register_rule(nn.Conv1d, nn.Conv2d)
def conv_rule(layer: nn.Module, a: torch.Tensor, b: torch.Tensor) -> LayerTerm:
    """Batched inputs ``[k, C, L]`` / ``[k, C, H, W]`` (unbatched: the fallback)."""
    dims = len(layer.kernel_size)
    if a.dim() != dims + 2:
        return FuncRule(layer, a, b)
    pads = _pads(layer)
    if any(pads):
        mode = "constant" if layer.padding_mode == "zeros" else layer.padding_mode
        a = F.pad(a, pads, mode=mode)
    kernel, dilation, stride = layer.kernel_size, layer.dilation, layer.stride
    if dims == 1:
        a = a.unsqueeze(2)
        kernel, dilation, stride = (1, *kernel), (1, *dilation), (1, *stride)
    patches = F.unfold(a, kernel, dilation=dilation, stride=stride)  # [k, C kernel, P]
    k, groups, out = a.shape[0], layer.groups, layer.out_channels
    positions = patches.shape[-1]
    sums = OuterSums(patches.reshape(k, groups, patches.shape[1] // groups, positions),
                     b.reshape(k, groups, out // groups, positions))
    bias = b.reshape(k, out, positions).sum(2) if layer.bias is not None else None
    return OuterTerm(sums, layer.weight.shape, bias)
