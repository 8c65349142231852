"""The kernel registry: (op, back-end) -> kernel, chosen by device, bound to buffers.

Each op (contracts in :mod:`kernels`) has at most one kernel per back-end,
in ``kernels/<back-end>/<module>.py`` (:data:`MODULES` names the module),
and that module registers it when imported::

    @register("clip_rows", backend="numba_cpu")
    def clip_rows(acts, grads, max_norm, factors): ...

Every back-end runs on one device type, declared in :data:`BACKENDS`, so
the engine never names a kernel module: it asks once, at set-up, for an op
on the device of its tensors (:func:`get`), and binds the kernel to the
buffers it will pass at every step (:func:`bind`). A back-end's modules are
imported on the first lookup for its device, so adding a back-end is a new
folder and a line in :data:`BACKENDS`, and touches no other back-end.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Backend:
    """One back-end: the package ``kernels/<name>/`` and where its kernels run."""

    #: Its package under ``kernels/`` and its key in the registry.
    name: str
    #: The torch device type of the tensors its kernels take; ``"any"`` for
    #: the generic torch kernels, the fallback on every device.
    device: str
    #: What ``backend=`` (and ``mpidp train --kernels``) selects it by, and
    #: ``kernel.backend``: one name for Numba's CPU and CUDA back-ends, since a
    #: device has at most one back-end of a family.
    family: str


#: Every back-end. Where a device has several, the first listed is preferred:
#: CuPy before Numba CUDA (its launches cost the least Python). The generic
#: ones (device ``"any"``) come after every device's own.
BACKENDS: dict[str, Backend] = {b.name: b for b in (
    Backend("numba_cpu", "cpu", "numba"),
    Backend("cupy", "cuda", "cupy"),
    Backend("numba_cuda", "cuda", "numba"),
    Backend("torch", "any", "torch"),
)}

#: op -> the module of its kernel in each back-end's package.
MODULES = {
    "clip_rows": "clip_rows",
    "clip_groups": "clip_groups",
    "clip_linear_rows": "clip_linear_rows",
    "relu_backward": "relu_backward",
    "softmax_xent": "softmax_xent",
    "sgd_update": "sgd_update",
    "gaussian_stream": "gaussian",
    "gather_rows": "gather_rows",
}
OPS = tuple(MODULES)

#: Fused ops: one call doing what the engine would otherwise compose from
#: the ops above (name -> module). A back-end may offer one; there is no
#: generic kernel, because the generic version is the engine's own
#: composition of the ops. Its ``bind`` returns None where it cannot serve
#: the buffers, and the engine composes instead.
FUSED = {
    "mlp_step": "mlp_step",
}

#: Ops without CUDA kernels of their own: on GPUs the generic torch kernel runs
#: (the per-group clipping's padded batched GEMMs are what a GPU runs well
#: anyway; the generic path's Linear clipping is a few launches per layer
#: there; the batch's row gather is torch's index_select, one launch).
GENERIC_ON_GPU = ("clip_groups", "clip_linear_rows", "gather_rows")

#: (op, back-end name) -> kernel.
_KERNELS: dict[tuple[str, str], Callable] = {}
#: (fused op, back-end name) -> kernel.
_FUSED_KERNELS: dict[tuple[str, str], Callable] = {}
#: Back-ends whose modules were imported.
_loaded: set[str] = set()
#: Kernel modules that could not be imported, and why (an optional back-end).
UNAVAILABLE: dict[str, str] = {}


class UnknownKernel(LookupError):
    """No kernel for an op on a device (and back-end)."""


class BackendUnusable(RuntimeError):
    """A GPU back-end imports but cannot compile or launch a kernel here."""


#: GPU back-end name -> None (its probe kernel ran) or why it cannot run.
_CHECKED: dict[str, str | None] = {}


def _registrar(table: dict, kind: str, name: str, known: dict,
               backend: str) -> Callable[[Callable], Callable]:
    """The decorator that puts ``fn`` into ``table`` under ``(name, backend)``."""
    if name not in known:
        raise ValueError(f"unknown {kind} {name!r}; {kind}s are {', '.join(known)}")
    if backend not in BACKENDS:
        raise ValueError(f"unknown back-end {backend!r}; back-ends are {', '.join(BACKENDS)}")

    def decorate(fn: Callable) -> Callable:
        if (name, backend) in table:
            raise ValueError(f"{kind} {name!r} registered twice for back-end {backend!r}")
        fn.backend = BACKENDS[backend].family  # type: ignore[attr-defined]
        table[name, backend] = fn
        return fn

    return decorate


def register(op: str, *, backend: str) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn`` as ``backend``'s kernel for ``op``.

    Sets ``fn.backend`` to the back-end's family (``"numba"``, ``"cupy"``,
    ``"torch"``). Raises ValueError for an op not in :data:`OPS`, a back-end
    not in :data:`BACKENDS`, or a second kernel for the same pair.
    """
    return _registrar(_KERNELS, "kernel op", op, MODULES, backend)


