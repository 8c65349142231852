"""Per-communicator state: the private communicator, its channels, the checked plans.

The first all-reduce on a communicator duplicates it (so our messages never
meet the user's, and receives may accept any tag), sets up the channels the
communicator can use (:mod:`collectives.channels`) and attaches the state
to it as an MPI attribute: freeing the user's communicator frees ours. A
:class:`Plan` is made once per call signature, after the ranks agreed on it
(:mod:`collectives.core.consistency`): the algorithm's schedule over the first
channel that serves it, or a library collective; it keeps the runners bound
to the last few buffers it reduced, so a repeated call allocates nothing.
The blind-call words the failure rules read are the state's
:class:`~collectives.core.peers.Peers`.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np

from collectives.auto import tuning
from collectives.auto.tuning import TunedPlan
from collectives.channels import KINDS, futex
from collectives.core import consistency, ended
from collectives.core.combine import free_mpi_ops, warm_up
from collectives.core.consistency import make_enter
from collectives.core.context import OPS, PlanContext
from collectives.core.peers import Peers
from collectives.errors import AllreduceError, AllreduceMismatch
from collectives.registry import Algorithm, get, names
from collectives.runtime import MPI, oversubscribed_anywhere, sharing_facts

#: Signatures kept per communicator, and buffers bound per signature.
MAX_PLANS = 64
MAX_BINDINGS = 4
#: Longest message of the point-to-point algorithms (bytes) when the ranks
#: have a core each: a received piece is combined while still in cache. When
#: the node is oversubscribed every message costs a trip through the
#: scheduler, so messages are not cut (docs/collectives.md).
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
    """One checked signature: its context, what runs it, and its bound runners.

    ``runs`` is the algorithm that runs (``auto`` resolved); ``channel`` the
    channel its schedule runs over (None for a library collective).
    """

    __slots__ = ("ctx", "algorithm", "runs", "channel", "binders", "bindings", "host_only")

    def __init__(self, ctx: PlanContext, algorithm: str, runs: Algorithm, channel: Any) -> None:
        self.ctx = ctx
        self.algorithm = algorithm
        self.runs = runs
        self.channel = channel
        self.binders: dict[str, Callable[[Any], Runner]] = {}
        self.bindings: OrderedDict[tuple, tuple[Any, Runner]] = OrderedDict()
        if channel is not None:
            self.host_only = bool(channel.host_only)
        else:
            self.host_only = bool(runs.host_only is not None and runs.host_only(ctx))

    def release(self) -> None:
        """Free what the plan's binders allocated outside Python (local)."""
        for free in self.ctx.on_release:
            free()
        self.ctx.on_release.clear()

    def _binder(self, ctx: PlanContext) -> Callable[[Any], Runner]:
        if self.channel is None:
            return self.runs.plan(ctx)
        schedule, rank, size = self.runs.schedule, ctx.rank, ctx.size
        return self.channel.plan(ctx, lambda n: schedule(rank, size, n))

    def runner(self, key_obj: Any, view: Any, space: Any = None, extra: Any = None,
               hold: Any = None) -> Runner:
        """The runner reducing ``view``, kept per ``key_obj`` (the user's buffer)
        and ``extra`` (what else identifies its memory, e.g. a data pointer);
        ``hold`` is kept with it (a weak reference that stops numpy resizing
        the array while it is bound)."""
        key = (id(key_obj), extra)
        entry = self.bindings.get(key)
        if entry is not None and entry[0] is key_obj:
            self.bindings.move_to_end(key)
            return entry[1]
        space_name = "host" if space is None else space.name
        binder = self.binders.get(space_name)
        if binder is None:
            ctx = self.ctx if space is None else replace(self.ctx, space=space)
            binder = self.binders[space_name] = self._binder(ctx)
        run = binder(view)
        self.bindings[key] = (key_obj, run, hold)
        while len(self.bindings) > MAX_BINDINGS:
            self.bindings.popitem(last=False)
        return run


