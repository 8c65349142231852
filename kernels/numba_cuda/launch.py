"""How torch tensors reach the Numba CUDA kernels: zero-copy views, torch's stream.

* A CUDA tensor becomes a Numba device array through its
  ``__cuda_array_interface__`` (``cuda.as_cuda_array(t, sync=False)``: no
  copy, no synchronization). The views are cached by (pointer, shape,
  strides, dtype), since the engine passes the same buffers every step; the
  cache is bounded and holds the tensors it views, so a cached pointer can
  never be handed to another tensor by the allocator.
* Kernels are launched on torch's *current* stream of the tensor's device
  (``cuda.external_stream``), so they are ordered with the torch ops before
  and after them without any synchronization.
* Under Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, the tests on a
  machine without a GPU) the same wrappers take CPU tensors and pass numpy
  views; anywhere else a CPU tensor is a TypeError.

Launch shapes and argument checks are in :mod:`kernels.common.cuda_shapes`.
"""
from __future__ import annotations

from collections import OrderedDict

import numba
import numpy as np
import torch
from numba import cuda

#: Views kept (a training step uses a few dozen).
MAX_CACHED_VIEWS = 128

SIMULATED = bool(numba.config.ENABLE_CUDASIM)

_VIEWS: "OrderedDict[tuple, object]" = OrderedDict()
_STREAMS: dict[int, object] = {}


def array(t: torch.Tensor):
    """A zero-copy Numba view of ``t`` (see module docstring)."""
    device = t.device.type
    if device == "cuda":
        key = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device.index)
        view = _VIEWS.get(key)
        if view is None:
            view = cuda.as_cuda_array(t.detach(), sync=False)
            _VIEWS[key] = view
            if len(_VIEWS) > MAX_CACHED_VIEWS:
                _VIEWS.popitem(last=False)
        return view
    if device == "cpu" and SIMULATED:
        view = t.detach().numpy()
        if not view.flags.c_contiguous:
            # The simulator copies host arrays in and out as single blocks; a
            # strided view goes in as a contiguous copy, not copied back. The
            # kernels only read strided arguments (ReLU outputs), so nothing
            # is lost; the tests compare every written array with the CPU.
            return cuda.In(np.ascontiguousarray(view))
        return view
    raise TypeError(f"the Numba CUDA kernels take CUDA tensors, not {device} ones")


def stream(t: torch.Tensor):
    """torch's current stream on ``t``'s device, as a Numba stream (0 under the simulator)."""
    if t.device.type != "cuda":
        return 0
    pointer = torch.cuda.current_stream(t.device).cuda_stream
    found = _STREAMS.get(pointer)
    if found is None:
        found = _STREAMS[pointer] = cuda.external_stream(pointer)
    return found


@cuda.jit
def _probe(out):
    out[0] = 1.0


def self_check() -> torch.Tensor:
    """Compile and launch one one-thread kernel on the current GPU (the simulator's
    CPU); returns the one-element tensor it wrote 1.0 into.

    ``numba-cuda`` can import and find the GPU yet fail at its first compile
    (numba-cuda 0.30.4 with numpy 2.5 does, inside its own lowering), so the
    registry calls this before choosing the back-end (and checks the value).
    Raises whatever the compile or launch raises.
    """
    t = torch.zeros(1, dtype=torch.float32, device="cpu" if SIMULATED else "cuda")
    _probe[1, 1, stream(t)](array(t))
    return t
