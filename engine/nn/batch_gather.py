"""The step's batch gather, shared by the engines (:mod:`engine.dp.fast_mlp`,
:mod:`engine.dp.module_engine`): the ``gather_rows`` kernel bound once per
batch size, since binding (numpy views of the tensors on the CPU) costs as
much as a small gather."""
from __future__ import annotations

from typing import Callable

import torch

from kernels import registry


class BatchGather:
    """``gather(X, y, rows, outputs)``: ``out = X[rows, :w]``, ``labels = y[rows]``.

    ``outputs(k) -> (out, labels)`` gives the engine's buffers for a batch of
    k rows; it is asked only when the kernel is bound, the first time a batch
    size is seen with these ``X`` and ``y``. Contract of the op in
    :mod:`kernels`; ``backend`` as the engine's, the best kernel where that
    back-end has none (a forced CUDA back-end: torch's, generic on GPUs).
    """

    def __init__(self, device, backend: str | None = None) -> None:
        self.kernel = registry.get_or_best("gather_rows", device, backend)
        self.forget()

    @property
    def backend(self) -> str:
        return self.kernel.backend

    def forget(self) -> None:
        """Drop the bindings (the engine reallocated its buffers)."""
        #: k -> (X, y, the kernel bound to them and to the first k rows' buffers)
        self._bound: dict[int, tuple] = {}

    def __call__(self, X: torch.Tensor, y: torch.Tensor, rows: torch.Tensor,
                 outputs: Callable[[int], tuple[torch.Tensor, torch.Tensor]]) -> None:
        k = int(rows.shape[0])
        bound = self._bound.get(k)
        if bound is None or bound[0] is not X or bound[1] is not y:
            out, labels = outputs(k)
            bound = (X, y, registry.bind(self.kernel, X=X, y=y, out=out, out_labels=labels))
            self._bound[k] = bound
        bound[2](rows=rows)
