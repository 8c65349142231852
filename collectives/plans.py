"""Per-communicator state: the private communicator, the checked plans.

The first all-reduce on a communicator duplicates it (so our messages never
meet the user's, and receives may accept any tag) and attaches the state to
it as an MPI attribute: freeing the user's communicator frees ours. A
:class:`Plan` is made once per call signature, after the ranks agreed on it
(:mod:`collectives.consistency`), and keeps the runners bound to the last
few buffers it reduced, so a repeated call allocates nothing.
"""
from __future__ import annotations

import atexit
import os
from collections import OrderedDict
from typing import Any, Callable

import numpy as np

from collectives import consistency
from collectives.context import OPS, PlanContext
from collectives.errors import AllreduceError, AllreduceMismatch
from collectives.registry import Algorithm, get, names
from collectives.runtime import MPI, launch_info

#: Signatures kept per communicator, and buffers bound per signature.
MAX_PLANS = 64
MAX_BINDINGS = 4
#: Longest message of the point-to-point algorithms (bytes) when the ranks
#: have a core each: a received piece is combined while still in cache. When
#: the node is oversubscribed every message costs a trip through the
#: scheduler, so messages are not cut (see README, "Collectives").
DEFAULT_SEGMENT = 1024 * 1024
UNLIMITED_SEGMENT = 1 << 62


def segment_bytes(oversubscribed: bool = False) -> int:
    """``MPIDP_ALLREDUCE_SEGMENT`` (bytes, >= 64), else the default for the placement."""
    text = os.environ.get("MPIDP_ALLREDUCE_SEGMENT", "").strip()
    if not text:
        return UNLIMITED_SEGMENT if oversubscribed else DEFAULT_SEGMENT
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 64:
        raise AllreduceError(f"MPIDP_ALLREDUCE_SEGMENT={text!r}: give a number of bytes >= 64")
    return min(value, UNLIMITED_SEGMENT)


Runner = Callable[[], None]
#: Called when a communicator's state is freed (the dispatcher forgets its last call).
ON_FREE: list[Callable[[], None]] = []


class Plan:
    """One checked signature: its context, planner output and bound runners."""

    __slots__ = ("ctx", "algorithm", "runs", "binders", "bindings")

    def __init__(self, ctx: PlanContext, algorithm: str, runs: Algorithm) -> None:
        self.ctx = ctx
        self.algorithm = algorithm
        self.runs = runs
        self.binders: dict[str, Callable[[Any], Runner]] = {}
        self.bindings: OrderedDict[int, tuple[Any, Runner]] = OrderedDict()

    def runner(self, key_obj: Any, view: Any, space: Any = None, extra: Any = None) -> Runner:
        """The runner reducing ``view``, kept per ``key_obj`` (the user's buffer)
        and ``extra`` (what else identifies its memory, e.g. a data pointer)."""
        key = (id(key_obj), extra)
        entry = self.bindings.get(key)
        if entry is not None and entry[0] is key_obj:
            self.bindings.move_to_end(key)
            return entry[1]
        space_name = "host" if space is None else space.name
        binder = self.binders.get(space_name)
        if binder is None:
            ctx = self.ctx if space is None else _with_space(self.ctx, space)
            binder = self.binders[space_name] = self.runs.plan(ctx)
        run = binder(view)
        self.bindings[key] = (key_obj, run)
        while len(self.bindings) > MAX_BINDINGS:
            self.bindings.popitem(last=False)
        return run


def _with_space(ctx: PlanContext, space: Any) -> PlanContext:
    from dataclasses import replace

    return replace(ctx, space=space)


