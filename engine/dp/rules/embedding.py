"""``nn.Embedding``: per-example norms from the rows each example looks up.

Example i's weight gradient is zero except on the rows it looks up; row r is
``sum_{p: idx_ip = r} b_ip`` (positions at ``padding_idx`` contribute nothing,
as in torch). So ``|g_i|^2 = sum_{p,q: idx_ip = idx_iq} b_ip . b_iq``, computed
without the ``L x L`` equality mask: the ``b_ip`` are summed per distinct
(example, row) pair (one ``index_add`` over the pairs' keys ``i V + r``) and
the pairs' squared norms added per example. Work and memory ``k L d``; no
per-example ``[V, d]`` gradient is formed. When no example looks a row up
twice (one lookup each, or distinct rows: a sort of each example's ``L``
indices tells), there is nothing to sum and ``|g_i|^2 = sum_p |b_ip|^2``,
the common case of one table holding several features' categories. Up to
:data:`PAIRWISE_POSITIONS` lookups per example the norm compares every pair
of positions instead (``k L^2 d``, one batched product): the same number
without the unique or the check's read-back, so a CUDA graph can hold it.
The clipped sum is one
``index_add`` of ``c_i b_ip`` into row ``idx_ip``; a group's norm is the same
sum with the group in place of the example.

An embedding with ``max_norm`` (renormalises looked-up rows in place) or
``scale_grad_by_freq`` (divides by counts over the batch) is refused
(:func:`engine.dp.rules.refusal`).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from engine.dp.rules import LayerTerm, group_owner, refusal, register_rule

#: Lookups per example up to which the squared norms compare every pair of an
#: example's positions (L^2 small products, no sort or unique).
PAIRWISE_POSITIONS = 64


class _EmbeddingTerm:
    def __init__(self, layer: nn.Embedding, a: torch.Tensor, b: torch.Tensor):
        self.k = a.shape[0]
        self.positions = math.prod(a.shape[1:])  # L lookups per example
        self.rows, dim = layer.num_embeddings, layer.embedding_dim
        self.index = a.reshape(self.k * self.positions).to(torch.int64)
        self.b = b.reshape(self.k * self.positions, dim)
        if layer.padding_idx is not None:  # torch gives the padding row no gradient
            self.b = self.b * (self.index != layer.padding_idx).to(b.dtype)[:, None]

    @property
    def sq_norms(self) -> torch.Tensor:
        """``[k]`` per-example squared norms (computed when asked: the household
        unit needs only :meth:`group_sq_norms`)."""
        if self.positions <= 1:
            return self.b.square().sum(1).view(self.k, self.positions).sum(1)
        if self.positions <= PAIRWISE_POSITIONS:
            return self._pairwise_sq()
        if self._rows_distinct():
            return self.b.square().sum(1).view(self.k, self.positions).sum(1)
        return self._pair_sq(torch.arange(self.k, device=self.b.device), self.k)

    def _pairwise_sq(self) -> torch.Tensor:
        """``[k]``: ``sum_{p,q: idx_ip = idx_iq} b_ip . b_iq``, every pair of an
        example's positions compared (L^2 of them): no data-dependent shape and
        no value read back, so a CUDA graph can hold it."""
        L = self.positions
        index = self.index.view(self.k, L)
        b = self.b.view(self.k, L, self.b.shape[1])
        same = (index[:, :, None] == index[:, None, :]).to(b.dtype)
        return (same * torch.bmm(b, b.transpose(1, 2))).sum((1, 2))

    def _rows_distinct(self) -> bool:
        """Whether every example looks up ``positions`` different rows."""
        ordered = self.index.view(self.k, self.positions).sort(dim=1).values
        return not bool((ordered[:, 1:] == ordered[:, :-1]).any())

    def _pair_sq(self, owner: torch.Tensor, n_owners: int) -> torch.Tensor:
        """``[n_owners]``: per owner (example or group), the squared norm of its
        summed row gradients; ``owner`` ``[k]``, each example's owner."""
        key = owner.repeat_interleave(self.positions) * self.rows + self.index
        pairs, pair_of = torch.unique(key, return_inverse=True)
        sums = self.b.new_zeros(pairs.shape[0], self.b.shape[1]).index_add_(0, pair_of, self.b)
        return self.b.new_zeros(n_owners).index_add_(0, pairs // self.rows,
                                                     sums.square().sum(1))

    def clipped_sum(self, factors: torch.Tensor) -> dict[str, torch.Tensor]:
        weighted = (self.b.view(self.k, self.positions, self.b.shape[1])
                    * factors[:, None, None]).view(self.b.shape)
        grad = self.b.new_zeros(self.rows, self.b.shape[1]).index_add_(0, self.index, weighted)
        return {"weight": grad}

    def group_sq_norms(self, groups: torch.Tensor) -> torch.Tensor:
        return self._pair_sq(group_owner(groups), groups.shape[0] - 1)


@register_rule(nn.Embedding)
def embedding_rule(layer: nn.Module, a: torch.Tensor, b: torch.Tensor) -> LayerTerm:
    """Row sums per (example, row): any index shape ``[k, ...]``."""
    reason = refusal(layer)
    if reason is not None:
        raise ValueError(f"{type(layer).__name__} {reason}")
    return _EmbeddingTerm(layer, a, b)
