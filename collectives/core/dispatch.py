"""The all-reduce entry point: a fast path for the repeated call, and the rest.

The trainer reduces the same buffer with the same arguments on every step,
so :func:`allreduce` first compares the call with the previous one (object
identity of buffer and communicator, the algorithm and op, the dtype, that
the array is still 1-D, writeable and contiguous) and, when nothing
changed, runs the runner bound last time: no allocation, no collective, no plan
lookup. For a tuned ``auto`` on a numpy array it takes the next call from
the tuner's iterator itself (:class:`collectives.auto.tuning.TunedPlan`),
because a frame of ``auto``'s own is a measurable share of a small call
(docs/design/auto-tuner.md). Anything else takes the slow path: check the
buffer, find or make the checked plan of the signature (collective the
first time, see :mod:`collectives.core.consistency`), bind it to the
buffer, remember the call.

A numpy array bound to a plan is held by a weak reference, which makes
numpy refuse to resize it in place (``ndarray.resize`` raises, even with
``refcheck=False``): its size and memory cannot change, so the bound runner
can never write into memory the array no longer owns (re-reading its data
pointer would cost as much as the rest of the fast path). :func:`forget`
releases the bindings. Its strides can still change in place
(``x.strides = ...``, which keeps its data pointer): the fast path reads
its contiguity with its writeability (one ``flags`` object), so a layout a
first call would refuse is refused on any call. A torch or device buffer is
re-checked by its data pointer, length and strides on every call instead
(``as_strided_`` changes a tensor's layout in place; whether a torch tensor
requires grad is checked with the rest of the call, when it is bound); a torch CPU
tensor is reduced through a numpy view of its memory made by
address (``tensor.numpy()`` would make its storage unresizable for good).

What happens when a call fails is the subject of :mod:`collectives.core.failures`.
"""
from __future__ import annotations

import ctypes
import sys
import threading
import weakref
from typing import Any, Callable, NamedTuple

import numpy as np

from collectives.core import device, failures, plans
from collectives.core.context import OPS, SUPPORTED_DTYPES
from collectives.errors import AllreduceError, UnknownOp, UnsupportedBuffer
from collectives.registry import Algorithm, get
from collectives.runtime import MPI, mpi_cuda_support

Runner = Callable[[], None]
_NOTHING = object()
#: The last call: (buffer, comm argument, algorithm, op argument, dtype,
#: skip the writeable and contiguity checks (not a numpy array), runner, and
#: for a tuned ``auto`` the runner's iterator of calls (``next(calls)()`` is
#: a call), else None).
_EMPTY = (_NOTHING, _NOTHING, None, None, None, True, None, None)
_hot: tuple = _EMPTY


def allreduce(buf: Any, comm: "MPI.Intracomm | None" = None, algorithm: str = "auto",
              op: "str | MPI.Op" = "sum") -> Any:
    """Reduce ``buf`` in place over ``comm`` (default ``COMM_WORLD``); returns ``buf``.

    Every rank of ``comm`` must make the same sequence of calls, with
    buffers of the same length and dtype and the same algorithm and op.

    Args:
        buf: a contiguous, writeable 1-D buffer of float16, float32, float64,
            int32 or int64: a numpy array, a torch CPU tensor (reduced in
            place, no copy), or a device array exposing
            ``__cuda_array_interface__`` (CuPy, torch CUDA): passed to MPI
            directly when MPI is CUDA-aware, else staged through a reused host
            buffer. A numpy array cannot be resized in place while a plan
            holds it (see the module docstring).
        comm: the intracommunicator.
        algorithm: a name from :func:`collectives.names` (``auto`` picks by
            size and placement).
        op: ``"sum"``, ``"max"`` or ``"min"`` (or ``MPI.SUM``, ``MPI.MAX``,
            ``MPI.MIN``). Floats follow the special-value rule of
            :mod:`collectives.core.combine` (one answer for NaN, inf and -0.0 on
            every rank and with every algorithm).

    Returns:
        ``buf``, now holding the reduction of every rank's buffer,
        bit-identical on every rank.

    Raises:
        UnknownAlgorithm, UnknownOp, UnsupportedBuffer, AllreduceError: bad
            arguments on this rank.
        AllreduceMismatch: the ranks passed different lengths, dtypes, ops or
            algorithms, or made their calls in a different order.

    An error raised on every rank alike (``collective = True``) leaves the
    communicator usable. Any other error on a job of several ranks ends the
    job (``MPI_Abort``) after printing it, unless
    :func:`collectives.abort_on_error` was turned off; see
    :mod:`collectives.core.failures`.
    """
    hot = _hot
    if (buf is hot[0] and comm is hot[1] and algorithm == hot[2] and op == hot[3]
            and buf.dtype is hot[4] and buf.ndim == 1
            and (hot[5] or ((flags := buf.flags).writeable and flags.c_contiguous))):
        try:
            calls = hot[7]
            if calls is None:
                hot[6]()
            else:  # tuned auto: its next call, with no frame of auto's own
                next(calls)()
        except BaseException as error:
            forget()
            if not getattr(error, "_collectives_wiped", False):  # not by a nested retry
                wipe(buf)
            failures.handle(error, comm, midway=True)
            raise
        return buf
    return _allreduce_slow(buf, comm, algorithm, op)


