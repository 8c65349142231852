"""``clip_groups`` with torch ops: the generic kernel for any device.

Groups are padded to the largest one and their Gram matrices formed with one
batched GEMM per layer: ``(A A^T) * (G G^T)`` summed over a group's block is
its squared gradient norm (contract in :mod:`kernels`); padding rows are
zero and add nothing.
"""
from __future__ import annotations

from typing import Sequence

import torch

from kernels.registry import register


@register("clip_groups", backend="torch")
def clip_groups(acts: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                groups: torch.Tensor, max_norm: float, factors: torch.Tensor) -> int:
    """Book-keeping per-group clipping (contract in :mod:`kernels`)."""
    k = grads[0].shape[0] if grads else 0
    if k == 0:
        return 0
    device = grads[0].device
    starts = torch.as_tensor(groups, dtype=torch.int64).to(device)
    sizes = starts[1:] - starts[:-1]
    n_groups, width = int(sizes.shape[0]), int(sizes.max())
    # index[h, s] = row s of group h, or k (a zero row) past the group's end
    slot = torch.arange(width, device=device)
    index = starts[:-1, None] + slot[None, :]
    index = torch.where(slot[None, :] < sizes[:, None], index, torch.full_like(index, k))
    sq = torch.zeros(n_groups, dtype=torch.float64, device=device)
    for a, g in zip(acts, grads):
        pa = torch.cat([a, a.new_zeros(1, a.shape[1])])[index]  # [H, S, d_in+1]
        pg = torch.cat([g, g.new_zeros(1, g.shape[1])])[index]  # [H, S, d_out]
        gram = (pa @ pa.transpose(1, 2)) * (pg @ pg.transpose(1, 2))
        sq += gram.sum((1, 2)).double()
    norms = sq.clamp_min_(0).sqrt_()
    # min(1, C / n) written as C / max(n, C): exact, and 1 for a zero gradient.
    per_group = (max_norm / torch.clamp_min(norms, max_norm)).to(grads[0].dtype)
    per_row = torch.repeat_interleave(per_group, sizes)
    factors[:k].copy_(per_row)
    for g in grads:
        g.mul_(per_row[:, None])
    return int(sizes[norms > max_norm].sum())
