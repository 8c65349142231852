"""``clip_linear_rows`` as one Numba CPU kernel: the generic path's Linear
layers' norms, clip factors and scaling fused (contract in :mod:`kernels`).

The per-layer rules of :mod:`engine.dp.rules` would spend about five torch
ops per Linear layer on norms and factors, each a dispatch that costs more
than its arithmetic at a batch of a few hundred rows; this is one pass per
row. Squared norms accumulate in float64.
"""
from __future__ import annotations

import math
from typing import Sequence

import numba
import numpy as np
import torch

from kernels.registry import register
from kernels.torch.clip_linear_rows import clip_linear_rows as _generic


@numba.njit(parallel=True, fastmath=True, cache=True)
def _clip_linear_rows(acts, grads, bias, extra, max_norm, factors):
    k = factors.shape[0]
    clipped = 0
    for i in numba.prange(k):
        sq = extra[i] if extra.shape[0] else 0.0
        for layer in range(len(acts)):
            a = acts[layer]
            g = grads[layer]
            sa = bias[layer]
            for j in range(a.shape[1]):
                sa += a[i, j] * a[i, j]
            sg = 0.0
            for j in range(g.shape[1]):
                sg += g[i, j] * g[i, j]
            sq += sa * sg
        norm = math.sqrt(sq)
        if norm > max_norm:
            c = max_norm / norm
            clipped += 1
            for layer in range(len(grads)):
                g = grads[layer]
                cg = g.dtype.type(c)
                for j in range(g.shape[1]):
                    g[i, j] *= cg
        else:
            c = 1.0
        factors[i] = c
    return clipped


_NO_EXTRA = np.zeros(0, dtype=np.float64)


@register("clip_linear_rows", backend="numba_cpu")
def clip_linear_rows(acts: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                     bias: Sequence[bool], extra: torch.Tensor | None, max_norm: float,
                     factors: torch.Tensor) -> int:
    """Book-keeping clipping of the generic path's Linear layers (contract in :mod:`kernels`)."""
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
    more = _NO_EXTRA if extra is None else extra.detach().double().numpy()
    return int(_clip_linear_rows(a, g, ones, more, float(max_norm), factors.numpy()))