def forget(comm: "MPI.Intracomm | None" = None) -> None:
    """Drop the remembered last call; with ``comm``, also its plans and buffers.

    Plans hold temporaries and references to the buffers they were bound
    to; forgetting them releases that memory (and lets those arrays be
    resized again). With ``comm`` every rank of it must call this (the next
    call of a forgotten signature is checked again, collectively); without,
    it is local.
    """
    global _hot
    _hot = _EMPTY
    if comm is not None:
        plans.forget_plans(comm)


plans.ON_FREE.append(forget)


def op_name(op: Any) -> str:
    """``"sum"``/``"max"``/``"min"`` for a name or an ``MPI.Op``; raises :class:`UnknownOp`."""
    if isinstance(op, str):
        if op in OPS:
            return op
    elif isinstance(op, MPI.Op):
        for name, (mpi_op, _) in OPS.items():
            if op == mpi_op:
                return name
    raise UnknownOp(f"unknown op {op!r}; allreduce supports sum, max and min (as strings or "
                    "MPI.SUM, MPI.MAX, MPI.MIN)")


def _host_view(buf: np.ndarray) -> np.ndarray:
    if buf.ndim != 1:
        raise UnsupportedBuffer(f"allreduce needs a 1-D array, got shape {buf.shape}; pass a "
                                "flat view (x.ravel() of a contiguous array)")
    if not buf.flags.c_contiguous:
        raise UnsupportedBuffer("allreduce needs a contiguous array (it reduces in place); "
                                "pass np.ascontiguousarray(x) and use the result")
    if not buf.flags.writeable:
        raise UnsupportedBuffer("allreduce reduces in place but the array is read-only "
                                "(flags.writeable is False); pass a writeable copy")
    if buf.dtype not in SUPPORTED_DTYPES or not buf.dtype.isnative:
        raise UnsupportedBuffer(f"allreduce does not support dtype {buf.dtype}; use one of "
                                f"{', '.join(map(str, SUPPORTED_DTYPES))} (native byte order)")
    return buf


def _is_torch_tensor(buf: Any) -> bool:
    module = type(buf).__module__
    return module.startswith("torch") and hasattr(buf, "data_ptr")


def _check_tensor(tensor: Any) -> np.dtype:
    """The numpy dtype of a torch tensor the all-reduce may reduce in place
    (any device); raises :class:`UnsupportedBuffer`."""
    name = str(tensor.dtype).removeprefix("torch.")
    try:
        dtype = np.dtype(name)
    except TypeError:  # bfloat16, complex32, ...: no numpy twin
        dtype = None
    if dtype is None or dtype not in SUPPORTED_DTYPES:  # (None == float64 for numpy)
        raise UnsupportedBuffer(
            f"allreduce does not support dtype {tensor.dtype}; use one of "
            f"{', '.join('torch.' + str(d) for d in SUPPORTED_DTYPES)} (e.g. reduce "
            "x.float() and copy the result back)")
    if tensor.requires_grad and sys.modules["torch"].is_grad_enabled():
        raise UnsupportedBuffer(
            "allreduce writes into the tensor in place, where autograd cannot see it, but "
            "the tensor requires grad and grad mode is on (torch refuses in-place changes of "
            "such a leaf too); reduce a tensor that does not (its .grad, or x.detach(), the "
            "same memory), or call it under torch.no_grad() as an optimizer would")
    return dtype


