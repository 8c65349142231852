"""``nn.Linear``: the book-keeping / ghost-norm rule, and the outer-product
sums that convolutions share.

Goodfellow 2015, "Efficient per-example gradient computations"; Li et al.
2022, "Large language models can be strong differentially private learners";
Bu et al. 2023, "Differentially private optimization on large model at small
cost". On a ``[k, d]`` input, example i's weight gradient is the outer
product ``b_i a_i^T``, so its squared norm is ``|a_i|^2 |b_i|^2`` (plus
``|b_i|^2`` for the bias), and the clipped sum is the single GEMM
``(c * b)^T a``. No per-example gradient is ever formed. A group's summed
gradient has the squared norm ``sum_{i,j} (a_i . a_j)(b_i . b_j)`` (plus
``sum_{i,j} b_i . b_j`` for the bias), from the Gram products of its rows.

On a ``[k, T, d]`` input (a sequence; any dims between the first and the
last are positions), example i's weight gradient is a sum of outer products
over its positions, ``g_i = sum_t b_it a_it^T``, whose squared norm is the
ghost norm ``sum_{t,s} (a_it . a_is)(b_it . b_is)`` (Li et al. 2022): Gram
matrices ``[T, T]`` instead of ``g_i`` itself, chosen when ``T^2`` is below
the weight's size, else ``g_i`` is materialised (:class:`OuterSums`). The bias
gradient ``sum_t b_it`` is small and always materialised.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from engine.dp.rules import (FuncRule, LayerTerm, blocks, group_sq_norms_of, padded_index,
                             register_rule)


def _gram_sum(a: torch.Tensor, b: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``sum_{i,j in h} (a_i . a_j)(b_i . b_j)`` per group h."""
    pa, pb = blocks(a, index), blocks(b, index)
    return ((pa @ pa.transpose(1, 2)) * (pb @ pb.transpose(1, 2))).sum((1, 2))


class _LinearTerm:
    #: The clipper may clip this term's rows itself (``clip_linear_rows``,
    #: all book-keeping layers in one kernel) and then call
    #: :meth:`scaled_sum_into`; ``sq_norms`` is computed only when asked for.
    book_keeping = True

    def __init__(self, layer: nn.Linear, a: torch.Tensor, b: torch.Tensor):
        self.a, self.b, self.has_bias = a, b, layer.bias is not None

    @property
    def sq_norms(self) -> torch.Tensor:
        b_sq = self.b.square().sum(1)
        a_sq = self.a.square().sum(1)
        return (a_sq + 1 if self.has_bias else a_sq) * b_sq

    def clipped_sum(self, factors: torch.Tensor) -> dict[str, torch.Tensor]:
        cb = self.b * factors[:, None]
        out = {"weight": cb.t() @ self.a}
        if self.has_bias:
            out["bias"] = cb.sum(0)
        return out

    def clipped_sum_into(self, factors: torch.Tensor, views: dict[str, torch.Tensor]) -> None:
        """:meth:`clipped_sum` written straight into ``views`` (one GEMM into the
        weight's slice of the flat buffer, no temporary); scales ``b`` in place,
        so the term is spent afterwards."""
        self.b.mul_(factors[:, None])
        self.scaled_sum_into(views)

    def scaled_sum_into(self, views: dict[str, torch.Tensor]) -> None:
        """The sum into ``views`` once ``b``'s rows carry their clip factors."""
        torch.mm(self.b.t(), self.a, out=views["weight"])
        if self.has_bias:
            torch.sum(self.b, 0, out=views["bias"])

    def group_sq_norms(self, groups: torch.Tensor) -> torch.Tensor:
        index, _ = padded_index(groups, self.a.shape[0])
        a = self.a
        if self.has_bias:  # the bias is a weight column on an input of ones
            a = torch.cat([a, a.new_ones(a.shape[0], 1)], 1)
        return _gram_sum(a, self.b, index)


