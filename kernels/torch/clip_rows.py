"""``clip_rows`` with torch ops: the generic kernel for any device."""
from __future__ import annotations

from typing import Sequence

import torch

from kernels.registry import register


@register("clip_rows", backend="torch")
def clip_rows(acts: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], max_norm: float,
              factors: torch.Tensor, count: torch.Tensor | None = None) -> int | None:
    """Book-keeping per-example clipping (contract in :mod:`kernels`)."""
    k = grads[0].shape[0] if grads else 0
    if k == 0:
        if count is not None:
            count.zero_()
        return 0 if count is None else None
    sq = torch.zeros(k, dtype=grads[0].dtype, device=grads[0].device)
    for a, g in zip(acts, grads):
        sq.addcmul_(a.square().sum(1), g.square().sum(1))
    norms = sq.sqrt_()
    # min(1, C / n) written as C / max(n, C): exact, and 1 for a zero gradient.
    c = torch.clamp_min(norms, max_norm).reciprocal_().mul_(max_norm)
    factors[:k].copy_(c)
    for g in grads:
        g.mul_(c[:, None])
    if count is not None:  # on the device: nothing read back
        count.copy_((norms > max_norm).sum(dtype=count.dtype))
        return None
    return int((norms > max_norm).sum())
