"""The Numba word loop behind :mod:`collectives.channels.streaming` (imported
on first use, x86-64 only).

Module-level on purpose: made inside a function, the loop closed over its
intrinsics, whose pickled form differs in every process, so Numba never
found it in its cache and compiled it again in each one.
"""
from __future__ import annotations

from llvmlite import ir
import kernels.numba_target  # noqa: F401  (first: Numba's target is fixed by the first @njit)
from kernels.shared_compiles import cached_njit
from numba import types
from numba.extending import intrinsic


@intrinsic
def store_nontemporal(typingctx, array, index, value):
    """``array[index] = value`` with LLVM's ``!nontemporal`` hint (``movnti``)."""
    def codegen(context, builder, signature, args):
        array_value, index_value, word = args
        data = context.make_array(signature.args[0])(context, builder, array_value).data
        store = builder.store(word, builder.gep(data, [index_value]))
        hint = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
        store.set_metadata("nontemporal", hint)
    return types.void(array, index, value), codegen


@intrinsic
def store_fence(typingctx):
    """``sfence``: earlier stores are visible before any later one."""
    def codegen(context, builder, signature, args):
        name = "llvm.x86.sse.sfence"
        fence = builder.module.globals.get(name) or ir.Function(
            builder.module, ir.FunctionType(ir.VoidType(), []), name=name)
        builder.call(fence, [])
    return types.void(), codegen


@cached_njit(nogil=True)
def stream_words(dst, src):
    """``dst[:] = src`` (uint64 arrays of equal length) by non-temporal stores, then ``sfence``."""
    for i in range(src.shape[0]):
        store_nontemporal(dst, i, src[i])
    store_fence()
