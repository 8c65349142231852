"""All-reduce micro-benchmark: every registered algorithm against MPI's own.

Run it like OSU's osu_allreduce or nccl-tests' all_reduce_perf, on every
rank: ``mpiexec -n 2 mpidp bench allreduce``. For each size (``-b`` to ``-e``,
times ``-f``) it times every algorithm (``-a``, default all, ``native``
included) on the same buffer, interleaving the algorithms in rounds so that
host effects hit them all alike, and prints on rank 0:

* time: average over iterations and ranks, with the fastest and slowest
  rank's average (OSU's avg/min/max latency);
* algbw = bytes / time (the bytes reduced: whole elements of ``-d``, a
  size rounded down) and busbw = algbw * 2(p-1)/p (nccl-tests'
  PERFORMANCE.md), the bandwidth each rank's link sustains, comparable across
  rank counts; the single-process memory-copy bandwidth is printed above the
  table as the ceiling on one node;
* "x native": native's time divided by the algorithm's (> 1 is faster);
* the channel each algorithm's schedule ran over (``--json``: ``channel``),
  and for ``auto`` what it ran (its tuning tries the candidates on the timed
  calls themselves; ``--json``: ``tuned_calls``, calls per candidate);
* #wrong with ``-c``: after each size's timed calls (which reduce zeros,
  unchecked), one more call per algorithm reduces a pattern of small
  integers (every sum exact in every dtype); its elements that differ from
  the exact expected result, or are not bit-identical to rank 0's. Any
  wrong element makes the command exit with 3.

``--json FILE`` writes one record per algorithm and size; ``--plot FILE.png``
draws latency and busbw against size (in a format matplotlib writes, named
by the extension). Options that cannot work (an unknown or repeated ``-a``
name, an output that cannot be written, a plot format matplotlib lacks) are
refused before anything is measured, in one line (exit 2). The harness never knows which
algorithm it times: it looks them up by name in the registry. The timed
rounds are :mod:`collectives.bench.measure`'s, the table, footers, plot and
``--summarize`` :mod:`collectives.bench.report`'s.
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import math
import os
import re
import sys
from typing import Any, Callable

import numpy as np

import kernels.files
from collectives import machine
from collectives.bench.errors import BenchUsageError, BenchWriteError
from collectives.bench.measure import copy_bandwidth, cpu_ticks, measure, steal_percent
from collectives.bench.report import (HEADER, format_row, plot, steal_line, streaming_line,
                                      summarize, xcore_line)
from collectives.core.plans import comm_state
from collectives.describe import format_size
from collectives.registry import names
from collectives.runtime import MPI, launch_info

EXIT_WRONG = 3
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20,
          "MB": 1 << 20, "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30,
          "T": 1 << 40, "TB": 1 << 40, "TIB": 1 << 40}
DTYPES = ("float16", "float32", "float64", "int32", "int64")
#: The largest size :func:`parse_size` accepts (1024T); what memory allows is checked later.
MAX_SIZE = 1 << 50
#: The options only a measurement uses (dest -> flag); ``--summarize`` refuses them.
MEASURING = {"minbytes": "-b", "maxbytes": "-e", "stepfactor": "-f", "iters": "-i",
             "warmup_iters": "-w", "check": "-c", "algorithms": "-a", "datatype": "-d",
             "op": "-o", "rounds": "--rounds", "time": "--time", "keep_heap": "--keep-heap",
             "json": "--json", "plot": "--plot"}


def parse_size(text: str) -> int:
    """``"8"``, ``"64K"``, ``"64M"``, ``"1GiB"`` -> bytes (binary units), at most
    :data:`MAX_SIZE` (numpy refused larger ones with a traceback)."""
    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 8, 64K, 64M, 1G)")
    value = int(match.group(1)) * _UNITS[match.group(2).upper()]
    if value > MAX_SIZE:
        raise argparse.ArgumentTypeError(f"{text.strip()} is too large (at most 1024T)")
    return value


def _at_least(least: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= ``least`` (-i -3 ran 10,000
    iterations under a header that said -3)."""
    def whole(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} must be at least {least}")
        return value
    return whole


