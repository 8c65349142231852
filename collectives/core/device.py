"""Device buffers: handed to a CUDA-aware MPI, or staged through host memory.

A device buffer is anything exposing ``__cuda_array_interface__`` (CuPy
arrays, torch CUDA tensors, Numba device arrays). What the all-reduce needs
from the device is small and lives behind :class:`DeviceOps`: synchronize the
buffer's stream, copy to and from a host array, allocate a (pinned) host
staging buffer, and, for a CUDA-aware MPI, an array space (device
temporaries and element-wise combine) so the point-to-point algorithms run
on the device too. :class:`CupyOps` implements it with CuPy, which wraps
any ``__cuda_array_interface__`` object without copying.

* **CUDA-aware MPI** (:func:`collectives.runtime.mpi_cuda_support`, or
  ``MPIDP_CUDA_AWARE=1``): the buffer goes to MPI directly, after its
  stream is synchronized (MPI does not look at CUDA streams); combines run
  on the device, each followed by a stream synchronize before MPI reads.
* **Otherwise**: synchronize, copy into a host staging buffer that is
  allocated once per signature (pinned when CuPy is present), all-reduce on
  the host, copy back.

Other array types can register their own :class:`DeviceOps` with
:func:`register_device_ops` (the tests do, with a fake device array).
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

import numpy as np

from collectives.core.context import OPS, SUPPORTED_DTYPES
from collectives.errors import UnsupportedBuffer

Runner = Callable[[], None]


class DeviceOps(Protocol):
    """What the all-reduce needs from a device library (see module docstring)."""

    name: str

    def synchronize(self, buf: Any) -> None:
        """Wait for the work queued on ``buf``'s stream (its CUDA array interface's)."""

    def to_host(self, buf: Any, host: np.ndarray) -> None:
        """Copy ``buf`` into ``host``; complete when it returns."""

    def from_host(self, host: np.ndarray, buf: Any) -> None:
        """Copy ``host`` into ``buf``; complete when it returns."""

    def empty_host(self, n: int, dtype: np.dtype) -> np.ndarray:
        """A host array for staging (pinned memory when the library can)."""

    def as_array(self, buf: Any) -> Any:
        """``buf`` as an array of the device space (no copy), for CUDA-aware MPI."""

    def space(self) -> Any:
        """The array space (``name``, ``empty``, ``combiner``, ``spec``) on the device."""


_REGISTERED: list[tuple[type, DeviceOps]] = []


def register_device_ops(array_type: type, ops: DeviceOps) -> None:
    """Use ``ops`` for buffers of ``array_type`` (checked before CuPy)."""
    _REGISTERED.insert(0, (array_type, ops))


def unregister_device_ops(array_type: type) -> None:
    """Undo :func:`register_device_ops` for ``array_type``."""
    _REGISTERED[:] = [(t, o) for t, o in _REGISTERED if t is not array_type]


def is_device_array(buf: Any) -> bool:
    """True for objects exposing ``__cuda_array_interface__``."""
    return hasattr(type(buf), "__cuda_array_interface__")


def describe(buf: Any) -> tuple[int, np.dtype]:
    """Length and dtype of a 1-D contiguous device array; raises UnsupportedBuffer."""
    try:
        cai = buf.__cuda_array_interface__
        shape, typestr = tuple(cai["shape"]), cai["typestr"]
        strides = cai.get("strides")
    except Exception as error:  # noqa: BLE001 - any failure means "not usable"
        raise UnsupportedBuffer(f"cannot read __cuda_array_interface__ of "
                                f"{type(buf).__name__}: {error}") from None
    dtype = np.dtype(typestr)
    if len(shape) != 1:
        raise UnsupportedBuffer(f"allreduce needs a 1-D device array, got shape {shape}; "
                                "pass a flat view (e.g. x.ravel())")
    if dtype not in SUPPORTED_DTYPES:
        raise UnsupportedBuffer(f"allreduce does not support dtype {dtype} on the device; use "
                                f"one of {', '.join(map(str, SUPPORTED_DTYPES))}")
    if strides is not None and shape[0] > 1 and tuple(strides) != (dtype.itemsize,):
        raise UnsupportedBuffer("allreduce needs a contiguous device array; pass a contiguous "
                                "copy (e.g. cupy.ascontiguousarray(x))")
    return int(shape[0]), dtype


def ops_for(buf: Any) -> DeviceOps:
    """The :class:`DeviceOps` for ``buf``: a registered one, else CuPy."""
    for array_type, ops in _REGISTERED:
        if isinstance(buf, array_type):
            return ops
    try:
        return CupyOps()
    except ImportError:
        raise UnsupportedBuffer(
            f"allreduce got a device array ({type(buf).__name__}) but CuPy is not installed; "
            "install the GPU extra (pip install 'mpidp[cuda12]')") from None


def direct_runner(ops: DeviceOps, buf: Any, run: Runner) -> Runner:
    """Runner for CUDA-aware MPI: synchronize the buffer's stream, then ``run``."""
    synchronize = ops.synchronize

    def run_direct() -> None:
        synchronize(buf)
        run()

    return run_direct


