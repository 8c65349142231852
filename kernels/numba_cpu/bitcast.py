"""Bit casts between float64 and uint64, for Numba.

A kernel that splits a float into exponent and mantissa with integer masks
needs the float's bits; ``ndarray.view`` works on arrays only, and going
through memory keeps LLVM from vectorising the loop. These intrinsics are
one LLVM ``bitcast`` each: no instruction at all on x86, any vector width.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic


def _cast(source, target, llvm_type):
    @intrinsic
    def cast(typingctx, x):
        if x != source:
            return None
        sig = target(source)

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], llvm_type)
        return sig, codegen
    return cast


#: float64 -> uint64, its IEEE-754 bits.
f64_bits = _cast(types.float64, types.uint64, ir.IntType(64))
#: uint64 -> float64 with those bits.
bits_f64 = _cast(types.uint64, types.float64, ir.DoubleType())
