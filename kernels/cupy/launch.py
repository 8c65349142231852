"""How torch tensors reach the CuPy kernels: device pointers and torch's stream.

The CUDA C lives in ``kernels/cupy/*.cu`` (:mod:`kernels.cupy.sources`
lists the entry points); each file is compiled once per process by
``cupy.RawModule`` (NVRTC) on first use, and its functions are looked up by
the names listed there.

* Arguments: a torch CUDA tensor goes in as its device pointer
  (``numpy.uint64(t.data_ptr())``, zero-copy, the same address its
  ``__cuda_array_interface__`` and DLPack capsule carry) with its sizes and
  leading dimension as 64-bit integers, so a launch builds no wrapper object;
  scalars are numpy scalars of exactly the C parameter's type (the tests
  check every launch against the ``.cu`` signatures).
* Stream: every launch runs on torch's *current* stream of the tensor's
  device (``cupy.cuda.ExternalStream``, cached), on that device, so the
  kernels are ordered with the torch ops around them and nothing synchronizes.

Importing this module imports CuPy (ImportError without it: the registry
then skips the CuPy kernels).
"""
from __future__ import annotations

import cupy
import numpy as np
import torch

from kernels.common.cuda_shapes import numpy_dtype
from kernels.cupy import sources

#: NVRTC options for every source.
OPTIONS = ("--std=c++14",)
_MODULES: dict[str, object] = {}
_FUNCTIONS: dict[tuple, object] = {}
_STREAMS: dict[tuple, object] = {}
#: Tests (a fake CuPy, no GPU) set this to launch on CPU tensors' host pointers.
HOST_TENSORS_FOR_TESTS = False


def _check_device(t: torch.Tensor) -> None:
    if t.device.type != "cuda" and not HOST_TENSORS_FOR_TESTS:
        raise TypeError(f"the CuPy kernels take CUDA tensors, not {t.device.type} ones")


def pointer(t: torch.Tensor) -> np.uint64:
    """The device address of ``t``'s first element (a ``T*`` kernel argument)."""
    _check_device(t)
    return np.uint64(t.data_ptr())


def function(stem: str, kernel: str, t: torch.Tensor):
    """The compiled entry point of ``kernel`` in ``<stem>.cu`` for ``t``'s dtype."""
    name = sources.entry(stem, kernel, numpy_dtype(t))
    key = (name, t.device.index)
    fn = _FUNCTIONS.get(key)
    if fn is None:
        module = _MODULES.get(stem)
        if module is None:
            code = sources.source_path(stem).read_text(encoding="utf-8")
            module = _MODULES[stem] = cupy.RawModule(code=code, options=OPTIONS)
        with cupy.cuda.Device(t.device.index or 0):
            fn = _FUNCTIONS[key] = module.get_function(name)
    return fn


def launch(fn, t: torch.Tensor, grid: tuple, block: tuple, args: tuple) -> None:
    """Run ``fn`` on torch's current stream of ``t``'s device."""
    index = t.device.index or 0
    pointer_ = torch.cuda.current_stream(t.device).cuda_stream if t.device.type == "cuda" else 0
    stream = _STREAMS.get((index, pointer_))
    if stream is None:
        stream = _STREAMS[(index, pointer_)] = cupy.cuda.ExternalStream(pointer_, index)
    with cupy.cuda.Device(index), stream:
        fn(grid, block, args)


_PROBE_SOURCE = 'extern "C" __global__ void mpidp_probe(float* out) { out[0] = 1.0f; }\n'


def self_check() -> torch.Tensor:
    """Compile (NVRTC) and launch one one-thread kernel on the current GPU;
    returns the one-element tensor it wrote 1.0 into.

    Importing CuPy proves little: NVRTC or the driver can still refuse the
    first compile (a CUDA 12 CuPy next to a CUDA 13 NVRTC), so the registry
    calls this before choosing the back-end (and checks the value). Raises
    whatever the compile or launch raises.
    """
    t = torch.zeros(1, dtype=torch.float32, device="cuda")
    fn = cupy.RawModule(code=_PROBE_SOURCE, options=OPTIONS).get_function("mpidp_probe")
    launch(fn, t, (1,), (1,), (pointer(t),))
    return t