def staged_runner(ops: DeviceOps, buf: Any, host: np.ndarray, run: Runner) -> Runner:
    """Runner through host memory: device -> ``host``, ``run`` on it, ``host`` -> device."""
    synchronize, to_host, from_host = ops.synchronize, ops.to_host, ops.from_host

    def run_staged() -> None:
        synchronize(buf)
        to_host(buf, host)
        run()
        from_host(host, buf)

    return run_staged


#: CUDA C bodies of the element-wise rules of :mod:`collectives.core.combine`
#: (``nan("")`` is the canonical quiet NaN, converted to ``T``).
DEVICE_RULES = {
    "sum": "T v = a + b; out = (v != v) ? (T)nan(\"\") : v;",
    "max": "out = (a != a || b != b) ? (T)nan(\"\") : (a > b) ? a : (b > a) ? b "
           ": (a == (T)0) ? (T)(a + b) : a;",
    "min": "out = (a != a || b != b) ? (T)nan(\"\") : (a < b) ? a : (b < a) ? b "
           ": (a == (T)0) ? (T)(-((-a) + (-b))) : a;",
    "canonical": "out = (a != a) ? (T)nan(\"\") : a;",
}


class CupySpace:
    """Device temporaries and combines with CuPy (for CUDA-aware MPI)."""

    name = "cupy"

    def __init__(self, cupy: Any) -> None:
        self.cupy = cupy

    def empty(self, n: int, dtype: np.dtype) -> Any:
        return self.cupy.empty(n, dtype)

    def combiner(self, op: str, dtype: np.dtype) -> Callable[[Any, Any, Any], None]:
        """The rule of :mod:`collectives.core.combine` as one CuPy element-wise kernel
        (integers: CuPy's ufunc)."""
        cupy = self.cupy
        if dtype.kind == "f":
            kernel = cupy.ElementwiseKernel("T a, T b", "T out", DEVICE_RULES[op],
                                            f"mpidp_{op}_rule")
        else:
            ufunc = getattr(cupy, OPS[op][1])

            def kernel(a, b, out):
                ufunc(a, b, out=out)
        current_stream = cupy.cuda.get_current_stream

        def combine(a, b, out):
            kernel(a, b, out)
            current_stream().synchronize()  # MPI reads ``out`` next

        return combine

    def canonicalizer(self, dtype: np.dtype) -> Callable[[Any], None] | None:
        """``fix(view)``: NaNs of ``view`` made canonical on the device; None for integers."""
        if dtype.kind != "f":
            return None
        kernel = self.cupy.ElementwiseKernel("T a, T b", "T out", DEVICE_RULES["canonical"],
                                             "mpidp_canonical_rule")
        current_stream = self.cupy.cuda.get_current_stream

        def fix(view: Any) -> None:
            kernel(view, view, view)
            current_stream().synchronize()

        return fix

    def spec(self, view: Any, mpi_type: Any) -> list:
        return [view, mpi_type]  # mpi4py passes the device pointer on


class CupyOps:
    """:class:`DeviceOps` with CuPy (wraps any ``__cuda_array_interface__`` object)."""

    name = "cupy"

    def __init__(self, cupy: Any = None, cupyx: Any = None) -> None:
        """Use the ``cupy``/``cupyx`` modules given (tests pass stand-ins), else import them."""
        if cupy is None:
            import cupy  # ImportError tells ops_for that CuPy is missing
            import cupyx
        self.cupy, self.cupyx = cupy, cupyx

    def synchronize(self, buf: Any) -> None:
        cai = buf.__cuda_array_interface__
        runtime = self.cupy.cuda.runtime
        if "stream" not in cai:
            runtime.deviceSynchronize()  # producer did not say: be safe
        elif cai["stream"] is not None:  # None: producer promises no pending work
            runtime.streamSynchronize(cai["stream"])

    def to_host(self, buf: Any, host: np.ndarray) -> None:
        self.cupy.asarray(buf).get(out=host, blocking=True)

    def from_host(self, host: np.ndarray, buf: Any) -> None:
        self.cupy.asarray(buf).set(host)
        self.cupy.cuda.get_current_stream().synchronize()

    def empty_host(self, n: int, dtype: np.dtype) -> np.ndarray:
        return self.cupyx.empty_pinned((n,), dtype=dtype)

    def as_array(self, buf: Any) -> Any:
        return self.cupy.asarray(buf)

    def space(self) -> CupySpace:
        return CupySpace(self.cupy)
