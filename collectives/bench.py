"""All-reduce micro-benchmark: every registered algorithm against MPI's own.

Run it like OSU's osu_allreduce or nccl-tests' all_reduce_perf, on every
rank: ``mpiexec -n 2 mpidp bench allreduce``. For each size (``-b`` to ``-e``,
times ``-f``) it times every algorithm (``-a``, default all, ``native``
included) on the same buffer, interleaving the algorithms in rounds so that
host effects hit them all alike, and prints on rank 0:

* time: average over iterations and ranks, with the fastest and slowest
  rank's average (OSU's avg/min/max latency);
* algbw = bytes / time and busbw = algbw * 2(p-1)/p (nccl-tests'
  PERFORMANCE.md), the bandwidth each rank's link sustains, comparable across
  rank counts; the single-process memory-copy bandwidth is printed above the
  table as the ceiling on one node;
* "x native": native's time divided by the algorithm's (> 1 is faster);
* the channel each algorithm's schedule ran over (``--json``: ``channel``),
  and for ``auto`` what it ran (its tuning tries the candidates on the timed
  calls themselves; ``--json``: ``tuned_calls``, calls per candidate);
* #wrong with ``-c``: elements differing from the exact expected result, or
  not bit-identical to rank 0's (the data are small integers, so every sum is
  exact in every dtype). Any wrong element makes the command exit with 3.

``--json FILE`` writes one record per algorithm and size; ``--plot FILE.png``
draws latency and busbw against size. The harness never knows which
algorithm it times: it looks them up by name in the registry.
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import re
import statistics
import sys
import time
import zlib
from typing import Any

import numpy as np

from collectives.core_probe import CoreProbe
from collectives.describe import format_size
from collectives import machine
from collectives.dispatch import algorithm_for, allreduce, forget
from collectives.plans import comm_state
from collectives.registry import get, names
from collectives.runtime import MPI, launch_info

EXIT_WRONG = 3
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20,
          "MB": 1 << 20, "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}
DTYPES = ("float16", "float32", "float64", "int32", "int64")


def parse_size(text: str) -> int:
    """``"8"``, ``"64K"``, ``"64M"``, ``"1GiB"`` -> bytes (binary units)."""
    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 8, 64K, 64M, 1G)")
    return int(match.group(1)) * _UNITS[match.group(2).upper()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("8"),
                        metavar="SIZE", help="smallest message (default 8 B)")
    parser.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64M"),
                        metavar="SIZE", help="largest message (default 64M)")
    parser.add_argument("-f", "--stepfactor", type=int, default=2, metavar="F",
                        help="multiply the size by F between rows (default 2)")
    parser.add_argument("-i", "--iters", type=int, default=0, metavar="N",
                        help="timed iterations per algorithm and size (default 0: as many "
                        "as fit in --time seconds, between 5 and 10000)")
    parser.add_argument("-w", "--warmup_iters", type=int, default=5, metavar="N",
                        help="untimed iterations first (default 5)")
    parser.add_argument("-c", "--check", type=int, nargs="?", const=1, default=0,
                        metavar="0|1", help="check every result (exact, bit-identical on all "
                        "ranks); a wrong one makes the command exit with 3")
    parser.add_argument("-a", "--algorithms", default="all", metavar="A,B",
                        help="comma-separated algorithms (default: all registered, "
                        "native included)")
    parser.add_argument("-d", "--datatype", default="float32", choices=DTYPES,
                        help="element type (default float32)")
    parser.add_argument("-o", "--op", default="sum", choices=("sum", "max", "min"),
                        help="reduction (default sum)")
    parser.add_argument("--rounds", type=int, default=5, metavar="R",
                        help="interleave the algorithms in R rounds per size (default 5)")
    parser.add_argument("--time", type=float, default=0.1, metavar="S",
                        help="with -i 0: seconds of timing per algorithm and size (default 0.1)")
    parser.add_argument("--keep-heap", action="store_true",
                        help="on every rank, keep freed memory in the heap (glibc mallopt: "
                        "M_MMAP_MAX 0, M_TRIM_THRESHOLD 1 GiB, i.e. MALLOC_MMAP_MAX_=0 "
                        "MALLOC_TRIM_THRESHOLD_=1073741824), so MPICH's temporary for large "
                        "native all-reduces is not page-faulted in on every call "
                        "(default: leave malloc alone)")
    parser.add_argument("--json", metavar="FILE", help="write the records as JSON")
    parser.add_argument("--summarize", nargs="+", metavar="FILE",
                        help="do not measure: print a markdown table of the medians of "
                        "earlier --json runs (speedups over native paired per round)")
    parser.add_argument("--min-xcore", type=float, metavar="GBPS",
                        help="with --summarize: leave out the sizes measured while the "
                        "core-to-core copy bandwidth (measured before and after each size, "
                        "see the footer of a run) was below GBPS, i.e. in a slow spell of a "
                        "virtual machine's host")
    parser.add_argument("--max-xcore", type=float, metavar="GBPS",
                        help="with --summarize: the opposite, keep only the sizes measured "
                        "while the core-to-core copy was below GBPS before and after (the "
                        "slow spells)")
    parser.add_argument("--plot", metavar="FILE.png", help="plot latency and busbw vs size")


def sizes(minbytes: int, maxbytes: int, factor: int) -> list[int]:
    """The message sizes in bytes, nccl-tests style."""
    if minbytes < 1 or maxbytes < minbytes or factor < 2:
        raise BenchUsageError("need 1 <= -b <= -e and -f >= 2")
    out, size = [], minbytes
    while size <= maxbytes:
        out.append(size)
        size *= factor
    return out


class BenchUsageError(ValueError):
    """A benchmark option that cannot work."""

    exit_code = 2
    collective = True


class BenchWriteError(OSError):
    """An output that could not be written at the end (checked before the run)."""

    exit_code = 74
    collective = True


def check_output(path: str | None, option: str) -> str | None:
    """Why ``path`` cannot be written, or None: mpidp's rule for every output
    (docs/lifecycle.md: the file may exist; its directory must exist and
    accept a new file; mpidp never creates a missing parent directory)."""
    if not path:
        return None
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"{option} {path}: is a directory; give a file name"
    if not os.path.isdir(parent):
        what = "is a file, not a directory" if os.path.exists(parent) else "does not exist"
        return (f"{option} {path}: directory {parent} {what} (mpidp creates the file you "
                "name, never its parent)")
    probe = os.path.join(parent, f".mpidp-probe-{os.getpid()}")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.unlink(probe)
    except OSError as error:
        return f"{option} {path}: cannot write in {parent}: {error.strerror}"
    return None


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
    """Single-process memory-copy bandwidth in GB/s (np.copyto, median of repeats)."""
    src = np.ones(nbytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return nbytes / float(np.median(times)) / 1e9


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
    """Share of CPU time stolen by the host between two :func:`cpu_ticks` readings."""
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


def measure(comm: Any, algorithms: list[str], sizes_bytes: list[int], dtype_name: str,
            op: str, iters: int = 0, warmup: int = 5, check: bool = False, rounds: int = 5,
            seconds: float = 0.1, on_row: Any = None) -> list[dict]:
    """Time every algorithm at every size (collective); returns the records (all ranks).

    ``on_row(records_of_one_size)`` is called on every rank after each size.
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
            algbw = nbytes / avg / 1e9
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


