"""``softmax_xent`` with torch ops: the generic kernel for any device."""
from __future__ import annotations

import torch

from kernels.registry import register


@register("softmax_xent", backend="torch")
def softmax_xent(logits: torch.Tensor, labels: torch.Tensor, grad: torch.Tensor) -> float:
    """Per-row cross-entropy: ``grad = softmax - onehot``; returns the summed loss."""
    if logits.shape[0] == 0:
        return 0.0
    logp = torch.log_softmax(logits, 1)
    loss = -logp.gather(1, labels[:, None]).sum()
    torch.exp(logp, out=grad)
    grad.scatter_add_(1, labels[:, None], torch.full_like(grad[:, :1], -1.0))
    return float(loss)
