"""``mlp_step`` as one Numba CPU call: an MLP's whole clipped gradient sum.

:mod:`engine.dp.fast_mlp` composes a step from the ops (GEMMs, ``softmax_xent``,
``relu_backward``, ``clip_rows``), about fifteen calls from Python, each with
its dispatch. This kernel makes the same calls from compiled code: the
GEMMs through the BLAS routine torch calls (:mod:`kernels.numba_cpu.blas`),
the element-wise work through the other Numba kernels' own functions. Two
differences in how, none in what: each hidden layer's GEMM writes straight
into the next layer's activation buffer (its rows' stride skips the column
of ones), where ``torch.mm`` needs a buffer of its own, and the ReLU is
applied there in place. At one thread the results are the composed step's,
bit for bit (tested).

At several threads the batch's rows are cut into one contiguous part per
thread (whole households with ``groups``), and each thread runs the whole
step on its part: its rows' products with sequential BLAS calls (MKL's
per-thread setting, :func:`kernels.numba_cpu.blas.threads_address`, put
back after), its rows' clipping, its part's weight-gradient sums into a
buffer of its own; then the parts' sums are added, in part order, into
``grad_out``. Per-example work is independent by row, so the threads meet
once, at that addition, where the BLAS's own threading meets at each of the
step's eight small products and hands every activation from one core to the
other (figures: docs/design/rows-cut-over-the-threads.md). The sums
then differ from the composed
step's by the order of additions (float rounding; tested against it), are
the same from call to call at a given number of parts, and are the
composed step's again with ``MPIDP_NO_ROW_SPLIT`` set. Where torch's BLAS
has no per-thread setting, the batch is not cut.

Contract (an op of the fused kind, :func:`kernels.registry.fused`):

``mlp_step.bind(acts, grads, weights, grad_out, logits, labels, factors)``
    returns ``step(max_norm, groups=None) -> (loss, clipped)`` (its ``parts``:
    how many parts it cuts the rows into), or None when
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

from kernels.numba_cpu.blas import call_int, gemm, gemm_address, threads_address
from kernels.numba_cpu.clip_groups import _clip_groups, clip_groups_range, group_starts
from kernels.numba_cpu.clip_rows import (NO_EXTRA, clip_rows_core, clip_rows_core_serial,
                                         clip_rows_range)
from kernels.numba_cpu.relu_backward import _relu_backward
from kernels.numba_cpu.softmax_xent import _softmax_xent, check_labels
from kernels.registry import register_fused
from kernels.shared_compiles import cached_njit

#: Set (to anything but empty) to compose the ops instead, e.g. to compare.
SWITCH = "MPIDP_NO_FUSED_STEP"
#: Set (to anything but empty) to keep the batch whole at several threads (the
#: BLAS then threads each product), e.g. to compare.
SPLIT_SWITCH = "MPIDP_NO_ROW_SPLIT"
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


@cached_njit
def _forward_backward(fn, acts, grads, weights, logits, labels, scratch, scalars, lo, hi):
    """Rows ``lo`` to ``hi`` of the batch through the forward (each hidden
    layer's GEMM straight into the next activation buffer, its ReLU in place),
    the loss and the backward into ``grads``, on the calling thread; returns
    their summed cross-entropy."""
    k = hi - lo
    last = len(weights) - 1
    for i in range(last + 1):
        a, w = acts[i][lo:hi], weights[i]
        d_out, d_in1 = w.shape[0], w.shape[1]
        if i < last:
            h = acts[i + 1][lo:hi]  # its first d_out columns; the ones column stays
            gemm(fn, scratch, scalars, False, True, k, d_out, d_in1, a, d_in1, w, d_in1,
                 0.0, h, d_out + 1)
            _relu_in_place(h, k, d_out)
        else:
            gemm(fn, scratch, scalars, False, True, k, d_out, d_in1, a, d_in1, w, d_in1,
                 0.0, logits[lo:hi], d_out)
    loss = _softmax_xent(logits[lo:hi], labels[lo:hi], grads[last][lo:hi])
    for i in range(last, 0, -1):
        w = weights[i]
        d_out, d_in = w.shape[0], w.shape[1] - 1
        gemm(fn, scratch, scalars, False, False, k, d_in, d_out, grads[i][lo:hi], d_out, w,
             d_in + 1, 0.0, grads[i - 1][lo:hi], d_in)
        _relu_backward(grads[i - 1][lo:hi], acts[i][lo:hi])
    return loss


@numba.njit(inline="always")
def _weight_sums(fn, grads, acts, grad_out, k, scratch, scalars):
    """``grad_out[l] = grads[l]^T acts[l]`` over the batch's ``k`` rows."""
    for i in range(len(grad_out)):
        out = grad_out[i]
        d_out, d_in1 = out.shape[0], out.shape[1]
        gemm(fn, scratch, scalars, True, False, d_out, d_in1, k, grads[i], d_out, acts[i],
             d_in1, 0.0, out, d_in1)


# One entry point per clipping mode, not one taking the mode as an argument:
# each compiles and links only its own clipping, so a first run compiles
# less (docs/design/shared-compiles.md).

@cached_njit
def _mlp_step_plain(fn, acts, grads, weights, grad_out, logits, labels, scratch, scalars):
    """The whole step of the batch without clipping (mode NONE)."""
    k = acts[0].shape[0]
    loss = _forward_backward(fn, acts, grads, weights, logits, labels, scratch, scalars, 0, k)
    _weight_sums(fn, grads, acts, grad_out, k, scratch, scalars)
    return loss, 0


@cached_njit
def _mlp_step_rows(fn, acts, grads, weights, grad_out, logits, labels, factors, max_norm,
                   scratch, scalars, no_bias):
    """The whole step, each row clipped (mode ROWS) on the calling thread."""
    k = acts[0].shape[0]
    loss = _forward_backward(fn, acts, grads, weights, logits, labels, scratch, scalars, 0, k)
    clipped = clip_rows_core_serial(acts, grads, no_bias, NO_EXTRA, max_norm, factors)
    _weight_sums(fn, grads, acts, grad_out, k, scratch, scalars)
    return loss, clipped


@cached_njit
def _mlp_step_rows_parallel(fn, acts, grads, weights, grad_out, logits, labels, factors,
                            max_norm, scratch, scalars, no_bias):
    """:func:`_mlp_step_rows` with the clipping's rows in a parallel loop."""
    k = acts[0].shape[0]
    loss = _forward_backward(fn, acts, grads, weights, logits, labels, scratch, scalars, 0, k)
    clipped = clip_rows_core(acts, grads, no_bias, NO_EXTRA, max_norm, factors)
    _weight_sums(fn, grads, acts, grad_out, k, scratch, scalars)
    return loss, clipped


@cached_njit
def _mlp_step_groups(fn, acts, grads, weights, grad_out, logits, labels, factors, max_norm,
                     groups, scratch, scalars):
    """The whole step, each group of rows clipped as one (mode GROUPS)."""
    k = acts[0].shape[0]
    loss = _forward_backward(fn, acts, grads, weights, logits, labels, scratch, scalars, 0, k)
    clipped = _clip_groups(acts, grads, groups, max_norm, factors)
    _weight_sums(fn, grads, acts, grad_out, k, scratch, scalars)
    return loss, clipped


@cached_njit
def _rows_step(fn, acts, grads, weights, partial, offsets, logits, labels, factors, mode,
               max_norm, groups, first, stop, scratch, scalars, no_bias, lo, hi):
    """Rows ``lo`` to ``hi`` of the batch (groups ``first`` to ``stop`` with
    GROUPS) through the whole step, on the calling thread: forward, loss,
    backward and clipping in the shared buffers' rows, the weight-gradient
    sums of these rows into ``partial`` (flat, layer l at ``offsets[l]``)."""
    k = hi - lo
    if k == 0:
        partial[:] = 0.0
        return 0.0, 0
    loss = _forward_backward(fn, acts, grads, weights, logits, labels, scratch, scalars, lo,
                             hi)
    clipped = 0
    if mode == GROUPS:
        clipped = clip_groups_range(acts, grads, groups, first, stop, max_norm, factors)
    elif mode == ROWS:
        clipped = clip_rows_range(acts, grads, no_bias, max_norm, factors, lo, hi)
    for i in range(len(weights)):
        w = weights[i]
        d_out, d_in1 = w.shape[0], w.shape[1]
        gemm(fn, scratch, scalars, True, False, d_out, d_in1, k, grads[i][lo:hi], d_out,
             acts[i][lo:hi], d_in1, 0.0, partial[offsets[i]:], d_in1)
    return loss, clipped


@cached_njit
def _split_bounds(k, mode, groups, bounds, firsts):
    """Cut k rows into ``len(bounds) - 1`` contiguous parts of about equal size:
    part t is rows ``bounds[t]`` to ``bounds[t + 1]``; with GROUPS the cuts
    fall on group starts (a household stays whole) and part t holds groups
    ``firsts[t]`` to ``firsts[t + 1]``."""
    parts = bounds.shape[0] - 1
    n_groups = groups.shape[0] - 1 if mode == GROUPS else 0
    bounds[0], firsts[0] = 0, 0
    h = 0
    for t in range(1, parts):
        target = t * k // parts
        if mode == GROUPS:
            while h < n_groups and groups[h] < target:
                h += 1
            bounds[t], firsts[t] = groups[h], h
        else:
            bounds[t], firsts[t] = target, 0
    bounds[parts], firsts[parts] = k, n_groups


@cached_njit(parallel=True)
def _mlp_step_split(fn, set_threads, acts, grads, weights, grad_out, partial, offsets, logits,
                    labels, factors, mode, max_norm, groups, bounds, firsts, scratch, scalars,
                    no_bias):
    """The step with the batch's rows cut into ``partial.shape[0]``
    parts, one per thread, each through :func:`_rows_step` with sequential
    BLAS calls (``set_threads``: MKL's per-thread setter); then each
    coordinate of ``grad_out`` is the parts' sums added in part order."""
    parts = partial.shape[0]
    check_labels(labels, logits.shape[1])  # here: raised in the parallel loop, it is lost
    _split_bounds(acts[0].shape[0], mode, groups, bounds, firsts)
    losses = np.zeros(parts)
    clips = np.zeros(parts, dtype=np.int64)
    for t in numba.prange(parts):
        before = call_int(set_threads, 1)
        loss, clipped = _rows_step(fn, acts, grads, weights, partial[t], offsets, logits,
                                   labels, factors, mode, max_norm, groups, firsts[t],
                                   firsts[t + 1], scratch[t], scalars[t], no_bias, bounds[t],
                                   bounds[t + 1])
        call_int(set_threads, before)
        losses[t] = loss
        clips[t] = clipped
    for t in numba.prange(parts):
        for i in range(len(grad_out)):
            out = grad_out[i]
            n = out.shape[0] * out.shape[1]
            flat = out.reshape(n)
            lo, hi = t * n // parts, (t + 1) * n // parts
            mine = flat[lo:hi]
            mine[:] = partial[0, offsets[i] + lo:offsets[i] + hi]
            for u in range(1, parts):  # one vectorised pass per part, in part order
                theirs = partial[u, offsets[i] + lo:offsets[i] + hi]
                for j in range(hi - lo):
                    mine[j] += theirs[j]
    loss, clipped = 0.0, 0
    for t in range(parts):
        loss += losses[t]
        clipped += clips[t]
    return loss, clipped


def row_split_parts(threads: int | None = None) -> int:
    """Into how many parts the fused step cuts a batch's rows at ``threads``
    Numba threads (default: the current count): one per thread, or 1 (no
    cut) at one thread, where the BLAS has no per-thread setter to keep each
    part's products sequential, or with :data:`SPLIT_SWITCH` set."""
    threads = numba.get_num_threads() if threads is None else int(threads)
    if threads <= 1 or os.environ.get(SPLIT_SWITCH) or threads_address() is None:
        return 1
    return threads


#: (parts, parameters, dtype) -> the split step's scratch: the parts' sums and
#: the cut points. A step binds once per batch size, and Poisson batches come
#: in a hundred sizes; the scratch is overwritten by every call and calls do
#: not overlap (they hold the GIL), so every binding of a shape shares one.
_WORKSPACES: dict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}


