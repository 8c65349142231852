"""What the two CUDA ``gaussian_stream`` back-ends share: the Philox state and
the launch shape.

Both kernels (Numba ``@cuda.jit`` in :mod:`kernels.numba_cuda.gaussian`, CUDA C in
``kernels/cupy/gaussian.cu``) draw the same stream: thread b computes Philox
block ``counter + b`` and adds four normals to ``buf[4b:4b+4]``. A subclass
only launches its kernels (:meth:`PhiloxDeviceStream._launch` and
:meth:`PhiloxDeviceStream._launch_at`).

For a captured CUDA graph, where a launch's arguments are frozen, the draw
splits in two: :meth:`PhiloxDeviceStream.take` advances the host state as
:meth:`PhiloxDeviceStream.add_` would and returns the counter of the call,
which the caller copies into device memory with the step's other inputs;
:meth:`PhiloxDeviceStream.add_at_` launches the kernel that reads it there.
Together they add exactly what ``add_`` adds, and the state stays on the host.
"""
from __future__ import annotations

import numpy as np
import torch

from kernels.common import philox
from kernels.common.cuda_shapes import check_flat, grid_1d


class PhiloxDeviceStream:
    """A reproducible N(0, 1) stream added into CUDA tensors in place."""

    backend = ""

    def __init__(self, seed_sequence: np.random.SeedSequence, device=None):
        self._state = philox.PhiloxState(seed_sequence)

    def add_(self, buf: torch.Tensor, std: float) -> None:
        """``buf += std * N(0, 1)`` (1-D contiguous float32/float64 tensor)."""
        n = buf.shape[0]
        if n == 0:
            return
        check_flat(buf, "gaussian_stream.add_")
        counter = self._state.take(n)
        blocks, threads = grid_1d(-(-n // 4))
        self._launch(buf, float(std), counter, blocks, threads)

    def _launch(self, buf: torch.Tensor, std: float, counter: int, blocks: int,
                threads: int) -> None:
        raise NotImplementedError

    def take(self, n: int) -> int:
        """Advance the state past the blocks of an ``add_`` of ``n`` elements, as
        ``add_`` does; returns that call's first counter (a 128-bit integer)."""
        return self._state.take(n) if n else self._state.counter

    def add_at_(self, buf: torch.Tensor, std: float, counter: torch.Tensor,
                offset: int = 0) -> None:
        """``buf += std * N(0, 1)`` from the counter in device memory: ``counter``
        is an int64 tensor ``[2]`` (low word, high word) on ``buf``'s device,
        read when the kernel runs, plus ``offset`` blocks. The host state is
        not touched (:meth:`take` advanced it)."""
        n = buf.shape[0]
        if n == 0:
            return
        check_flat(buf, "gaussian_stream.add_at_")
        if counter.dtype != torch.int64 or counter.shape != (2,) \
                or counter.device != buf.device:
            raise ValueError(f"counter: need an int64 tensor [2] on {buf.device}, got "
                             f"{counter.dtype} {tuple(counter.shape)} on {counter.device}")
        check_flat(counter, "counter")
        blocks, threads = grid_1d(-(-n // 4))
        self._launch_at(buf, float(std), counter, int(offset), blocks, threads)

    def _launch_at(self, buf: torch.Tensor, std: float, counter: torch.Tensor, offset: int,
                   blocks: int, threads: int) -> None:
        raise NotImplementedError

    def get_state(self) -> list[int]:
        return self._state.get_state()

    def set_state(self, state: list[int]) -> None:
        """Restore :meth:`get_state`; ValueError for the state of another kind of stream."""
        self._state.set_state(state)
