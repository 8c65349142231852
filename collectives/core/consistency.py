"""Making sure every rank makes the same all-reduce call, without paying for it.

A *signature* is what must agree between the ranks: length, dtype, op, the
algorithm asked for and the one that runs, and the message segment size.
Checking it with a collective on every call would double the cost of small
all-reduces, so:

1. **First call of a signature** on a communicator: the ranks exchange a
   fixed-size record of it (point-to-point, on the private communicator).
   Any difference raises :class:`AllreduceMismatch` on every rank with a table
   of what each rank passed (``collective = True``).
2. **Later calls** cost nothing extra. Every message of the point-to-point
   schedules carries the signature's tag (a CRC of the signature) and every
   receive accepts any tag and checks it; shared-memory slots carry the tag
   too. A rank that receives a message or a slot of another call raises
   instead of mixing data; a message longer than expected raises too (MPI
   truncation).
3. **Blind calls.** ``MPI_Allreduce`` and the shared-memory channels' waits
   see no point-to-point message. Each rank therefore counts the blind calls
   it enters in words its peers can read (:data:`BLIND_WORDS`: shared memory
   on one node, else an MPI window read with one-sided MPI), with each call's
   tag. A rank waiting for peers (for first-call records, in a shared-memory
   wait, or, on one node, for a point-to-point message) reads them: a peer
   further ahead, in the same state on two probes, is blocked in a call this
   rank never made: :class:`AllreduceMismatch`.
4. **MPI_Allreduce of equal byte counts** cannot tell two signatures apart
   (float32[16] and int32[16] would be summed together). After each ``native``
   call, where the ranks share memory, every rank compares its peers' tags of
   the same call number (a peer cannot be two blind calls ahead: its next
   call needs this rank), so all ranks raise (``collective = True``) instead
   of returning wrong numbers; calls of different byte counts raise on the
   rank that sees it (MPI may have finished its call and left the peer's
   waiting). Across nodes that costs one more all-reduce per call and is
   done only with ``MPIDP_ALLREDUCE_VERIFY=1``.
5. **A rank that makes no more calls says so** (:data:`GONE`): when a call
   of its own failed and the error is raised (the communicator then
   refuses its calls), and when its program ends. A peer waiting for it in
   a wait of ours raises; a peer inside ``MPI_Allreduce`` of a call it will
   never make is joined with scratch data (:data:`RELEASE_TAG`), and its
   check of point 4 raises.

What no check here can see, as in plain MPI: a call skipped by one rank
pairs each later call of the same signature with the other ranks' next
one (a count of calls is local to each rank and equal on both sides of
such a pairing), until the calls stop matching; and two calls of one
signature with different buffers made in a different order. What remains
MPI's business: ``native`` calls of *different* byte counts made in a
different order across nodes, and, across nodes, a rank in a
point-to-point schedule whose peer sits in another call's
``MPI_Allreduce`` (both wait inside MPI; see :mod:`collectives.core.failures`).
What happens after an error is the subject of :mod:`collectives.core.failures`.
"""
from __future__ import annotations

import os
import sys
import time
import zlib
from typing import Callable

import numpy as np

from collectives.core.context import OPS, SUPPORTED_DTYPES
from collectives.errors import AllreduceMismatch
from collectives.runtime import MPI