class OuterSums:
    """Per-example gradients that are sums of outer products over positions.

    ``a`` ``[k, G, m, P]`` and ``b`` ``[k, G, n, P]``: example i's gradient is,
    for each of G independent blocks, ``g_ig = b_ig a_ig^T`` (``[n, m]``,
    summed over the P positions). Squared norms by the ghost norm
    ``sum_{p,q} (a_p . a_q)(b_p . b_q)`` when ``P^2 <= m n`` (Gram matrices
    smaller than the gradient), else from the materialised ``g_i``; both exact.
    """

    #: Force the ghost norm (True) or the materialised gradients (False); None
    #: chooses by size. For tests, which check both paths.
    ghost: bool | None = None

    def __init__(self, a: torch.Tensor, b: torch.Tensor):
        self.a, self.b = a, b
        self.k, self.G, self.m, self.P = a.shape
        self.n = b.shape[2]
        self.grads = None
        if self._use_ghost(self.P):
            self.sq_norms = _ghost(a, b).sum(1)
        else:
            self.grads = b @ a.transpose(-1, -2)
            self.sq_norms = self.grads.square().sum((1, 2, 3))

    def _use_ghost(self, positions: int) -> bool:
        forced = type(self).ghost
        return positions * positions <= self.m * self.n if forced is None else forced

    def weighted(self, factors: torch.Tensor) -> torch.Tensor:
        """``sum_i factors_i g_i``, ``[G, n, m]``."""
        if self.grads is not None:
            return torch.tensordot(factors, self.grads, dims=([0], [0]))
        cb = self.b * factors[:, None, None, None]
        # [G, n, k P] @ [G, k P, m]: one batched GEMM over the blocks
        left = cb.permute(1, 2, 0, 3).reshape(self.G, self.n, self.k * self.P)
        right = self.a.permute(1, 0, 3, 2).reshape(self.G, self.k * self.P, self.m)
        return left @ right

    def group_sq_norms(self, groups: torch.Tensor) -> torch.Tensor:
        """A group's summed gradient is one example whose positions are all its
        rows' positions: the ghost norm over ``S P`` positions (S the largest
        group), or the materialised gradients summed per group."""
        index, _ = padded_index(groups, self.k)
        width = index.shape[1] * self.P
        if self.grads is None and self._use_ghost(width):
            H = index.shape[0]

            def gather(x: torch.Tensor) -> torch.Tensor:  # [H, G, rows, S P]
                x = blocks(x, index)  # [H, S, G, rows, P]
                return x.permute(0, 2, 3, 1, 4).reshape(H, self.G, x.shape[3], width)

            return _ghost(gather(self.a), gather(self.b)).sum(1)
        if self.grads is None:
            self.grads = self.b @ self.a.transpose(-1, -2)
        return group_sq_norms_of([self.grads], groups)


def _ghost(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``sum_{p,q} (a_p . a_q)(b_p . b_q)`` over the last two dims: ``[..., rows, P]``."""
    gram_a = a.transpose(-1, -2) @ a
    gram_b = b.transpose(-1, -2) @ b
    return (gram_a * gram_b).sum((-2, -1))


class OuterTerm:
    """A layer whose weight gradient is :class:`OuterSums` (reshaped to the
    weight's shape) and whose optional bias gradient is ``[k, out]``."""

    def __init__(self, sums: OuterSums, weight_shape: torch.Size,
                 bias: torch.Tensor | None):
        self.sums, self.weight_shape, self.bias = sums, weight_shape, bias
        self.sq_norms = sums.sq_norms
        if bias is not None:
            self.sq_norms = self.sq_norms + bias.square().sum(1)

    def clipped_sum(self, factors: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {"weight": self.sums.weighted(factors).reshape(self.weight_shape)}
        if self.bias is not None:
            out["bias"] = factors @ self.bias
        return out

    def group_sq_norms(self, groups: torch.Tensor) -> torch.Tensor:
        sq = self.sums.group_sq_norms(groups)
        if self.bias is not None:
            sq = sq + group_sq_norms_of([self.bias], groups)
        return sq


@register_rule(nn.Linear)
def linear_rule(layer: nn.Module, a: torch.Tensor, b: torch.Tensor) -> LayerTerm:
    """Book-keeping on ``[k, d]`` inputs, ghost norm on ``[k, ..., d]``."""
    if a.dim() == 2:
        return _LinearTerm(layer, a, b)
    if a.dim() < 2:
        return FuncRule(layer, a, b)
    k, d_in, d_out = a.shape[0], a.shape[-1], b.shape[-1]
    positions = math.prod(a.shape[1:-1])
    a3 = a.reshape(k, positions, d_in)
    b3 = b.reshape(k, positions, d_out)
    sums = OuterSums(a3.transpose(1, 2).unsqueeze(1), b3.transpose(1, 2).unsqueeze(1))
    bias = b3.sum(1) if layer.bias is not None else None
    return OuterTerm(sums, layer.weight.shape, bias)
