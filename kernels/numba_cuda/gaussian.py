"""``gaussian_stream`` on CUDA with Numba ``@cuda.jit``: Philox4x64-10 and Box-Muller.

The twin of ``kernels/cupy/gaussian.cu``; the stream, its state and a host
reference are in :mod:`kernels.common.philox`. Thread b computes Philox block
``counter + b`` and adds four normals to ``buf[4b:4b+4]``; the counter is
the launch's argument, or (``add_at_``, for a captured CUDA graph) read
from device memory when ``ctr`` is not empty. The 64-bit
multiply-high is written with 32-bit halves and the round keys come
precomputed from the host, so nothing overflows a numpy scalar when the CUDA
simulator runs this code, and the same source compiles for the GPU. It is
written inline, without device functions: calling one makes Numba ask the
driver for the GPU's compute capability, so ``compile_ptx`` (the tests'
ahead-of-time check) would need a GPU. The transform runs in float64 on
purpose (see :data:`kernels.cupy.sources.FLOAT64_BY_DESIGN`).
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import numba
import numpy as np
import torch
from numba import cuda

from kernels.common import philox
from kernels.common.cuda_shapes import numpy_dtype
from kernels.common.philox_stream import PhiloxDeviceStream
from kernels.numba_cuda.launch import array as device_array
from kernels.numba_cuda.launch import stream
from kernels.registry import register

_M32 = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)
_S11 = np.uint64(11)
_ONE = np.uint64(1)
_ZERO = np.uint64(0)
_M0_LO, _M0_HI = np.uint64(philox.M0 & 0xFFFFFFFF), np.uint64(philox.M0 >> 32)
_M1_LO, _M1_HI = np.uint64(philox.M1 & 0xFFFFFFFF), np.uint64(philox.M1 >> 32)
_INV53 = 1.0 / 9007199254740992.0
_TWO_PI = 2.0 * math.pi


def _build(ft):
    @cuda.jit
    def philox_normal_add(out, std, keys, ctr_lo, ctr_hi, ctr, offset):
        b = cuda.grid(1)
        n = out.shape[0]
        first = 4 * b
        if first < n:
            if ctr.shape[0] > 0:  # the counter in device memory, plus offset blocks
                ctr_lo = numba.uint64(ctr[0]) + offset
                ctr_hi = numba.uint64(ctr[1]) + (_ONE if ctr_lo < offset else _ZERO)
            c0 = ctr_lo + numba.uint64(b)
            c1 = ctr_hi + (_ONE if c0 < ctr_lo else _ZERO)
            c2 = _ZERO
            c3 = _ZERO
            for r in range(philox.ROUNDS):
                # (hi0, lo0) = c0 * M0 and (hi1, lo1) = c2 * M1, from 32-bit halves
                a_lo = c0 & _M32
                a_hi = c0 >> _S32
                p00 = a_lo * _M0_LO
                p01 = a_lo * _M0_HI
                p10 = a_hi * _M0_LO
                mid = (p00 >> _S32) + (p01 & _M32) + (p10 & _M32)
                hi0 = a_hi * _M0_HI + (p01 >> _S32) + (p10 >> _S32) + (mid >> _S32)
                lo0 = (mid << _S32) | (p00 & _M32)
                a_lo = c2 & _M32
                a_hi = c2 >> _S32
                p00 = a_lo * _M1_LO
                p01 = a_lo * _M1_HI
                p10 = a_hi * _M1_LO
                mid = (p00 >> _S32) + (p01 & _M32) + (p10 & _M32)
                hi1 = a_hi * _M1_HI + (p01 >> _S32) + (p10 >> _S32) + (mid >> _S32)
                lo1 = (mid << _S32) | (p00 & _M32)
                c0, c1, c2, c3 = hi1 ^ c1 ^ keys[r, 0], lo1, hi0 ^ c3 ^ keys[r, 1], lo0
            # Box-Muller on uniforms in (0, 1] (top 53 bits plus one ulp)
            r1 = math.sqrt(-2.0 * math.log((numba.float64(c0 >> _S11) + 1.0) * _INV53))
            t1 = _TWO_PI * ((numba.float64(c1 >> _S11) + 1.0) * _INV53)
            r2 = math.sqrt(-2.0 * math.log((numba.float64(c2 >> _S11) + 1.0) * _INV53))
            t2 = _TWO_PI * ((numba.float64(c3 >> _S11) + 1.0) * _INV53)
            out[first] = ft(numba.float64(out[first]) + std * (r1 * math.cos(t1)))
            if first + 1 < n:
                out[first + 1] = ft(numba.float64(out[first + 1]) + std * (r1 * math.sin(t1)))
            if first + 2 < n:
                out[first + 2] = ft(numba.float64(out[first + 2]) + std * (r2 * math.cos(t2)))
            if first + 3 < n:
                out[first + 3] = ft(numba.float64(out[first + 3]) + std * (r2 * math.sin(t2)))

    return SimpleNamespace(philox_normal_add=philox_normal_add)


KERNELS = {np.dtype(np.float32): _build(numba.float32),
           np.dtype(np.float64): _build(numba.float64)}


def signatures(dtype) -> dict[str, tuple]:
    """Argument types of every kernel for ``dtype`` (for ahead-of-time PTX checks)."""
    ft = numba.from_dtype(np.dtype(dtype))
    return {"philox_normal_add": (ft[:], numba.float64, numba.uint64[:, :], numba.uint64,
                                  numba.uint64, numba.int64[:], numba.uint64)}


class NumbaCudaGaussianStream(PhiloxDeviceStream):
    """A reproducible N(0, 1) stream added into CUDA tensors in place (see module docstring)."""

    backend = "numba"

    def __init__(self, seed_sequence: np.random.SeedSequence, device=None):
        super().__init__(seed_sequence, device)
        self._keys: dict = {}
        self._empty: dict = {}

    def _round_keys(self, buf: torch.Tensor):
        """The key schedule (uint64, 10 x 2), on the buffer's device (copied once)."""
        where = (self._state.key, buf.device)
        table = self._keys.get(where)
        if table is None:
            table = philox.round_keys(self._state.key)
            if buf.device.type == "cuda":
                with cuda.gpus[buf.device.index or 0]:
                    table = cuda.to_device(table)
            self._keys = {where: table}
        return table

    def _launch(self, buf: torch.Tensor, std: float, counter: int, blocks: int,
                threads: int) -> None:
        KERNELS[numpy_dtype(buf)].philox_normal_add[blocks, threads, stream(buf)](
            device_array(buf), std, self._round_keys(buf),
            np.uint64(counter & philox.MASK64), np.uint64(counter >> 64), self._no_counter(buf),
            _ZERO)

    def _launch_at(self, buf: torch.Tensor, std: float, counter: torch.Tensor, offset: int,
                   blocks: int, threads: int) -> None:
        KERNELS[numpy_dtype(buf)].philox_normal_add[blocks, threads, stream(buf)](
            device_array(buf), std, self._round_keys(buf), _ZERO, _ZERO, device_array(counter),
            np.uint64(offset & philox.MASK64))

    def _no_counter(self, buf: torch.Tensor):
        """An empty int64 array on ``buf``'s device: the counter is the argument."""
        where = buf.device
        empty = self._empty.get(where)
        if empty is None:
            empty = self._empty[where] = device_array(
                torch.empty(0, dtype=torch.int64, device=where))
        return empty

    def set_state(self, state: list[int]) -> None:
        super().set_state(state)
        self._keys.clear()


@register("gaussian_stream", backend="numba_cuda")
def gaussian_stream(seed_sequence: np.random.SeedSequence, device=None) -> NumbaCudaGaussianStream:
    """A CUDA Gaussian stream (see module docstring)."""
    return NumbaCudaGaussianStream(seed_sequence, device)
