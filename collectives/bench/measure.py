"""The timed part of ``mpidp bench allreduce``: every algorithm at every size, in rounds.

:func:`measure` times the algorithms on the same buffer, interleaved in
rounds so that host effects hit them all alike, after warm-up calls (and,
for a tuned ``auto``, after its tuner has tried every candidate). With the
check on, each algorithm's result is compared with the exact expected one
(:func:`pattern` gives small integers, so every sum is exact in every dtype)
and with rank 0's bits. Beside the times, each record keeps what the
machine did meanwhile: the host's steal time (:func:`cpu_ticks`), the
core-to-core copy bandwidth before and after the size
(:mod:`collectives.bench.core_probe`), and the share of streaming copies.
"""
from __future__ import annotations

import statistics
import time
import zlib
from typing import Any

import numpy as np

from collectives.bench.core_probe import CoreProbe
from collectives.core.dispatch import algorithm_for, allreduce, forget
from collectives.core.plans import comm_state
from collectives.runtime import MPI


def pattern(count: int, rank: int, dtype: Any) -> Any:
    """Small integers in [-8, 8] that depend on rank and index (exact sums)."""
    index = np.arange(count, dtype=np.int64)
    return ((index * 131 + rank * 31) % 17 - 8).astype(dtype)


def expected(count: int, size: int, dtype: Any, op: str) -> Any:
    reduce = {"sum": np.add, "max": np.maximum, "min": np.minimum}[op]
    total = pattern(count, 0, np.int64)
    for q in range(1, size):
        reduce(total, pattern(count, q, np.int64), out=total)
    return total.astype(dtype)


