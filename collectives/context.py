"""What an algorithm's planner is given: :class:`PlanContext`.

Algorithms are written once against this small interface and run unchanged
on host arrays (numpy) and, with a CUDA-aware MPI, on device arrays (CuPy):
the *array space* supplies temporaries, the element-wise combine and the MPI
message spec of a view. Every message of an algorithm carries the tag of the
call signature and every receive accepts any tag and checks it, so a rank
whose call differs from its partner's raises :class:`AllreduceMismatch`
instead of mixing the two calls' data (see :mod:`collectives.consistency`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from collectives.errors import AllreduceMismatch
from collectives.runtime import MPI

#: dtypes every algorithm supports (native byte order).
SUPPORTED_DTYPES = tuple(np.dtype(t) for t in
                         (np.float16, np.float32, np.float64, np.int32, np.int64))
#: op name -> (MPI operation, numpy/CuPy ufunc name)
OPS: dict[str, tuple[Any, str]] = {
    "sum": (MPI.SUM, "add"),
    "max": (MPI.MAX, "maximum"),
    "min": (MPI.MIN, "minimum"),
}

#: ``combine(a, b, out)``: ``out = a (op) b`` element-wise; ``out`` may alias ``a`` or ``b``.
Combine = Callable[[Any, Any, Any], Any]


def chunk_bounds(n: int, parts: int) -> list[int]:
    """Boundaries of ``parts`` near-equal chunks of ``range(n)`` (sizes differ by <= 1).

    Chunk ``i`` is ``[b[i], b[i+1])``; with ``n < parts`` some chunks are empty.
    """
    return [n * i // parts for i in range(parts + 1)]


def split(lo: int, hi: int, pieces: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut into ``pieces`` near-equal consecutive ranges (some may be empty)."""
    b = chunk_bounds(hi - lo, pieces)
    return [(lo + b[i], lo + b[i + 1]) for i in range(pieces)]


class HostSpace:
    """Host memory: numpy temporaries and ufuncs, MPI specs over ``MPI.buffer``."""

    name = "host"

    def empty(self, n: int, dtype: np.dtype) -> np.ndarray:
        return np.empty(n, dtype)

    def combiner(self, op: str) -> Combine:
        if op == "sum":
            return np.add  # positional ``out``: the cheapest call (~0.24 us for tiny arrays)
        ufunc = getattr(np, OPS[op][1])

        def combine(a, b, out):  # numpy deprecates a positional ``out`` for max/min
            ufunc(a, b, out=out)

        return combine

    def spec(self, view: np.ndarray, mpi_type: "MPI.Datatype") -> list:
        # A prebuilt [buffer, datatype] spec skips mpi4py's per-call
        # buffer-protocol and typecode look-ups (about 0.4 us per call).
        return [MPI.buffer(view), mpi_type]


HOST = HostSpace()


