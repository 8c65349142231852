"""Strong and weak scaling of `mpidp train`: time per epoch, speed-up, comm/compute,
time to accuracy, cost — the seed project's tables and mlbench's metrics.

For each rank count (--ranks), privacy mode (--privacy), all-reduce algorithm
(--allreduce) and thread policy (--threads), it launches

    mpiexec -n P mpidp train --data FILE --epochs E --metrics FILE.jsonl ...

and reads the per-epoch records the trainer writes: the first epoch
(start-up: kernel compilation, buffers) apart from the steady state (avg /
min / max of the other epochs), speed-up T_base/T_n and efficiency against
the series' fewest ranks, the time in the all-reduce against the rest, test
accuracy and epsilon. Strong scaling keeps the global batch (--batch-size;
each rank's expected batch is B/P, as the seed project did); weak scaling
(--scaling weak) keeps --local-batch per rank. With --target-accuracy it
reports the training time to that accuracy, with --time-budget the accuracy
reached within that many training seconds (mlbench's two metrics; see
`mpidp train --help`); with --price-per-node-hour a cost table.

One launch per configuration, not sub-communicators of one big launch:
ranks left idle by a sub-communicator still occupy cores (MPI waits
busy-poll; on a 2-core machine an idle third and fourth rank would slow the
ranks being timed), and a 1-rank run inside a 4-rank launch would get one
thread instead of the whole node. A launch per size is also what a cluster
does: jobs/sweep_scaling.sh submits one Slurm job per node/task layout and
`--collect` builds the same tables from their metrics.

Baselines: --threads auto (the default of mpidp train) gives every rank
cores // ranks threads, so every row uses the whole node and the speed-up
says what more ranks add on the same hardware; --threads 1 pins one thread
per rank, so each rank adds a core (classic strong scaling; on a 2-core
machine a 1-rank run then leaves a core idle). --threads auto,1 runs both.
Runs with more ranks x threads than cores are marked oversubscribed (*):
they measure contention, not scaling.

Presets: `seed` (default) is the seed project's workload (790,000 x 100
synthetic rows, the shape prep makes of 1.2 M PUMS records, MLP 128-128,
batch 256, DP-SGD and non-private); `mlbench-2a` is mlbench's closed-division
task 2a: L2-regularised logistic regression on a dense epsilon-like set
(400,000 x 2,000), synchronous SGD with one all-reduce per step, 100 rows
per rank (weak scaling), learning rate alpha/sqrt(t), time to test accuracy
0.89. Options given explicitly override the preset's.

Examples:
  flock /tmp/mpidp-bench.lock mpidp bench scaling --ranks 1,2,4 --threads auto,1 \\
      --json scaling.json --plot scaling.png --price-per-node-hour 3.06
  mpidp bench scaling --preset mlbench-2a --ranks 1,2 --plot 2a.png
  mpidp bench scaling --collect sweep/*/ --price-per-node-hour 12.24   # cluster sweep
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import collectives
from collectives import MPI
from collectives.launch import child_env, launcher_argv, launcher_words
from collectives.runtime import available_cores
from engine import outputs
from engine.bench import scaling_report as report, synthetic
from engine.bench.scaling_plot import plot
from engine.errors import ConfigError, WriteFailed

#: Preset values for options left unset on the command line.
PRESETS: dict[str, dict] = {
    "seed": dict(rows=790_000, test_rows=200_000, features=100, dense=False,
                 hidden="128,128", batch_size=256, local_batch=None, scaling="strong",
                 privacy="dp,nodp", lr="0.05", lr_schedule="constant", momentum=0.9,
                 weight_decay=0.0, sampling="poisson", epochs=10, target_accuracy=None),
    "mlbench-2a": dict(rows=400_000, test_rows=100_000, features=2000, dense=True,
                       hidden="", batch_size=None, local_batch=100, scaling="weak",
                       privacy="nodp", lr="1:200,2:400,3:500,4:600,8:700,16:800",
                       lr_schedule="inv-sqrt", momentum=0.0, weight_decay=2.5e-6,
                       sampling="shuffle", epochs=10, target_accuracy=0.89),
}


class BenchError(Exception):
    """A benchmark setting that cannot work, or a run that failed."""

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(message)
        self.collective = True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_argument_group("what to run")
    what.add_argument("--preset", choices=tuple(PRESETS), default="seed",
                      help="workload defaults (see above; default: seed)")
    what.add_argument("--ranks", default="1,2,4",
                      help="comma-separated rank counts (default: 1,2,4)")
    what.add_argument("--scaling", default=None,
                      help="strong, weak or strong,weak (default: the preset's)")
    what.add_argument("--batch-size", type=int, default=None,
                      help="strong scaling: expected global batch (seed: 256)")
    what.add_argument("--local-batch", type=int, default=None,
                      help="weak scaling: expected batch per rank (mlbench-2a: 100)")
    what.add_argument("--privacy", default=None,
                      help="dp, nodp or dp,nodp (default: the preset's)")
    what.add_argument("--allreduce", default="auto",
                      help="comma-separated all-reduce algorithms (default: auto)")
    what.add_argument("--threads", default="auto",
                      help="comma-separated thread policies per rank: auto (cores // ranks, "
                      "as mpidp train) or a number (default: auto)")
    what.add_argument("--epochs", type=int, default=None,
                      help="epochs per run, the maximum with --target-accuracy (default: 10)")
    what.add_argument("--repeat", type=int, default=1,
                      help="rounds over all configurations; steady epochs are pooled, "
                      "other figures are medians (default: 1)")
    train = parser.add_argument_group("model and training (passed to mpidp train)")
    train.add_argument("--data", default=None,
                       help="prepared HDF5 file (default: the preset's synthetic file, "
                       "written once into --cache)")
    train.add_argument("--rows", type=int, default=None, help="synthetic training rows")
    train.add_argument("--test-rows", type=int, default=None, help="synthetic test rows")
    train.add_argument("--features", type=int, default=None, help="synthetic features")
    train.add_argument("--hidden", default=None, help="hidden widths ('' = logistic regression)")
    train.add_argument("--lr", default=None,
                       help="learning rate, or one per rank count as R:LR,R:LR "
                       "(mlbench tunes alpha per cluster size)")
    train.add_argument("--lr-schedule", default=None, help="constant or inv-sqrt")
    train.add_argument("--momentum", type=float, default=None)
    train.add_argument("--weight-decay", type=float, default=None, help="L2 coefficient")
    train.add_argument("--sampling", default=None, help="poisson or shuffle")
    train.add_argument("--noise-multiplier", type=float, default=1.0,
                       help="sigma of the DP runs (default: 1.0)")
    train.add_argument("--max-grad-norm", type=float, default=1.0,
                       help="clipping bound C of the DP runs (default: 1.0)")
    train.add_argument("--seed", type=int, default=1, help="seed of every run (default: 1)")
    train.add_argument("--train-args", default="",
                       help="more options for mpidp train, one quoted string")
    stop = parser.add_argument_group("time to accuracy / accuracy after time")
    stop.add_argument("--target-accuracy", type=float, default=None,
                      help="report the training time to this test accuracy (runs stop "
                      "there unless --time-budget is given) (mlbench-2a: 0.89)")
    stop.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                      help="runs stop after this much training; report the accuracy "
                      "reached within it")
    out = parser.add_argument_group("output")
    out.add_argument("--json", metavar="FILE", help="write summaries and every epoch as JSON")
    out.add_argument("--plot", metavar="FILE.png", help="speed-up, time per epoch, comm/compute")
    out.add_argument("--markdown", action="store_true", help="also print a markdown table")
    out.add_argument("--price-per-node-hour", type=float, default=None, metavar="PRICE",
                     help="print the cost table: nodes x training hours x PRICE")
    out.add_argument("--keep", metavar="DIR", help="keep every run's metrics in DIR")
    out.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    how = parser.add_argument_group("where")
    how.add_argument("--launcher", default="mpiexec -n {ranks}",
                     help="launch command; {ranks} is replaced (default: 'mpiexec -n "
                     "{ranks}'; e.g. 'srun --mpi=pmi2 -n {ranks}' inside an allocation)")
    how.add_argument("--cache", default=os.environ.get(
        "MPIDP_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "mpidp")),
        help="where synthetic files are kept (default: ~/.cache/mpidp or $MPIDP_CACHE)")
    how.add_argument("--collect", nargs="+", metavar="DIR",
                     help="run nothing: tabulate the runs in these directories (each with "
                     "metrics.jsonl and the sweep-point.json of jobs/sweep_scaling.sh)")


# ------------------------------------------------------------ settings
def _algorithm_names() -> tuple[str, ...]:
    return tuple(collectives.names())


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with the preset's values filled in where none was given; checked."""
    settings = argparse.Namespace(**vars(args))
    for name, value in PRESETS[args.preset].items():
        if getattr(settings, name, None) is None:
            setattr(settings, name, value)
    settings.rank_list = parse_ints(settings.ranks, "--ranks")
    settings.modes = _choices(settings.scaling, ("strong", "weak"), "--scaling")
    settings.privacy_list = _choices(settings.privacy, ("dp", "nodp"), "--privacy")
    settings.algorithms = _choices(settings.allreduce, _algorithm_names(), "--allreduce")
    from engine.nn.model import parse_hidden  # deferred: torch, kept out of `mpidp bench --help`

    try:
        parse_hidden(settings.hidden)
    except ConfigError as error:
        raise BenchError(str(error)) from None
    settings.thread_policies = _choices(settings.threads, None, "--threads")
    for policy in settings.thread_policies:
        if policy != "auto" and not (policy.isdigit() and int(policy) > 0):
            raise BenchError(f"--threads {policy!r}: use auto or a positive number")
    settings.lr_by_ranks = parse_lr(settings.lr, settings.rank_list)
    if "strong" in settings.modes and not settings.batch_size:
        raise BenchError("strong scaling needs --batch-size (the global batch)")
    if "weak" in settings.modes and not settings.local_batch:
        raise BenchError("weak scaling needs --local-batch (the batch per rank)")
    if settings.epochs < 1 or settings.repeat < 1:
        raise BenchError("--epochs and --repeat must be at least 1")
    return settings


