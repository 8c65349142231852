"""``nn.Linear``: the book-keeping / ghost-norm rule.

Goodfellow 2015, "Efficient per-example gradient computations"; Li et al.
2022, "Large language models can be strong differentially private learners";
Bu et al. 2023, "Differentially private optimization on large model at small
cost". On a ``[k, d]`` input, example i's weight gradient is the outer
product ``b_i a_i^T``, so its squared norm is ``|a_i|^2 |b_i|^2`` (plus
``|b_i|^2`` for the bias), and the clipped sum is the single GEMM
``(c * b)^T a``. No per-example gradient is ever formed. A group's summed
gradient has the squared norm ``sum_{i,j} (a_i . a_j)(b_i . b_j)`` (plus
``sum_{i,j} b_i . b_j`` for the bias), from the Gram products of its rows.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.dp.rules import FuncRule, LayerTerm, blocks, padded_index, register_rule


def _gram_sum(a: torch.Tensor, b: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``sum_{i,j in h} (a_i . a_j)(b_i . b_j)`` per group h."""
    pa, pb = blocks(a, index), blocks(b, index)
    return ((pa @ pa.transpose(1, 2)) * (pb @ pb.transpose(1, 2))).sum((1, 2))


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
