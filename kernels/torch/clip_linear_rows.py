"""``clip_linear_rows`` with torch ops: the generic kernel for any device."""
from __future__ import annotations

from typing import Sequence

import torch

from kernels.registry import register


@register("clip_linear_rows", backend="torch")
def clip_linear_rows(acts: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                     bias: Sequence[bool], extra: torch.Tensor | None, max_norm: float,
                     factors: torch.Tensor, count: torch.Tensor | None = None) -> int | None:
    """Book-keeping clipping of the generic path's Linear layers (contract in :mod:`kernels`)."""
    k = factors.shape[0]
    if k == 0:
        if count is not None:
            count.zero_()
        return 0 if count is None else None
    sq = (torch.zeros(k, dtype=factors.dtype, device=factors.device) if extra is None
          else extra.detach().to(factors.dtype).clone())
    for a, g, has_bias in zip(acts, grads, bias):
        sa = a.square().sum(1)
        sq.addcmul_(sa + 1 if has_bias else sa, g.square().sum(1))
    norms = sq.sqrt_()
    # min(1, C / n) written as C / max(n, C): exact, and 1 for a zero gradient.
    factors.copy_(torch.clamp_min(norms, max_norm).reciprocal_().mul_(max_norm))
    for g in grads:
        g.mul_(factors[:, None].to(g.dtype))
    if count is not None:  # on the device: nothing read back
        count.copy_((norms > max_norm).sum(dtype=count.dtype))
        return None
    return int((norms > max_norm).sum())