def _torch_view(tensor: Any) -> np.ndarray:
    dtype = _check_tensor(tensor)
    if tensor.dim() != 1:
        raise UnsupportedBuffer(f"allreduce needs a 1-D tensor, got shape {tuple(tensor.shape)}; "
                                "pass a flat view (x.view(-1) of a contiguous tensor)")
    if not tensor.is_contiguous():
        raise UnsupportedBuffer(f"allreduce needs a contiguous tensor (it reduces in place), "
                                f"got strides {tuple(tensor.stride())}; pass x.contiguous() "
                                "and use the result")
    # A view of the tensor's memory by address: tensor.numpy() would mark its
    # storage not resizable for good (even after collectives.forget). The
    # view is valid while the storage is; the runner re-checks the data
    # pointer and length on every call (_torch_runner), and the plan holds
    # the tensor while it is bound.
    n = tensor.numel()
    if n == 0:
        return np.empty(0, dtype)
    memory = (ctypes.c_char * (n * dtype.itemsize)).from_address(tensor.data_ptr())
    return _host_view(np.frombuffer(memory, dtype=dtype))


def _torch_runner(tensor: Any, view: np.ndarray, run: Runner, retry: Runner) -> Runner:
    """``run``, or ``retry`` (the slow path, which checks the tensor afresh)
    where the tensor's memory or layout changed since it was bound."""
    ptr, n, strides = tensor.data_ptr(), view.size, tensor.stride()

    def run_tensor() -> None:
        # storage swapped or resized, or strides changed in place (as_strided_)
        if tensor.data_ptr() != ptr or tensor.numel() != n or tensor.stride() != strides:
            forget()
            retry()
        else:
            run()

    return run_tensor


def _device_layout(buf: Any) -> tuple:
    """``(data pointer, strides)`` of a device buffer: a torch tensor's, else
    its array interface's (strides None where it says C-contiguous)."""
    if _is_torch_tensor(buf):
        return buf.data_ptr(), buf.stride()
    interface = buf.__cuda_array_interface__
    return interface["data"][0], interface.get("strides")


def _nothing_to_reduce() -> None:
    """The all-reduce of a device buffer over one rank."""


def _device_runner(buf: Any, comm_state: plans.CommState, plan: plans.Plan,
                   retry: Runner) -> Runner:
    layout = _device_layout(buf)
    target = buf.detach() if _is_torch_tensor(buf) else buf
    n, dtype = plan.ctx.n, plan.ctx.dtype
    if comm_state.size == 1:
        # One rank: the sum is the buffer. Nothing to stage, and no reason to
        # wait for the device (a one-GPU run keeps the host ahead of it).
        run = _nothing_to_reduce
    elif mpi_cuda_support() and not plan.host_only:
        ops = device.ops_for(target)
        inner = plan.runner(buf, ops.as_array(target), space=ops.space(), extra=layout[0])
        run = device.direct_runner(ops, target, inner)
    else:
        ops = device.ops_for(target)
        key = (n, dtype, ops.name)
        host = comm_state.staging.get(key)
        if host is None:
            host = comm_state.staging[key] = ops.empty_host(n, dtype)
        run = device.staged_runner(ops, target, host, plan.runner(host, host))

    def run_checked() -> None:
        # e.g. a torch tensor given new storage, or new strides (as_strided_)
        if _device_layout(buf) != layout:
            forget()
            retry()
        else:
            run()

    return run_checked


class _Checked(NamedTuple):
    """A call whose arguments passed the checks."""

    kind: str  # "host", "torch" or "device"
    view: Any  # the numpy view to reduce (None for a device buffer)
    n: int
    dtype: np.dtype
    op: str
    algorithm: Algorithm
    state: plans.CommState


