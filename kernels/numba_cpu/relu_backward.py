"""``relu_backward`` as a Numba CPU kernel: one branch-free pass, no boolean temporary.

The engine's ``out`` is a hidden layer's activations without their column of
ones: a view whose rows are contiguous but one element apart from each
other. Numba types such a view as of any layout, and LLVM does not
vectorise a loop whose stride it does not know, so the kernel reads the
rows through the whole buffer they sit in (C-contiguous, the ones column
left unread) whenever the view's storage allows it, so that the loop is
vectorised (figures: docs/design/small-kernels.md).
"""
from __future__ import annotations

import numpy as np
import torch

from kernels.registry import register
from kernels.shared_compiles import cached_njit


@cached_njit(fastmath=True)
def _relu_backward(grad, out):
    for i in range(grad.shape[0]):
        for j in range(grad.shape[1]):
            # Multiply by the 0/1 mask: a conditional store compiles to a branch,
            # mispredicted half the time since the signs are random.
            grad[i, j] = grad[i, j] * (out[i, j] > 0)


def rows_in_their_buffer(view: torch.Tensor) -> np.ndarray:
    """A C-contiguous numpy array whose row i starts where ``view``'s row i does
    and whose first ``view.shape[1]`` columns are ``view``'s: the buffer the
    rows sit in, for a view of leading columns (``a[:, :-1]``). The plain
    view where that cannot be made (columns not adjacent, or rows whose
    stride would reach past the storage)."""
    array = view.numpy()
    if view.dim() != 2 or view.shape[0] == 0 or view.stride(1) != 1 \
            or view.stride(0) == view.shape[1]:  # already C-contiguous rows
        return array
    k, stride = view.shape[0], view.stride(0)
    if stride < view.shape[1] or (view.storage_offset() + k * stride) * view.element_size() \
            > view.untyped_storage().nbytes():
        return array
    return np.lib.stride_tricks.as_strided(array, shape=(k, stride),
                                           strides=(stride * array.itemsize, array.itemsize))


@register("relu_backward", backend="numba_cpu")
def relu_backward(grad: torch.Tensor, out: torch.Tensor) -> None:
    """Zero ``grad`` where the ReLU output ``out`` is not positive, in place."""
    _bind(grad, out)()


def _bind(grad: torch.Tensor, out: torch.Tensor):
    """``relu_backward`` on these buffers: numpy views made once (``registry.bind``)."""
    if grad.shape[0] == 0:
        return lambda: None
    g, o = grad.numpy(), rows_in_their_buffer(out)
    return lambda: _relu_backward(g, o)


relu_backward.bind = _bind