class CommState:
    """What mpidp keeps per user communicator (see module docstring)."""

    def __init__(self, comm: "MPI.Intracomm") -> None:
        # the first call on comm: a rank that makes it alone would wait in Dup for ever
        ended.wait_for_peers(comm, "collectives.allreduce()", "its first call")
        self.comm = comm.Dup()
        self.comm.Set_errhandler(MPI.ERRORS_RETURN)
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.tag_ub = min(int(self.comm.Get_attr(MPI.TAG_UB) or 32767), 2**30)
        self.plans: OrderedDict[tuple, Plan] = OrderedDict()
        self.tags: dict[int, str] = {consistency.CHECK_TAG: "a first-call signature check"}
        self.nbytes: dict[int, int] = {}  # bytes of the signature of each tag
        self.staging: dict[tuple, Any] = {}
        #: The channels this communicator has, in order of preference (each
        #: kind's creation is collective; a kind that cannot work here is absent).
        self.channels = [c for c in (kind.create(self.comm) for kind in KINDS) if c is not None]
        # The blind-call words, readable by the peers (collectives.core.peers).
        self.peers = Peers(self.comm, self.channels, self.explain)
        self.shared = self.peers.shared
        #: Set when a call failed on this rank in the middle of its messages:
        #: the ranks may be out of step, so later calls refuse (see :meth:`check_usable`).
        self.broken: str | None = None
        #: Set when a stop (KeyboardInterrupt, SystemExit) left a call on this rank
        #: midway: peers may wait inside MPI_Allreduce for a call it never ends
        #: (:func:`collectives.core.failures.leave_at_exit` ends the job then).
        self.stopped_midway: str | None = None
        # One verdict for the whole communicator (also the barrier after the
        # windows' initialisation): thresholds and segments must agree.
        facts = self.comm.allgather(sharing_facts())
        self.oversubscribed = oversubscribed_anywhere(facts)
        # Waiting ranks sleep on a futex when they outnumber the cores (and can).
        if self.shared is not None:
            self.shared.sleep = self.oversubscribed and futex.available()
        kinds = {c.name for c in self.channels}
        self.placement = placement_of(self.size, self.oversubscribed, "shm-pair" in kinds,
                                      "shm-group" in kinds)
        #: The tunings of ``auto`` on this machine and layout (None: static table).
        self.store = self._store([fact.host for fact in facts]) if self.size > 1 else None

    def _store(self, hosts: list[str]) -> tuning.Store | None:
        """Rank 0 reads this machine's tunings and shares them (collective, on
        every rank whatever its setting: a rank tuning and one on the static
        table then fail their first ``auto`` call together, by its record)."""
        key = tuning.machine_key(self.size, len(set(hosts)), self.placement)
        mine = tuning.enabled()
        known = tuning.read(tuning.tuning_file(), key) if self.rank == 0 and mine else None
        known = self.comm.bcast(known, root=0)
        return tuning.Store(key, known or {}, writer=self.rank == 0) if mine else None

    def channel_for(self, schedule: Any) -> Any:
        """The first channel of this communicator that serves ``schedule``."""
        return next(c for c in self.channels if c.serves(schedule))

    def channel_named(self, name: str) -> Any:
        """This communicator's channel called ``name``, or None."""
        return next((c for c in self.channels if c.name == name), None)

    def route(self, nbytes: int, algorithm: str) -> tuple[str, str | None]:
        """``(algorithm that runs, channel name or None)`` for a call of ``nbytes``
        with ``algorithm`` (local: no plan is made)."""
        chosen = get(algorithm)
        runs = get(chosen.choose(nbytes, self.placement)) if chosen.choose else chosen
        if runs.schedule is None:
            return runs.name, None
        return runs.name, self.channel_for(runs.schedule(self.rank, self.size, 1)).name

    def free(self) -> None:
        """Release the private communicator and windows (collective)."""
        if self in _STATES:
            _STATES.remove(self)
        for hook in ON_FREE:
            hook()
        self.drop_plans()  # their runners hold views of the windows
        self.peers.free()
        for channel in self.channels:
            channel.free()
        self.channels, self.shared = [], None
        if self.comm != MPI.COMM_NULL:
            self.comm.Free()
        self.staging.clear()

    def explain(self, tag: int) -> str:
        return self.tags.get(tag, f"a call this rank has not made yet (tag {tag})")

    def plan(self, n: int, dtype: np.dtype, op: str, chosen: Algorithm) -> Plan:
        """The checked plan of a signature (collective on first use)."""
        key = (n, dtype, op, chosen.name)
        plan = self.plans.get(key)
        if plan is not None:
            self.plans.move_to_end(key)
            return plan
        plan = self._new_plan(n, dtype, op, chosen)
        self.plans[key] = plan
        while len(self.plans) > MAX_PLANS:
            self.plans.popitem(last=False)[1].release()
        return plan

    def drop_plans(self) -> None:
        """Forget every plan (local)."""
        for plan in self.plans.values():
            plan.release()
        self.plans.clear()

    def check_usable(self) -> None:
        """Raise :class:`AllreduceError` if an earlier call broke this communicator."""
        if self.broken is not None:
            raise AllreduceError(
                f"rank {self.rank}: an earlier allreduce on this communicator failed in the "
                f"middle of its messages ({self.broken}), so the ranks may be out of step "
                "and messages of that call may still arrive; use a new communicator "
                "(comm.Dup() on every rank) for further all-reduces.")

    def _new_plan(self, n: int, dtype: np.dtype, op: str, chosen: Algorithm) -> Any:
        algorithm, runs = chosen.name, chosen
        tuned = chosen.choose is not None and self.store is not None
        if chosen.choose is not None:
            runs = get(chosen.choose(n * dtype.itemsize, self.placement))
        # A tuned auto runs no algorithm of its own: its record says "auto", so a
        # rank tuning and a rank on the static table are told apart.
        runs_name = "auto" if tuned else runs.name
        segment = segment_bytes(self.oversubscribed)
        tag = consistency.signature_tag(n, dtype, op, runs_name, segment, self.tag_ub)
        record = consistency.make_record(n, dtype, op, algorithm, runs_name, segment, tag)
        if self.size > 1:
            self.peers.clear_suspects()
            table = consistency.exchange_records(
                self.comm, record, self.explain, lambda peer: self.peers.peer_blocked(peer, tag))
            message = consistency.mismatch_message(table, names())
            if message is not None:
                raise AllreduceMismatch(message, collective=True)
        description = consistency.describe_record(record, names())
        self.tags[tag] = f"allreduce {description}"
        self.nbytes[tag] = n * dtype.itemsize
        if tuned:
            return self._tuned_plan(n, dtype, op, runs.name)
        mpi_op, _ = OPS[op]
        ctx = PlanContext(
            comm=self.comm, rank=self.rank, size=self.size, n=n, dtype=dtype, op=op,
            mpi_type=MPI.Datatype.fromcode(dtype.char), mpi_op=mpi_op, tag=tag,
            segment=max(1, segment // dtype.itemsize), explain=self.explain,
            description=description, enter_blind=make_enter(self.peers.blind_calls, tag),
            verify_blind=self.peers.verifier(tag, description, self.nbytes),
            blocked=self.peers.blocked_in_call,
            watch=self.peers.watcher(tag) if self.shared is not None else None,
            yielding=self.oversubscribed,
            releases=self.peers.releases if self.shared is not None else None)
        warm_up(dtype, op)  # compile the combine now, not inside the first call's waits
        channel = None
        if runs.schedule is not None:
            channel = self.channel_for(runs.schedule(self.rank, self.size, n))
        return Plan(ctx, algorithm, runs, channel)


    def _tuned_plan(self, n: int, dtype: np.dtype, op: str, first: str) -> TunedPlan:
        """``auto`` chosen by measurement (:mod:`collectives.auto.tuning`)."""
        names_ = [name for name in tuning.CANDIDATES if name in names()]
        key = tuning.bucket(n * dtype.itemsize, dtype, op)
        counter = np.dtype(np.float64)
        plan = TunedPlan(
            SimpleNamespace(n=n, dtype=dtype, op=op), names_, first,
            candidate=lambda name: self.plan(n, dtype, op, get(name)),
            agreement=lambda: self.plan(2 * len(names_), counter, "max", get("native")),
            prior=self.store.prior(key))
        self.store.keep(key, plan.tuner)
        return plan


def placement_of(size: int, oversubscribed: bool, pair: bool, group: bool) -> str:
    """The placement :mod:`collectives.auto.table` chooses by (see ``auto.PLACEMENTS``)."""
    if size == 1:
        return "single"
    if oversubscribed:
        return ("oversubscribed-pair" if pair else "oversubscribed" if group
                else "oversubscribed-nodes")
    return "pair" if pair else "cores"


def _delete_state(comm, keyval, state: CommState) -> None:
    # MPI calls this when the user frees the communicator: a collective call
    # of theirs, so freeing ours here is collective too.
    try:
        if state in _STATES:
            _STATES.remove(state)
            state.free()
    except Exception:  # noqa: BLE001 - never fail inside MPI's attribute callback
        pass


def _at_finalize(comm, keyval, value) -> None:
    # MPI calls this first thing in MPI_Finalize (COMM_SELF's attributes are
    # deleted before anything else), when every rank finalizes: the windows
    # are freed there, collectively, before MPI tears down. A job that is
    # aborted never gets here, so a failing rank never waits in a collective
    # free (collectives.core.failures, rule 6); the OS reclaims its windows.
    for state in list(_STATES):
        try:
            state.free()
        except Exception:  # noqa: BLE001 - never fail inside MPI's attribute callback
            pass
    _STATES.clear()
    free_mpi_ops()  # after the plans that used them


_KEYVAL: int | None = None
#: States still attached to a communicator, in creation order (the same on
#: every rank of each communicator: creation is collective).
_STATES: list[CommState] = []


def check_mpi_live() -> None:
    """Raise AllreduceError after ``MPI_Finalize``: any MPI call then ends the
    process with MPICH's own words, which a program cannot catch."""
    if MPI.Is_finalized():
        error = AllreduceError("allreduce after MPI_Finalize: MPI has been shut down in this "
                               "process; reduce before finalizing")
        error.collective = True  # nothing to abort: no MPI call may follow
        raise error


def comm_state(comm: "MPI.Intracomm") -> CommState:
    """The state attached to ``comm``, created collectively on first use.

    Raises:
        AllreduceError: ``comm`` is not a usable intracommunicator.
    """
    global _KEYVAL
    check_mpi_live()
    if isinstance(comm, MPI.Comm) and comm == MPI.COMM_NULL:
        raise AllreduceError("allreduce got MPI.COMM_NULL: the communicator was freed (or is "
                             "the result of a Split that left this rank out); pass a live "
                             "communicator")
    if not isinstance(comm, MPI.Intracomm):
        kind = "an intercommunicator" if isinstance(comm, MPI.Comm) else \
            f"a {type(comm).__name__}"
        raise AllreduceError(f"allreduce needs an mpi4py intracommunicator (e.g. "
                             f"MPI.COMM_WORLD or comm.Dup()), got {kind}")
    if _KEYVAL is None:
        _KEYVAL = MPI.Comm.Create_keyval(delete_fn=_delete_state)
        MPI.COMM_SELF.Set_attr(MPI.Comm.Create_keyval(delete_fn=_at_finalize), True)
    state = comm.Get_attr(_KEYVAL)
    if state is None:
        state = CommState(comm)
        comm.Set_attr(_KEYVAL, state)
        _STATES.append(state)
    return state


def existing_state(comm: "MPI.Intracomm | None") -> "CommState | None":
    """The state attached to ``comm`` (``None``: ``COMM_WORLD``), or None (local)."""
    comm = MPI.COMM_WORLD if comm is None else comm
    if _KEYVAL is None or not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
        return None
    try:
        return comm.Get_attr(_KEYVAL)
    except MPI.Exception:
        return None


def forget_plans(comm: "MPI.Intracomm") -> None:
    """Drop the plans, bindings and staging buffers kept for ``comm`` (local)."""
    if _KEYVAL is None:
        return
    state = comm.Get_attr(_KEYVAL)
    if state is not None:
        state.drop_plans()
        state.staging.clear()
