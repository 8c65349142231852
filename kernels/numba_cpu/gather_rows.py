"""``gather_rows`` as one Numba CPU loop: the step's batch, copied row by row.

The batch's rows are scattered over a shard far larger than the caches, so
the copy waits on memory, and what matters is how many rows' cache lines are
in flight at once. A plain loop over the rows keeps several in flight;
``torch.index_select`` spends its time between them (two calls, one for the
inputs and one for the labels, each with torch's dispatch), so this loop
replaces it. Software prefetching a few rows ahead gained nothing
measurable, so there is none (figures: docs/design/row-gather.md).

At several threads each thread copies one contiguous part of the rows, as
many misses in flight per core. The parts are the fused MLP step's
(:mod:`kernels.numba_cpu.mlp_step`), so each thread's rows are in its own
core's cache when its part of the step reads them.
"""
from __future__ import annotations

import numba
import torch

from kernels.registry import register
from kernels.shared_compiles import cached_njit


@cached_njit(nogil=True)
def _gather(X, y, rows, out, out_labels):
    n = X.shape[0]
    width = out.shape[1]  # at most X's: its first columns
    for i in range(rows.shape[0]):
        r = rows[i]
        if r < 0 or r >= n:
            raise IndexError("gather_rows: a row index is out of range")
        for j in range(width):
            out[i, j] = X[r, j]
        out_labels[i] = y[r]


@cached_njit(nogil=True)
def _check_rows(rows, n):
    for i in range(rows.shape[0]):
        if rows[i] < 0 or rows[i] >= n:
            raise IndexError("gather_rows: a row index is out of range")


@cached_njit(parallel=True, nogil=True)
def _gather_parts(X, y, rows, out, out_labels, parts):
    """:func:`_gather` with the rows cut into ``parts`` contiguous parts, one
    per thread. The indices are checked first: an exception raised in a
    parallel loop's body is lost."""
    _check_rows(rows, X.shape[0])
    k = rows.shape[0]
    width = out.shape[1]
    for t in numba.prange(parts):
        for i in range(t * k // parts, (t + 1) * k // parts):
            r = rows[i]
            for j in range(width):
                out[i, j] = X[r, j]
            out_labels[i] = y[r]


@register("gather_rows", backend="numba_cpu")
def gather_rows(X: torch.Tensor, y: torch.Tensor, rows: torch.Tensor, out: torch.Tensor,
                out_labels: torch.Tensor) -> None:
    """``out = X[rows]``, ``out_labels = y[rows]`` (contract in :mod:`kernels`)."""
    _bind(X, y, out, out_labels)(rows)


def _bind(X: torch.Tensor, y: torch.Tensor, out: torch.Tensor, out_labels: torch.Tensor):
    """``gather_rows`` on these buffers: numpy views made once, the serial or
    the parted kernel chosen by Numba's thread count (``registry.bind``); the
    returned ``gather(rows)`` takes the rows as a tensor or numpy array."""
    if X.dim() != 2 or not X.is_contiguous() or not out.is_contiguous():
        raise ValueError("gather_rows needs C-contiguous 2-D X and out")
    if out.dim() != 2 or out.shape[1] > X.shape[1]:
        raise ValueError(f"gather_rows: out {list(out.shape)} is wider than X {list(X.shape)}")
    Xn, yn, on, ln = X.numpy(), y.numpy(), out.numpy(), out_labels.numpy()
    parts = numba.get_num_threads()

    def gather(rows) -> None:
        r = rows.numpy() if isinstance(rows, torch.Tensor) else rows
        if parts > 1:
            _gather_parts(Xn, yn, r, on, ln, parts)
        else:
            _gather(Xn, yn, r, on, ln)

    return gather


gather_rows.bind = _bind