@dataclass
class PlanContext:
    """Everything a planner needs about one call signature.

    Attributes:
        comm: the private communicator of the call (a duplicate of the user's).
        rank, size: this rank and the number of ranks.
        n, dtype, op: length, numpy dtype and op name (``sum``/``max``/``min``).
        mpi_type, mpi_op: the matching MPI datatype and operation.
        tag: the message tag of this signature (every message carries it).
        segment: longest message in elements; longer transfers are cut into
            pieces so that a received piece is combined while still in cache.
        space: the array space (:data:`HOST`, or a device space).
        explain: ``explain(tag) -> str`` describes the call a tag belongs to.
        description: the signature in words, for error messages.
    """

    comm: "MPI.Intracomm"
    rank: int
    size: int
    n: int
    dtype: np.dtype
    op: str
    mpi_type: "MPI.Datatype"
    mpi_op: "MPI.Op"
    tag: int
    segment: int
    space: Any = HOST
    explain: Callable[[int], str] = field(default=lambda tag: f"tag {tag}")
    description: str = ""
    #: int64 memoryview [blind calls entered, tag of the last one], readable
    #: by the peers (see :mod:`collectives.consistency`). A *blind* call
    #: waits where point-to-point messages cannot reach it: MPI_Allreduce,
    #: or the shared-memory exchange of :mod:`collectives.shm`.
    blind_calls: Any = None
    #: the shared-memory channel of a 2-rank communicator on one node, or None.
    pair: Any = None
    #: the shared-memory channel of a communicator of >= 3 ranks on one node, or None.
    group: Any = None
    #: ``blocked(peer, tag, first) -> reason | None``: is ``peer`` unable to
    #: join this rank's current blind call of ``tag``? (``first``: the first
    #: probe of a wait; see CommState.peer_blocked)
    blocked: Any = None

    def empty(self, n: int) -> Any:
        """A temporary of ``n`` elements of this dtype in the array space."""
        return self.space.empty(n, self.dtype)

    @property
    def combine(self) -> Combine:
        """``combine(a, b, out)``: ``out = a (op) b``; on a device, finished when it returns."""
        return self.space.combiner(self.op)

    def spec(self, view: Any) -> list:
        """The point-to-point message spec of ``view`` (build it once, at bind time).

        Messages travel as bytes: a message of another call then always
        lands as a clean error (wrong tag, or truncation), never as a partial
        element, which MPICH treats as an internal error.
        """
        return self.space.spec(view, MPI.BYTE)

    def typed_spec(self, view: Any) -> list:
        """The spec of ``view`` with its MPI datatype (for MPI reductions)."""
        return self.space.spec(view, self.mpi_type)

    def piece_count(self, longest: int) -> int:
        """Pieces needed so that none is longer than the segment (at least 1)."""
        return max(1, -(-longest // self.segment))

    def pieces(self, send: tuple[int, int], recv: tuple[int, int], count: int | None = None
               ) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """Pair the ranges sent and received in one exchange, cut into pieces.

        Sender and receiver must cut a range into the same number of pieces.
        By default the count depends only on the longer of the two ranges,
        which is right when the partner sends what we receive and receives
        what we send (pairwise exchanges); a ring passes ``count`` instead.
        """
        if count is None:
            count = self.piece_count(max(send[1] - send[0], recv[1] - recv[0]))
        return list(zip(split(*send, count), split(*recv, count)))

    def fail(self, source: int | None, tag: int | None, error: Exception | None = None) -> None:
        """Raise :class:`AllreduceMismatch` for an unexpected message from ``source``."""
        sender = "a peer" if source is None else f"rank {source}"
        if error is not None and getattr(error, "Get_error_class", lambda: None)() \
                == MPI.ERR_TRUNCATE:
            what = "a message longer than expected (MPI: message truncated)"
        elif error is not None:
            what = f"a message it could not receive (MPI: {str(error).splitlines()[0]})"
        else:
            what = f"a message of {self.explain(tag)}"
        raise AllreduceMismatch(
            f"rank {self.rank}: during allreduce of {self.description} it received from "
            f"{sender} {what}. The ranks called allreduce with different buffers "
            "(length, dtype), ops or algorithms, or in a different order; every rank must "
            "make the same sequence of calls.")

    def fail_blocked(self, peer: int, reason: str) -> None:
        """Raise :class:`AllreduceMismatch`: ``peer`` cannot join this call."""
        raise AllreduceMismatch(
            f"rank {self.rank}: during allreduce of {self.description}, rank {peer} is "
            f"{reason}: a call this rank is not making. Every rank must make the same "
            "sequence of calls.")

    def fail_peer_error(self, peer: int) -> None:
        """Raise :class:`AllreduceMismatch`: ``peer`` left this call with an error."""
        raise AllreduceMismatch(
            f"rank {self.rank}: during allreduce of {self.description}, rank {peer} left the "
            "call after an error (its own message says why), so this rank cannot finish it. "
            "Every rank must make the same sequence of calls.")

    def make_exchange(self) -> Callable[[Any, int, Any, int], None]:
        """``exchange(send_spec, dest, recv_spec, source)``: one checked ``Sendrecv``."""
        sendrecv = self.comm.Sendrecv
        tag, any_tag, status, fail = self.tag, MPI.ANY_TAG, MPI.Status(), self.fail

        def exchange(send, dest, recv, source):
            try:
                sendrecv(send, dest, tag, recv, source, any_tag, status)
            except MPI.Exception as error:
                fail(source, None, error)
            if status.tag != tag:
                fail(source, status.tag)

        return exchange

    def make_send(self) -> Callable[[Any, int], None]:
        """``send(spec, dest)``: a blocking send with this signature's tag."""
        send, tag = self.comm.Send, self.tag

        def send_tagged(spec, dest):
            send(spec, dest, tag)

        return send_tagged

    def make_recv(self) -> Callable[[Any, int], None]:
        """``recv(spec, source)``: a blocking receive that checks the tag."""
        recv = self.comm.Recv
        tag, any_tag, status, fail = self.tag, MPI.ANY_TAG, MPI.Status(), self.fail

        def receive(spec, source):
            try:
                recv(spec, source, any_tag, status)
            except MPI.Exception as error:
                fail(source, None, error)
            if status.tag != tag:
                fail(source, status.tag)

        return receive

    def check_statuses(self, statuses: list, sources: list[int]) -> None:
        """Raise if a completed receive carried another call's tag."""
        tag = self.tag
        for status, source in zip(statuses, sources):
            if status.tag != tag:
                self.fail(source, status.tag)
