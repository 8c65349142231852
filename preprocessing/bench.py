"""Time `mpidp prep` end to end against a single-process polars pipeline.

Each run is a fresh process, timed from launch to exit as a user sees it
(`mpiexec -n P mpidp prep FILE --out OUT.h5`, interpreter start and MPI
start-up included), on a synthetic 286-column PUMS file (generated once with
`mpidp synth` and cached). The reference (preprocessing/reference.py) does
the same job with polars in one process; the runs are interleaved (reference,
1 rank, 2 ranks, ... per round) and the medians are compared. The output
file is deleted before every run (replacing an existing file costs time).

Run it alone on the machine, e.g.:
  flock /tmp/mpidp-bench.lock mpidp bench prep --repeat 5
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from collectives import MPI, machine
from collectives.launch import child_env, find_tool
from kernels.files import cache_dir
from preprocessing import atomic
from preprocessing.errors import PrepError


#: Records in the synthetic file when --rows is not given.
ROWS = 1_200_000


def default_cache() -> str:
    """The synthetic file's folder when --cache is not given: $MPIDP_CACHE, else
    mpidp's cache folder (``kernels.files.cache_dir``: $XDG_CACHE_HOME/mpidp or
    ~/.cache/mpidp), as ``bench scaling`` has it."""
    return os.environ.get("MPIDP_CACHE") or str(cache_dir())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rows", type=int, default=None,
                        help=f"records in the synthetic file (default: {ROWS}; not with "
                        "--input)")
    parser.add_argument("--input", metavar="FILE.csv",
                        help="time this file instead of the cached synthetic one")
    parser.add_argument("--ranks", default="1,2", help="rank counts to time (default: 1,2)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds (default: 3)")
    parser.add_argument("--cache", default=None,
                        help="where the synthetic file is kept (default: $MPIDP_CACHE, else "
                        "mpidp's cache folder, $XDG_CACHE_HOME/mpidp or ~/.cache/mpidp; not "
                        "with --input)")
    parser.add_argument("--no-reference", action="store_true",
                        help="skip the polars reference")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")


def check_cache(cache: str) -> None:
    """Raise PrepError (collective, one line) unless ``--cache`` can hold the
    synthetic file: a folder, or a path whose nearest existing part is one
    (the missing folders are made). A file there ended in a traceback from
    ``mkdir`` after the options were taken."""
    if not str(cache).strip():
        raise PrepError("--cache is empty; give a folder, e.g. --cache ~/.cache/mpidp",
                        collective=True)
    path = Path(cache)
    for part in (path, *path.parents):
        if part.is_dir():
            return
        if part.exists() or part.is_symlink():
            what = "it is" if part == path else f"{part} is"
            raise PrepError(f"--cache {cache}: {what} not a folder; give a folder for the "
                            "synthetic file (made if missing)", collective=True)


def synthetic_file(cache: str, rows: int) -> str:
    """The cached synthetic input, written with `mpidp synth` if missing
    (``cache``: checked by :func:`check_cache`; a folder that cannot be made
    is a PrepError)."""
    path = Path(cache) / f"synth-pums-2018-{rows}-seed1.csv"
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise PrepError(f"--cache {cache}: cannot make the folder: "
                            f"{exc.strerror or exc}") from None
        print(f"writing {path} ({rows:,} rows, once) ...", file=sys.stderr, flush=True)
        _checked([find_tool("mpidp"), "synth", "--rows", str(rows), "--out", str(path),
                  "--seed", "1", "--quiet"])
    return str(path)


def _shown(argv: list[str]) -> str:
    """The command as a user would type it: programs by name, not by path."""
    here = os.path.dirname(sys.executable)
    return " ".join(os.path.basename(a) if os.path.dirname(a) == here else a for a in argv)


def _checked(argv: list[str]) -> subprocess.CompletedProcess:
    """Run a child command; its failure is a one-line error with its last words."""
    result = subprocess.run(argv, capture_output=True, text=True, env=child_env())
    if result.returncode != 0:
        lines = (result.stderr or result.stdout).strip().splitlines()
        raise PrepError(f"`{_shown(argv)}` failed with exit code {result.returncode}: "
                        f"{lines[-1] if lines else 'no output'}")
    return result


def _rank_counts(text: str) -> list[int]:
    try:
        ranks = [int(r) for r in text.split(",") if r.strip()]
    except ValueError:
        ranks = []
    if not ranks or min(ranks) < 1:
        raise PrepError(f"--ranks {text!r}: expected comma-separated positive integers, "
                        "e.g. 1,2", collective=True)
    return ranks


def _timed(argv: list[str], out: str) -> tuple[float, dict[str, float]]:
    """Seconds from launch to exit, and the steps the command printed
    (``--timings``): each named step's seconds, ``start`` the time before the
    first step (interpreter, imports, MPI start-up: what the steps leave out)
    and, for prep, ``parse rank R`` and ``sha256 rank R`` of every rank."""
    if os.path.exists(out):
        os.unlink(out)
    started = time.perf_counter()
    result = _checked(argv)
    seconds = time.perf_counter() - started
    return seconds, parse_steps(result.stdout + result.stderr, seconds)


def _ranks_of(name: str) -> int | None:
    """N of ``mpidp prep, N rank(s)``; None for the reference."""
    return int(name.split(", ")[1].split()[0]) if name.startswith("mpidp prep, ") else None


def _pairs(times: dict[str, list[float]]) -> list[tuple[str, str, list[float], list[float]]]:
    """(key, label, slower run's times, faster run's times) of each ratio: polars'
    time over prep's at each rank count, and the speed-up from the fewest ranks."""
    by_ranks = dict(sorted((_ranks_of(name), t) for name, t in times.items()
                           if _ranks_of(name)))
    polars = times.get("polars (1 process)")
    first = next(iter(by_ranks), None)
    pairs = []
    for n, t in by_ranks.items():
        if polars is not None:
            pairs.append((f"vs_polars_{n}_ranks", f"mpidp prep at {n} rank(s), polars' time "
                          "over it", polars, t))
        if n != first:
            pairs.append((f"speedup_{first}_to_{n}_ranks",
                          f"mpidp prep, {first} -> {n} ranks, speed-up", by_ranks[first], t))
    return pairs


