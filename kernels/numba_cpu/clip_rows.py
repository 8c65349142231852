"""``clip_rows`` as one Numba CPU kernel: norms, clip factors and scaling fused.

One pass per example row over every layer's activations and output
gradients (contract in :mod:`kernels`), instead of about five torch
ops per layer. Each row's squared norm per layer is accumulated in the
arrays' dtype, in as many partial sums as the vector is wide (fastmath
lets LLVM reorder them), and the layers' products and the total in
float64: widening every float32 element to float64 first halved the
kernel's speed, and float32 partial sums of a row of a few hundred
squares are within float32 rounding of the float64 sum.

``bind_norms`` is the fused form of :mod:`kernels`: the engine's
``relu_backward`` and ``softmax_xent`` already read every row this kernel
would, and sum their squares as they go, so the kernel is left with the
first layer's inputs and the scaling.
"""
from __future__ import annotations

import math
from typing import Sequence

import numba
import numpy as np
import torch

from kernels.registry import register


@numba.njit(fastmath=True, inline="always")
def _row_sq(x, i):
    """``|x[i]|^2``, summed in x's dtype."""
    s = x.dtype.type(0.0)
    for j in range(x.shape[1]):
        s += x[i, j] * x[i, j]
    return s


@numba.njit(fastmath=True, inline="always")
def _clip_row(grads, i, sq, max_norm, factors):
    """Row i's factor ``min(1, max_norm / sqrt(sq))`` into ``factors[i]``, its
    rows of ``grads`` scaled by it; returns 1 if it was clipped, else 0."""
    norm = math.sqrt(sq)
    if norm <= max_norm:
        factors[i] = 1.0
        return 0
    c = max_norm / norm
    for layer in range(len(grads)):
        g = grads[layer]
        cg = g.dtype.type(c)
        for j in range(g.shape[1]):
            g[i, j] *= cg
    factors[i] = c
    return 1


@numba.njit(parallel=True, fastmath=True, cache=True)
def clip_rows_core(acts, grads, bias, extra, max_norm, factors):
    """The kernel of ``clip_rows`` and ``clip_linear_rows``: row i's squared
    norm is ``extra[i]`` (when ``extra`` is not empty) plus, per layer,
    ``(bias[layer] + |acts[i]|^2) |grads[i]|^2``; rows above ``max_norm``
    are scaled in place. ``clip_rows`` passes zero biases (its activations
    carry the column of ones) and no extra."""
    k = factors.shape[0]
    clipped = 0
    for i in numba.prange(k):
        sq = extra[i] if extra.shape[0] else 0.0
        for layer in range(len(acts)):
            sa = bias[layer] + np.float64(_row_sq(acts[layer], i))
            sq += sa * np.float64(_row_sq(grads[layer], i))
        clipped += _clip_row(grads, i, sq, max_norm, factors)
    return clipped


@numba.njit(parallel=True, fastmath=True, cache=True)
def clip_rows_from_norms(acts0, hidden_sq, grads_sq, grads, max_norm, factors):
    """``clip_rows`` with every squared row norm but the first layer's input's
    already summed (``bind_norms``): layer 0's is ``|acts0[i]|^2``, layer
    l >= 1's is ``(1 + hidden_sq[l][i]) grads_sq[l][i]`` (the 1: the ones
    column); ``hidden_sq[0]`` is not read."""
    k = factors.shape[0]
    clipped = 0
    for i in numba.prange(k):
        sq = np.float64(_row_sq(acts0, i)) * grads_sq[0][i]
        for layer in range(1, len(grads)):
            sq += (1.0 + hidden_sq[layer][i]) * grads_sq[layer][i]
        clipped += _clip_row(grads, i, sq, max_norm, factors)
    return clipped


#: :func:`clip_rows_core` without a parallel region: the same numbers (rows are
#: independent), without the cost of starting one, for a single thread.
clip_rows_core_serial = numba.njit(fastmath=True, cache=True)(clip_rows_core.py_func)
#: :func:`clip_rows_from_norms` without a parallel region, likewise.
clip_rows_from_norms_serial = numba.njit(fastmath=True, cache=True)(clip_rows_from_norms.py_func)

#: ``extra`` when there is none.
NO_EXTRA = np.zeros(0, dtype=np.float64)


@register("clip_rows", backend="numba_cpu")
def clip_rows(acts: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], max_norm: float,
              factors: torch.Tensor) -> int:
    """Book-keeping per-example clipping (contract in :mod:`kernels`)."""
    return _bind(acts, grads, factors)(max_norm)


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


def _bind_norms(acts: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                factors: torch.Tensor, hidden_sq: Sequence[torch.Tensor],
                grads_sq: Sequence[torch.Tensor]):
    """The fused form (contract in :mod:`kernels`): ``clip_rows`` whose squared
    row norms of ``acts[l][:, :-1]`` (l >= 1) and ``grads[l]`` the kernels
    before it wrote into ``hidden_sq[l]`` and ``grads_sq[l]``; only
    ``acts[0]``'s are summed here."""
    k = grads[0].shape[0] if grads else 0
    if k == 0:
        return lambda max_norm: 0
    a0 = acts[0].numpy()
    g = tuple(t.numpy() for t in grads)
    hs = tuple(t.numpy() for t in hidden_sq)
    gs = tuple(t.numpy() for t in grads_sq)
    f = factors.numpy()[:k]
    core = clip_rows_from_norms if numba.get_num_threads() > 1 else clip_rows_from_norms_serial
    return lambda max_norm: int(core(a0, hs, gs, g, float(max_norm), f))


clip_rows.bind = _bind
clip_rows.bind_norms = _bind_norms
