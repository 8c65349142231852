"""The device-agnostic kernel interface: an op name and a device give a function.

The engine never imports a kernel module directly. It asks, once at set-up,
``kernels.dispatch.get(op, device)`` for each op it uses, where ``device`` is
the ``torch.device`` (or its type string) of the tensors it will pass; the
CPU Numba kernels, the generic torch kernels and the CUDA kernels (Numba
``@cuda.jit`` and CuPy ``RawModule`` over ``kernels/cuda/*.cu``) all register
under the same op names with the same contract:

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
``sgd_update(params, velocity, grad, scale, lr, momentum) -> None``
    SGD with momentum on flat buffers of one dtype, in place:
    ``velocity = momentum * velocity + scale * grad``, then
    ``params -= lr * velocity`` (PyTorch's convention; ``grad`` unchanged).
``gaussian_stream(seed_sequence[, device]) -> stream``
    A reproducible stream of N(0, 1) samples with ``stream.add_(buf, std)``
    (adds ``std * N(0, 1)`` to every element of a 1-D buffer in place),
    ``stream.get_state() -> list[int]`` and ``stream.set_state(list)``
    (ValueError for the state of another kind of stream). Kernels for a
    device other than the CPU take the ``torch.device`` as second argument.

A step calls every kernel on the same buffers each time, so the engine binds
them once: :func:`bind` fixes the buffer arguments (by name) and returns a
callable taking the rest by keyword. A back-end whose arguments need
converting provides ``kernel.bind`` and converts once there (the Numba CPU
kernels take numpy views of the tensors: about 0.7 us per tensor per call
otherwise, 5 us of a ``clip_rows`` call); the others are bound with
``functools.partial``.

Registration is by decorator, one kernel per module::

    @register("clip_rows", "cpu", backend="numba")
    def clip_rows(acts, grads, max_norm, factors): ...

``device="any"`` marks a generic implementation (torch ops) used when no
device-specific one is registered. A device may have several back-ends
(``"cupy"`` and ``"numba"`` on ``"cuda"``); :func:`get` returns the one
:data:`PREFERENCE` puts first unless one is named. CUDA tensors are passed
as torch tensors; the CUDA kernels run on torch's current stream of the
tensors' device.
"""
from __future__ import annotations

import functools
import importlib
from typing import Callable

#: Modules that register kernels (imported on first lookup). One kernel per module.
KERNEL_MODULES = (
    "kernels.torch.clip_rows",
    "kernels.numba_cpu.clip_rows",
    "kernels.torch.relu_backward",
    "kernels.numba_cpu.relu_backward",
    "kernels.torch.softmax_xent",
    "kernels.numba_cpu.softmax_xent",
    "kernels.torch.sgd_update",
    "kernels.numba_cpu.sgd_update",
    "kernels.torch.gaussian",
    "kernels.numba_cpu.gaussian",
)

#: Modules of device-specific kernels, imported only when that device is asked
#: for (so the CPU path never imports CuPy or Numba's CUDA target).
DEVICE_KERNEL_MODULES = {
    "cuda": (
        "kernels.cupy.clip_rows",
        "kernels.numba_cuda.clip_rows",
        "kernels.cupy.relu_backward",
        "kernels.numba_cuda.relu_backward",
        "kernels.cupy.softmax_xent",
        "kernels.numba_cuda.softmax_xent",
        "kernels.cupy.gaussian",
        "kernels.numba_cuda.gaussian",
    ),
}

#: On a device with several back-ends, which wins (whatever the import order):
#: CuPy (CUDA C, the cheapest launches from Python), then Numba CUDA. The
#: generic torch kernels (device "any") always come last.
PREFERENCE = {"cuda": ("cupy", "numba")}

OPS = ("clip_rows", "relu_backward", "softmax_xent", "sgd_update", "gaussian_stream")

