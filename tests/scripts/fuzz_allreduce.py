"""Seeded fuzzing of all-reduce call sequences, as a user's program would make them.

``mpiexec -n N python fuzz_allreduce.py SEED``: every rank draws the same
sequence of calls (algorithm, dtype, op, length) from ``SEED``; with
probability one half one rank then deviates in one call (another length,
another dtype of the same item size, another op or algorithm, two calls
swapped, or one call skipped). Each rank checks every result it gets against
the exact answer of its own call (small integers: exact in every dtype).

It prints ``PLAN <deviation or none>``, then on each rank ``DONE`` after the
last call, ``COLLECTIVE-ERROR`` when an AllreduceMismatch was raised on every
rank alike (then it stops), or ``WRONG`` for a result that is wrong without
an error. Any other error ends the job (collectives.abort_on_error, the
default) with exit code 2. tests/test_collectives_failures.py checks that
every run is one of: no deviation and all DONE; a deviation and every rank
reporting the collective error; a deviation and exit code 2 with the
mismatch printed. Never a hang, a crash or a WRONG, except after a skipped
call: like MPI, nothing tells two calls of one signature apart, so the calls
after it may pair with the next ones of the other ranks (WRONG), but the
run must still end with the mismatch (docs/collectives.md).
"""
from __future__ import annotations

import sys

import numpy as np

import collectives
from collectives import MPI

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
seed = int(sys.argv[1])
calls = int(sys.argv[2]) if len(sys.argv) > 2 else 12

ALGORITHMS = collectives.names()
DTYPES = [np.float32, np.float64, np.int32, np.int64, np.float16]
SAME_SIZE = {np.dtype(np.float32): np.int32, np.dtype(np.int32): np.float32,
             np.dtype(np.float64): np.int64, np.dtype(np.int64): np.float64,
             np.dtype(np.float16): np.float16}
OPS = ["sum", "max", "min"]
LENGTHS = [0, 1, 2, 3, 7, 16, 100, 1000, 40_000, 300_001]


def draw(rng: np.random.Generator) -> tuple:
    return (ALGORITHMS[rng.integers(len(ALGORITHMS))], DTYPES[rng.integers(len(DTYPES))],
            OPS[rng.integers(len(OPS))], LENGTHS[rng.integers(len(LENGTHS))])


def plan(rng: np.random.Generator) -> tuple[list[tuple], list[tuple], str]:
    """(everyone's calls, the deviating rank's calls, what deviates)."""
    # Repeated signatures exercise the cached (fast) paths, where most checks live.
    pool = [draw(rng) for _ in range(4)]
    sequence = [pool[rng.integers(len(pool))] if rng.random() < 0.6 else draw(rng)
                for _ in range(calls)]
    mine = list(sequence)
    if rng.random() < 0.5:
        return sequence, mine, "none"
    k = int(rng.integers(calls))
    algorithm, dtype, op, n = sequence[k]
    kind = ["length", "dtype", "op", "algorithm", "swap", "skip"][rng.integers(6)]
    if kind == "length":
        mine[k] = (algorithm, dtype, op, n + 1 + int(rng.integers(3)))
    elif kind == "dtype":
        mine[k] = (algorithm, SAME_SIZE[np.dtype(dtype)], op, n)
        if np.dtype(dtype) == np.dtype(np.float16):
            mine[k] = (algorithm, dtype, op, n + 1)
    elif kind == "op":
        mine[k] = (algorithm, dtype, OPS[(OPS.index(op) + 1) % 3], n)
    elif kind == "algorithm":
        mine[k] = (ALGORITHMS[(ALGORITHMS.index(algorithm) + 1) % len(ALGORITHMS)],
                   dtype, op, n)
    elif kind == "swap":
        j = (k + 1 + int(rng.integers(calls - 1))) % calls
        mine[k], mine[j] = mine[j], mine[k]
    else:
        del mine[k]
        return sequence, mine, f"{kind} at call {k}"
    if mine == sequence:  # e.g. two equal calls swapped: no deviation after all
        return sequence, mine, "none"
    return sequence, mine, f"{kind} at call {k}"


def contribution(q: int, n: int, dtype) -> np.ndarray:
    return ((np.arange(n) * 7 + q * 3) % 11 - 5).astype(dtype)


def expected(n: int, dtype, op: str) -> np.ndarray:
    parts = np.stack([contribution(q, n, np.int64) for q in range(size)])
    reduce = {"sum": np.add, "max": np.maximum, "min": np.minimum}[op]
    return reduce.reduce(parts, axis=0).astype(dtype) if n else np.empty(0, dtype)


def main() -> None:
    rng = np.random.default_rng(seed)
    sequence, deviant, what = plan(rng)
    odd = int(rng.integers(size))
    if rank == 0:
        print(f"PLAN {what} (rank {odd})" if what != "none" else "PLAN none", flush=True)
    mine = deviant if rank == odd else sequence
    buffers: dict[tuple, np.ndarray] = {}
    try:
        for algorithm, dtype, op, n in mine:
            key = (np.dtype(dtype).str, n)
            buf = buffers.setdefault(key, np.empty(n, dtype))  # reused: the fast path
            buf[...] = contribution(rank, n, dtype)
            collectives.allreduce(buf, comm, algorithm, op)
            want = expected(n, dtype, op)
            if buf.tobytes() != want.tobytes():
                print(f"WRONG rank {rank}: {algorithm} {np.dtype(dtype)}[{n}] {op}", flush=True)
                return
    except collectives.AllreduceMismatch as error:
        if not error.collective:
            raise
        print(f"COLLECTIVE-ERROR rank {rank}", flush=True)
        return
    print(f"DONE rank {rank}", flush=True)


if __name__ == "__main__":
    main()