def slow_spell(record: dict, min_xcore: float | None) -> bool:
    """Whether ``record`` was measured while the core-to-core copy bandwidth,
    before or after its size, was below ``min_xcore`` GB/s."""
    xcore = record.get("xcore_gbps")
    return min_xcore is not None and xcore is not None and min(xcore) < min_xcore


def fast_spell(record: dict, max_xcore: float | None) -> bool:
    """Whether ``record`` was not measured wholly below ``max_xcore`` GB/s core to
    core (before and after its size; not measured counts as not below)."""
    xcore = record.get("xcore_gbps")
    return max_xcore is not None and (xcore is None or max(xcore) >= max_xcore)


def summarize(runs: list[list[dict]], min_xcore: float | None = None,
              max_xcore: float | None = None) -> str:
    """A markdown table of several runs' records (medians of per-round ratios).

    With ``min_xcore``, sizes measured in a slow spell (:func:`slow_spell`)
    are left out; with ``max_xcore``, all but those measured wholly in one
    (:func:`fast_spell`); the caption says how many.
    """
    median = statistics.median
    measured = {(i, r["bytes"]) for i, records in enumerate(runs) for r in records}
    dropped = {(i, r["bytes"]) for i, records in enumerate(runs) for r in records
               if slow_spell(r, min_xcore) or fast_spell(r, max_xcore)}
    runs = [[r for r in records if (i, r["bytes"]) not in dropped]
            for i, records in enumerate(runs)]
    cells: dict[tuple[int, str], list[dict]] = {}
    rounds = {(i, r["bytes"], r["algorithm"]): r["rounds_us"]
              for i, records in enumerate(runs) for r in records}
    for i, records in enumerate(runs):
        for r in records:
            native = rounds.get((i, r["bytes"], "native"))
            if native is not None:
                r = dict(r, speedup=paired_speedup(native, r["rounds_us"]))
                cells.setdefault((r["bytes"], r["algorithm"]), []).append(r)
    algorithms = list(dict.fromkeys(name for _, name in cells))
    shown = [a for a in algorithms if a != "native"]
    lines = ["| size | native time | " + " | ".join(shown) + " | ring busbw (native) |",
             "|---:|---:|" + "---:|" * len(shown) + "---:|"]
    first = next((records[0] for records in runs if records), None)
    if first is None:
        return "No size left to summarize" + (" (see --min-xcore / --max-xcore)."
                                              if min_xcore or max_xcore else ".")
    for nbytes in sorted({b for b, _ in cells}):
        speed = {a: median(r["speedup"] for r in cells[(nbytes, a)]) for a in algorithms
                 if (nbytes, a) in cells}
        t = median(r["avg_us"] for r in cells[(nbytes, "native")])
        best = max((v, a) for a, v in speed.items() if a != "auto")[1]
        row = []
        for a in shown:
            text = f"{speed[a]:.2f}" if a in speed else "-"
            if a == "auto" and a in speed:
                # auto against the best side by side, round by round (not through
                # native's rounds, whose noise the two speed-ups would both carry).
                paired = [1 / paired_speedup(rounds[(i, nbytes, best)], rounds[(i, nbytes, a)])
                          for i in range(len(runs))
                          if (i, nbytes, a) in rounds and (i, nbytes, best) in rounds]
                text += f" ({cells[(nbytes, a)][0]['runs']}, {median(paired):.2f} of best)"
            row.append(text)
        bus = (f"{median(r['busbw_gbps'] for r in cells[(nbytes, 'ring')]):.2f} "
               f"({median(r['busbw_gbps'] for r in cells[(nbytes, 'native')]):.2f})"
               if (nbytes, "ring") in cells else "-")
        time_text = f"{t:.1f} us" if t < 1000 else f"{t / 1000:.2f} ms"
        lines.append(f"| {format_size(nbytes)} | {time_text} | " + " | ".join(row) +
                     f" | {bus} |")
    ceiling = median(r[0].get("copy_ceiling_gbps") or 0 for r in runs if r)
    stolen = [r["steal_pct"] for records in runs for r in records
              if r.get("steal_pct") is not None]
    machine = (f" Host steal time per size: {min(stolen):.1f}-{max(stolen):.1f}% "
               f"(median {median(stolen):.1f}%)." if stolen else "")
    xcore = [x for records in runs for r in records for x in (r.get("xcore_gbps") or [])]
    if xcore:
        machine += (f" Core-to-core copy (rank 0 -> 1) before/after each size: "
                    f"{min(xcore):.1f}-{max(xcore):.1f} GB/s.")
    if min_xcore is not None or max_xcore is not None:
        rule = " or ".join(([f"below {min_xcore:g}"] if min_xcore is not None else []) +
                           ([f"not wholly below {max_xcore:g}"] if max_xcore is not None
                            else []))
        machine += (f" Left out, measured {rule} GB/s core to core: "
                    f"{len(dropped)} of {len(measured)} sizes over the runs.")
    streamed = [100 * r["streamed"] for records in runs for r in records
                if r.get("streamed") is not None]
    if streamed:
        machine += (f" Calls that streamed (2-rank pair, per run and size): "
                    f"{min(streamed):.0f}-{max(streamed):.0f}% (median {median(streamed):.0f}%).")
    lines.append(f"\n{len(runs)} run(s) of {first['ranks']} ranks"
                 f"{' (oversubscribed)' if first.get('oversubscribed') else ''}, "
                 f"{first['dtype']} {first['op']}; algorithm columns: native's time / its "
                 "time (> 1 is faster), median over rounds and runs; auto: what it ran and "
                 "its time over the best algorithm's (1.00 = the best), median over rounds "
                 "and runs of the two's times in the same round; busbw in GB/s; "
                 f"memory-copy ceiling {ceiling:.1f} GB/s.{machine}")
    return "\n".join(lines)