def _workspace(parts: int, n: int, dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    key = (parts, n, np.dtype(dtype).str)
    space = _WORKSPACES.get(key)
    if space is None:
        space = (np.empty((parts, n), dtype=dtype), np.empty(parts + 1, dtype=np.int64),
                 np.empty(parts + 1, dtype=np.int64))
        _WORKSPACES[key] = space
    return space


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
    no_bias = np.zeros(len(g), dtype=np.float64)
    parts = row_split_parts()
    # One cache line of by-reference BLAS arguments per part (no false sharing).
    scratch = np.zeros((parts, 16), dtype=np.int32)
    scalars = np.zeros((parts, 128 // a[0].itemsize), dtype=a[0].dtype)
    if parts > 1:
        set_threads = threads_address()
        offsets = np.cumsum([0] + [x.size for x in w]).astype(np.int64)
        partial, bounds, firsts = _workspace(parts, int(offsets[-1]), a[0].dtype)

        def run(mode, bound, starts):
            return _mlp_step_split(fn, set_threads, a, g, w, o, partial, offsets, z, y, f, mode,
                                   bound, starts, bounds, firsts, scratch, scalars, no_bias)
    else:
        rows = _mlp_step_rows_parallel if numba.get_num_threads() > 1 else _mlp_step_rows
        one, values = scratch[0], scalars[0]

        def run(mode, bound, starts):
            if mode == ROWS:
                return rows(fn, a, g, w, o, z, y, f, bound, one, values, no_bias)
            if mode == GROUPS:
                return _mlp_step_groups(fn, a, g, w, o, z, y, f, bound, starts, one, values)
            return _mlp_step_plain(fn, a, g, w, o, z, y, one, values)

    def step(max_norm: float | None, groups=None) -> tuple[float, int]:
        if max_norm is None:
            mode, bound, starts = NONE, 0.0, _NO_GROUPS
        elif groups is None:
            mode, bound, starts = ROWS, float(max_norm), _NO_GROUPS
        else:
            mode, bound, starts = GROUPS, float(max_norm), group_starts(groups)
        loss, clipped = run(mode, bound, starts)
        return float(loss), int(clipped)

    step.parts = parts
    step.partial = partial if parts > 1 else None  # the parts' sums (shared, see _workspace)
    return step


mlp_step.bind = _bind
