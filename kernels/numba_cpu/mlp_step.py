"""``mlp_step`` as one Numba CPU call: an MLP's whole clipped gradient sum.

:mod:`engine.nn.fast_mlp` composes a step from the ops (GEMMs, ``softmax_xent``,
``relu_backward``, ``clip_rows``), about fifteen calls from Python, each with
its dispatch. This kernel makes the same calls from compiled code: the
GEMMs through the BLAS routine torch calls (:mod:`kernels.numba_cpu.blas`),
the element-wise work through the other Numba kernels' own functions. Two
differences in how, none in what: each hidden layer's GEMM writes straight
into the next layer's activation buffer (its rows' stride skips the column
of ones), where ``torch.mm`` needs a buffer of its own, and the ReLU is
applied there in place. The results are the composed step's, bit for bit
(tested).

Contract (an op of the fused kind, :func:`kernels.registry.fused`):

``mlp_step.bind(acts, grads, weights, grad_out, logits, labels, factors)``
    returns ``step(max_norm, groups=None) -> (loss, clipped)``, or None when
    it cannot serve these buffers (no BLAS to call for their dtype, not all
    on the CPU) or ``MPIDP_NO_FUSED_STEP`` is set: the engine then composes
    the ops. ``acts[l]`` is layer
    l's input with its trailing column of ones (k x (d_l + 1); ``acts[0]``
    holds the batch, the others are written), ``weights[l]`` its ``[W | b]``
    (d_{l+1} x (d_l + 1)), ``grads[l]`` (k x d_{l+1}) and ``logits`` (k x
    classes) are written, ``grad_out[l]`` receives ``grads[l]^T acts[l]``.
    ``max_norm=None`` gives the plain sum; with ``groups`` (int64 ``[H+1]``
    offsets) each group is clipped as one (``clip_groups``), else each row
    (``clip_rows``). Returns the summed cross-entropy and the number of rows
    scaled down.
"""
from __future__ import annotations

import os
from typing import Sequence

import numba
import numpy as np
import torch

from kernels.numba_cpu.blas import gemm, gemm_address
from kernels.numba_cpu.clip_groups import _clip_groups, group_starts
from kernels.numba_cpu.clip_rows import NO_EXTRA, clip_rows_core, clip_rows_core_serial
from kernels.numba_cpu.relu_backward import _relu_backward
from kernels.numba_cpu.softmax_xent import _softmax_xent
from kernels.registry import register_fused

#: Set (to anything but empty) to compose the ops instead, e.g. to compare.
SWITCH = "MPIDP_NO_FUSED_STEP"
#: Clipping modes of the kernel.
NONE, ROWS, GROUPS = 0, 1, 2
_NO_GROUPS = np.zeros(1, dtype=np.int64)
_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}


@numba.njit(inline="always")
def _relu_in_place(h, k, width):
    """``h[:k, :width] = max(h, 0)`` as ``torch.clamp_min(z, 0)`` gives it: NaN
    stays NaN, -0.0 becomes 0.0 (no fast-math: it would drop the NaN test)."""
    for i in range(k):
        for j in range(width):
            v = h[i, j]
            h[i, j] = v if (v > 0.0 or v != v) else 0.0


@numba.njit(cache=True)
def _mlp_step(fn, acts, grads, weights, grad_out, logits, labels, factors, mode, max_norm,
              groups, parallel, scratch, scalars, no_bias):
    k = acts[0].shape[0]
    last = len(weights) - 1
    for i in range(last + 1):
        a, w = acts[i], weights[i]
        d_out, d_in1 = w.shape[0], w.shape[1]
        if i < last:
            h = acts[i + 1]  # its first d_out columns; the ones column stays
            gemm(fn, scratch, scalars, False, True, k, d_out, d_in1, a, d_in1, w, d_in1,
                 0.0, h, d_out + 1)
            _relu_in_place(h, k, d_out)
        else:
            gemm(fn, scratch, scalars, False, True, k, d_out, d_in1, a, d_in1, w, d_in1,
                 0.0, logits, d_out)
    loss = _softmax_xent(logits, labels, grads[last])
    for i in range(last, 0, -1):
        w = weights[i]
        d_out, d_in = w.shape[0], w.shape[1] - 1
        gemm(fn, scratch, scalars, False, False, k, d_in, d_out, grads[i], d_out, w, d_in + 1,
             0.0, grads[i - 1], d_in)
        _relu_backward(grads[i - 1], acts[i])
    clipped = 0
    if mode == GROUPS:
        clipped = _clip_groups(acts, grads, groups, max_norm, factors)
    elif mode == ROWS and parallel:
        clipped = clip_rows_core(acts, grads, no_bias, NO_EXTRA, max_norm, factors)
    elif mode == ROWS:
        clipped = clip_rows_core_serial(acts, grads, no_bias, NO_EXTRA, max_norm, factors)
    for i in range(last + 1):
        out = grad_out[i]
        d_out, d_in1 = out.shape[0], out.shape[1]
        gemm(fn, scratch, scalars, True, False, d_out, d_in1, k, grads[i], d_out, acts[i],
             d_in1, 0.0, out, d_in1)
    return loss, clipped


def _contiguous(tensors: Sequence[torch.Tensor]) -> bool:
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)


@register_fused("mlp_step", backend="numba_cpu")
def mlp_step(acts: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
             weights: Sequence[torch.Tensor], grad_out: Sequence[torch.Tensor],
             logits: torch.Tensor, labels: torch.Tensor, factors: torch.Tensor,
             max_norm: float | None, groups: torch.Tensor | None = None) -> tuple[float, int]:
    """One fused step (contract in the module docstring); raises ValueError
    where :func:`bind` would give None."""
    step = _bind(acts, grads, weights, grad_out, logits, labels, factors)
    if step is None:
        raise ValueError("mlp_step cannot run on these tensors (no BLAS gemm for their "
                         "dtype, or not contiguous CPU tensors)")
    return step(max_norm, groups)


def _bind(acts, grads, weights, grad_out, logits, labels, factors):
    """The fused step on these buffers, or None (module docstring)."""
    dtype = _DTYPES.get(weights[0].dtype)
    fn = None if dtype is None or os.environ.get(SWITCH) else gemm_address(dtype)
    tensors = [*acts, *grads, *weights, *grad_out, logits, labels, factors]
    k = acts[0].shape[0]
    if fn is None or k == 0 or not _contiguous(tensors) \
            or len({t.dtype for t in tensors if t is not labels}) != 1:
        return None
    a = tuple(t.numpy() for t in acts)
    g = tuple(t.numpy() for t in grads)
    w = tuple(t.numpy() for t in weights)
    o = tuple(t.numpy() for t in grad_out)
    z, y, f = logits.numpy(), labels.numpy(), factors.numpy()[:k]
    scratch = np.zeros(8, dtype=np.int32)
    scalars = np.zeros(2, dtype=a[0].dtype)
    no_bias = np.zeros(len(g), dtype=np.float64)
    parallel = numba.get_num_threads() > 1

    def step(max_norm: float | None, groups=None) -> tuple[float, int]:
        if max_norm is None:
            mode, bound, starts = NONE, 0.0, _NO_GROUPS
        elif groups is None:
            mode, bound, starts = ROWS, float(max_norm), _NO_GROUPS
        else:
            mode, bound, starts = GROUPS, float(max_norm), group_starts(groups)
        loss, clipped = _mlp_step(fn, a, g, w, o, z, y, f, mode, bound, starts, parallel,
                                  scratch, scalars, no_bias)
        return float(loss), int(clipped)

    return step


mlp_step.bind = _bind