def parse_ints(text: str, option: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise BenchError(f"{option} {text!r}: expected comma-separated integers") from None
    if not values or any(v < 1 for v in values):
        raise BenchError(f"{option} {text!r}: expected positive integers")
    return sorted(set(values))


def _choices(text: str, allowed: tuple | None, option: str) -> list[str]:
    values = list(dict.fromkeys(v.strip() for v in str(text).split(",") if v.strip()))
    bad = [v for v in values if allowed is not None and v not in allowed]
    if bad or not values:
        raise BenchError(f"{option} {text!r}: choose from {', '.join(allowed or ())}")
    return values


def parse_lr(text: str, ranks: list[int]) -> dict[int, float]:
    """``"0.05"`` (every rank count) or ``"1:200,2:400"`` (one per rank count) ->
    {ranks: lr}; a rank count without a value is an error."""
    text = str(text).strip()
    try:
        if ":" not in text:
            return {r: float(text) for r in ranks}
        table = {}
        for item in text.split(","):
            count, value = item.split(":")
            table[int(count)] = float(value)
    except ValueError:
        raise BenchError(f"--lr {text!r}: a number, or RANKS:LR pairs like 1:200,2:400") \
            from None
    missing = [r for r in ranks if r not in table]
    if missing:
        raise BenchError(f"--lr {text!r} has no learning rate for {missing} ranks")
    return {r: table[r] for r in ranks}


def plan(settings: argparse.Namespace, data: str, workdir: str) -> list[dict]:
    """The configurations to launch, in order (series outer, ranks inner)."""
    runs = []
    for mode in settings.modes:
        for privacy in settings.privacy_list:
            for algorithm in settings.algorithms:
                for threads in settings.thread_policies:
                    for ranks in settings.rank_list:
                        runs.append(_config(settings, data, workdir, mode, privacy == "dp",
                                            algorithm, threads, ranks))
    return runs


def _config(s, data, workdir, mode, dp, algorithm, threads, ranks) -> dict:
    batch = s.batch_size if mode == "strong" else s.local_batch * ranks
    name = f"{mode}-{'dp' if dp else 'nodp'}-{algorithm}-t{threads}-n{ranks}"
    argv = ["train", "--data", data, "--epochs", str(s.epochs), "--batch-size", str(batch),
            "--hidden", s.hidden, "--lr", repr(s.lr_by_ranks[ranks]),
            "--lr-schedule", s.lr_schedule, "--momentum", repr(s.momentum),
            "--weight-decay", repr(s.weight_decay), "--sampling", s.sampling,
            "--allreduce", algorithm, "--seed", str(s.seed), "--no-progress"]
    argv += (["--noise-multiplier", repr(s.noise_multiplier), "--max-grad-norm",
              repr(s.max_grad_norm)] if dp else ["--no-dp"])
    if threads != "auto":
        argv += ["--threads", threads]
    if s.time_budget is not None:  # the target is then read off the history
        argv += ["--time-budget", repr(s.time_budget)]
    elif s.target_accuracy is not None:
        argv += ["--target-accuracy", repr(s.target_accuracy)]
    argv += shlex.split(s.train_args)
    return {"name": name, "mode": mode, "dp": dp, "allreduce": algorithm, "threads": threads,
            "ranks": ranks, "nodes": 1, "layout": f"1x{ranks}", "batch_size": batch,
            "metrics": os.path.join(workdir, name + ".jsonl"), "train_argv": argv}


def shown_command(config: dict, launcher: str) -> str:
    """The command as a user would type it."""
    argv = [*launcher_words(launcher, config["ranks"]), "mpidp", *config["train_argv"],
            "--metrics", os.path.basename(config["metrics"])]
    return shlex.join(argv)


# ------------------------------------------------------------ data
def ensure_data(settings: argparse.Namespace) -> str:
    """The file to train on: --data, or the preset's synthetic file (written once)."""
    if settings.data:
        if not os.path.isfile(settings.data):
            raise BenchError(f"--data {settings.data}: no such file")
        return settings.data
    kind = f"dense-decay{synthetic.DENSE_DECAY:g}" if settings.dense else "synth"
    path = Path(settings.cache) / (f"{kind}-{settings.rows}x{settings.features}-"
                                   f"{settings.test_rows}-seed0.h5")
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"writing {path} (once) ...", file=sys.stderr, flush=True)
        if settings.dense:
            synthetic.write_dense(path, rows=settings.rows, features=settings.features,
                                  test_rows=settings.test_rows, seed=0)
        else:
            synthetic.write(path, rows=settings.rows, features=settings.features,
                            test_rows=settings.test_rows, seed=0)
    return str(path)


