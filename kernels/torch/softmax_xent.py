"""``softmax_xent`` with torch ops: the generic kernel for any device."""
from __future__ import annotations

import torch

from kernels.registry import register


@register("softmax_xent", backend="torch")
def softmax_xent(logits: torch.Tensor, labels: torch.Tensor, grad: torch.Tensor,
                 losses: torch.Tensor | None = None) -> float | None:
    """Per-row cross-entropy: ``grad = softmax - onehot``; returns the summed loss
    (or, with ``losses``, writes the rows' losses there and returns None: on a
    GPU nothing is read back)."""
    k = logits.shape[0]
    if k == 0:
        return 0.0 if losses is None else None
    logp = torch.log_softmax(logits, 1)
    picked = logp.gather(1, labels[:, None])
    torch.exp(logp, out=grad)
    grad.scatter_add_(1, labels[:, None], torch.full_like(grad[:, :1], -1.0))
    if losses is not None:
        torch.neg(picked[:, 0], out=losses[:k])
        return None
    return float(-picked.sum())