def register_fused(name: str, *, backend: str) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn`` as ``backend``'s kernel for the fused op ``name``
    (:data:`FUSED`); ValueError for an unknown name or back-end, or a second one."""
    return _registrar(_FUSED_KERNELS, "fused op", name, FUSED, backend)


def fused(name: str, device="cpu", backend: str | None = None) -> Callable | None:
    """The kernel of the fused op ``name`` for ``device`` (and the forced
    ``backend`` family, if any), or None: then the caller composes the ops."""
    dtype = _device_type(device)
    _load(dtype)
    for b in BACKENDS.values():
        fn = _FUSED_KERNELS.get((name, b.name))
        if fn is not None and b.device == dtype and backend in (None, fn.backend):
            return fn
    return None


def _import(backend: str) -> None:
    """Import ``kernels/<backend>/<module>.py`` for every op it has a module for."""
    if backend in _loaded:
        return
    _loaded.add(backend)
    for module in (*MODULES.values(), *FUSED.values()):
        name = f"kernels.{backend}.{module}"
        if importlib.util.find_spec(name) is None:
            continue  # no kernel for that op here (no CUDA clip_groups)
        try:
            importlib.import_module(name)
        except ImportError as exc:  # an optional back-end that is not installed
            UNAVAILABLE[name] = f"{type(exc).__name__}: {exc}"


def _load(device_type: str = "") -> None:
    """Import the generic and CPU back-ends, and ``device_type``'s when given."""
    for b in BACKENDS.values():
        # Other devices' back-ends are imported only when that device is asked
        # for: the CPU path never imports CuPy or Numba's CUDA target.
        if b.device in ("any", "cpu", device_type):
            _import(b.name)


def _device_type(device) -> str:
    return device if isinstance(device, str) else getattr(device, "type", str(device))


def _candidates(op: str, device_type: str) -> list[Callable]:
    """``device_type``'s kernels for ``op`` in the order of :data:`BACKENDS`, then
    the generic ones."""
    names = [b.name for b in BACKENDS.values() if b.device == device_type]
    names += [b.name for b in BACKENDS.values() if b.device == "any" and b.name not in names]
    return [_KERNELS[op, name] for name in names if (op, name) in _KERNELS]


def get(op: str, device="cpu", backend: str | None = None) -> Callable:
    """The kernel of ``op`` for tensors on ``device`` (a torch.device or its type).

    Args:
        op: one of :data:`OPS`.
        device: where the tensors live.
        backend: force a family (``"numba"``, ``"cupy"``, ``"torch"`` for the
            generic kernel); ``None`` picks the device's preferred kernel, the
            generic one when the device has none.

    Raises:
        UnknownKernel: no kernel for that op, device and back-end.
    """
    dtype = _device_type(device)
    _load(dtype)
    candidates = _candidates(op, dtype)
    if backend is not None:
        candidates = [fn for fn in candidates if fn.backend == backend]
    if not candidates:
        missing = [f"{name} ({why})" for name, why in UNAVAILABLE.items()
                   if name.rsplit(".", 1)[1] == MODULES.get(op)]
        raise UnknownKernel(f"no {op!r} kernel for device {dtype!r}"
                            + (f" and back-end {backend!r}" if backend else "")
                            + (f"; not importable: {', '.join(missing)}" if missing else ""))
    return candidates[0]


def get_or_best(op: str, device="cpu", backend: str | None = None) -> Callable:
    """:func:`get`, except that a forced ``backend`` without a kernel for ``op``
    on ``device`` (``cupy`` has no ``clip_groups``: :data:`GENERIC_ON_GPU`) gives
    the best kernel there is instead of UnknownKernel."""
    if backend is not None and backend not in backends(op, device):
        backend = None
    return get(op, device, backend)