# ------------------------------------------------------------ running
def execute(config: dict, launcher: str, cores: int | None) -> dict:
    """Launch one configuration; returns the run (config + its epoch records)."""
    argv = [*launcher_argv(launcher, config["ranks"]), sys.executable, "-m", "engine.cli",
            *config["train_argv"], "--metrics", config["metrics"]]
    started = time.perf_counter()
    result = subprocess.run(argv, capture_output=True, text=True, env=child_env())
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-8:])
        raise BenchError(f"{shown_command(config, launcher)} failed with exit code "
                         f"{result.returncode}:\n{tail}")
    epochs = read_metrics(config["metrics"])
    threads = epochs[-1].get("threads") or 1
    run = dict(config, epochs=epochs, launch_s=seconds,
               command=shown_command(config, launcher),
               oversubscribed=bool(cores and config["ranks"] * threads > cores))
    run.pop("train_argv")
    return run


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The epoch records of a metrics file (JSON lines)."""
    try:
        lines = Path(path).read_text().splitlines()
        records = [json.loads(line) for line in lines if line.strip()]
    except (OSError, ValueError) as exc:
        raise BenchError(f"{path}: cannot read the run's metrics ({exc})") from None
    if not records:
        raise BenchError(f"{path}: no epoch finished in this run")
    return records


def collect(directories: list[str]) -> list[dict]:
    """Runs from job directories (``metrics.jsonl`` + optional ``sweep-point.json``)."""
    # deferred: torch, kept out of `mpidp bench --help`
    from engine.config import add_arguments as train_arguments

    parser = argparse.ArgumentParser(add_help=False)
    train_arguments(parser)
    runs = []
    for directory in directories:
        metrics = Path(directory) / "metrics.jsonl"
        if not metrics.is_file():
            raise BenchError(f"{directory}: no metrics.jsonl (did its job run? see its "
                             "output file)")
        point_file = Path(directory) / "sweep-point.json"
        point = json.loads(point_file.read_text()) if point_file.is_file() else {}
        epochs = read_metrics(metrics)
        try:
            train = parser.parse_args(["--data", "-", *shlex.split(point.get("train_args",
                                                                              ""))])
        except SystemExit:
            raise BenchError(f"{point_file}: train_args are not mpidp train options") \
                from None
        ranks = int(epochs[-1]["ranks"])
        nodes = int(point.get("nodes", 1))
        runs.append({"name": point.get("layout", Path(directory).name),
                     "mode": point.get("scaling", "strong"),
                     "dp": epochs[-1].get("epsilon") is not None,
                     "allreduce": train.allreduce,
                     "threads": str(train.threads) if train.threads else "auto",
                     "ranks": ranks, "nodes": nodes,
                     "layout": point.get("layout", f"{nodes}x{ranks // max(1, nodes)}"),
                     "batch_size": train.batch_size,
                     "oversubscribed": bool(point.get("oversubscribed", False)),
                     "command": point.get("command"), "job_id": point.get("job_id"),
                     "epochs": epochs})
    return runs


# ------------------------------------------------------------ machine
def machine() -> dict:
    """Where the benchmark ran (for the JSON and the header)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"host": platform.node(), "cpu": cpu, "cores": available_cores(),
            "memory_gib": _memory_gib(), "python": platform.python_version(),
            "mpi": MPI.Get_library_version().strip().splitlines()[0].strip()}