def paired_ratios(times: dict[str, list[float]]) -> dict:
    """Each ratio of :func:`_pairs` as the median of its per-round values (the
    pipelines of a round ran one after the other) and ``KEY_spread``, the
    least and greatest round: what ``tools/bench_guard.py`` compares."""
    out: dict = {}
    for key, _, slower, faster in _pairs(times):
        per_round = [a / b for a, b in zip(slower, faster)]
        out[key] = statistics.median(per_round)
        out[key + "_spread"] = [min(per_round), max(per_round)]
    return out


def parse_steps(text: str, seconds: float) -> dict[str, float]:
    """The steps of a ``--timings`` output (see :func:`_timed`)."""
    steps: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("steps "):
            for item in line[len("steps"):].split(","):
                name, _, value = item.strip().rpartition(" ")
                if name:
                    steps[name] = float(value)
        elif line.startswith("rank ") and "parsed and cleaned" in line:
            words = line.split()
            rank = words[1]
            steps[f"parse rank {rank}"] = float(words[words.index("in") + 1])
            steps[f"sha256 rank {rank}"] = float(words[words.index("then") + 1])
    counted = sum(v for k, v in steps.items() if " rank " not in k)
    if steps:
        steps["start"] = max(0.0, seconds - counted)
    return steps


def _median_steps(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each step's median over the runs (in the order the first run named them)."""
    names = list(dict.fromkeys(k for run in runs for k in run))
    start = [n for n in names if n == "start"]
    ordered = start + [n for n in names if n != "start"]
    return {n: statistics.median(run[n] for run in runs if n in run) for n in ordered}


def _records(path: str) -> int:
    with open(path, "rb") as handle:
        return sum(block.count(b"\n") for block in iter(lambda: handle.read(1 << 24), b"")) - 1


def run(args: argparse.Namespace) -> int:
    if MPI.COMM_WORLD.Get_size() > 1:
        raise PrepError("run the benchmark as one process (`mpidp bench prep`); it "
                        "starts mpiexec itself", collective=True)
    ranks = _rank_counts(args.ranks)
    if args.input:  # the synthetic file's options would be ignored
        ignored = [o for o, v in (("--rows", args.rows), ("--cache", args.cache)) if v is not None]
        if ignored:
            raise PrepError(f"{', '.join(ignored)} would be ignored with --input {args.input}: "
                            "they describe the synthetic file; drop "
                            f"{'it' if len(ignored) == 1 else 'them'}", collective=True)
    args.rows = ROWS if args.rows is None else args.rows
    args.cache = default_cache() if args.cache is None else args.cache
    if args.repeat < 1 or args.rows < 1:
        raise PrepError("--repeat and --rows must be at least 1", collective=True)
    if args.input and not os.path.isfile(args.input):
        raise PrepError(f"--input {args.input}: no such file", collective=True)
    if args.json:  # before the runs: the same rule as every output (atomic.check_writable)
        atomic.check_writable(args.json, option="--json", example="out.json")
    if not args.input:  # the synthetic file's folder (--input needs none)
        check_cache(args.cache)
    source = args.input or synthetic_file(args.cache, args.rows)
    records = _records(source)
    size_mb = os.path.getsize(source) / 1e6
    workdir = tempfile.mkdtemp(prefix="mpidp-bench-", dir=os.path.dirname(source))
    out = os.path.join(workdir, "out.h5")
    cases = {} if args.no_reference else {
        "polars (1 process)": [sys.executable, "-m", "preprocessing.reference", source,
                               "--out", out, "--timings"]}
    for n in ranks:
        cases[f"mpidp prep, {n} rank{'s' if n > 1 else ''}"] = [
            find_tool("mpiexec"), "-n", str(n), find_tool("mpidp"), "prep", source, "--out", out,
            "--quiet", "--timings"]
    times: dict[str, list[float]] = {name: [] for name in cases}
    steps: dict[str, list[dict]] = {name: [] for name in cases}
    try:
        for round_ in range(args.repeat):
            for name, argv in cases.items():
                seconds, parts = _timed(argv, out)
                times[name].append(seconds)
                steps[name].append(parts)
            print(f"round {round_ + 1}/{args.repeat}: " + ", ".join(
                f"{name} {t[-1]:.2f} s" for name, t in times.items()), file=sys.stderr,
                flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    medians = {name: statistics.median(t) for name, t in times.items()}
    reference = medians.get("polars (1 process)")
    one = medians.get("mpidp prep, 1 rank")
    print(f"\nmpidp bench prep: {source}\n{records:,} records, {size_mb:.0f} MB, "
          f"median of {args.repeat} runs, process start to file written\n")
    print(f"{'pipeline':<22} {'seconds':>8} {'records/s':>12} {'vs polars':>10} "
          f"{'speed-up':>9}")
    for name, seconds in medians.items():
        ratio = f"{reference / seconds:.2f}x" if reference else "-"
        speedup = f"{one / seconds:.2f}x" if one and name.startswith("mpidp") else "-"
        print(f"{name:<22} {seconds:>8.2f} {records / seconds:>12,.0f} {ratio:>10} "
              f"{speedup:>9}")
    ratios = paired_ratios(times)
    if ratios:
        cpu = machine.cpu_model()
        print()
        for key, label, _, _ in _pairs(times):
            value, (low, high) = ratios[key], ratios[key + "_spread"]
            print(f"{label}: {value:.2f}x [{low:.2f}, {high:.2f} over {args.repeat} "
                  f"rounds; {cpu}]")
    median_steps = {name: _median_steps(runs) for name, runs in steps.items()}
    print("\nwhere the time goes (median seconds; start: interpreter, imports and MPI "
          "start-up before the first step; prep's steps are rank 0's clock, each rank's "
          "parse and the sha256 it finished after parsing beside them):")
    for name, parts in median_steps.items():
        print(f"  {name:<22} " + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()))
    if args.json:
        try:
            Path(args.json).write_text(json.dumps({
                "input": source, "records": records, "megabytes": size_mb,
                "repeat": args.repeat, "seconds": times, "median_seconds": medians,
                "steps": steps, "median_steps": median_steps, **ratios,
                "provenance": machine.provenance(),
            }, indent=2))
        except OSError as exc:
            raise PrepError(f"--json {args.json}: cannot write it: {exc.strerror}") from None
    return 0