def check(backend: str) -> str | None:
    """Compile and launch a one-thread probe kernel of GPU back-end ``backend``.

    Returns None when it ran, else why not (one line). Importing a back-end
    is not enough: numba-cuda can import, see the GPU and then fail at its
    first compile. Cached per process; call it after the rank's GPU is bound
    (the probe runs on the current device).
    """
    if BACKENDS[backend].device != "cuda":
        raise ValueError(f"{backend!r} is not a GPU back-end")
    if backend not in _CHECKED:
        try:
            written = importlib.import_module(f"kernels.{backend}.launch").self_check()
            if written.item() != 1.0:  # .item() synchronizes with the kernel's stream
                raise RuntimeError("the probe kernel ran but did not write its result")
        except ImportError as exc:
            _CHECKED[backend] = f"not importable ({type(exc).__name__}: {exc})"
        except Exception as exc:  # noqa: BLE001 - any failure of the probe is the answer
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            _CHECKED[backend] = f"cannot compile or launch a kernel ({type(exc).__name__}: {first})"
        else:
            _CHECKED[backend] = None
    return _CHECKED[backend]


def choose(device, backend: str | None = None) -> str | None:
    """The kernel family to run on ``device``: ``backend`` once checked, or the
    first GPU back-end whose probe kernel runs.

    On the CPU (or for the generic ``"torch"``) nothing is probed and
    ``backend`` is returned as given (None: the registry's preference). On a
    GPU, ``None`` gives the first of the device's back-ends (:data:`BACKENDS`
    order) that passes :func:`check`, and ``"torch"`` when none does.

    Raises:
        BackendUnusable: ``backend`` was named and cannot run here (the
            message says why and which families can).
    """
    dtype = _device_type(device)
    if dtype != "cuda" or backend == "torch":
        return backend
    _load(dtype)
    names = {b.family: b.name for b in BACKENDS.values() if b.device == "cuda"}
    if backend is None:  # the first that runs: the others are not compiled at all
        return next((family for family, name in names.items() if check(name) is None),
                    "torch")
    if backend in names and check(names[backend]) is None:
        return backend
    usable = ", ".join([f for f, name in names.items() if check(name) is None] + ["torch"])
    if backend not in names:
        raise BackendUnusable(f"no {backend!r} back-end for {dtype!r}; usable here: {usable}")
    raise BackendUnusable(f"the {backend} back-end on {dtype!r}: {check(names[backend])}; "
                          f"usable here: {usable}")


def bind(kernel: Callable, **buffers) -> Callable:
    """``kernel`` with the arguments in ``buffers`` fixed (by parameter name).

    For calls repeated on the same buffers: the result takes the kernel's
    other arguments by keyword (``bind(clip_rows, acts=A, grads=G,
    factors=f)(max_norm=1.0)``) and returns what the kernel returns. The
    buffers must stay alive and keep their shapes while the bound kernel is
    used. A back-end whose arguments need converting provides
    ``kernel.bind`` and converts once there (the Numba CPU kernels take numpy
    views of the tensors, whose making costs about as much as a small kernel
    call); the others are bound with ``functools.partial``.
    """
    binder = getattr(kernel, "bind", None)
    return binder(**buffers) if binder is not None else functools.partial(kernel, **buffers)


def backends(op: str, device) -> list[str]:
    """Families with a kernel for ``op`` on ``device``, preferred first (the
    generic ``"torch"`` last)."""
    dtype = _device_type(device)
    _load(dtype)
    return [fn.backend for fn in _candidates(op, dtype)]


def implementations(op: str, device=None) -> dict[str, Callable]:
    """The preferred kernel of ``op`` per device type (``"any"`` for the generic one).

    With ``device``, that device's back-ends are imported first (else only the
    generic and CPU ones are, as for any lookup).
    """
    _load("" if device is None else _device_type(device))
    devices = {BACKENDS[name].device for (o, name) in _KERNELS if o == op}
    return {d: _candidates(op, d)[0] for d in devices}


def kernels_of(backend: str) -> dict[str, Callable]:
    """op -> kernel of one back-end (imported first; empty when it cannot be).

    Raises:
        KeyError: ``backend`` is not in :data:`BACKENDS`.
    """
    _import(BACKENDS[backend].name)
    return {op: fn for (op, name), fn in _KERNELS.items() if name == backend}