def _memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# ------------------------------------------------------------ command
def run(args: argparse.Namespace) -> int:
    """One process: launch ``mpidp train`` per configuration (or --collect job
    directories), then print the tables and write --json / --plot.

    Raises:
        BenchError: bad settings, a missing file, or a run that failed.
    """
    if MPI.COMM_WORLD.Get_size() > 1:
        raise BenchError("run the benchmark as one process (`mpidp bench scaling`); it "
                         "starts one mpiexec per configuration itself")
    # Every output before any work (engine.outputs): not a failed write after the runs.
    outputs.check_all({"--json": args.json, "--plot": args.plot})
    if args.keep and not args.collect:
        outputs.check_directory(args.keep, "--keep")
    where = machine()
    load_before = _load()
    if args.collect:
        settings = args
        runs = collect(args.collect)
        source = f"collected from {len(args.collect)} job directories"
    else:
        settings = resolve(args)
        # Fail now, not after writing the data (a dry run needs no launcher binary).
        (launcher_words if settings.dry_run else launcher_argv)(settings.launcher, 1)
        data = ensure_data(settings)
        keep = settings.keep
        workdir = keep or tempfile.mkdtemp(prefix="mpidp-scaling-")
        os.makedirs(workdir, exist_ok=True)
        configs = plan(settings, data, workdir)
        if settings.dry_run:
            for config in configs:
                print(shown_command(config, settings.launcher))
            return 0
        cores = available_cores() if settings.launcher.startswith("mpiexec") else None
        runs = []
        total = len(configs) * settings.repeat
        for round_ in range(settings.repeat):
            for i, config in enumerate(configs):
                n = round_ * len(configs) + i + 1
                config = dict(config, metrics=config["metrics"].replace(
                    ".jsonl", f".r{round_ + 1}.jsonl"))
                print(f"[{n}/{total}] {shown_command(config, settings.launcher)}",
                      file=sys.stderr, flush=True)
                run_ = execute(config, settings.launcher, cores)
                last = run_["epochs"][-1]
                steady = [e["epoch_time_s"] for e in run_["epochs"][1:]] or \
                    [run_["epochs"][0]["epoch_time_s"]]
                print(f"[{n}/{total}] {len(run_['epochs'])} epochs, "
                      f"{sum(steady) / len(steady):.3f} s/epoch after the first, test "
                      f"accuracy {last.get('test_accuracy') or float('nan'):.4f} "
                      f"({run_['launch_s']:.1f} s)", file=sys.stderr, flush=True)
                runs.append(run_)
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
        source = data
    target = settings.target_accuracy
    budget = settings.time_budget
    summaries = [report.summarize(group, target, budget) for group in report.group_runs(runs)]
    report.add_speedups(summaries)
    if args.price_per_node_hour is not None:
        report.add_cost(summaries, args.price_per_node_hour)
    load_after = _load()
    print(f"\nmpidp bench scaling: {source}")
    print(f"machine: {where['host']}, {where['cpu']}, {where['cores']} cores, "
          f"{where['memory_gib']} GiB; {where['mpi']}; load average before "
          f"{load_before}, after {load_after}\n")
    print(report.format_table(summaries))
    if args.price_per_node_hour is not None:
        print("\n" + report.format_cost_table(summaries))
    if args.markdown:
        print("\n" + report.markdown_table(summaries))
    if args.json:
        document = {"benchmark": "mpidp bench scaling", "machine": where,
                    "load_average": {"before": load_before, "after": load_after},
                    "data": source, "target_accuracy": target, "time_budget": budget,
                    "summaries": summaries, "runs": runs}
        outputs.write_json(args.json, document, "--json")
    if args.plot:
        try:
            plot(summaries, args.plot, f"mpidp bench scaling on {where['host']} "
                 f"({where['cores']} cores): {os.path.basename(source)}")
        except OSError as exc:
            raise WriteFailed(f"--plot {args.plot}: cannot write it: {exc.strerror}") from None
    return 0