#: Tag of the first-call records; data tags are >= FIRST_DATA_TAG.
CHECK_TAG = 1
FIRST_DATA_TAG = 2
_MAGIC = 0x6D706964  # "mpid"
RECORD_FIELDS = ("magic", "length", "dtype", "op", "algorithm", "runs", "segment", "tag")
#: Seconds a rank waits for its peers' records before it says so on stderr.
WARN_AFTER = float(os.environ.get("MPIDP_ALLREDUCE_WAIT_WARNING", "60"))
#: int64 words of a rank's blind-call record, readable by its peers:
#: ``[blind calls entered, gone, tag of the last even call, tag of the
#: last odd call]``; the tag of the last call is the slot of its parity.
BLIND_WORDS = 4
#: The record's word that says the rank makes no more calls on the
#: communicator (0 while it may): :data:`GONE_FAILED` or :data:`GONE_EXITED`.
GONE = 1
#: A call of this rank failed midway: the communicator refuses its further calls.
GONE_FAILED = 1
#: This rank's program is ending (interpreter exit).
GONE_EXITED = 2
#: The tag of a *release*: a rank that leaves joins, with scratch data, the
#: ``MPI_Allreduce`` in which a peer waits for it, so that the peer is not
#: left there for ever; the peer's order check then sees this tag and raises.
RELEASE_TAG = -1


def last_blind_tag(words) -> tuple[int, int]:
    """``(blind calls entered, tag of the last one)`` from a rank's words."""
    count = int(words[0])
    return count, int(words[2 + (count & 1)])


def gone_reason(gone: int) -> str:
    """What a rank's :data:`GONE` word says, in words."""
    if gone == GONE_EXITED:
        return "its program is ending"
    return "a call of its own failed; its message says why"


def make_enter(words: memoryview, tag: int) -> Callable[[], int]:
    """``enter() -> call number``: count a blind call of ``tag`` in ``words``.

    The call's tag is stored in the slot of its parity before the count, so a
    peer that sees the count sees the tag.
    """

    def enter() -> int:
        call = words[0] + 1
        words[2 + (call & 1)] = tag
        words[0] = call
        return call

    return enter


def make_verify(peers: list[memoryview], tag: int, rank: int, ranks: list[int],
                describe: str, explain: Callable[[int], str],
                same_bytes: Callable[[int], bool] = lambda tag: True
                ) -> Callable[[int], None]:
    """``verify(call)``: after blind call number ``call`` of ``tag`` completed,
    check that every peer's call of that number had the same tag (point 4).

    ``peers`` are the peers' blind-call words (shared memory), ``ranks`` their
    ranks. A peer cannot be two blind calls ahead (its next call needs this
    rank), so the parity slot still holds its tag of ``call``. Raises
    :class:`AllreduceMismatch` on every rank (each sees a peer that differs)
    when the calls had the same byte count (``same_bytes(their tag)``);
    else on this rank only: MPI may have finished this rank's call and left
    the peer's waiting (raised on every rank, it would be caught and the
    peer left there).
    """
    if not peers:
        return lambda call: None

    def fail(call: int) -> None:
        slot = 2 + (call & 1)
        q, words = next((q, w) for q, w in zip(ranks, peers) if w[slot] != tag)
        if words[slot] == RELEASE_TAG:
            raise released(rank, q, describe, int(words[GONE]))
        if not same_bytes(int(words[slot])):
            raise AllreduceMismatch(
                f"rank {rank}: allreduce of {describe} went through MPI_Allreduce "
                f"together with rank {q}'s call of {explain(words[slot])}, of another byte "
                "count: the ranks called allreduce in a different order, and MPI may leave "
                f"rank {q} waiting. The buffer holds no valid result. Every rank must make "
                "the same sequence of calls.")
        raise AllreduceMismatch(
            f"rank {rank}: allreduce of {describe} went through MPI_Allreduce "
            f"together with rank {q}'s call of {explain(words[slot])}: the ranks "
            "called allreduce in a different order, with buffers of the same byte "
            "count, which MPI cannot tell apart. The buffer holds no valid result. "
            "Every rank must make the same sequence of calls.", collective=True)

    if len(peers) == 1:  # the common case, without a loop
        (only,) = peers

        def verify_one(call: int) -> None:
            if only[2 + (call & 1)] != tag:
                fail(call)

        return verify_one

    def verify(call: int) -> None:
        slot = 2 + (call & 1)
        for words in peers:
            if words[slot] != tag:
                fail(call)

    return verify


