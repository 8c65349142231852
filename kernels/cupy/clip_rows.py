"""``clip_rows`` on CUDA with CuPy: the kernels of ``clip_rows.cu`` beside it.

Contract in :mod:`kernels`; the algorithm (per-layer row norms,
one-block clip factors with the count of clipped rows, row scaling) and its
precision are those of the Numba twin, :mod:`kernels.numba_cuda.clip_rows`.
Launches go through :mod:`kernels.cupy.launch` (device pointers, torch's
current stream); returning the count synchronizes that stream, writing it
into a given ``count`` tensor does not (a CUDA graph can hold the call).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from kernels.common.cuda_shapes import check_count, grid_2d, leading, numpy_dtype, pow2_at_least, scratch
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
    norms = function("clip_rows", "clip_row_sq_norms", g0)
    for layer, (a, g) in enumerate(zip(acts, grads)):
        args = (pointer(a), np.int64(leading(a, "acts")), np.int64(a.shape[1]),
                pointer(g), np.int64(leading(g, "grads")), np.int64(g.shape[1]),
                pointer(sq), np.int32(layer > 0))
        launch(norms, g0, (k,), (pow2_at_least(max(a.shape[1], g.shape[1])),), args)
    f = factors[:k]
    launch(function("clip_rows", "clip_factors", g0), g0, (1,), (pow2_at_least(k),),
           (pointer(sq), np.int64(k), scalar(max_norm), pointer(f), pointer(out)))
    scale = function("clip_rows", "clip_scale_rows", g0)
    for g in grads:
        grid, block = grid_2d(k, g.shape[1])
        launch(scale, g0, grid, block, (pointer(g), np.int64(leading(g, "grads")), np.int64(k),
                                        np.int64(g.shape[1]), pointer(f)))
    return None if count is not None else int(out.item())
