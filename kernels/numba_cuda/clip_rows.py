"""``clip_rows`` on CUDA with Numba ``@cuda.jit``: norms, clip factors, row scaling.

Contract in :mod:`kernels` (same results as the CPU kernels, to float
rounding). Four kernels, the twins of ``kernels/cupy/clip_rows.cu``:

* ``fused_rows`` (one block per example row, up to
  :data:`~kernels.common.cuda_shapes.FUSED_LAYERS` layers): the row's squared
  norm over every layer, its clip factor, and its rows of every ``g_l``
  scaled, in one launch; ``clip_factors`` then recounts the clipped rows
  from the same norms. Two launches a step, where the three kernels below
  take ``2L + 1``; with more layers, those three:
* ``row_sq_norms`` (once per layer, one block per example row):
  ``sq[i] (+)= |a_i|^2 |g_i|^2``, a shared-memory tree reduction (no warp
  shuffles, so the CUDA simulator runs the very same code);
* ``clip_factors`` (one block over all rows): ``factors[i] = min(1, C/sqrt(sq[i]))``
  and the number of clipped rows, reduced in shared memory (no atomics);
* ``scale_rows`` (once per layer): ``g[i, :] *= factors[i]``.

Squared norms accumulate in the tensors' precision (float32 in training,
like the generic torch kernel); the CPU Numba kernel uses float64, so the
two agree to float32 rounding. Returning the count reads one integer back
from the device (it synchronizes torch's current stream); writing it into a
given ``count`` tensor does not (a CUDA graph can hold the call).
"""
from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Sequence

import numba
import numpy as np
import torch
from numba import cuda

from kernels.common.cuda_shapes import (FUSED_LAYERS, MAX_THREADS, check_count, grid_2d,
                                        leading, numpy_dtype, pow2_at_least, scratch)
from kernels.numba_cuda.launch import array, stream
from kernels.registry import register


def _build(ft):
    """The three kernels for element type ``ft`` (every literal typed: no float64
    creeps into float32 kernels; the PTX test checks it)."""
    zero, one = ft(0), ft(1)

    @cuda.jit
    def fused_rows(a0, g0, a1, g1, a2, g2, a3, g3, layers, max_norm, sq, factors):
        # no device functions: numba-cuda types a call to one through the current
        # CUDA context, which an ahead-of-time PTX compile without a GPU lacks
        i = cuda.blockIdx.x
        t = cuda.threadIdx.x
        n = cuda.blockDim.x
        sa_s = cuda.shared.array(MAX_THREADS, ft)
        sg_s = cuda.shared.array(MAX_THREADS, ft)
        factor_s = cuda.shared.array(1, ft)
        s = zero
        for layer in range(layers):
            a, g = a0, g0
            if layer == 1:
                a, g = a1, g1
            elif layer == 2:
                a, g = a2, g2
            elif layer == 3:
                a, g = a3, g3
            sa = zero
            sg = zero
            for j in range(t, a.shape[1], n):
                v = a[i, j]
                sa += v * v
            for j in range(t, g.shape[1], n):
                v = g[i, j]
                sg += v * v
            cuda.syncthreads()  # thread 0 has read the previous layer's sums
            sa_s[t] = sa
            sg_s[t] = sg
            cuda.syncthreads()
            step = n // 2
            while step > 0:
                if t < step:
                    sa_s[t] += sa_s[t + step]
                    sg_s[t] += sg_s[t + step]
                cuda.syncthreads()
                step //= 2
            if layer == 0:
                s = sa_s[0] * sg_s[0]
            else:
                s += sa_s[0] * sg_s[0]
        if t == 0:
            norm = math.sqrt(s)
            f = one
            if norm > max_norm:
                f = max_norm / norm
            sq[i] = s
            factors[i] = f
            factor_s[0] = f
        cuda.syncthreads()
        f = factor_s[0]
        if f != one:
            for layer in range(layers):
                g = g0
                if layer == 1:
                    g = g1
                elif layer == 2:
                    g = g2
                elif layer == 3:
                    g = g3
                for j in range(t, g.shape[1], n):
                    g[i, j] *= f

    @cuda.jit
    def row_sq_norms(a, g, sq, accumulate):
        i = cuda.blockIdx.x
        t = cuda.threadIdx.x
        n = cuda.blockDim.x
        sa_s = cuda.shared.array(MAX_THREADS, ft)
        sg_s = cuda.shared.array(MAX_THREADS, ft)
        sa = zero
        sg = zero
        for j in range(t, a.shape[1], n):
            v = a[i, j]
            sa += v * v
        for j in range(t, g.shape[1], n):
            v = g[i, j]
            sg += v * v
        sa_s[t] = sa
        sg_s[t] = sg
        cuda.syncthreads()
        step = n // 2
        while step > 0:
            if t < step:
                sa_s[t] += sa_s[t + step]
                sg_s[t] += sg_s[t + step]
            cuda.syncthreads()
            step //= 2
        if t == 0:
            p = sa_s[0] * sg_s[0]
            if accumulate:
                sq[i] += p
            else:
                sq[i] = p

    @cuda.jit
    def clip_factors(sq, max_norm, factors, count):
        t = cuda.threadIdx.x
        n = cuda.blockDim.x
        counts = cuda.shared.array(MAX_THREADS, numba.int32)
        clipped = 0
        for i in range(t, sq.shape[0], n):
            norm = math.sqrt(sq[i])
            if norm > max_norm:
                factors[i] = max_norm / norm
                clipped += 1
            else:
                factors[i] = one
        counts[t] = clipped
        cuda.syncthreads()
        step = n // 2
        while step > 0:
            if t < step:
                counts[t] += counts[t + step]
            cuda.syncthreads()
            step //= 2
        if t == 0:
            count[0] = counts[0]

    @cuda.jit
    def scale_rows(g, factors):
        j, i0 = cuda.grid(2)
        if j < g.shape[1]:
            for i in range(i0, g.shape[0], cuda.gridDim.y * cuda.blockDim.y):
                g[i, j] *= factors[i]

    return SimpleNamespace(fused_rows=fused_rows, row_sq_norms=row_sq_norms,
                           clip_factors=clip_factors, scale_rows=scale_rows)