def _allreduce_slow(buf: Any, comm: "MPI.Intracomm | None", algorithm: str, op: Any) -> Any:
    """:func:`allreduce` for a call that differs from the previous one."""
    stage = ["checking"]  # then "planning" (the first-call check), then "running"
    try:
        call = _check(buf, comm, algorithm, op)
        stage[0] = "planning"
        return _bind_and_run(buf, comm, algorithm, op, call, stage)
    except BaseException as error:
        forget()
        if stage[0] == "running" and not getattr(error, "_collectives_wiped", False):
            wipe(buf)
        try:
            error._collectives_wiped = True  # decided here: the caller's frames leave it
        except AttributeError:  # an exception without a __dict__
            pass
        failures.handle(error, comm, stage[0] != "checking")
        raise


def wipe(buf: Any) -> None:
    """Fill ``buf`` with NaN (floats) or 0 (integers) after a call failed
    once its data had moved: it may hold a mix of calls or ranks, which must
    never pass for a result (nor show this rank another rank's numbers).
    Local; best effort (a buffer that cannot be written is left alone)."""
    try:
        if _is_torch_tensor(buf):
            target = buf.detach()
            target.fill_(float("nan") if target.dtype.is_floating_point else 0)
        elif isinstance(buf, np.ndarray) or hasattr(buf, "fill"):
            buf.fill(np.nan if np.dtype(buf.dtype).kind == "f" else 0)
    except Exception:  # noqa: BLE001 - the call's own error is the one to report
        pass


def _check(buf: Any, comm: Any, algorithm: str, op: Any) -> _Checked:
    """Check the call's arguments (rule 1 of :mod:`collectives.core.failures`)."""
    name = op_name(op)
    chosen = get(algorithm)  # UnknownAlgorithm before any communication
    if isinstance(buf, np.ndarray):
        kind, view = "host", _host_view(buf)
        n, dtype = view.size, view.dtype
    elif _is_torch_tensor(buf) and buf.device.type == "cpu":
        kind, view = "torch", _torch_view(buf)
        n, dtype = view.size, view.dtype
    elif device.is_device_array(buf):
        kind, view = "device", None
        if _is_torch_tensor(buf):
            _check_tensor(buf)
        target = buf.detach() if _is_torch_tensor(buf) else buf
        n, dtype = device.describe(target)
        device.ops_for(target)  # UnsupportedBuffer without CuPy, before any message
    else:
        raise UnsupportedBuffer(
            f"allreduce cannot reduce a {type(buf).__name__}; pass a numpy array, a torch "
            "tensor or a device array (__cuda_array_interface__)")
    plans.check_mpi_live()  # before any MPI call: the thread check is one
    _check_thread()
    state = plans.comm_state(MPI.COMM_WORLD if comm is None else comm)
    state.check_usable()
    return _Checked(kind, view, n, dtype, name, chosen, state)


def _check_thread() -> None:
    """Refuse a call from a thread that may not call MPI: any but the main
    thread below ``MPI_THREAD_SERIALIZED`` (mpidp asks for ``FUNNELED``)."""
    if MPI.Is_thread_main():
        return
    level = MPI.Query_thread()
    if level < MPI.THREAD_SERIALIZED:
        names = {MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE",
                 MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED"}
        raise AllreduceError(
            f"allreduce called from thread {threading.current_thread().name!r}, but MPI runs "
            f"at {names.get(level, level)}, where only the main thread may call it; call "
            "allreduce from the main thread, or set MPI4PY_RC_THREAD_LEVEL=serialized (or "
            "multiple) before collectives is first imported and let one thread at a time "
            "call it")


def _bind_and_run(buf: Any, comm: Any, algorithm: str, op: Any, call: _Checked,
                  stage: list) -> Any:
    """Find or make the plan (collective the first time), bind it, remember, run
    (``stage[0]`` becomes ``"running"`` when the buffer may be written)."""
    global _hot
    plan = call.state.plan(call.n, call.dtype, call.op, call.algorithm)
    stage[0] = "running"
    if call.kind == "host":
        run = plan.runner(buf, call.view, hold=weakref.ref(buf))
    elif call.kind == "torch":
        inner = plan.runner(buf, call.view, extra=(buf.data_ptr(), call.n))
        run = _torch_runner(buf, call.view, inner,
                            lambda: _allreduce_slow(buf, comm, algorithm, op))
    else:
        run = _device_runner(buf, call.state, plan,
                             lambda: _allreduce_slow(buf, comm, algorithm, op))
    _hot = (buf, comm, algorithm, op, buf.dtype, call.kind != "host", run,
            getattr(run, "calls", None))
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
