"""A user's own mpi4py program around collectives.allreduce, one scenario per run.

``mpiexec -n N python [-m mpi4py] user_allreduce.py SCENARIO [ALGORITHM]``;
tests/test_collectives_failures.py runs it with a timeout (a hang is a
failure) and reads the exit code and the lines it prints:

* ``raise-after``: one all-reduce, then rank 1 raises its own ValueError while
  the others wait in a barrier (run under ``python -m mpi4py``).
* ``swap``: two signatures checked, then rank 0 calls them in the other order.
* ``swap-same-bytes``: the same with float32[16] and int32[16] (equal byte
  counts, which MPI cannot tell apart).
* ``bad-first-call``: on a fresh communicator, rank 1 passes a bad algorithm name.
* ``buffers``: resized, reshaped and read-only arrays after a first call.
* ``specials``: NaN, inf and -0.0 on different ranks, every op and algorithm.
* ``skip``: ten calls of one signature, rank 1 skips the sixth: the sums
  after it mix calls (``WRONG``, as in plain MPI: nothing tells two calls
  of one signature apart), then the others wait in a call rank 1 never
  makes, which must end the job when rank 1's program ends.
* ``rank-0-only``: the first all-reduce on the communicator under ``if
  rank == 0:``; the other ranks' programs end. It must end the job (exit
  2), not wait in the communicator's set-up for ever.
* ``left-in-native``: with ``abort_on_error(False)``, rank 0 calls another
  signature while the others wait in a cached ``native`` call: rank 0
  raises, and must not leave them inside ``MPI_Allreduce``: they raise too,
  their buffers filled with NaN (``CAUGHT``, then ``NAN`` or ``NOT-NAN``).

* ``stopped-midway``: Ctrl-C lands on every rank but rank 1 while they wait
  in the third all-reduce for rank 1, which comes late: they leave the call
  with KeyboardInterrupt as it completes, and rank 1 goes on into a fourth
  that nobody else makes, inside ``MPI_Allreduce`` where it sees no mark.
  The job must end (exit 130), not wait there for ever.

* ``fail-between`` and ``fail-between-abort-off`` (the same after
  ``abort_on_error(False)``): two all-reduces, on the communicator and on a
  second one of the same ranks (``Split``), then rank 1 raises its own
  RuntimeError (uncaught, no ``-m mpi4py``) while the others make a third
  call on the second communicator: rank 0 at once, rank 2 half a second
  later, when rank 1's program has certainly passed its exit check. Rank 1
  must not finalize and leave them inside ``MPI_Allreduce`` (``native``):
  it ends the job, or with abort off it releases them and they raise
  (``CAUGHT``, ``DONE``).

An AllreduceMismatch raised on every rank alike is caught and reported as
``COLLECTIVE-ERROR``; a result that is wrong without an error prints
``WRONG``.
"""
from __future__ import annotations

import sys

import numpy as np

import collectives
from collectives import MPI

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
scenario = sys.argv[1]
algorithm = sys.argv[2] if len(sys.argv) > 2 else "auto"


def check(buf: np.ndarray, expected: np.ndarray, what: str) -> None:
    if not np.array_equal(buf, expected):
        print(f"WRONG rank {rank}: {what}: {buf[:4]} instead of {expected[:4]}", flush=True)


def raise_after() -> None:
    buf = np.ones(1000, np.float32)
    collectives.allreduce(buf, comm, algorithm)
    if rank == 1:
        raise ValueError("an ordinary bug of the user's, on rank 1")
    comm.Barrier()


def swap(first: np.ndarray, second: np.ndarray) -> None:
    a, b = first.copy(), second.copy()
    collectives.allreduce(a, comm, algorithm)
    collectives.allreduce(b, comm, algorithm)
    order = [first, second] if rank else [second, first]
    try:
        for template in order:
            buf = template.copy()
            collectives.allreduce(buf, comm, algorithm)
            check(buf, template * size, f"{template.dtype}[{template.size}]")
    except collectives.AllreduceMismatch as error:
        if not error.collective:
            raise
        print(f"COLLECTIVE-ERROR rank {rank}: {error}", flush=True)
        # no result, and none of another rank's numbers: NaN, or 0 for integers
        wiped = np.isnan(buf).all() if buf.dtype.kind == "f" else not buf.any()
        print(f"{'WIPED' if wiped else 'NOT-WIPED'} rank {rank}", flush=True)
        return
    print(f"DONE rank {rank}", flush=True)


def bad_first_call() -> None:
    fresh = comm.Dup()
    name = "butterfly" if rank == 1 else algorithm
    collectives.allreduce(np.ones(10, np.float32), fresh, name)