KERNELS = {np.dtype(np.float32): _build(numba.float32),
           np.dtype(np.float64): _build(numba.float64)}


def signatures(dtype) -> dict[str, tuple]:
    """Argument types of every kernel for ``dtype`` (for ahead-of-time PTX checks)."""
    ft = numba.from_dtype(np.dtype(dtype))
    rows, vec = ft[:, :], ft[:]
    return {"fused_rows": (rows,) * (2 * FUSED_LAYERS) + (numba.int32, ft, vec, vec),
            "row_sq_norms": (rows, rows, vec, numba.boolean),
            "clip_factors": (vec, ft, vec, numba.int32[:]),
            "scale_rows": (rows, vec)}


@register("clip_rows", backend="numba_cuda")
def clip_rows(acts: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], max_norm: float,
              factors: torch.Tensor, count: torch.Tensor | None = None) -> int | None:
    """Book-keeping per-example clipping (contract in :mod:`kernels`)."""
    k = grads[0].shape[0] if grads else 0
    if k == 0:
        if count is not None:
            count.zero_()
        return 0 if count is None else None
    dtype = numpy_dtype(grads[0])
    kernels, s = KERNELS[dtype], stream(grads[0])
    sq = array(scratch(grads[0], k, grads[0].dtype, "sq"))
    out = scratch(grads[0], 1, torch.int32, "count") if count is None \
        else check_count(count, grads[0])
    f = array(factors[:k])
    for a, g in zip(acts, grads):
        leading(a, "acts")
        leading(g, "grads")
    if len(grads) <= FUSED_LAYERS:
        layers = [(array(a), array(g)) for a, g in zip(acts, grads)]
        # unused slots: a one-element array, never read (not a layer passed twice,
        # which the simulator would copy back twice)
        unused = array(scratch(grads[0], 1, grads[0].dtype, "unused").view(1, 1))
        slots = layers + [(unused, unused)] * (FUSED_LAYERS - len(layers))
        threads = pow2_at_least(max(max(a.shape[1], g.shape[1]) for a, g in zip(acts, grads)))
        kernels.fused_rows[k, threads, s](*(x for pair in slots for x in pair),
                                          np.int32(len(layers)), dtype.type(max_norm), sq, f)
    else:
        for layer, (a, g) in enumerate(zip(acts, grads)):
            threads = pow2_at_least(max(a.shape[1], g.shape[1]))
            kernels.row_sq_norms[k, threads, s](array(a), array(g), sq, layer > 0)
    kernels.clip_factors[1, pow2_at_least(k), s](sq, dtype.type(max_norm), f, array(out))
    if len(grads) > FUSED_LAYERS:
        for g in grads:
            grid, block = grid_2d(k, g.shape[1])
            kernels.scale_rows[grid, block, s](array(g), f)
    return None if count is not None else int(out.item())