#: Ops without CUDA kernels of their own: on GPUs the generic torch kernel runs
#: (the SGD update is two element-wise torch ops, one launch each; its Numba
#: kernel exists to save the CPU's per-op dispatch cost).
GENERIC_ON_GPU = ("sgd_update",)

#: op -> device -> implementations in order of preference.
_REGISTRY: dict[str, dict[str, list[Callable]]] = {op: {} for op in OPS}
#: Groups of modules already imported ("" for KERNEL_MODULES, else a device type).
_loaded: set[str] = set()
#: Kernel modules that could not be imported, and why (an optional back-end).
UNAVAILABLE: dict[str, str] = {}


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
        table = _REGISTRY[op].setdefault(device, [])
        if any(other.backend == backend for other in table):
            raise ValueError(f"kernel {op!r} registered twice for device {device!r} "
                             f"and back-end {backend!r}")
        fn.backend = backend  # type: ignore[attr-defined]
        table.append(fn)
        return fn

    return decorate


def _load(device_type: str = "") -> None:
    """Import the generic and CPU kernels, and ``device_type``'s when given."""
    for group in ("", device_type):
        if group in _loaded:
            continue
        _loaded.add(group)
        for name in (KERNEL_MODULES if group == "" else DEVICE_KERNEL_MODULES.get(group, ())):
            try:
                importlib.import_module(name)
            except ImportError as exc:  # an optional back-end that is not installed
                UNAVAILABLE[name] = f"{type(exc).__name__}: {exc}"


def _device_type(device) -> str:
    return device if isinstance(device, str) else getattr(device, "type", str(device))


def _candidates(op: str, dtype: str) -> list[Callable]:
    """``dtype``'s kernels in order of :data:`PREFERENCE`, then the generic ones."""
    order = PREFERENCE.get(dtype, ())
    specific = sorted(_REGISTRY[op].get(dtype, ()),
                      key=lambda fn: order.index(fn.backend) if fn.backend in order
                      else len(order))
    return specific + list(_REGISTRY[op].get("any", ()))


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
    dtype = _device_type(device)
    _load(dtype)
    candidates = _candidates(op, dtype)
    if backend is not None:
        candidates = [fn for fn in candidates if fn.backend == backend]
    if not candidates:
        missing = [f"{name} ({why})" for name, why in UNAVAILABLE.items()
                   if name.rsplit(".", 1)[1] == op.split('_stream')[0]]
        raise UnknownKernel(f"no {op!r} kernel for device {dtype!r}"
                            + (f" and back-end {backend!r}" if backend else "")
                            + (f"; not importable: {', '.join(missing)}" if missing else ""))
    return candidates[0]


def bind(kernel: Callable, **buffers) -> Callable:
    """``kernel`` with the arguments in ``buffers`` fixed (by parameter name).

    For calls repeated on the same buffers: the result takes the kernel's
    other arguments by keyword (``bind(clip_rows, acts=A, grads=G,
    factors=f)(max_norm=1.0)``) and returns what the kernel returns. The
    buffers must stay alive and keep their shapes while the bound kernel is
    used. Uses ``kernel.bind`` when the back-end provides one (see the module
    docstring), else ``functools.partial``.
    """
    binder = getattr(kernel, "bind", None)
    return binder(**buffers) if binder is not None else functools.partial(kernel, **buffers)


def implementations(op: str, device=None) -> dict[str, Callable]:
    """The preferred implementation of ``op`` per device: device -> function.

    With ``device``, that device's kernels are imported first (else only the
    generic and CPU ones are, as for any lookup).
    """
    _load("" if device is None else _device_type(device))
    return {d: _candidates(op, d)[0] for d, fns in _REGISTRY[op].items() if fns}


def backends(op: str, device) -> list[str]:
    """Back-end names registered for ``op`` on ``device``, preferred first
    (the generic ``"torch"`` last)."""
    dtype = _device_type(device)
    _load(dtype)
    return [fn.backend for fn in _candidates(op, dtype)]
