"""Combining two buffers element-wise, with one rule for special values.

Every algorithm combines with these kernels, and ``native`` applies the same
rule to what ``MPI_Allreduce`` returns, so a given input gives the same bits
whatever the algorithm, on every rank:

* ``sum``: IEEE addition, then any NaN becomes the canonical quiet NaN
  (``np.nan``: sign clear, payload zero). Without this, NaN payloads and
  signs depend on operand order (``inf + -inf`` gives a negative NaN on
  x86, ``NaN_a + NaN_b`` keeps the first payload), which differs between
  algorithms and, inside MPI, between ranks.
* ``max`` / ``min``: NaN propagates (as numpy's ``maximum``), as the
  canonical NaN; ``max(-0.0, +0.0)`` is ``+0.0`` and ``min`` of them
  ``-0.0`` (IEEE 754-2019 ``maximum`` / ``minimum``). MPI's ``MPI_MAX``
  ignores NaN or not depending on operand order.
* integers: plain ``+``, ``max``, ``min`` (wrapping on overflow, as MPI).

The float32/float64 kernels are Numba loops that apply the rule while they
combine, at the speed of ``np.add`` (one pass, no temporaries); float16
goes through numpy and a second pass. Combines never emit numpy's
``RuntimeWarning`` on overflow or ``inf - inf``.
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Callable

import numpy as np

#: ``combine(a, b, out)``: ``out = a (op) b`` element-wise; ``out`` may alias ``a`` or ``b``.
Combine = Callable[[Any, Any, Any], Any]
UFUNCS = {"sum": np.add, "max": np.maximum, "min": np.minimum}


@functools.lru_cache(maxsize=None)
def _kernels() -> dict[str, Callable] | None:
    """The Numba kernels (:mod:`collectives.core.combine_kernels`, compiled on first
    use per dtype and cached on disk), or None where Numba cannot be imported
    (numpy with a second pass instead)."""
    try:  # deferred: only a plan with a float buffer needs Numba
        from collectives.core import combine_kernels
    except Exception:  # noqa: BLE001 - any import failure means "not here"
        return None
    kernels: dict[str, Callable] = {op: _pair(*loops)
                                    for op, loops in combine_kernels.LOOPS.items()}
    kernels["canonical"] = combine_kernels.canonical
    return kernels


def _pair(into: Callable, apart: Callable) -> Combine:
    """``combine(a, b, out)``: the two-array loop when ``out`` is ``a`` or ``b``
    (see :mod:`collectives.core.combine_kernels`), else the three-array one."""

    def combine(a, b, out):
        if out is b:
            into(a, b)
        elif out is a:
            into(b, a)
        else:
            apart(a, b, out)

    return combine


def _numpy_float(op: str) -> Combine:
    ufunc = UFUNCS[op]

    def combine(a, b, out):
        with np.errstate(all="ignore"):
            zeros = (a == 0) & (b == 0) if op != "sum" else None
            signs = None if zeros is None else (np.signbit(a) & np.signbit(b) if op == "max"
                                                else np.signbit(a) | np.signbit(b))
            ufunc(a, b, out=out)
        if zeros is not None and zeros.any():
            out[zeros] = np.where(signs[zeros], -0.0, 0.0)
        canonicalize(out)

    return combine


def host_combiner(op: str, dtype: np.dtype) -> Combine:
    """The host combine of ``op`` for arrays of ``dtype`` (see the module docstring)."""
    if dtype.kind != "f":
        if op == "sum":
            return np.add  # positional ``out``: the cheapest call for tiny arrays
        ufunc = UFUNCS[op]

        def combine(a, b, out):  # numpy deprecates a positional ``out`` for max/min
            ufunc(a, b, out=out)

        return combine
    kernels = _kernels()
    if kernels is None or dtype.itemsize < 4:  # float16: numpy, then a second pass
        return _numpy_float(op)
    return kernels[op]


def canonicalize(out: np.ndarray) -> None:
    """Every NaN of the float array ``out`` becomes the canonical quiet NaN (in place)."""
    if out.dtype.kind != "f" or out.size == 0:
        return
    kernels = _kernels()
    if kernels is not None and out.dtype.itemsize >= 4:
        kernels["canonical"](out)
        return
    with np.errstate(all="ignore"):
        nans = np.isnan(out)
    if nans.any():
        out[nans] = np.nan


def canonicalizer(dtype: np.dtype) -> Callable[[np.ndarray], None] | None:
    """The fastest :func:`canonicalize` for arrays of ``dtype`` (the Numba kernel
    itself where there is one); None for integers, which have no NaN."""
    if dtype.kind != "f":
        return None
    kernels = _kernels()
    return kernels["canonical"] if kernels is not None and dtype.itemsize >= 4 else canonicalize


def warm_up(dtype: np.dtype, op: str) -> None:
    """Compile (or load from Numba's cache) the kernel of ``(dtype, op)`` now,
    so that no rank compiles inside a timed or waited-on call."""
    if dtype.kind == "f" and dtype.itemsize >= 4 and _kernels() is not None:
        x = np.zeros(1, dtype)
        host_combiner(op, dtype)(x, x, x)
        canonicalize(x)


#: The user-defined MPI operations made so far, one per (op, dtype): the
#: operation depends on nothing else, and MPI libraries allow few of them
#: (mpi4py: 32 live ones), so one per plan (per length) ran out.
_MPI_OPS: dict[tuple[str, str], Any] = {}
_MPI_OPS_LOCK = threading.Lock()


def mpi_op(op: str, dtype: np.dtype, mpi: Any) -> Any:
    """The user-defined MPI operation applying :func:`host_combiner`
    (commutative), for ``native`` max/min on floats: made once per ``(op,
    dtype)`` and shared by every plan and communicator; the caller must not
    free it (:func:`free_mpi_ops` does, in ``MPI_Finalize``)."""
    dtype = np.dtype(dtype)
    key = (op, dtype.str)
    with _MPI_OPS_LOCK:
        made = _MPI_OPS.get(key)
        if made is None:
            made = _MPI_OPS[key] = mpi.Op.Create(_applier(host_combiner(op, dtype), dtype),
                                                 commute=True)
    return made


def _applier(combine: Combine, dtype: np.dtype) -> Callable[[Any, Any, Any], None]:
    """MPI's callback for :func:`mpi_op`: ``inoutbuf = inbuf (op) inoutbuf``."""

    def apply(inbuf, inoutbuf, datatype):
        a = np.frombuffer(inbuf, dtype=dtype)
        b = np.frombuffer(inoutbuf, dtype=dtype)
        combine(a, b, b)

    return apply


def free_mpi_ops() -> None:
    """Free the operations of :func:`mpi_op` (local; at ``MPI_Finalize``, after
    every plan that used one is dropped). A later :func:`mpi_op` makes a new one."""
    with _MPI_OPS_LOCK:
        made = list(_MPI_OPS.values())
        _MPI_OPS.clear()
    for operation in made:
        try:
            operation.Free()
        except Exception:  # noqa: BLE001 - MPI may be past freeing it (finalized)
            pass