def released(rank: int, peer: int, describe: str, gone: int) -> AllreduceMismatch:
    """The error of a rank whose ``MPI_Allreduce`` ``peer`` joined only to
    release it (see :data:`RELEASE_TAG`): raised on this rank only."""
    return AllreduceMismatch(
        f"rank {rank}: allreduce of {describe} waited in MPI_Allreduce for rank {peer}, "
        f"which never made this call ({gone_reason(gone)}) and joined it only to release "
        "this rank. The buffer holds no valid result. Every rank must make the same "
        "sequence of calls.")


def make_verify_mpi(comm: "MPI.Intracomm", tag: int, rank: int, describe: str
                    ) -> Callable[[int], None]:
    """Point 4 where the ranks do not share memory (``MPIDP_ALLREDUCE_VERIFY=1``):
    one more 16-byte ``MPI_Allreduce`` (MAX of tag and -tag) per call."""
    words = np.zeros(2, dtype=np.int64)
    allreduce, in_place, spec = comm.Allreduce, MPI.IN_PLACE, [words, MPI.INT64_T]

    def verify(call: int) -> None:
        words[0], words[1] = tag, -tag
        allreduce(in_place, spec, MPI.MAX)
        if words[0] != tag or words[1] != -tag:
            raise AllreduceMismatch(
                f"rank {rank}: allreduce of {describe} went through MPI_Allreduce while "
                "another rank made a different call of the same byte count (checked with "
                "MPIDP_ALLREDUCE_VERIFY=1). The buffer holds no valid result. Every rank must "
                "make the same sequence of calls.", collective=True)

    return verify


def verify_everywhere() -> bool:
    """``MPIDP_ALLREDUCE_VERIFY=1``: check native calls with an extra all-reduce
    where the ranks do not share memory."""
    return os.environ.get("MPIDP_ALLREDUCE_VERIFY", "").strip() == "1"


def _crc(text: str) -> int:
    # zlib.crc32, not hash(): Python's str hash differs between processes.
    return zlib.crc32(text.encode())


def signature_tag(n: int, dtype: np.dtype, op: str, runs: str, segment: int,
                  tag_ub: int) -> int:
    """The message tag of a signature: the same on every rank, >= FIRST_DATA_TAG."""
    text = f"{n}:{dtype.str}:{op}:{runs}:{segment}"
    return FIRST_DATA_TAG + _crc(text) % (tag_ub - FIRST_DATA_TAG)


def make_record(n: int, dtype: np.dtype, op: str, algorithm: str, runs: str,
                segment: int, tag: int) -> np.ndarray:
    """The fixed-size record of a signature that the ranks compare."""
    return np.array([_MAGIC, n, SUPPORTED_DTYPES.index(dtype), list(OPS).index(op),
                     _crc(algorithm), _crc(runs), segment, tag], dtype=np.int64)


def describe_record(record: np.ndarray, names: list[str]) -> str:
    """A record in words, e.g. ``float32[1000] sum, algorithm 'auto' (runs ring)``."""
    by_crc = {_crc(name): name for name in names}

    def name(value: int) -> str:
        return by_crc.get(int(value), "an algorithm this rank does not know")

    dtype = SUPPORTED_DTYPES[int(record[2])] if 0 <= record[2] < len(SUPPORTED_DTYPES) else "?"
    op = list(OPS)[int(record[3])] if 0 <= record[3] < len(OPS) else "?"
    segment = "unlimited" if record[6] >= 1 << 62 else f"{int(record[6])} B"
    return (f"{dtype}[{int(record[1])}] {op}, algorithm '{name(record[4])}' "
            f"(runs {name(record[5])}, segment {segment})")


