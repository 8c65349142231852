"""The Numba loops behind :mod:`collectives.core.combine` (imported on first use).

They are module-level functions on purpose, so that a process loads them
from Numba's cache instead of compiling them: Numba keys a cached function
by its code and the values of its closure cells, and a dispatcher held in a
closure cell pickles differently in every process, so loops made by a
factory were compiled again by every process, each writing one more cache
file (docs/design/trainer-small-choices.md). Nothing here may close over anything.
The six loops are written out rather than made from one: a factory is what
closed over them, and a loop taking the op as an argument costs every
combine a call more, which small all-reduces pay on every call.

Each op comes twice: ``<op>_into(x, y)`` (``y = x (op) y``) and
``<op>_apart(a, b, out)``. A loop whose output may alias an input is not
vectorised by LLVM when it does (its run-time overlap check fails), and
in-place combines are the common case, so they get the two-array loop; the
rules are symmetric, so ``x (op) y`` and ``y (op) x`` have the same bits.
"""
from __future__ import annotations

import numpy as np
import kernels.numba_target  # noqa: F401  (first: Numba's target is fixed by the first @njit)
from kernels.shared_compiles import cached_njit


@cached_njit(nogil=True, inline="always")
def _add1(x, y, nan):
    v = x + y
    return v if v == v else nan


@cached_njit(nogil=True, inline="always")
def _max1(x, y, nan):
    if x != x or y != y:
        return nan
    if x > y:
        return x
    if y > x:
        return y
    return x + y if x == 0 else x  # +0/-0: the sum is +0 unless both are -0


@cached_njit(nogil=True, inline="always")
def _min1(x, y, nan):
    if x != x or y != y:
        return nan
    if x < y:
        return x
    if y < x:
        return y
    return -((-x) + (-y)) if x == 0 else x  # +0/-0: -0 unless both are +0


@cached_njit(nogil=True)
def sum_into(x, y):
    nan = y.dtype.type(np.nan)
    for i in range(y.shape[0]):
        y[i] = _add1(x[i], y[i], nan)


@cached_njit(nogil=True)
def sum_apart(a, b, out):
    nan = out.dtype.type(np.nan)
    for i in range(out.shape[0]):
        out[i] = _add1(a[i], b[i], nan)


@cached_njit(nogil=True)
def max_into(x, y):
    nan = y.dtype.type(np.nan)
    for i in range(y.shape[0]):
        y[i] = _max1(x[i], y[i], nan)


@cached_njit(nogil=True)
def max_apart(a, b, out):
    nan = out.dtype.type(np.nan)
    for i in range(out.shape[0]):
        out[i] = _max1(a[i], b[i], nan)


@cached_njit(nogil=True)
def min_into(x, y):
    nan = y.dtype.type(np.nan)
    for i in range(y.shape[0]):
        y[i] = _min1(x[i], y[i], nan)


@cached_njit(nogil=True)
def min_apart(a, b, out):
    nan = out.dtype.type(np.nan)
    for i in range(out.shape[0]):
        out[i] = _min1(a[i], b[i], nan)


@cached_njit(nogil=True)
def canonical(out):
    """Every NaN of ``out`` becomes the canonical quiet NaN, in place."""
    nan = out.dtype.type(np.nan)
    for i in range(out.shape[0]):
        if out[i] != out[i]:
            out[i] = nan


#: op -> (into, apart)
LOOPS = {"sum": (sum_into, sum_apart), "max": (max_into, max_apart),
         "min": (min_into, min_apart)}
