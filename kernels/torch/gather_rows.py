"""``gather_rows`` with torch ops: the generic kernel for any device."""
from __future__ import annotations

import torch

from kernels.registry import register


@register("gather_rows", backend="torch")
def gather_rows(X: torch.Tensor, y: torch.Tensor, rows: torch.Tensor, out: torch.Tensor,
                out_labels: torch.Tensor) -> None:
    """``out = X[rows]``, ``out_labels = y[rows]`` (contract in :mod:`kernels`)."""
    width = out.shape[1]
    torch.index_select(X if width == X.shape[1] else X[:, :width], 0, rows, out=out)
    torch.index_select(y, 0, rows, out=out_labels)