def exchange_records(comm: "MPI.Intracomm", record: np.ndarray, describe_tag: Callable[[int], str],
                     peer_blocked: Callable[[int], str | None] | None = None) -> np.ndarray:
    """Send this rank's record to every peer and receive theirs (all ranks call it).

    Returns the ``size x len(record)`` table of records, row ``i`` from rank
    ``i``. Raises :class:`AllreduceMismatch` (on this rank only) when a peer
    sends a message of another call instead, or when ``peer_blocked(peer)``
    reports that a peer is stuck in a call this rank never made.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    table = np.zeros((size, record.size), dtype=np.int64)
    table[rank] = record
    peers = [q for q in range(size) if q != rank]
    # As bytes, like the algorithms' messages (see PlanContext.spec).
    sends = [comm.Isend([record, MPI.BYTE], dest=q, tag=CHECK_TAG) for q in peers]
    recvs = [comm.Irecv([table[q], MPI.BYTE], source=q, tag=MPI.ANY_TAG) for q in peers]
    statuses = [MPI.Status() for _ in peers]
    done = [False] * len(peers)
    start = time.monotonic()
    next_probe, warned, spins = start + 0.05, False, 0
    while not all(done):
        for i, request in enumerate(recvs):
            if done[i]:
                continue
            try:
                done[i] = request.Test(statuses[i])
            except MPI.Exception as error:
                raise AllreduceMismatch(
                    f"rank {rank}: at the first call of an allreduce signature it received "
                    f"from rank {peers[i]} a message longer than a signature record (MPI: "
                    f"{str(error).splitlines()[0]}): rank {peers[i]} is inside another "
                    "allreduce call. Every rank must make the same sequence of calls.") from None
            if done[i] and statuses[i].tag != CHECK_TAG:
                raise AllreduceMismatch(
                    f"rank {rank}: at the first call of an allreduce signature it received "
                    f"from rank {peers[i]} a message of {describe_tag(statuses[i].tag)}: "
                    f"rank {peers[i]} is inside another allreduce call. Every rank must make "
                    "the same sequence of calls.")
        if all(done):
            break
        spins += 1
        if spins > 1000:
            time.sleep(0.0002)  # oversubscribed ranks: give the core to the peer
        now = time.monotonic()
        if peer_blocked is not None and now >= next_probe:
            next_probe = now + 0.5
            for i, q in enumerate(peers):
                reason = None if done[i] else peer_blocked(q)
                if reason:
                    raise AllreduceMismatch(
                        f"rank {rank}: starts a new allreduce signature while rank {q} is "
                        f"{reason}: a call this rank never made. Every rank must make the "
                        "same sequence of calls.")
        if not warned and now - start > WARN_AFTER:
            warned = True
            missing = [q for i, q in enumerate(peers) if not done[i]]
            sys.stderr.write(
                f"[rank {rank}] mpidp: allreduce has waited {WARN_AFTER:.0f} s for ranks "
                f"{missing} to make the same call (first call of a signature); they are "
                "late, or not calling allreduce.\n")
            sys.stderr.flush()
    MPI.Request.Waitall(sends)
    return table


def mismatch_message(table: np.ndarray, names: list[str]) -> str | None:
    """``None`` when all rows agree, else a message listing each rank's call."""
    if (table == table[0]).all():
        return None
    groups: dict[bytes, list[int]] = {}
    for q, row in enumerate(table):
        groups.setdefault(row.tobytes(), []).append(q)
    lines = [f"  ranks {_ranges(qs)}: {describe_record(table[qs[0]], names)}"
             for qs in groups.values()]
    fields = [RECORD_FIELDS[j] for j in range(table.shape[1])
              if not (table[:, j] == table[0, j]).all() and RECORD_FIELDS[j] != "tag"]
    return ("allreduce called with different arguments on different ranks (they differ in "
            f"{', '.join(fields) or 'tag'}):\n" + "\n".join(lines) +
            "\nEvery rank must pass a buffer of the same length and dtype, the same op and "
            "algorithm (and the same MPIDP_ALLREDUCE_* settings).")


def _ranges(ranks: list[int]) -> str:
    parts, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None]):
        if b != a + 1:
            parts.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ",".join(parts)
