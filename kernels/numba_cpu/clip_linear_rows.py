"""``clip_linear_rows`` as one Numba CPU kernel: the generic path's Linear
layers' norms, clip factors and scaling fused (contract in :mod:`kernels`).

The per-layer rules of :mod:`engine.dp.rules` would spend about five torch
ops per Linear layer on norms and factors, each a dispatch that costs more
than its arithmetic at a batch of a few hundred rows; this is one pass per
row (the kernel of :mod:`kernels.numba_cpu.clip_rows`, with each layer's bias
term and the other layers' norms). Squared norms accumulate in float64.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from kernels.numba_cpu.clip_rows import NO_EXTRA, clip_rows_core
from kernels.registry import register
from kernels.torch.clip_linear_rows import clip_linear_rows as _generic


@register("clip_linear_rows", backend="numba_cpu")
def clip_linear_rows(acts: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                     bias: Sequence[bool], extra: torch.Tensor | None, max_norm: float,
                     factors: torch.Tensor, count: torch.Tensor | None = None) -> int | None:
    """Book-keeping clipping of the generic path's Linear layers (contract in :mod:`kernels`)."""
    if count is not None:
        count.fill_(clip_linear_rows(acts, grads, bias, extra, max_norm, factors))
        return None
    k = factors.shape[0]
    if k == 0:
        return 0
    if not all(g.is_contiguous() for g in grads):  # scaled in place: no copies
        return _generic(acts, grads, bias, extra, max_norm, factors)
    # one layout for every array (Numba indexes a tuple by a run-time index
    # only when its items share one type): the inputs, only read, are made
    # contiguous where a view is not (the first layer's, often)
    a = tuple(x.detach().contiguous().numpy() for x in acts)
    g = tuple(x.detach().numpy() for x in grads)
    ones = np.asarray([1.0 if b else 0.0 for b in bias], dtype=np.float64)
    more = NO_EXTRA if extra is None else extra.detach().double().numpy()
    return int(clip_rows_core(a, g, ones, more, float(max_norm), factors.numpy()))