HEADER = (f"{'size':>10} {'count':>10} {'type':>8} {'algorithm':<30} {'time(us)':>10} "
          f"{'min(us)':>10} {'max(us)':>10} {'algbw(GB/s)':>11} {'busbw(GB/s)':>11} "
          f"{'x native':>8} {'#wrong':>6}")


def format_row(row: dict) -> str:
    name = row["algorithm"]
    if row["runs"] != name:
        name = f"{name} ({row['runs']})"
    ratio = f"{row['x_native']:.2f}" if row["x_native"] else "-"
    wrong = "-" if row["wrong"] is None else str(row["wrong"])
    return (f"{format_size(row['bytes']):>10} {row['count']:>10} {row['dtype']:>8} "
            f"{name:<30} {row['avg_us']:>10.2f} {row['min_us']:>10.2f} {row['max_us']:>10.2f} "
            f"{row['algbw_gbps']:>11.3f} {row['busbw_gbps']:>11.3f} {ratio:>8} {wrong:>6}")


def plot(records: list[dict], path: str, title: str, ceiling: float | None) -> None:
    """Latency and busbw against size, one line per algorithm, log axes."""
    import matplotlib  # deferred: optional and slow to import; only --plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (lat, bw) = plt.subplots(1, 2, figsize=(12, 4.8))
    for name in dict.fromkeys(r["algorithm"] for r in records):
        rows = [r for r in records if r["algorithm"] == name]
        x = [r["bytes"] for r in rows]
        style = {"linestyle": "--"} if name == "native" else {}
        lat.plot(x, [r["avg_us"] for r in rows], marker=".", label=name, **style)
        bw.plot(x, [r["busbw_gbps"] for r in rows], marker=".", label=name, **style)
    if ceiling:
        bw.axhline(ceiling, color="grey", linestyle=":", label=f"memcpy {ceiling:.1f} GB/s")
    for ax, ylabel in ((lat, "time per call (us)"), (bw, "busbw (GB/s)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def keep_heap() -> bool:
    """glibc: serve large allocations from the heap and never trim it; False without glibc."""

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_max = -1, -4
        return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold,
                                                                        1 << 30))
    except (OSError, AttributeError):
        return False