def copy_bandwidth(nbytes: int = 64 << 20, repeats: int = 7) -> float:
    """Single-process memory-copy bandwidth in GB/s (np.copyto, median of repeats)
    of ``nbytes`` rounded down to whole float64 elements (the bytes copied)."""
    src = np.ones(nbytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return src.nbytes / float(np.median(times)) / 1e9


def cpu_ticks() -> tuple[int, int] | None:
    """``(stolen, total)`` CPU time of this machine so far, in clock ticks, from
    ``/proc/stat``; None where there is no such file (not Linux).

    *Steal* is time a virtual machine's CPUs were ready to run but the host
    ran something else: two ranks that must run at the same time to exchange
    data then wait for each other, while a single-process copy hardly
    notices.
    """
    try:
        with open("/proc/stat") as handle:
            fields = handle.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != "cpu":
        return None
    ticks = [int(x) for x in fields[1:9]]  # user nice system idle iowait irq softirq steal
    return ticks[7], sum(ticks)


def steal_percent(before: tuple[int, int] | None, after: tuple[int, int] | None
                  ) -> float | None:
    """Share of CPU time stolen by the host between two :func:`cpu_ticks` readings;
    None when a reading is missing (no ``/proc/stat``) or when no clock tick
    passed between them (too short to tell: see
    :func:`collectives.bench.report.steal_line`)."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return 100.0 * (after[0] - before[0]) / (after[1] - before[1])


def _check(buf: Any, comm: Any, algorithm: str, op: str, allreduce: Any) -> int:
    """Run one checked call; returns the number of wrong elements over all ranks."""
    rank, size = comm.Get_rank(), comm.Get_size()
    buf[...] = pattern(buf.size, rank, buf.dtype)
    allreduce(buf, comm, algorithm, op)
    want = expected(buf.size, size, buf.dtype, op)
    got = buf.view(np.uint8).reshape(buf.size, buf.dtype.itemsize)
    wrong = int(np.count_nonzero((got != want.view(np.uint8).reshape(got.shape)).any(axis=1)))
    digests = comm.allgather(zlib.crc32(buf.view(np.uint8)))
    if digests[rank] != digests[0]:
        wrong = max(wrong, 1)
    buf[...] = 0
    return int(comm.allreduce(wrong))


def tuner_of(state: Any, count: int, dtype: Any, op: str, name: str) -> Any:
    """The tuner of a tuned ``auto`` plan of this signature, or None; its counts
    include every call made so far (``TunedPlan.settle``)."""
    plan = state.plans.get((count, np.dtype(dtype), op, name))
    if hasattr(plan, "settle"):
        plan.settle()
    return getattr(plan, "tuner", None)


#: Untimed calls of every algorithm before the first size (see :func:`measure`).
WARMUP_PASS = 200


def measure(comm: Any, algorithms: list[str], sizes_bytes: list[int], dtype_name: str,
            op: str, iters: int = 0, warmup: int = 5, check: bool = False, rounds: int = 5,
            seconds: float = 0.1, on_row: Any = None) -> list[dict]:
    """Time every algorithm at every size (collective); returns the records (all ranks).

    A size is rounded down to whole ``dtype`` elements: its records' ``bytes``
    (``count`` * itemsize) are the bytes reduced, and the rates are of those
    (a size under one element is skipped). ``on_row(records_of_one_size)`` is
    called on every rank after each size.
    """

    dtype = np.dtype(dtype_name)
    size = comm.Get_size()
    state = comm_state(comm)
    oversubscribed, placement = state.oversubscribed, state.placement
    rounds = max(1, rounds)
    # Oversubscribed, the probe's two ranks would wait for the scheduler, not the copy.
    probe = None if oversubscribed else CoreProbe.create(comm)
    # Rank 0's count of the pair's cached and streaming copies (channels.copy_mode).
    pair = state.channel_named("shm-pair")
    choices = pair.choices if pair is not None and state.rank == 0 else None
    records = []
    # The job's first calls pay what no later size pays (the first messages
    # between the ranks, first-touch page faults, clocks ramping up), so the
    # per-size warm-up below cannot absorb them: one untimed pass of every
    # algorithm at the first size, WARMUP_PASS calls each, before anything is
    # timed (else the first row of a run reads several times the next one's).
    first = next((b // dtype.itemsize for b in sizes_bytes if b // dtype.itemsize), 0)
    if first:
        scratch = np.zeros(first, dtype=dtype)
        for name in algorithms:
            for _ in range(WARMUP_PASS):
                allreduce(scratch, comm, name, op)
        comm.Barrier()
    for nbytes in sizes_bytes:
        count = nbytes // dtype.itemsize
        if count == 0:
            continue
        buf = np.zeros(count, dtype=dtype)
        xcore = [probe.measure()] if probe is not None else [None]
        ticks = cpu_ticks()
        elapsed = dict.fromkeys(algorithms, 0.0)
        done = dict.fromkeys(algorithms, 0)
        streamed = {name: [0, 0] for name in algorithms}  # timed calls: streamed, counted
        per_round: dict[str, list[float]] = {name: [] for name in algorithms}
        ran: dict[str, dict[str, int]] = {name: {} for name in algorithms}  # tuned auto
        # Warm-up: first calls pay one-time set-up (buffers, compiled kernels;
        # for auto, the first call of each candidate, which its tuner makes
        # untimed), then the per-call time that (with -i 0) sets the iteration
        # count is measured on warmed-up calls, the same count on every rank.
        per_call = {}
        for name in algorithms:
            for _ in range(max(1, warmup)):
                allreduce(buf, comm, name, op)
            tuner = tuner_of(state, count, dtype, op, name)
            while tuner is not None and tuner.calls < len(tuner.plan):
                allreduce(buf, comm, name, op)  # deterministic: the same count on every rank
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(max(1, warmup)):
                allreduce(buf, comm, name, op)
            per_call[name] = (time.perf_counter() - start) / max(1, warmup)
        every_rank = comm.allgather(per_call)
        per_call = {name: max(d[name] for d in every_rank) for name in algorithms}
        planned = {name: iters if iters > 0 else
                   int(min(10000, max(5, seconds / max(per_call[name], 1e-9))))
                   for name in algorithms}
        for r in range(rounds):
            for name in algorithms:
                batch = planned[name] // rounds + (1 if r < planned[name] % rounds else 0)
                if batch == 0:
                    continue
                allreduce(buf, comm, name, op)  # rebind: the timed calls take the fast path
                before = list(choices.calls) if choices is not None else None
                tuner = tuner_of(state, count, dtype, op, name)
                used = list(tuner.used) if tuner is not None else None
                comm.Barrier()
                start = time.perf_counter()
                for _ in range(batch):
                    allreduce(buf, comm, name, op)
                spent = time.perf_counter() - start
                if before is not None:
                    streamed[name][0] += choices.calls[1] - before[1]
                    streamed[name][1] += sum(choices.calls) - sum(before)
                if used is not None:
                    tuner = tuner_of(state, count, dtype, op, name)  # settled
                    for i, k in enumerate(tuner.used):
                        ran[name][tuner.names[i]] = ran[name].get(tuner.names[i], 0) + k - used[i]
                elapsed[name] += spent
                done[name] += batch
                per_round[name].append(spent / batch * 1e6)
        stolen = steal_percent(ticks, cpu_ticks())
        stolen = comm.allreduce(-1.0 if stolen is None else stolen, op=MPI.MAX)
        xcore.append(probe.measure() if probe is not None else None)
        rows = []
        native_rounds = None
        for name in algorithms:
            mine = elapsed[name] / done[name]
            every = comm.allgather(mine)
            avg = sum(every) / size
            # Per-round averages over the ranks: for paired, per-round ratios.
            rounds_us = [float(x) for x in np.mean(comm.allgather(per_round[name]), axis=0)]
            wrong = _check(buf, comm, name, op, allreduce) if check else None
            share = streamed[name][0] / streamed[name][1] if streamed[name][1] else None
            share = comm.bcast(share, root=0)
            algbw = count * dtype.itemsize / avg / 1e9  # the bytes reduced, not -b's
            runs = (max(ran[name], key=ran[name].get) if ran[name]  # what a tuned auto ran most
                    else algorithm_for(count * dtype.itemsize, comm, name))
            rows.append({
                "algorithm": name,
                "runs": runs,
                "tuned_calls": ran[name] or None,
                "channel": state.route(count * dtype.itemsize, runs)[1],
                "bytes": count * dtype.itemsize, "count": count, "dtype": dtype.name,
                "op": op, "ranks": size, "oversubscribed": oversubscribed,
                "placement": placement,
                "iterations": done[name],
                "avg_us": avg * 1e6, "min_us": min(every) * 1e6, "max_us": max(every) * 1e6,
                "algbw_gbps": algbw, "busbw_gbps": algbw * 2 * (size - 1) / size,
                "wrong": wrong, "rounds_us": rounds_us,
                "steal_pct": None if stolen < 0 else stolen,
                "xcore_gbps": None if xcore[0] is None else xcore,
                "streamed": share,
            })
            if name == "native":
                native_rounds = rounds_us
        for row in rows:  # paired per round: host effects hit both sides alike
            row["x_native"] = (paired_speedup(native_rounds, row["rounds_us"])
                               if native_rounds else None)
        records += rows
        del buf
        forget(comm)  # release this size's plans and temporaries (collective)
        if on_row is not None:
            on_row(rows)
    if probe is not None:  # collective: not in a finally (a raising rank aborts the job)
        probe.free()
    return records


def paired_speedup(reference: list[float], times: list[float]) -> float:
    """Median over rounds of reference time / time (> 1: faster than the reference)."""
    return statistics.median(a / b for a, b in zip(reference, times))