def _seconds(text: str) -> float:
    """An argparse type: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text} must be a number of seconds > 0")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("8"),
                        metavar="SIZE", help="smallest message (default 8 B)")
    parser.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64M"),
                        metavar="SIZE", help="largest message (default 64M)")
    parser.add_argument("-f", "--stepfactor", type=int, default=2, metavar="F",
                        help="multiply the size by F between rows (default 2)")
    parser.add_argument("-i", "--iters", type=_at_least(0), default=0, metavar="N",
                        help="timed iterations per algorithm and size (default 0: as many "
                        "as fit in --time seconds, between 5 and 10000)")
    parser.add_argument("-w", "--warmup_iters", type=_at_least(0), default=5, metavar="N",
                        help="untimed iterations first (default 5)")
    parser.add_argument("-c", "--check", type=int, nargs="?", const=1, default=0,
                        choices=(0, 1), metavar="0|1",
                        help="after each size's timed calls (which reduce zeros, "
                        "unchecked), reduce a pattern of small integers once with each "
                        "algorithm and check that result: exact, and bit-identical on all "
                        "ranks (the #wrong column); a wrong one makes the command exit with 3")
    parser.add_argument("-a", "--algorithms", default="all", metavar="A,B",
                        help="comma-separated algorithms, each once (default: all "
                        "registered, native included)")
    parser.add_argument("-d", "--datatype", default="float32", choices=DTYPES,
                        help="element type (default float32)")
    parser.add_argument("-o", "--op", default="sum", choices=("sum", "max", "min"),
                        help="reduction (default sum)")
    parser.add_argument("--rounds", type=_at_least(1), default=5, metavar="R",
                        help="interleave the algorithms in R rounds per size (default 5)")
    parser.add_argument("--time", type=_seconds, default=0.1, metavar="S",
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
                        "earlier --json runs (speedups over native paired per round), all "
                        "of the same ranks, dtype, op and placement")
    parser.add_argument("--min-xcore", type=float, metavar="GBPS",
                        help="with --summarize: leave out the sizes measured while the "
                        "core-to-core copy bandwidth (measured before and after each size, "
                        "see the footer of a run) was below GBPS, i.e. in a slow spell of a "
                        "virtual machine's host")
    parser.add_argument("--max-xcore", type=float, metavar="GBPS",
                        help="with --summarize: the opposite, keep only the sizes measured "
                        "while the core-to-core copy was below GBPS before and after (the "
                        "slow spells)")
    parser.add_argument("--plot", metavar="FILE.png", help="plot latency and busbw vs size, "
                        "in the format of the file's extension (png, svg, pdf, ...)")


def sizes(minbytes: int, maxbytes: int, factor: int) -> list[int]:
    """The message sizes in bytes, nccl-tests style."""
    if minbytes < 1 or maxbytes < minbytes or factor < 2:
        raise BenchUsageError("need 1 <= -b <= -e and -f >= 2")
    out, size = [], minbytes
    while size <= maxbytes:
        out.append(size)
        size *= factor
    return out


def measured_sizes(minbytes: int, maxbytes: int, factor: int, dtype: str) -> list[int]:
    """The sizes of :func:`sizes` that hold at least one ``dtype`` element; a
    :class:`BenchUsageError` when none does (nothing would be measured)."""
    itemsize = np.dtype(dtype).itemsize
    out = [b for b in sizes(minbytes, maxbytes, factor) if b >= itemsize]
    if not out:
        raise BenchUsageError(f"no size from -b {format_size(minbytes)} to -e "
                              f"{format_size(maxbytes)} holds one {dtype} element "
                              f"({itemsize} B); raise -e to at least {itemsize}")
    return out


def memory_needed(largest: int, itemsize: int, check: bool) -> int:
    """About how many bytes one rank needs for a message of ``largest`` bytes:
    the message and as much again (MPI's temporary for a large native
    all-reduce, an algorithm's buffers), and with the check the exact
    expected result, built in int64 (about 4 arrays of 8 B per element)."""
    return 2 * largest + (4 * 8 * (largest // itemsize) if check else 0)


def memory_problem(largest: int, itemsize: int, check: bool, local_ranks: int,
                   memory: int | None) -> str | None:
    """Why a node with ``memory`` bytes cannot hold ``local_ranks`` ranks'
    messages of ``largest`` bytes (:func:`memory_needed`), or None (also
    when ``memory`` is unknown). Refused up front: numpy's MemoryError came
    only after the smaller sizes had run, as an error about a model."""
    need = local_ranks * memory_needed(largest, itemsize, check)
    if memory is None or need <= memory:
        return None
    ranks = "1 rank needs" if local_ranks == 1 else f"{local_ranks} ranks need"
    return (f"-e/--maxbytes {format_size(largest)}: {ranks} about {need / (1 << 30):.1f} GiB "
            f"on this node (the message and as much again per rank"
            f"{', and -c' if check else ''}), but it has {memory / (1 << 30):.1f} GiB of "
            "memory; lower -e")


def summarize_problem(args: argparse.Namespace) -> str | None:
    """Why ``--summarize`` cannot take these options, or None: it reads saved
    runs and measures nothing, so a measurement's options (:data:`MEASURING`)
    would be silently ignored."""
    defaults = argparse.ArgumentParser()
    add_arguments(defaults)
    default = vars(defaults.parse_args([]))
    given = [flag for dest, flag in MEASURING.items() if getattr(args, dest) != default[dest]]
    if not given:
        return None
    return (f"--summarize reads saved runs and measures nothing: leave out {', '.join(given)} "
            "(options of a measurement)")


def check_output(path: str | None, option: str) -> str | None:
    """Why ``path`` cannot be written, or None: mpidp's rule for every output
    (docs/lifecycle.md: the file may exist; its directory must exist and
    accept a new file; mpidp never creates a missing parent directory)."""
    if path is None:
        return None
    if not path.strip():  # "" is no file (engine.outputs.check_not_empty)
        return f"{option} is empty; give a path, or leave {option} out"
    parent = os.path.dirname(os.path.abspath(path))
    problem = kernels.files.not_an_output_file(path)
    if problem is not None:
        why, directory = problem
        return (f"{option} {path}: {why}; give a file name" if directory else
                f"{option} {path}: {why}; the output is {kernels.files.RENAMED_OVER}: "
                "give a file name")
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


def plot_format_problem(path: str | None) -> str | None:
    """Why matplotlib cannot write a plot to ``path``, or None: its extension
    names no format it writes (``p.txt`` was refused by ``savefig`` only
    after the whole measurement). No extension is matplotlib's default, PNG."""
    if path is None:
        return None
    extension = os.path.splitext(path)[1][1:].lower()
    if not extension:
        return None
    try:  # deferred: matplotlib is slow to import; only --plot needs it
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError:
        return "--plot needs matplotlib (pip install matplotlib), or leave --plot out"
    formats = FigureCanvasAgg.get_supported_filetypes()
    if extension in formats:
        return None
    return (f"--plot {path}: matplotlib writes no '{extension}' files; end the name with "
            f"one of .{', .'.join(sorted(formats))} (e.g. .png)")


def algorithm_list(text: str) -> list[str]:
    """The algorithms ``-a`` names (``all``: every registered one), each once;
    a :class:`BenchUsageError` (one line, the same on every rank) for a name
    not registered or named twice (it was reported once per rank, with a
    traceback's exit, or timed twice under two table rows)."""
    if text == "all":
        return names()
    algorithms = [a.strip() for a in text.split(",") if a.strip()]
    if not algorithms:
        raise BenchUsageError(f"-a/--algorithms {text!r} names no algorithm; "
                              "give e.g. -a ring,native, or leave -a out for all")
    for name in algorithms:
        if name not in names():
            close = next((n for n in names() if n.lower() == name.lower()), None)
            hint = f" (did you mean {close!r}?)" if close else ""
            raise BenchUsageError(f"-a/--algorithms: unknown algorithm {name!r}{hint}; "
                                  f"choose from {', '.join(names())}")
    twice = sorted({name for name in algorithms if algorithms.count(name) > 1})
    if twice:
        raise BenchUsageError(f"-a/--algorithms {text!r} names {', '.join(twice)} more than "
                              "once; name each algorithm once")
    return algorithms


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


def describe_run(comm: Any, auto_placement: str = "") -> str:
    """One line about the job (local; ``auto_placement`` from the comm's state)."""

    info = launch_info(comm)
    level = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
             MPI.THREAD_SERIALIZED: "serialized",
             MPI.THREAD_MULTIPLE: "multiple"}.get(MPI.Query_thread(), "?")
    placement = (f"oversubscribed: {info.local_ranks} ranks on {info.capacity} cores"
                 if info.oversubscribed else
                 f"{info.cores} cores{' each, bound' if info.bound else ''}")
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
        problem = summarize_problem(args)
        if problem:
            raise BenchUsageError(problem)
        if rank == 0:
            runs = []
            for path in args.summarize:
                try:
                    with open(path) as handle:
                        runs.append(json.load(handle))
                except (OSError, ValueError) as error:
                    raise BenchUsageError(f"{path}: cannot read benchmark JSON ({error})")
            print(summarize(runs, args.min_xcore, args.max_xcore, args.summarize))
        return 0
    algorithms = algorithm_list(args.algorithms)
    sizes_bytes = measured_sizes(args.minbytes, args.maxbytes, args.stepfactor, args.datatype)
    itemsize = np.dtype(args.datatype).itemsize
    largest = sizes_bytes[-1] // itemsize * itemsize  # the bytes reduced at the largest size
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    problem = memory_problem(largest, itemsize, bool(args.check), node.Get_size(),
                             machine.physical_memory())
    node.Free()
    problem = next((p for p in comm.allgather(problem) if p), None)  # the same on every rank
    if problem:
        raise BenchUsageError(problem)
    if args.keep_heap and not keep_heap():
        raise BenchUsageError("--keep-heap needs glibc (mallopt failed)")
    problem = None
    if rank == 0:  # the outputs before any measurement; rank 0 writes them
        problem = (check_output(args.json, "--json") or check_output(args.plot, "--plot")
                   or plot_format_problem(args.plot))
    problem = comm.bcast(problem, root=0)
    if problem:
        raise BenchUsageError(problem)
    ceiling = None
    copied = max(4 << 20, min(largest, 256 << 20)) // 8 * 8  # the largest message, 4-256 MiB
    comm.Barrier()
    if rank == 0:
        ceiling = copy_bandwidth(copied)
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
              f"{format_size(copied)}): {ceiling:.2f} GB/s; "
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
    stolen = steal_percent(ticks, cpu_ticks())  # None: no /proc/stat, or under a clock tick
    stolen = comm.allreduce(-1.0 if stolen is None else stolen, op=MPI.MAX)
    facts = machine.describe()
    for record in records:
        record["copy_ceiling_gbps"] = ceiling
        record.update(cpu=facts["cpu"], vector_extensions=facts["vector_extensions"],
                      mpi_library=facts["mpi"])
    wrong = sum(r["wrong"] or 0 for r in records)
    if rank == 0:
        print(steal_line(None if stolen < 0 else stolen, records, ticks is not None),
              file=out)
        print(xcore_line(records), file=out)
        streaming = streaming_line(records)
        if streaming:
            print(streaming, file=out)
        try:
            if args.json:  # every record also says how the run was made
                made = machine.provenance(facts, ranks=comm.Get_size())
                for record in records:
                    record["provenance"] = made
                kernels.files.replace_file(args.json, json.dumps(records, indent=1))
            if args.plot:
                plot(records, args.plot, f"all-reduce, {job}", ceiling)
        except OSError as error:
            raise BenchWriteError(f"cannot write the results: {error.strerror or error}") \
                from None
        if args.check:
            verdict = "all results correct" if not wrong else f"{wrong} WRONG elements"
            print(f"# check: {verdict}", file=out, flush=True)
    return EXIT_WRONG if wrong else 0