def malloc_setting(kept: bool) -> str:
    if kept:
        return "heap kept (mallopt M_MMAP_MAX=0, M_TRIM_THRESHOLD=1 GiB, --keep-heap)"
    env = {k: os.environ[k] for k in ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_")
           if k in os.environ}
    return " ".join(f"{k}={v}" for k, v in env.items()) or "glibc defaults (no --keep-heap)"


def steal_line(total: float, records: list[dict]) -> str:
    """The footer line on host steal time (see :func:`cpu_ticks`)."""
    per_size = [r for r in records if r.get("steal_pct") is not None]
    if not per_size:
        return "# host steal time: not measurable here (no /proc/stat)"
    worst = max(per_size, key=lambda r: r["steal_pct"])
    return (f"# host steal time (CPU time a VM host gave to others): {total:.1f}% over the "
            f"run, at most {worst['steal_pct']:.1f}% at {format_size(worst['bytes'])}; above "
            "a few percent, timings of ranks that wait for each other suffer most")


def streaming_line(records: list[dict]) -> str | None:
    """The footer line on streaming copies (see :mod:`collectives.channels.copy_mode`), or None
    when no algorithm could choose them."""
    shares: dict[str, list[float]] = {}
    for r in records:
        if r.get("streamed") is not None:
            shares.setdefault(r["algorithm"], []).append(100 * r["streamed"])
    if not shares:
        return None
    parts = ", ".join(f"{name} {min(v):.0f}-{max(v):.0f}%" for name, v in shares.items())
    return ("# streaming copies (the 2-rank shared-memory ring chooses per call between cached "
            f"and streaming copies): share of timed calls that streamed, per size: {parts} "
            "(per size in --json: streamed; MPIDP_ALLREDUCE_STREAMING=on/off fixes it)")


def xcore_line(records: list[dict]) -> str:
    """The footer line on the core-to-core copy bandwidth (see :mod:`collectives.core_probe`)."""
    values = [x for r in records for x in (r.get("xcore_gbps") or [])]
    if not values:
        return ("# core-to-core copy: not measured (one rank, ranks 0 and 1 on different "
                "nodes, or an oversubscribed node)")
    return (f"# core-to-core copy (rank 0 -> 1, {format_size(1 << 20)} through shared memory) "
            f"before/after each size: {min(values):.1f}-{max(values):.1f} GB/s; where it "
            "drops, data crosses between cores slowly (on a virtual machine: e.g. the host "
            "running the vCPUs on cores without a shared cache) and every all-reduce slows "
            "(per size in --json: xcore_gbps; --summarize --min-xcore leaves such sizes out)")


