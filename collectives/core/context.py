"""What a plan is given: :class:`PlanContext`, the call signature and its helpers.

A plan (an algorithm's schedule over a channel, or a library collective) is
built once per call signature. The context tells it who the ranks are, the
length, dtype and op, the message tag of the signature, the *array space*
(host memory, or device memory with a CUDA-aware MPI: temporaries, the
element-wise combine and the MPI message spec of a view), and raises the
errors that name what went wrong when ranks disagree
(:mod:`collectives.core.consistency`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from collectives.core.combine import Combine, canonicalizer, host_combiner
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



class HostSpace:
    """Host memory: numpy temporaries, the combines of :mod:`collectives.core.combine`,
    MPI specs over ``MPI.buffer``."""

    name = "host"

    def empty(self, n: int, dtype: np.dtype) -> np.ndarray:
        return np.empty(n, dtype)

    def combiner(self, op: str, dtype: np.dtype) -> Combine:
        return host_combiner(op, dtype)

    def canonicalizer(self, dtype: np.dtype) -> Callable[[np.ndarray], None] | None:
        """``fix(view)``: NaNs of ``view`` made canonical; None for integers."""
        return canonicalizer(dtype)

    def spec(self, view: np.ndarray, mpi_type: "MPI.Datatype") -> list:
        # A prebuilt [buffer, datatype] spec skips mpi4py's per-call
        # buffer-protocol and typecode look-ups.
        return [MPI.buffer(view), mpi_type]


HOST = HostSpace()


@dataclass
class PlanContext:
    """Everything a plan needs about one call signature.

    Attributes:
        comm: the private communicator of the call (a duplicate of the user's).
        rank, size: this rank and the number of ranks.
        n, dtype, op: length, numpy dtype and op name (``sum``/``max``/``min``).
        mpi_type, mpi_op: the matching MPI datatype and operation.
        tag: the message tag of this signature (every message carries it).
        segment: longest point-to-point message in elements; longer transfers
            are cut into pieces so that a received piece is combined while
            still in cache.
        space: the array space (:data:`HOST`, or a device space).
        explain: ``explain(tag) -> str`` describes the call a tag belongs to.
        description: the signature in words, for error messages.
        enter_blind: ``enter() -> call number``: count this rank into a
            *blind* call of this signature, one that waits where
            point-to-point messages cannot reach it (``MPI_Allreduce``, or a
            shared-memory channel's wait); peers read the count
            (:mod:`collectives.core.consistency`).
        verify_blind: ``verify(call number)``: after a blind call of
            ``MPI_Allreduce``, check that the peers made the same call.
        on_release: functions to call when the plan is dropped (e.g. to free
            a user-defined MPI operation).
        blocked: ``blocked(peer, tag, first) -> reason | None``: is ``peer``
            unable to join this rank's current blind call of ``tag``?
            (``first``: the first probe of a wait; see ``Peers.peer_blocked``)
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
    enter_blind: Callable[[], int] = field(default=lambda: 0)
    verify_blind: Callable[[int], None] = field(default=lambda call: None)
    blocked: Any = None
    #: ``watch(peer, first) -> reason | None`` for waits outside blind calls
    #: (point-to-point messages): is ``peer`` blocked in a blind call this
    #: rank is not making? None where the peers' words cannot be read with
    #: plain loads (ranks on several nodes): such waits stay inside MPI.
    watch: Any = None
    #: Waiting ranks give their core away (the node is oversubscribed).
    yielding: bool = False
    on_release: list = field(default_factory=list)
    #: ``{tag: release()}`` of the communicator, where its peers check the
    #: order of ``MPI_Allreduce`` calls (shared memory), else None: a plan
    #: that waits inside ``MPI_Allreduce`` registers how a rank that will
    #: not make its call joins it anyway, so that a peer is not left there
    #: (:data:`collectives.core.consistency.RELEASE_TAG`).
    releases: dict | None = None

    def empty(self, n: int) -> Any:
        """A temporary of ``n`` elements of this dtype in the array space."""
        return self.space.empty(n, self.dtype)

    @property
    def combine(self) -> Combine:
        """``combine(a, b, out)``: ``out = a (op) b`` with the special-value rule of
        :mod:`collectives.core.combine`; on a device, finished when it returns."""
        return self.space.combiner(self.op, self.dtype)

    def piece_count(self, longest: int) -> int:
        """Pieces needed so that none is longer than the segment (at least 1)."""
        return max(1, -(-longest // self.segment))

    def typed_spec(self, view: Any) -> list:
        """The spec of ``view`` with its MPI datatype (for MPI reductions)."""
        return self.space.spec(view, self.mpi_type)

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
