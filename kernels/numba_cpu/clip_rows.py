"""``clip_rows`` as one Numba CPU kernel: norms, clip factors and scaling fused.

One pass per example row over every layer's activations and output
gradients (contract in :mod:`kernels`), instead of about five torch
ops per layer. Each row's squared norm per layer is accumulated in the
arrays' dtype, in as many partial sums as the vector is wide (fastmath
lets LLVM reorder them), and the layers' products and the total in
float64: widening every float32 element to float64 first halved the
kernel's speed, and float32 partial sums of a row of a few hundred
squares are within float32 rounding of the float64 sum.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Sequence

import numba
import numpy as np

from kernels.numba_cpu import serial_twin
from kernels.registry import register
from kernels.shared_compiles import cached_njit

if TYPE_CHECKING:  # the vector-width measurement's child imports this module: no torch
    import torch


@numba.njit(fastmath=True, inline="always")
def _row_sq(x, i):
    """``|x[i]|^2``, summed in x's dtype."""
    s = x.dtype.type(0.0)
    for j in range(x.shape[1]):
        s += x[i, j] * x[i, j]
    return s


@numba.njit(fastmath=True, inline="always")
def _clip_row(acts, grads, bias, extra, i, max_norm, factors):
    """Row i of :func:`clip_rows_core`: its factor into ``factors[i]``, the row
    scaled in place if above ``max_norm``; returns 1 if it was, else 0."""
    sq = extra[i] if extra.shape[0] else 0.0
    for layer in range(len(acts)):
        sa = bias[layer] + np.float64(_row_sq(acts[layer], i))
        sq += sa * np.float64(_row_sq(grads[layer], i))
    norm = math.sqrt(sq)
    if norm > max_norm:
        c = max_norm / norm
        for layer in range(len(grads)):
            g = grads[layer]
            cg = g.dtype.type(c)
            for j in range(g.shape[1]):
                g[i, j] *= cg
        factors[i] = c
        return 1
    factors[i] = 1.0
    return 0


@cached_njit(parallel=True, fastmath=True)
def clip_rows_core(acts, grads, bias, extra, max_norm, factors):
    """The kernel of ``clip_rows`` and ``clip_linear_rows``: row i's squared
    norm is ``extra[i]`` (when ``extra`` is not empty) plus, per layer,
    ``(bias[layer] + |acts[i]|^2) |grads[i]|^2``; rows above ``max_norm``
    are scaled in place. ``clip_rows`` passes zero biases (its activations
    carry the column of ones) and no extra."""
    k = factors.shape[0]
    clipped = 0
    for i in numba.prange(k):
        clipped += _clip_row(acts, grads, bias, extra, i, max_norm, factors)
    return clipped


@cached_njit(fastmath=True)
def clip_rows_range(acts, grads, bias, max_norm, factors, lo, hi):
    """:func:`clip_rows_core` (no extra) on rows ``lo`` to ``hi`` only, on the
    calling thread: the fused step's threads each clip their own rows."""
    clipped = 0
    for i in range(lo, hi):
        clipped += _clip_row(acts, grads, bias, NO_EXTRA, i, max_norm, factors)
    return clipped


#: :func:`clip_rows_core` without a parallel region: the same numbers (rows are
#: independent), without the cost of starting one, for a single thread.
clip_rows_core_serial = serial_twin(clip_rows_core, fastmath=True)

#: ``extra`` when there is none.
NO_EXTRA = np.zeros(0, dtype=np.float64)


@register("clip_rows", backend="numba_cpu")
def clip_rows(acts: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], max_norm: float,
              factors: torch.Tensor, count: torch.Tensor | None = None) -> int | None:
    """Book-keeping per-example clipping (contract in :mod:`kernels`)."""
    n = _bind(acts, grads, factors)(max_norm)
    if count is None:
        return n
    count.fill_(n)
    return None


def _bind(acts: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], factors: torch.Tensor):
    """``clip_rows`` on these buffers: numpy views made, and the serial or
    parallel kernel chosen by Numba's thread count, once (``registry.bind``)."""
    k = grads[0].shape[0] if grads else 0
    if k == 0:
        return lambda max_norm: 0
    a = tuple(t.numpy() for t in acts)
    g = tuple(t.numpy() for t in grads)
    f = factors.numpy()[:k]
    no_bias = np.zeros(len(g), dtype=np.float64)
    core = clip_rows_core if numba.get_num_threads() > 1 else clip_rows_core_serial
    return lambda max_norm: int(core(a, g, no_bias, NO_EXTRA, float(max_norm), f))


clip_rows.bind = _bind
