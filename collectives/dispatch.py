"""The all-reduce entry point: a fast path for the repeated call, and the rest.

The trainer reduces the same buffer with the same arguments on every step,
so :func:`allreduce` first compares the call with the previous one (object
identity of buffer and communicator, the algorithm and op strings, the
dtype) and, when nothing changed, runs the runner bound last time: no
allocation, no collective, a few hundred nanoseconds of Python. Anything
else takes :func:`allreduce_slow`: check the buffer, find or make the
checked plan of the signature (collective the first time, see
:mod:`collectives.consistency`), bind it to the buffer, remember the call.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from collectives import device, plans
from collectives.context import OPS, SUPPORTED_DTYPES
from collectives.errors import UnknownOp, UnsupportedBuffer
from collectives.registry import get
from collectives.runtime import MPI, mpi_cuda_support

Runner = Callable[[], None]
_NOTHING = object()
#: (buffer, comm argument, algorithm, op, buffer dtype, runner) of the last call.
_hot: tuple = (_NOTHING, _NOTHING, None, None, None, None)


def allreduce(buf: Any, comm: "MPI.Intracomm | None" = None, algorithm: str = "auto",
              op: str = "sum") -> Any:
    """Reduce ``buf`` in place over ``comm`` (default ``COMM_WORLD``); returns ``buf``.

    Args:
        buf: a contiguous 1-D buffer of float16, float32, float64, int32 or
            int64: a numpy array, a torch CPU tensor (reduced in place, no
            copy), or a device array exposing ``__cuda_array_interface__``
            (CuPy, torch CUDA): passed to MPI directly when MPI is CUDA-aware,
            else staged through a reused host buffer.
        comm: the intracommunicator; every rank of it must make the same call.
        algorithm: a name from :func:`collectives.names` (``auto`` picks by
            size and number of ranks).
        op: ``"sum"``, ``"max"`` or ``"min"``.

    Returns:
        ``buf``, now holding the reduction of every rank's buffer,
        bit-identical on every rank.

    Raises:
        UnknownAlgorithm, UnknownOp, UnsupportedBuffer: bad arguments (this rank).
        AllreduceMismatch: the ranks passed different lengths, dtypes, ops or
            algorithms (every rank on a first call; else the detecting rank).
    """
    hot = _hot
    if (buf is hot[0] and comm is hot[1] and algorithm == hot[2] and op == hot[3]
            and buf.dtype is hot[4]):
        hot[5]()
        return buf
    return allreduce_slow(buf, comm, algorithm, op)


def forget(comm: "MPI.Intracomm | None" = None) -> None:
    """Drop the remembered last call; with ``comm``, also its plans and buffers.

    Plans hold temporaries and references to the buffers they were bound
    to; forgetting them releases that memory. With ``comm`` every rank of it
    must call this (the next call of a forgotten signature is checked
    again, collectively); without, it is local.
    """
    global _hot
    _hot = (_NOTHING, _NOTHING, None, None, None, None)
    if comm is not None:
        plans.forget_plans(comm)


plans.ON_FREE.append(forget)


def _host_view(buf: np.ndarray) -> np.ndarray:
    if buf.ndim != 1:
        raise UnsupportedBuffer(f"allreduce needs a 1-D array, got shape {buf.shape}; pass a "
                                "flat view (x.ravel() of a contiguous array)")
    if not buf.flags.c_contiguous:
        raise UnsupportedBuffer("allreduce needs a contiguous array (it reduces in place); "
                                "pass np.ascontiguousarray(x) and use the result")
    if not buf.flags.writeable:
        raise UnsupportedBuffer("allreduce reduces in place but the array is read-only")
    if buf.dtype not in SUPPORTED_DTYPES or not buf.dtype.isnative:
        raise UnsupportedBuffer(f"allreduce does not support dtype {buf.dtype}; use one of "
                                f"{', '.join(map(str, SUPPORTED_DTYPES))} (native byte order)")
    return buf


def _is_torch_tensor(buf: Any) -> bool:
    module = type(buf).__module__
    return module.startswith("torch") and hasattr(buf, "data_ptr")


def _torch_view(tensor: Any) -> np.ndarray:
    if tensor.dim() != 1 or not tensor.is_contiguous():
        raise UnsupportedBuffer(f"allreduce needs a contiguous 1-D tensor, got shape "
                                f"{tuple(tensor.shape)}; pass a flat contiguous view")
    try:
        view = tensor.detach().numpy()
    except (RuntimeError, TypeError) as error:
        raise UnsupportedBuffer(f"allreduce cannot use this tensor in place: {error}") from None
    return _host_view(view)


def _torch_runner(tensor: Any, view: np.ndarray, run: Runner, retry: Runner) -> Runner:
    ptr, n = tensor.data_ptr(), view.size

    def run_tensor() -> None:
        if tensor.data_ptr() != ptr or tensor.numel() != n:  # storage swapped or resized
            forget()
            retry()
        else:
            run()

    return run_tensor


def _device_pointer(buf: Any) -> int:
    if _is_torch_tensor(buf):
        return buf.data_ptr()
    return buf.__cuda_array_interface__["data"][0]


def _device_runner(buf: Any, comm_state: plans.CommState, plan: plans.Plan,
                   retry: Runner) -> Runner:
    target = buf.detach() if _is_torch_tensor(buf) else buf
    ops = device.ops_for(target)
    n, dtype = plan.ctx.n, plan.ctx.dtype
    pointer = _device_pointer(buf)
    if mpi_cuda_support() and not plan.host_only:
        inner = plan.runner(buf, ops.as_array(target), space=ops.space(), extra=pointer)
        run = device.direct_runner(ops, target, inner)
    else:
        key = (n, dtype, ops.name)
        host = comm_state.staging.get(key)
        if host is None:
            host = comm_state.staging[key] = ops.empty_host(n, dtype)
        run = device.staged_runner(ops, target, host, plan.runner(host, host))

    def run_checked() -> None:
        if _device_pointer(buf) != pointer:  # e.g. a torch tensor given new storage
            forget()
            retry()
        else:
            run()

    return run_checked


def allreduce_slow(buf: Any, comm: "MPI.Intracomm | None", algorithm: str, op: str) -> Any:
    """:func:`allreduce` for a call that differs from the previous one."""
    global _hot
    if op not in OPS:
        raise UnknownOp(f"unknown op {op!r}; choose from {', '.join(OPS)}")
    get(algorithm)  # UnknownAlgorithm before any communication
    user_comm = MPI.COMM_WORLD if comm is None else comm
    if isinstance(buf, np.ndarray):
        kind, view = "host", _host_view(buf)
        n, dtype = view.size, view.dtype
    elif _is_torch_tensor(buf) and buf.device.type == "cpu":
        kind, view = "torch", _torch_view(buf)
        n, dtype = view.size, view.dtype
    elif device.is_device_array(buf):
        kind, view = "device", None
        n, dtype = device.describe(buf.detach() if _is_torch_tensor(buf) else buf)
    else:
        raise UnsupportedBuffer(
            f"allreduce cannot reduce a {type(buf).__name__}; pass a numpy array, a torch "
            "tensor or a device array (__cuda_array_interface__)")
    state = plans.comm_state(user_comm)
    plan = state.plan(n, dtype, op, algorithm)
    if kind == "host":
        run = plan.runner(buf, view)
    elif kind == "torch":
        inner = plan.runner(buf, view, extra=(buf.data_ptr(), n))
        run = _torch_runner(buf, view, inner,
                            lambda: allreduce_slow(buf, comm, algorithm, op))
    else:
        run = _device_runner(buf, state, plan, lambda: allreduce_slow(buf, comm, algorithm, op))
    if getattr(buf, "dtype", _NOTHING) is not _NOTHING:
        _hot = (buf, comm, algorithm, op, buf.dtype, run)
    run()
    return buf


def algorithm_for(nbytes: int, comm: "MPI.Intracomm | None" = None,
                  algorithm: str = "auto") -> str:
    """The algorithm that ``algorithm`` runs for ``nbytes`` on ``comm``.

    Collective the first time ``comm`` is used by this module (as allreduce).
    """
    chosen = get(algorithm)
    if chosen.choose is None:
        return chosen.name
    state = plans.comm_state(MPI.COMM_WORLD if comm is None else comm)
    return chosen.choose(nbytes, state.placement)
