"""MPI point-to-point messages: the channel that serves every schedule.

Each round becomes MPI calls on the communicator's private duplicate: one
send and one receive are a ``Sendrecv``, a lone send or receive a blocking
``Send`` / ``Recv``, several (``naive``) non-blocking calls completed
together. Every message carries the call signature's tag and every receive
accepts any tag and checks it, so a rank whose call differs from its
partner's raises :class:`AllreduceMismatch` instead of mixing the two calls'
data (:mod:`collectives.core.consistency`). Messages travel as bytes: a message
of another call then always lands as a clean error (wrong tag, or
truncation), never as a partial element, which MPICH treats as an internal
error.

Where the ranks share a node (their blind-call words are plain memory),
every wait is a loop over non-blocking calls that also looks, every few
milliseconds, whether the awaited rank sits in ``MPI_Allreduce`` of another
call (which no message reaches): then :class:`AllreduceMismatch` instead of
two ranks blocked in MPI for ever. Across nodes the waits stay inside MPI
(cheaper; a rank of a point-to-point schedule and a peer in another call's
``MPI_Allreduce`` can then wait for each other: see
:mod:`collectives.core.failures`).

A message longer than the segment (``MPIDP_ALLREDUCE_SEGMENT``, see
:mod:`collectives.core.plans`) is sent in pieces, so that a received piece is
combined right after it arrives, while it is still in cache; both ends cut
by the round's agreed length (:meth:`collectives.schedule.Round.cut_basis`).
Messages only copied on arrival (a round whose ``span`` is None) go whole.
With a CUDA-aware MPI the same runs on device arrays: the context's array
space supplies temporaries, combines and message specs.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable

from collectives.channels import shm_window
from collectives.core.context import PlanContext
from collectives.runtime import MPI
from collectives.schedule import (COPY, REDUCE_INCOMING_FIRST, REDUCTIONS, STASH, Round,
                                  Schedule, split)

Runner = Callable[[], None]
Op = tuple[Callable, tuple]


class PointToPoint:
    """The channel every communicator has (see the module docstring)."""

    name = "p2p"
    host_only = False
    #: Waiting happens inside MPI.
    sleep = False
    #: No shared memory: the communicator's state keeps the blind-call
    #: words in an MPI window instead (:mod:`collectives.core.plans`).
    blind_calls = None

    @classmethod
    def create(cls, comm: "MPI.Intracomm") -> "PointToPoint":
        return cls()

    def free(self) -> None:
        pass

    def peer_blind(self, peer: int) -> None:
        return None

    def serves(self, schedule: Schedule) -> bool:
        return True

    def plan(self, ctx: PlanContext, schedule_of: Callable[[int], Schedule]
             ) -> Callable[[Any], Runner]:
        """The binder of ``schedule_of(ctx.n)`` over MPI messages."""
        schedule = schedule_of(ctx.n)
        rounds = [rnd for rnd in schedule.rounds if rnd.sends or rnd.recvs]
        counts = [1 if rnd.span is None else ctx.piece_count(rnd.cut_basis())
                  for rnd in rounds]
        reduced = [-(-r.length // count) for rnd, count in zip(rounds, counts)
                   for r in rnd.recvs if r.action in REDUCTIONS]
        tmp = ctx.empty(max(reduced)) if reduced else None
        rows = ctx.empty(ctx.size * ctx.n).reshape(ctx.size, ctx.n) if schedule.stash else None
        messages = Messages(ctx)

        def bind(view: Any) -> Runner:
            ops: list[Op] = []
            for rnd, count in zip(rounds, counts):
                if len(rnd.sends) + len(rnd.recvs) > 2 or any(r.action == STASH
                                                              for r in rnd.recvs):
                    ops.append(messages.posted(rnd, view, rows))
                else:
                    ops += messages.blocking(rnd, count, view, tmp)
            if schedule.stash:
                ops.append(messages.ordered_combine(view, rows))
            return messages.runner(ops)

        return bind


class Messages:
    """Builds the MPI calls of rounds, every name bound once (the hot path)."""

    def __init__(self, ctx: PlanContext) -> None:
        self.ctx = ctx
        self.combine = ctx.combine
        if ctx.watch is not None:
            self.exchange, self.send, self.recv = watchful(ctx)
        else:
            self.exchange, self.send, self.recv = (make_exchange(ctx), make_send(ctx),
                                                   make_recv(ctx))

    def spec(self, view: Any) -> list:
        return self.ctx.space.spec(view, MPI.BYTE)

    def _finish(self, action: str, incoming: Any, mine: Any) -> list[Op]:
        if action == COPY:
            return []
        operands = (incoming, mine, mine) if action == REDUCE_INCOMING_FIRST \
            else (mine, incoming, mine)
        return [(self.combine, operands)]

    def blocking(self, rnd: Round, count: int, view: Any, tmp: Any) -> list[Op]:
        """A round of one send and/or one receive, cut into ``count`` pieces."""
        spec, ops = self.spec, []
        send = rnd.sends[0] if rnd.sends else None
        recv = rnd.recvs[0] if rnd.recvs else None
        sent = split(send.lo, send.hi, count) if send else [None] * count
        received = split(recv.lo, recv.hi, count) if recv else [None] * count
        for s, r in zip(sent, received):
            if r is not None:
                mine = view[r[0]:r[1]]
                into = mine if recv.action == COPY else tmp[:r[1] - r[0]]
            if s is not None and r is not None:
                ops.append((self.exchange, (spec(view[s[0]:s[1]]), send.peer, spec(into),
                                            recv.peer)))
            elif s is not None:
                ops.append((self.send, (spec(view[s[0]:s[1]]), send.peer)))
            else:
                ops.append((self.recv, (spec(into), recv.peer)))
            if r is not None:
                ops += self._finish(recv.action, into, mine)
        return ops

    def posted(self, rnd: Round, view: Any, rows: Any) -> Op:
        """A round of several messages: all posted at once, completed together.
        Receives are stashed whole (rank q's buffer into row q) or copied."""
        ctx, spec = self.ctx, self.spec
        for r in rnd.recvs:
            if r.action not in (STASH, COPY):
                raise ValueError(f"a round of several messages cannot {r.action} on arrival")
        recvs = [(spec(rows[r.peer] if r.action == STASH else view[r.lo:r.hi]), r.peer)
                 for r in rnd.recvs]
        sends = [(spec(view[s.lo:s.hi]), s.peer) for s in rnd.sends]
        sources = [peer for _, peer in recvs]
        statuses = [MPI.Status() for _ in range(len(recvs) + len(sends))]
        isend, irecv = ctx.comm.Isend, ctx.comm.Irecv
        waitall = MPI.Request.Waitall if ctx.watch is None else _watched_wait(ctx, sources)
        tag, any_tag = ctx.tag, MPI.ANY_TAG

        def run() -> None:
            requests = [irecv(buf, q, any_tag) for buf, q in recvs]
            requests += [isend(buf, q, tag) for buf, q in sends]
            try:
                waitall(requests, statuses)
            except MPI.Exception as error:
                ctx.fail(None, None, error)
            check_statuses(ctx, statuses, sources)

        return run, ()

    def ordered_combine(self, view: Any, rows: Any) -> Op:
        """The buffer becomes the combination of all ranks' stashed buffers in
        rank order (this rank's own buffer standing in for its row)."""
        ctx, combine = self.ctx, self.combine
        r = ctx.rank
        # Our own row is needed only when we come third or later (the running
        # result overwrites our buffer from the first combine on).
        keep_own = r >= 2
        own_row = rows[r]
        parts = [rows[q] if q != r else (own_row if keep_own else view) for q in range(ctx.size)]
        first, second, rest = parts[0], parts[1], parts[2:]

        def run() -> None:
            if keep_own:
                own_row[...] = view
            combine(first, second, view)
            for part in rest:
                combine(view, part, view)

        return run, ()

    def runner(self, ops: list[Op]) -> Runner:
        """One runner for the ops; the hot case (one exchange, one combine) inlined."""
        if not ops:
            return lambda: None
        if len(ops) == 2 and ops[0][0] is self.exchange and ops[1][0] is self.combine \
                and self.ctx.watch is None:
            return self._exchange_and_combine(ops[0][1], ops[1][1])

        def run() -> None:
            for fn, args in ops:
                fn(*args)

        return run

    def _exchange_and_combine(self, xargs: tuple, cargs: tuple) -> Runner:
        ctx, combine = self.ctx, self.combine
        send_spec, dest, recv_spec, source = xargs
        a, b, out = cargs
        sendrecv, tag, any_tag, status = ctx.comm.Sendrecv, ctx.tag, MPI.ANY_TAG, MPI.Status()

        def run_pair() -> None:  # exchange() inlined: one Python call less per all-reduce
            try:
                sendrecv(send_spec, dest, tag, recv_spec, source, any_tag, status)
            except MPI.Exception as error:
                ctx.fail(source, None, error)
            if status.tag != tag:
                ctx.fail(source, status.tag)
            combine(a, b, out)

        return run_pair


def make_exchange(ctx: PlanContext) -> Callable[[Any, int, Any, int], None]:
    """``exchange(send_spec, dest, recv_spec, source)``: one checked ``Sendrecv``."""
    sendrecv = ctx.comm.Sendrecv
    tag, any_tag, status, fail = ctx.tag, MPI.ANY_TAG, MPI.Status(), ctx.fail

    def exchange(send, dest, recv, source):
        try:
            sendrecv(send, dest, tag, recv, source, any_tag, status)
        except MPI.Exception as error:
            fail(source, None, error)
        if status.tag != tag:
            fail(source, status.tag)

    return exchange


def make_send(ctx: PlanContext) -> Callable[[Any, int], None]:
    """``send(spec, dest)``: a blocking send with this signature's tag."""
    send, tag = ctx.comm.Send, ctx.tag

    def send_tagged(spec, dest):
        send(spec, dest, tag)

    return send_tagged


def make_recv(ctx: PlanContext) -> Callable[[Any, int], None]:
    """``recv(spec, source)``: a blocking receive that checks the tag."""
    recv = ctx.comm.Recv
    tag, any_tag, status, fail = ctx.tag, MPI.ANY_TAG, MPI.Status(), ctx.fail

    def receive(spec, source):
        try:
            recv(spec, source, any_tag, status)
        except MPI.Exception as error:
            fail(source, None, error)
        if status.tag != tag:
            fail(source, status.tag)

    return receive


def _watched_wait(ctx: PlanContext, peers: list[int]) -> Callable[[list, list], None]:
    """``wait(requests, statuses)``: Testall in a loop that spins (or yields the
    core when the node is oversubscribed) and, every ``CHECK_EVERY`` seconds,
    asks ``ctx.watch`` whether an awaited peer is blocked elsewhere."""
    testall, fail_blocked, watch = MPI.Request.Testall, ctx.fail_blocked, ctx.watch
    yielding = ctx.yielding

    def wait(requests: list, statuses: list) -> None:
        for _ in range(shm_window.SPINS):
            if testall(requests, statuses):
                return
            if yielding:
                os.sched_yield()
        first, next_check = True, time.monotonic() + shm_window.CHECK_EVERY
        while not testall(requests, statuses):
            if yielding:
                os.sched_yield()
            now = time.monotonic()
            if now < next_check:
                continue
            next_check = now + shm_window.CHECK_EVERY
            for peer in peers:
                reason = watch(peer, first)
                if reason:
                    fail_blocked(peer, reason)
            first = False

    return wait


def watchful(ctx: PlanContext) -> tuple[Callable, Callable, Callable]:
    """``exchange``, ``send`` and ``recv`` as :func:`make_exchange` & co., over
    non-blocking calls whose waits watch the peers (see the module docstring)."""
    comm, tag, any_tag, fail = ctx.comm, ctx.tag, MPI.ANY_TAG, ctx.fail
    isend, irecv = comm.Isend, comm.Irecv
    waits: dict[tuple, Callable] = {}

    def waiter(*peers: int) -> Callable:
        wait = waits.get(peers)
        if wait is None:
            wait = waits[peers] = _watched_wait(ctx, list(dict.fromkeys(peers)))
        return wait

    def exchange(send, dest, recv, source):
        statuses = [MPI.Status(), MPI.Status()]
        try:
            waiter(source, dest)([irecv(recv, source, any_tag), isend(send, dest, tag)],
                                 statuses)
        except MPI.Exception as error:
            fail(source, None, error)
        if statuses[0].tag != tag:
            fail(source, statuses[0].tag)

    def send_tagged(spec, dest):
        try:
            waiter(dest)([isend(spec, dest, tag)], [MPI.Status()])
        except MPI.Exception as error:
            fail(dest, None, error)

    def receive(spec, source):
        statuses = [MPI.Status()]
        try:
            waiter(source)([irecv(spec, source, any_tag)], statuses)
        except MPI.Exception as error:
            fail(source, None, error)
        if statuses[0].tag != tag:
            fail(source, statuses[0].tag)

    return exchange, send_tagged, receive


def check_statuses(ctx: PlanContext, statuses: list, sources: list[int]) -> None:
    """Raise if a completed receive carried another call's tag."""
    tag = ctx.tag
    for status, source in zip(statuses, sources):
        if status.tag != tag:
            ctx.fail(source, status.tag)