class CommState:
    """What mpidp keeps per user communicator (see module docstring)."""

    def __init__(self, comm: "MPI.Intracomm") -> None:
        self.comm = comm.Dup()
        self.comm.Set_errhandler(MPI.ERRORS_RETURN)
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.tag_ub = min(int(self.comm.Get_attr(MPI.TAG_UB) or 32767), 2**30)
        self.plans: OrderedDict[tuple, Plan] = OrderedDict()
        self.tags: dict[int, str] = {consistency.CHECK_TAG: "a first-call signature check"}
        self.staging: dict[tuple, Any] = {}
        # [native calls entered, tag of the last one], readable by the peers
        # with one-sided MPI (collectives.consistency, point 3).
        self.window = None
        self.native_calls = memoryview(bytearray(16)).cast("q")
        try:
            self.window = MPI.Win.Allocate(16, 8, comm=self.comm)
            self.native_calls = memoryview(self.window.tomemory()).cast("B").cast("q")
        except MPI.Exception:
            self.window = None
        self.native_calls[0] = self.native_calls[1] = 0
        self._suspects: dict[int, tuple[int, int]] = {}
        # One verdict for the whole communicator (also the barrier after the
        # window's initialisation): thresholds and segments must agree.
        self.oversubscribed = bool(self.comm.allreduce(
            int(launch_info(self.comm).oversubscribed), op=MPI.MAX))

    def free(self) -> None:
        """Release the private communicator and window (collective)."""
        if self in _STATES:
            _STATES.remove(self)
        for hook in ON_FREE:
            hook()
        if self.window is not None:
            self.native_calls = memoryview(bytearray(16)).cast("q")
            self.window.Free()
            self.window = None
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()
        self.plans.clear()
        self.staging.clear()

    def explain(self, tag: int) -> str:
        return self.tags.get(tag, f"a call this rank has not made yet (tag {tag})")

    def peer_blocked(self, peer: int, native_tag: int | None) -> str | None:
        """Why ``peer`` cannot be joining the call this rank is checking, or None.

        The call being checked is native with tag ``native_tag`` (None: not
        native). A peer that entered more native calls than this rank has
        made is blocked in a call this rank never made, unless it is one call
        ahead in the very call being checked (it finished its check first).
        Reported only when two probes in a row see the same state.
        """
        if self.window is None:
            return None
        theirs = np.zeros(2, dtype=np.int64)
        try:
            self.window.Lock(peer, MPI.LOCK_SHARED)
            self.window.Get([theirs, MPI.INT64_T], peer)
            self.window.Unlock(peer)
        except MPI.Exception:
            return None
        count, tag = int(theirs[0]), int(theirs[1])
        ahead = count - self.native_calls[0]
        if ahead < 1 or (ahead == 1 and tag == native_tag):
            self._suspects.pop(peer, None)
            return None
        if self._suspects.get(peer) != (count, tag):
            self._suspects[peer] = (count, tag)  # confirm on the next probe
            return None
        return (f"blocked in native all-reduce number {count} on this communicator "
                f"({self.explain(tag)}) while this rank has made {self.native_calls[0]}")

    def plan(self, n: int, dtype: np.dtype, op: str, algorithm: str) -> Plan:
        """The checked plan of a signature (collective on first use)."""
        key = (n, dtype, op, algorithm)
        plan = self.plans.get(key)
        if plan is not None:
            self.plans.move_to_end(key)
            return plan
        plan = self._new_plan(n, dtype, op, algorithm)
        self.plans[key] = plan
        while len(self.plans) > MAX_PLANS:
            self.plans.popitem(last=False)
        return plan

    def _new_plan(self, n: int, dtype: np.dtype, op: str, algorithm: str) -> Plan:
        chosen = get(algorithm)
        runs = chosen
        if chosen.choose is not None:
            runs = get(chosen.choose(n * dtype.itemsize, self.size, self.oversubscribed))
        segment = segment_bytes(self.oversubscribed)
        tag = consistency.signature_tag(n, dtype, op, runs.name, segment, self.tag_ub)
        record = consistency.make_record(n, dtype, op, algorithm, runs.name, segment, tag)
        if self.size > 1:
            native_tag = tag if runs.name == "native" else None
            self._suspects.clear()
            table = consistency.exchange_records(
                self.comm, record, self.explain,
                lambda peer: self.peer_blocked(peer, native_tag))
            message = consistency.mismatch_message(table, names())
            if message is not None:
                raise AllreduceMismatch(message, collective=True)
        description = consistency.describe_record(record, names())
        self.tags[tag] = f"allreduce {description}"
        mpi_op, _ = OPS[op]
        ctx = PlanContext(
            comm=self.comm, rank=self.rank, size=self.size, n=n, dtype=dtype, op=op,
            mpi_type=MPI.Datatype.fromcode(dtype.char), mpi_op=mpi_op, tag=tag,
            segment=max(1, segment // dtype.itemsize), explain=self.explain,
            description=description, native_calls=self.native_calls)
        return Plan(ctx, algorithm, runs)


def _delete_state(comm, keyval, state: CommState) -> None:
    try:
        if not MPI.Is_finalized():
            state.free()
    except Exception:  # noqa: BLE001 - never fail inside MPI's attribute callback
        pass


_KEYVAL: int | None = None
_STATES: list[CommState] = []


def comm_state(comm: "MPI.Intracomm") -> CommState:
    """The state attached to ``comm``, created collectively on first use."""
    global _KEYVAL
    if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
        raise AllreduceError(f"allreduce needs an mpi4py intracommunicator, got {comm!r}")
    if _KEYVAL is None:
        _KEYVAL = MPI.Comm.Create_keyval(delete_fn=_delete_state)
    state = comm.Get_attr(_KEYVAL)
    if state is None:
        state = CommState(comm)
        comm.Set_attr(_KEYVAL, state)
        _STATES.append(state)
    return state


def forget_plans(comm: "MPI.Intracomm") -> None:
    """Drop the plans, bindings and staging buffers kept for ``comm`` (local)."""
    if _KEYVAL is None:
        return
    state = comm.Get_attr(_KEYVAL)
    if state is not None:
        state.plans.clear()
        state.staging.clear()


@atexit.register
def _free_all() -> None:
    # Windows must be freed before MPI_Finalize (UCX warns otherwise). Python
    # runs this before mpi4py finalizes MPI.
    if MPI.Is_initialized() and not MPI.Is_finalized():
        for state in list(_STATES):
            try:
                state.free()
            except Exception:  # noqa: BLE001
                pass
