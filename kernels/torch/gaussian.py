"""``gaussian_stream`` with ``torch.Generator``: the generic kernel for any device."""
from __future__ import annotations

import numpy as np
import torch

from kernels.registry import register


class TorchGaussianStream:
    """A reproducible N(0, 1) stream from a torch generator on the buffer's device."""

    backend = "torch"

    def __init__(self, seed_sequence: np.random.SeedSequence, device="cpu"):
        self._seed = int(seed_sequence.generate_state(1, np.uint64)[0] >> np.uint64(1))
        self._device = torch.device(device)
        self._generator = torch.Generator(device=self._device)
        self._generator.manual_seed(self._seed)
        self._scratch: torch.Tensor | None = None

    def add_(self, buf: torch.Tensor, std: float) -> None:
        """``buf += std * N(0, 1)`` in place (1-D tensor)."""
        if self._scratch is None or self._scratch.shape != buf.shape \
                or self._scratch.dtype != buf.dtype:
            self._scratch = torch.empty_like(buf)
        self._scratch.normal_(0.0, 1.0, generator=self._generator)
        buf.add_(self._scratch, alpha=float(std))

    def get_state(self) -> list[int]:
        return self._generator.get_state().tolist()

    def set_state(self, state: list[int]) -> None:
        """Restore :meth:`get_state`; raises ValueError for a state of another
        generator (torch's own error is a RuntimeError, or none at all)."""
        size = self._generator.get_state().numel()
        if len(state) != size or not all(0 <= int(x) < 256 for x in state):
            raise ValueError(f"a torch generator state has {size} bytes, not {len(state)} "
                             "values of another generator")
        self._generator.set_state(torch.tensor(state, dtype=torch.uint8))


@register("gaussian_stream", backend="torch")
def gaussian_stream(seed_sequence: np.random.SeedSequence, device="cpu") -> TorchGaussianStream:
    """A Gaussian stream on ``device`` (contract in :mod:`kernels`)."""
    return TorchGaussianStream(seed_sequence, device)