def describe_run(comm: Any, auto_placement: str = "") -> str:
    """One line about the job (local; ``auto_placement`` from the comm's state)."""

    info = launch_info(comm)
    level = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
             MPI.THREAD_SERIALIZED: "serialized",
             MPI.THREAD_MULTIPLE: "multiple"}.get(MPI.Query_thread(), "?")
    placement = (f"oversubscribed: {info.local_ranks} ranks on {info.cores} cores"
                 if info.oversubscribed else f"{info.cores} cores")
    auto = f", auto's placement '{auto_placement}'" if auto_placement else ""
    return (f"{comm.Get_size()} ranks ({placement}{auto}), {machine.one_line()}, "
            f"MPI thread level {level}")


def run(args: argparse.Namespace) -> int:

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    if (args.min_xcore is not None or args.max_xcore is not None) and not args.summarize:
        raise BenchUsageError("--min-xcore and --max-xcore apply to --summarize (they filter "
                              "saved runs)")
    if args.summarize:
        if rank == 0:
            runs = []
            for path in args.summarize:
                try:
                    with open(path) as handle:
                        runs.append(json.load(handle))
                except (OSError, ValueError) as error:
                    raise BenchUsageError(f"{path}: cannot read benchmark JSON ({error})")
            print(summarize(runs, args.min_xcore, args.max_xcore))
        return 0
    if args.algorithms == "all":
        algorithms = names()
    else:
        algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
        for name in algorithms:
            get(name)  # UnknownAlgorithm, the same on every rank
    sizes_bytes = sizes(args.minbytes, args.maxbytes, args.stepfactor)
    if args.keep_heap and not keep_heap():
        raise BenchUsageError("--keep-heap needs glibc (mallopt failed)")
    problem = None
    if rank == 0:  # the outputs before any measurement; rank 0 writes them
        problem = check_output(args.json, "--json") or check_output(args.plot, "--plot")
    problem = comm.bcast(problem, root=0)
    if problem:
        raise BenchUsageError(problem)
    ceiling = None
    comm.Barrier()
    if rank == 0:  # copy as much as the largest message (4 MiB to 256 MiB)
        ceiling = copy_bandwidth(max(4 << 20, min(args.maxbytes, 256 << 20)))
    ceiling = comm.bcast(ceiling, root=0)

    job = describe_run(comm, comm_state(comm).placement)  # collective on first use
    out = sys.stdout
    if rank == 0:
        print(f"# mpidp bench allreduce: {job}", file=out)
        print(f"# dtype {args.datatype}, op {args.op}, iterations "
              f"{args.iters or f'auto ({args.time:g} s per algorithm and size)'}, warm-up "
              f"{args.warmup_iters}, {args.rounds} interleaved rounds, check "
              f"{'on' if args.check else 'off'}", file=out)
        print(f"# memory-copy ceiling (one process, np.copyto of "
              f"{format_size(max(4 << 20, min(args.maxbytes, 256 << 20)))}): {ceiling:.2f} GB/s; "
              "busbw = algbw * 2(p-1)/p; 'x native' = native time / time", file=out)
        print(f"# malloc: {malloc_setting(args.keep_heap)}", file=out)
        print(HEADER, file=out, flush=True)

    def on_row(rows: list[dict]) -> None:
        if rank == 0:
            for row in rows:
                print(format_row(row), file=out)
            out.flush()

    ticks = cpu_ticks()
    records = measure(comm, algorithms, sizes_bytes, args.datatype, args.op, args.iters,
                      args.warmup_iters, bool(args.check), args.rounds, args.time, on_row)
    stolen = comm.allreduce(steal_percent(ticks, cpu_ticks()) or 0.0, op=MPI.MAX)
    facts = machine.describe()
    for record in records:
        record["copy_ceiling_gbps"] = ceiling
        record.update(cpu=facts["cpu"], vector_extensions=facts["vector_extensions"],
                      mpi_library=facts["mpi"])
    wrong = sum(r["wrong"] or 0 for r in records)
    if rank == 0:
        print(steal_line(stolen, records), file=out)
        print(xcore_line(records), file=out)
        streaming = streaming_line(records)
        if streaming:
            print(streaming, file=out)
        try:
            if args.json:
                with open(args.json + ".tmp", "w") as handle:
                    json.dump(records, handle, indent=1)
                os.replace(args.json + ".tmp", args.json)
            if args.plot:
                plot(records, args.plot, f"all-reduce, {job}", ceiling)
        except OSError as error:
            raise BenchWriteError(f"cannot write the results: {error.strerror or error}") \
                from None
        if args.check:
            verdict = "all results correct" if not wrong else f"{wrong} WRONG elements"
            print(f"# check: {verdict}", file=out, flush=True)
    return EXIT_WRONG if wrong else 0
