"""``clip_groups`` as one Numba CPU kernel: per-group norms from Gram products,
clip factors and scaling fused, one group per iteration of a parallel loop.

A group (a household) is a few consecutive rows; its squared gradient norm
is ``sum_l sum_{i,j} (a_i . a_j)(g_i . g_j)`` over its rows (contract in
:mod:`kernels`). The loop visits each unordered pair once (the diagonal is
``|a_i|^2 |g_i|^2``, as in ``clip_rows``) and accumulates in float64.
"""
from __future__ import annotations

import math
from typing import Sequence

import numba
import numpy as np
import torch

from kernels.registry import register
from kernels.shared_compiles import cached_njit


@numba.njit(fastmath=True, inline="always")
def _clip_group(acts, grads, lo, hi, max_norm, factors):
    """The group of rows ``lo`` to ``hi``: its factor on each of its rows, its
    rows scaled in place if above ``max_norm``; returns how many rows were."""
    sq = 0.0
    for layer in range(len(acts)):
        a = acts[layer]
        g = grads[layer]
        for i in range(lo, hi):
            for j in range(i, hi):
                sa = 0.0
                for c in range(a.shape[1]):
                    sa += a[i, c] * a[j, c]
                sg = 0.0
                for c in range(g.shape[1]):
                    sg += g[i, c] * g[j, c]
                sq += sa * sg if i == j else 2.0 * sa * sg
    norm = math.sqrt(max(sq, 0.0))
    c = 1.0
    clipped = 0
    if norm > max_norm:
        c = max_norm / norm
        clipped = hi - lo
        for layer in range(len(grads)):
            g = grads[layer]
            cg = g.dtype.type(c)
            for i in range(lo, hi):
                for col in range(g.shape[1]):
                    g[i, col] *= cg
    for i in range(lo, hi):
        factors[i] = c
    return clipped


@cached_njit(parallel=True, fastmath=True)
def _clip_groups(acts, grads, groups, max_norm, factors):
    n_groups = groups.shape[0] - 1
    clipped_rows = np.zeros(max(n_groups, 1), dtype=np.int64)
    for h in numba.prange(n_groups):
        clipped_rows[h] = _clip_group(acts, grads, groups[h], groups[h + 1], max_norm, factors)
    return clipped_rows.sum()


@cached_njit(fastmath=True)
def clip_groups_range(acts, grads, groups, first, stop, max_norm, factors):
    """:func:`_clip_groups` on groups ``first`` to ``stop`` only, on the calling
    thread (the fused step's threads each clip their own households); returns
    how many rows were scaled."""
    clipped = 0
    for h in range(first, stop):
        clipped += _clip_group(acts, grads, groups[h], groups[h + 1], max_norm, factors)
    return clipped


@register("clip_groups", backend="numba_cpu")
def clip_groups(acts: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                groups: torch.Tensor, max_norm: float, factors: torch.Tensor) -> int:
    """Book-keeping per-group clipping (contract in :mod:`kernels`)."""
    return _bind(acts, grads, factors)(groups=groups, max_norm=max_norm)


def _bind(acts: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], factors: torch.Tensor):
    """``clip_groups`` on these buffers: numpy views made once (``registry.bind``);
    the groups change every step and are passed per call."""
    k = grads[0].shape[0] if grads else 0
    if k == 0:
        return lambda groups, max_norm: 0
    a = tuple(t.numpy() for t in acts)
    g = tuple(t.numpy() for t in grads)
    f = factors.numpy()[:k]

    def call(groups, max_norm: float) -> int:
        return int(_clip_groups(a, g, group_starts(groups), float(max_norm), f))

    return call


def group_starts(groups) -> np.ndarray:
    """The groups' int64 ``[H+1]`` offsets (a tensor or array) as the kernel
    takes them: a numpy array, copied only if it is not int64 already."""
    starts = groups.numpy() if isinstance(groups, torch.Tensor) else np.asarray(groups)
    return starts.astype(np.int64, copy=False)


clip_groups.bind = _bind
