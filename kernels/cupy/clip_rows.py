"""``clip_rows`` on CUDA with CuPy: the kernels of ``clip_rows.cu`` beside it.

Contract in :mod:`kernels`; the algorithm and its precision are those of
the Numba twin, :mod:`kernels.numba_cuda.clip_rows`: up to
:data:`~kernels.common.cuda_shapes.FUSED_LAYERS` layers, one block per row
computes the row's norm over every layer, its factor and scales its rows
(``clip_fused_rows``), then one block recounts the clipped rows
(``clip_factors``): two launches a step. With more layers: per-layer row
norms, the one-block factors and count, per-layer row scaling.
Launches go through :mod:`kernels.cupy.launch` (device pointers, torch's
current stream); returning the count synchronizes that stream, writing it
into a given ``count`` tensor does not (a CUDA graph can hold the call).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from kernels.common.cuda_shapes import (FUSED_LAYERS, check_count, grid_2d, leading,
                                        numpy_dtype, pow2_at_least, scratch)
from kernels.cupy.launch import function, launch, pointer
from kernels.registry import register


@register("clip_rows", backend="cupy")
def clip_rows(acts: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], max_norm: float,
              factors: torch.Tensor, count: torch.Tensor | None = None) -> int | None:
    """Book-keeping per-example clipping (contract in :mod:`kernels`)."""
    k = grads[0].shape[0] if grads else 0
    if k == 0:
        if count is not None:
            count.zero_()
        return 0 if count is None else None
    g0 = grads[0]
    scalar = numpy_dtype(g0).type
    sq = scratch(g0, k, g0.dtype, "sq")
    out = scratch(g0, 1, torch.int32, "count") if count is None else check_count(count, g0)
    f = factors[:k]
    if len(grads) <= FUSED_LAYERS:
        _fused(acts, grads, max_norm, sq, f)
    else:
        _by_layer(acts, grads, sq)
    launch(function("clip_rows", "clip_factors", g0), g0, (1,), (pow2_at_least(k),),
           (pointer(sq), np.int64(k), scalar(max_norm), pointer(f), pointer(out)))
    if len(grads) > FUSED_LAYERS:
        scale = function("clip_rows", "clip_scale_rows", g0)
        for g in grads:
            grid, block = grid_2d(k, g.shape[1])
            launch(scale, g0, grid, block, (pointer(g), np.int64(leading(g, "grads")),
                                            np.int64(k), np.int64(g.shape[1]), pointer(f)))
    return None if count is not None else int(out.item())


def _layer_args(a: torch.Tensor, g: torch.Tensor) -> tuple:
    return (pointer(a), np.int64(leading(a, "acts")), np.int64(a.shape[1]),
            pointer(g), np.int64(leading(g, "grads")), np.int64(g.shape[1]))


def _fused(acts, grads, max_norm: float, sq: torch.Tensor, f: torch.Tensor) -> None:
    """Norms, factors and scaled rows of every layer in one launch (the unused
    layer slots point at a one-element buffer, never read)."""
    g0 = grads[0]
    layers = list(zip(acts, grads))
    unused = scratch(g0, 1, g0.dtype, "unused").view(1, 1)
    slots = layers + [(unused, unused)] * (FUSED_LAYERS - len(layers))
    args = sum((_layer_args(a, g) for a, g in slots), ())
    width = max(max(a.shape[1], g.shape[1]) for a, g in layers)
    launch(function("clip_rows", "clip_fused_rows", g0), g0, (g0.shape[0],),
           (pow2_at_least(width),),
           args + (np.int32(len(layers)), numpy_dtype(g0).type(max_norm), pointer(sq),
                   pointer(f)))


def _by_layer(acts, grads, sq: torch.Tensor) -> None:
    """Every row's squared norm, one launch per layer."""
    g0 = grads[0]
    norms = function("clip_rows", "clip_row_sq_norms", g0)
    for layer, (a, g) in enumerate(zip(acts, grads)):
        launch(norms, g0, (g0.shape[0],), (pow2_at_least(max(a.shape[1], g.shape[1])),),
               _layer_args(a, g) + (pointer(sq), np.int32(layer > 0)))