def buffers() -> None:
    collectives.abort_on_error(False)  # every rank makes the same mistakes here
    a = np.ones(1000, np.float64)
    collectives.allreduce(a, comm, algorithm)
    try:
        a.resize(3000, refcheck=False)
        print(f"RESIZED rank {rank}", flush=True)
    except ValueError:
        print(f"RESIZE-REFUSED rank {rank}", flush=True)
    collectives.forget(comm)  # releases the array: now it may be resized
    a.resize(3000, refcheck=False)
    a[:] = 1
    collectives.allreduce(a, comm, algorithm)
    check(a, np.full(3000, float(size)), "resized after forget")
    b = np.ones(12, np.float32)
    collectives.allreduce(b, comm, algorithm)
    b.shape = (3, 4)
    for what, buf in (("2-D", b), ("read-only", None)):
        if buf is None:
            buf = np.ones(12, np.float32)
            collectives.allreduce(buf, comm, algorithm)
            buf.flags.writeable = False
        try:
            collectives.allreduce(buf, comm, algorithm)
            print(f"ACCEPTED {what} rank {rank}", flush=True)
        except collectives.UnsupportedBuffer as error:
            print(f"REFUSED {what} rank {rank}: {error}", flush=True)
    print(f"DONE rank {rank}", flush=True)


def specials() -> None:
    values = np.array([np.nan, -np.inf, np.inf, -0.0, 0.0, 1.0], np.float64)
    results = []
    for dtype in (np.float16, np.float32, np.float64):
        for op in ("sum", "max", "min"):
            answers = set()
            for name in collectives.names():
                # Every rank holds a rotation of the special values, so each
                # position meets different ones on different ranks.
                buf = np.roll(values, rank).astype(dtype)
                collectives.allreduce(buf, comm, name, op)
                everyone = comm.allgather(buf.tobytes())
                if len(set(everyone)) != 1:
                    print(f"DIFFERENT-RANKS {name} {op} {np.dtype(dtype)}", flush=True)
                answers.add(buf.tobytes())
            if len(answers) != 1:
                print(f"DIFFERENT-ALGORITHMS {op} {np.dtype(dtype)}", flush=True)
            results.append(len(answers))
    print(f"DONE rank {rank}", flush=True)


def skip() -> None:
    for i in range(10):
        if rank == 1 and i == 5:
            continue
        buf = np.full(4, float(i * 10 + rank), np.float64)
        collectives.allreduce(buf, comm, algorithm)
        check(buf, np.full(4, float(i * 10 * size + sum(range(size)))), f"call {i}")
    print(f"DONE rank {rank}", flush=True)


def left_in_native() -> None:
    collectives.abort_on_error(False)
    cached = np.ones(10, np.float32)
    collectives.allreduce(cached, comm, "native")
    try:
        if rank == 0:
            collectives.allreduce(np.ones(12, np.float32), comm, algorithm)
        else:
            collectives.allreduce(cached, comm, "native")
    except collectives.AllreduceMismatch as error:
        print(f"CAUGHT rank {rank}: {error}", flush=True)
    if rank:
        print(f"{'NAN' if np.isnan(cached).all() else 'NOT-NAN'} rank {rank}", flush=True)


def rank_0_only() -> None:
    if rank == 0:
        collectives.allreduce(np.ones(8), comm, algorithm)
        print("DONE rank 0", flush=True)


def stopped_midway() -> None:
    import os
    import signal
    import threading
    import time

    buf = np.ones(1000, np.float32)
    for i in range(4):
        if i == 2 and rank == 1:
            time.sleep(1.0)  # the others wait in the call, where the signal lands
        elif i == 2:
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
        collectives.allreduce(buf, comm, "native")
    print(f"DONE rank {rank}", flush=True)


def fail_between(abort: bool) -> None:
    import time

    collectives.abort_on_error(abort)
    second = comm.Split(0, rank)
    buf = np.ones(1000, np.float32)
    collectives.allreduce(buf, comm, algorithm)
    collectives.allreduce(buf, second, algorithm)
    if rank == 1:
        raise RuntimeError("an ordinary bug of the user's, on rank 1")
    if rank == 2:
        time.sleep(0.5)
    try:
        collectives.allreduce(buf, second, algorithm)
    except collectives.AllreduceMismatch as error:
        print(f"CAUGHT rank {rank}: {error}", flush=True)
    print(f"DONE rank {rank}", flush=True)


SCENARIOS = {
    "raise-after": raise_after,
    "swap": lambda: swap(np.ones(10, np.float32), np.ones(11, np.float32)),
    "swap-same-bytes": lambda: swap(np.ones(16, np.float32), np.ones(16, np.int32)),
    "bad-first-call": bad_first_call,
    "buffers": buffers,
    "specials": specials,
    "skip": skip,
    "left-in-native": left_in_native,
    "rank-0-only": rank_0_only,
    "stopped-midway": stopped_midway,
    "fail-between": lambda: fail_between(abort=True),
    "fail-between-abort-off": lambda: fail_between(abort=False),
}

if __name__ == "__main__":
    SCENARIOS[scenario]()
