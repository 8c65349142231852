"""The device-agnostic kernel interface: an op name and a device give a function.

The engine never imports a kernel module directly. It asks, once at set-up,
``kernels.dispatch.get(op, device)`` for each op it uses, where ``device`` is
the ``torch.device`` (or its type string) of the tensors it will pass; the
CPU Numba kernels, the generic torch kernels and (issue 6) the CUDA kernels
all register under the same op names with the same contract:

``clip_rows(acts, grads, max_norm, factors) -> int``
    Per-example clipping for a stack of Linear layers in book-keeping form.
    ``acts[l]`` is layer l's input with a trailing column of ones (k x
    (d_in+1)), ``grads[l]`` the loss gradient at its output (k x d_out);
    example i's gradient for layer l is ``grads[l][i]^T acts[l][i]``, so its
    squared norm is ``sum_l |acts[l][i]|^2 |grads[l][i]|^2``. Writes the clip
    factors ``min(1, max_norm / norm_i)`` into ``factors[:k]``, scales every
    ``grads[l][i]`` by its factor in place and returns how many rows were
    clipped (factor < 1). k = 0 is valid.
``relu_backward(grad, out) -> None``
    ``grad[i, j] = 0`` where ``out[i, j] <= 0`` (``out`` is the ReLU output,
    possibly a strided view).
``softmax_xent(logits, labels, grad) -> float``
    Cross-entropy of every row: writes ``softmax(logits) - onehot(labels)``
    into ``grad`` and returns the summed loss (a Python float).
``gaussian_stream(seed_words) -> stream``
    A reproducible stream of N(0, 1) samples with ``stream.add_(buf, std)``
    (adds ``std * N(0, 1)`` to every element of a 1-D buffer in place),
    ``stream.get_state() -> list[int]`` and ``stream.set_state(list)``.

Registration is by decorator, one kernel per module::

    @register("clip_rows", "cpu", backend="numba")
    def clip_rows(acts, grads, max_norm, factors): ...

``device="any"`` marks a generic implementation (torch ops) used when no
device-specific one is registered.
"""
from __future__ import annotations

import importlib
from typing import Callable

#: Modules that register kernels (imported on first lookup). One kernel per module.
KERNEL_MODULES = (
    "kernels.clip_rows_torch",
    "kernels.clip_rows_numba",
    "kernels.relu_backward_torch",
    "kernels.relu_backward_numba",
    "kernels.softmax_xent_torch",
    "kernels.softmax_xent_numba",
    "kernels.gaussian_torch",
    "kernels.gaussian_numba",
)

OPS = ("clip_rows", "relu_backward", "softmax_xent", "gaussian_stream")

_REGISTRY: dict[str, dict[str, Callable]] = {op: {} for op in OPS}
_loaded = False


class UnknownKernel(LookupError):
    """No implementation of an op for a device."""


def register(op: str, device: str, *, backend: str) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn`` as the implementation of ``op`` on ``device``.

    Args:
        op: one of :data:`OPS`.
        device: a torch device type (``"cpu"``, ``"cuda"``) or ``"any"``.
        backend: a short name shown in reports (``"numba"``, ``"torch"``, ``"cupy"``).
    """
    if op not in _REGISTRY:
        raise ValueError(f"unknown kernel op {op!r}; ops are {', '.join(OPS)}")

    def decorate(fn: Callable) -> Callable:
        if device in _REGISTRY[op]:
            raise ValueError(f"kernel {op!r} registered twice for device {device!r}")
        fn.backend = backend  # type: ignore[attr-defined]
        _REGISTRY[op][device] = fn
        return fn

    return decorate


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for name in KERNEL_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:  # an optional back-end that is not installed
            continue


def _device_type(device) -> str:
    return device if isinstance(device, str) else getattr(device, "type", str(device))


def get(op: str, device="cpu", backend: str | None = None) -> Callable:
    """The implementation of ``op`` for ``device`` (a torch.device or its type).

    Args:
        op: one of :data:`OPS`.
        device: where the tensors live.
        backend: force a back-end by name (``"torch"`` for the generic one);
            ``None`` picks the device-specific kernel when one is registered.

    Raises:
        UnknownKernel: nothing registered for that op, device and back-end.
    """
    _load()
    table = _REGISTRY[op]
    dtype = _device_type(device)
    candidates = [table[d] for d in (dtype, "any") if d in table]
    if backend is not None:
        candidates = [fn for fn in candidates if fn.backend == backend]
    if not candidates:
        raise UnknownKernel(f"no {op!r} kernel for device {dtype!r}"
                            + (f" and back-end {backend!r}" if backend else ""))
    return candidates[0]


def implementations(op: str) -> dict[str, Callable]:
    """Every registered implementation of ``op``: device -> function."""
    _load()
    return dict(_REGISTRY[op])
