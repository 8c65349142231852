"""Launch shapes and argument checks shared by the Numba CUDA and CuPy kernels.

Pure Python (imports nothing CUDA), so both back-ends launch the same grids
and the tests can check them without a GPU. Shapes adapt to the data
(powers of two up to :data:`MAX_THREADS`): tiny test shapes are tiny
simulations, and a 128-wide layer gets a 128-thread block.
"""
from __future__ import annotations

import numpy as np
import torch

#: Largest block of the row reductions (MPIDP_MAX_THREADS in kernels/cupy/*.cu,
#: the size of their shared arrays).
MAX_THREADS = 256
#: Most layers ``clip_rows`` clips in one fused launch (MPIDP_FUSED_LAYERS in
#: kernels/cupy/clip_rows.cu); more layers take one launch per layer and step.
FUSED_LAYERS = 4
#: CUDA's limit on the grid's y dimension; the 2-D kernels stride over rows beyond it.
MAX_GRID_Y = 65535

_SCRATCH: dict[tuple, torch.Tensor] = {}


def scratch(like: torch.Tensor, k: int, dtype: torch.dtype, name: str) -> torch.Tensor:
    """A reused buffer of ``k`` elements on ``like``'s device, kept per ``name``
    (grown, never shrunk), so the per-step kernels allocate nothing."""
    key = (name, like.device, dtype)
    buf = _SCRATCH.get(key)
    if buf is None or buf.shape[0] < k:
        buf = _SCRATCH[key] = torch.empty(max(k, 256), dtype=dtype, device=like.device)
    return buf[:k]


_DTYPES = {torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64)}


def numpy_dtype(t: torch.Tensor) -> np.dtype:
    """float32/float64 of a tensor as a numpy dtype; TypeError for anything else."""
    try:
        return _DTYPES[t.dtype]
    except KeyError:
        raise TypeError(f"the CUDA kernels take float32 or float64 tensors, not {t.dtype}") \
            from None


def pow2_at_least(n: int, cap: int = MAX_THREADS) -> int:
    """The smallest power of two >= n (at least 1), capped at ``cap``."""
    p = 1
    while p < n and p < cap:
        p *= 2
    return p


def grid_1d(n: int, cap: int = 128) -> tuple[int, int]:
    """(blocks, threads) for one thread per item."""
    threads = pow2_at_least(n, cap)
    return -(-n // threads), threads


def grid_2d(rows: int, cols: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(grid, block) of the element-wise kernels: x over columns, y over rows
    (grid-stride in y beyond :data:`MAX_GRID_Y` blocks)."""
    bx = pow2_at_least(cols, 32)
    by = pow2_at_least(rows, 8)
    return (-(-cols // bx), min(MAX_GRID_Y, -(-rows // by))), (bx, by)


def leading(t: torch.Tensor, name: str) -> int:
    """Elements between consecutive rows of a 2-D tensor with contiguous rows.

    Raises:
        ValueError: ``t`` is not 2-D or its rows are not contiguous.
    """
    if t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(f"{name}: the CUDA kernels need a 2-D tensor with contiguous rows, "
                         f"got shape {tuple(t.shape)} and strides {t.stride()}")
    return t.stride(0)


def check_flat(t: torch.Tensor, name: str) -> None:
    """Raise ValueError unless ``t`` is 1-D and contiguous."""
    if t.dim() != 1 or (t.shape[0] > 1 and t.stride(0) != 1):
        raise ValueError(f"{name}: the CUDA kernels need a contiguous 1-D tensor, got shape "
                         f"{tuple(t.shape)} and strides {t.stride()}")


#: Most blocks of a 1-D grid-stride launch (``sgd_update``); the kernel strides
#: over the elements beyond them.
MAX_BLOCKS_1D = 4096


def update_launch(params: torch.Tensor, velocity: torch.Tensor,
                  grad: torch.Tensor) -> tuple[int, int, int]:
    """``(n, blocks, threads)`` of an ``sgd_update`` launch on three flat buffers
    of one length ``n`` (blocks 0 when ``n`` is 0: nothing to launch).

    Raises:
        ValueError: a buffer is not contiguous 1-D, or the lengths differ.
    """
    for t, name in ((params, "params"), (velocity, "velocity"), (grad, "grad")):
        check_flat(t, name)
    n = params.shape[0]
    if velocity.shape[0] != n or grad.shape[0] != n:
        raise ValueError(f"sgd_update: params, velocity and grad differ in length "
                         f"({n}, {velocity.shape[0]}, {grad.shape[0]})")
    if n == 0:
        return 0, 0, 0
    blocks, threads = grid_1d(n, 256)
    return n, min(blocks, MAX_BLOCKS_1D), threads


def check_row_losses(losses: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """``losses[:k]`` for ``softmax_xent``'s per-row losses (k = logits' rows).

    Raises:
        ValueError: not a contiguous 1-D tensor of the logits' dtype and device
            with at least k elements.
    """
    k = logits.shape[0]
    if losses.dtype != logits.dtype or losses.device != logits.device \
            or losses.dim() != 1 or losses.shape[0] < k:
        raise ValueError(f"losses: need a 1-D {logits.dtype} tensor of at least {k} rows on "
                         f"{logits.device}, got {losses.dtype} {tuple(losses.shape)} on "
                         f"{losses.device}")
    check_flat(losses, "losses")
    return losses[:k]


def check_count(count: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``count``, the one-element int32 tensor a clipping kernel writes its count into.

    Raises:
        ValueError: not one int32 element on ``like``'s device.
    """
    if count.dtype != torch.int32 or count.numel() != 1 or count.device != like.device:
        raise ValueError(f"count: need one int32 element on {like.device}, got "
                         f"{count.dtype} {tuple(count.shape)} on {count.device}")
    return count.reshape(1)
