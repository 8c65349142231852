"""Matrix products from compiled Numba code: the BLAS ``gemm`` that torch itself calls.

A training step of the engine's MLP is eight small GEMMs with element-wise
kernels between them; called one by one from Python, each GEMM costs a few
microseconds of torch dispatch on top of its arithmetic, which at a batch
of a few hundred rows is a tenth of the step. Numba code cannot call
``torch.mm``, but it can call the Fortran BLAS routine torch's CPU build
calls for it: torch's x86 wheels carry MKL inside ``libtorch_cpu`` and
export its ``sgemm_`` and ``dgemm_``. Called with the same operands, it is
the same routine as ``torch.mm`` (the tests compare the two bit for bit), so
nothing is chosen per machine: only the Python between the calls goes.

The routine's address is looked up in the process's own ``libtorch_cpu``
(:func:`gemm_address`; None where torch has no such symbol, e.g. a build
without MKL: the engine then calls the torch ops). Compiled code receives
the address as an argument and calls through it (:func:`call_gemm`), so
nothing process-specific is compiled in and Numba can cache the kernels on
disk.
"""
from __future__ import annotations

import ctypes
import functools
import os

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

#: The Fortran symbols, by dtype.
SYMBOLS = {np.dtype(np.float32): "sgemm_", np.dtype(np.float64): "dgemm_"}
#: The character codes of Fortran's 'N' and 'T' (no transpose, transpose).
_N, _T = 78, 84


@functools.lru_cache(maxsize=None)
def _torch_library() -> ctypes.CDLL | None:
    """torch's ``libtorch_cpu`` as already loaded in this process, or None."""
    import torch  # deferred: the collectives import this package without torch

    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        return ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except (OSError, AttributeError):
        return None


@functools.lru_cache(maxsize=None)
def _address(symbol: str) -> int | None:
    """Address of ``symbol`` in torch's ``libtorch_cpu``, or None."""
    library = _torch_library()
    if library is None:
        return None
    try:
        return ctypes.cast(getattr(library, symbol), ctypes.c_void_p).value
    except AttributeError:
        return None


def gemm_address(dtype) -> int | None:
    """Address of the Fortran ``?gemm_`` that torch calls for ``dtype`` (float32
    or float64) in this process, or None where there is none to call."""
    symbol = SYMBOLS.get(np.dtype(dtype))
    return None if symbol is None else _address(symbol)


#: MKL's per-thread thread count, by value (``int MKL_Set_Num_Threads_Local(int)``,
#: what MKL's C header calls ``mkl_set_num_threads_local``; the symbol of that
#: name takes a pointer, as Fortran does): a thread that runs its own rows'
#: products asks for sequential ones with it, and restores the returned value.
THREADS_SYMBOL = "MKL_Set_Num_Threads_Local"


def threads_address() -> int | None:
    """Address of the BLAS's per-thread thread-count setter (MKL's
    :data:`THREADS_SYMBOL`) in torch's build, or None where there is none: a
    caller that splits work over its own threads then has no way to keep
    each thread's products sequential, and must not split."""
    return _address(THREADS_SYMBOL)


@intrinsic
def call_int(typingctx, fn, value):
    """``int32 f(int32 value)`` for the C function at address ``fn`` (intp)."""
    if not isinstance(fn, types.Integer) or not isinstance(value, types.Integer):
        return None
    sig = types.int32(fn, value)

    def codegen(context, builder, signature, llargs):
        int32 = ir.IntType(32)
        fnty = ir.FunctionType(int32, [int32])
        target = builder.inttoptr(llargs[0], fnty.as_pointer())
        arg = context.cast(builder, llargs[1], signature.args[1], types.int32)
        return builder.call(target, [arg])
    return sig, codegen


@intrinsic
def call_gemm(typingctx, fn, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
    """Call the Fortran gemm at address ``fn`` with the 13 argument addresses
    (every Fortran argument is passed by reference); all are intp."""
    args = (fn, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)
    if not all(isinstance(x, types.Integer) for x in args):
        return None
    sig = types.void(*args)

    def codegen(context, builder, signature, llargs):
        byte_ptr = ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [byte_ptr] * 13)
        target = builder.inttoptr(llargs[0], fnty.as_pointer())
        builder.call(target, [builder.inttoptr(x, byte_ptr) for x in llargs[1:]])
        return context.get_dummy_value()
    return sig, codegen


@numba.njit(inline="always")
def gemm(fn, scratch, scalars, trans_a, trans_b, m, n, k, a, lda, b, ldb, beta, c, ldc):
    """Row-major ``C[m, n] = op(A) op(B) + beta C`` through the column-major
    routine at ``fn``: C's storage read column-major is C^T = op(B)^T op(A)^T,
    so the operands go in swapped. ``a``, ``b``, ``c`` are arrays whose first
    element is the matrix's first; ``lda``, ``ldb``, ``ldc`` their row strides
    in elements; ``trans_a`` means op(A) = A^T (A stored k x m). ``scratch``
    (int32[8]) and ``scalars`` (two elements of C's dtype) hold the
    by-reference arguments."""
    scratch[0] = n
    scratch[1] = m
    scratch[2] = k
    scratch[3] = ldb
    scratch[4] = lda
    scratch[5] = ldc
    scratch[6] = _T if trans_b else _N
    scratch[7] = _T if trans_a else _N
    scalars[0] = 1.0
    scalars[1] = beta
    p = scratch.ctypes.data
    s = scalars.ctypes.data
    size = scalars.itemsize
    call_gemm(fn, p + 24, p + 28, p, p + 4, p + 8, s, b.ctypes.data, p + 12,
              a.ctypes.data, p + 16, s + size, c.ctypes.data, p + 20)
