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

Image presets (files of `mpidp prep --format mnist|cifar10`, or synthetic
images of the same shape written once into --cache; the report says which):

  mlbench-1a  mlbench's task 1a: ResNet-20 (GroupNorm) on CIFAR-10 (--data FILE,
              else synthetic 3x32x32 images, 50,000 train / 10,000 test),
              synchronous SGD, 32 examples per rank (weak scaling), lr 0.1 per
              256 examples scaled with the global batch (0.1 * 32 * P / 256),
              linear warm-up over 5 epochs, Nesterov momentum 0.9, weight decay
              1e-4, lr x0.1 at epochs 82 and 109 of 164 (--epochs and
              --time-budget cut it short); non-private by default (--privacy dp
              allowed; DP runs sample by Poisson, non-private ones take
              fixed-size shuffled batches as mlbench does); time to test accuracy
              --target-accuracy (default 0.70: reachable by ResNet-20 with
              GroupNorm and no augmentation, which mpidp does not do) and, with
              --time-budget, the accuracy after that many training seconds.
  dp-sweep    the data-parallel sweep: MNIST-shaped data (--data FILE, else
              synthetic 1x28x28, 60,000 / 10,000), models mnist-small and
              mnist-large (--models), global batches 128, 256, 512
              (--batch-sizes), the training rows repeated 1, 4 and 8 times
              (--data-repeats: more synthetic rows, or the real file's rows
              tiled into a cached file), ranks 1, 2, 4, DP-SGD and non-private,
              2 epochs: the first and the second epoch apart (time and
              examples/s; the first-epoch overhead is their difference) and the
              speed-up over one rank, as a table, --json and --plot.

Peers side by side (--baseline ddp, the default where torch.distributed is
available; --baseline none skips them): every mpidp run is followed by the
same configuration in PyTorch under the same launcher (`python -m
engine.bench.ddp_baseline`, module docstring): DistributedDataParallel for
non-private runs, Opacus' distributed DP-SGD for DP ones, on the same shard,
model, seed, batch, learning rate and epochs. Each mpidp row then shows the
peer's examples/s and the ratio (mpidp / DDP, mpidp / Opacus-DDP) of steady
epochs; the peers' own rows follow as series of their own.

Options that contradict a preset (an image model on a tabular preset, another
model than the preset's, --scaling strong on mlbench-1a, --hidden on an image
preset...) are one-line errors (exit 2).

Examples:
  flock /tmp/mpidp-bench.lock mpidp bench scaling --ranks 1,2,4 --threads auto,1 \\
      --json scaling.json --plot scaling.png --price-per-node-hour 3.06
  mpidp bench scaling --preset mlbench-2a --ranks 1,2 --plot 2a.png
  mpidp bench scaling --preset mlbench-1a --data cifar10.h5 --ranks 1,2,4 \\
      --time-budget 3600 --json 1a.json --plot 1a.png
  mpidp bench scaling --preset dp-sweep --data mnist.h5 --json sweep.json --plot sweep.png
  mpidp bench scaling --preset dp-sweep --models mnist-small --batch-sizes 256 \\
      --data-repeats 1 --ranks 1,2          # a sub-grid for a small machine
  mpidp bench scaling --collect sweep/*/ --price-per-node-hour 12.24   # cluster sweep
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile

from collectives import MPI, machine as machine_facts
from collectives.launch import launcher_argv, launcher_words
from collectives.runtime import available_cores
from engine.choices import seed_value
from engine import outputs
from engine.bench import scaling_report as report
from engine.bench.scaling_plan import (BenchError, PRESETS, check_launcher, check_numbers,
                                       check_train_options, plan, resolve, shown_command,
                                       undecided_delta)
from engine.bench.scaling_plot import plot, plot_sweep
from engine.bench.scaling_runs import collect, ensure_data, execute
from engine.errors import WriteFailed
from kernels.files import cache_dir


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
                      help="weak scaling: expected batch per rank (mlbench-2a: 100, "
                      "mlbench-1a: 32)")
    what.add_argument("--batch-sizes", default=None,
                      help="dp-sweep: comma-separated global batches (default: 128,256,512)")
    what.add_argument("--privacy", default=None,
                      help="dp, nodp or dp,nodp (default: the preset's)")
    what.add_argument("--allreduce", default="auto",
                      help="comma-separated all-reduce algorithms (default: auto)")
    what.add_argument("--threads", default="auto",
                      help="comma-separated thread policies per rank: auto (as mpidp train: "
                      "a rank's bound cores, or cores // ranks) or a number (default: auto)")
    what.add_argument("--epochs", type=int, default=None,
                      help="epochs per run, the maximum with --target-accuracy (default: the "
                      "preset's: seed and mlbench-2a 10, mlbench-1a 164, dp-sweep 2)")
    what.add_argument("--repeat", type=int, default=1,
                      help="rounds over all configurations; steady epochs are pooled, "
                      "other figures are medians (default: 1)")
    what.add_argument("--baseline", choices=("ddp", "none"), default=None,
                      help="ddp: run every configuration also in PyTorch DDP (non-private) "
                      "and Opacus' distributed DP-SGD (DP) and show them side by side; none: "
                      "mpidp only (default: ddp where torch.distributed is available)")
    train = parser.add_argument_group("model and training (passed to mpidp train)")
    train.add_argument("--data", default=None,
                       help="prepared HDF5 file (default: the preset's synthetic file, "
                       "written once into --cache); image presets: a file of `mpidp prep "
                       "--format cifar10` (mlbench-1a) or `--format mnist` (dp-sweep)")
    train.add_argument("--rows", type=int, default=None, help="synthetic training rows")
    train.add_argument("--test-rows", type=int, default=None, help="synthetic test rows")
    train.add_argument("--features", type=int, default=None, help="synthetic features")
    train.add_argument("--image-shape", default=None, metavar="CxHxW",
                       help="image presets: shape of the synthetic images (mlbench-1a: "
                       "3x32x32, dp-sweep: 1x28x28); not with --data")
    train.add_argument("--data-repeats", "--repeat-data", dest="data_repeats", default=None,
                       metavar="R,R",
                       help="dp-sweep: the training rows repeated R times, comma-separated "
                       "(synthetic: R times the rows; --data: its rows tiled into a file "
                       "cached in --cache) (default: 1,4,8)")
    train.add_argument("--hidden", default=None, help="hidden widths ('' = logistic regression)")
    train.add_argument("--model", default=None,
                       help="image presets: the one model to train (mlbench-1a: resnet20; "
                       "dp-sweep: mnist-small or mnist-large)")
    train.add_argument("--models", default=None,
                       help="dp-sweep: comma-separated models (default: "
                       "mnist-small,mnist-large)")
    train.add_argument("--lr", default=None,
                       help="learning rate, or one per rank count as R:LR,R:LR "
                       "(mlbench tunes alpha per cluster size); mlbench-1a: per 256 "
                       "examples, scaled with the global batch")
    train.add_argument("--lr-schedule", default=None,
                       help="constant or inv-sqrt (mlbench-1a: step, with its warm-up and "
                       "milestones)")
    train.add_argument("--momentum", type=float, default=None)
    train.add_argument("--weight-decay", type=float, default=None, help="L2 coefficient")
    train.add_argument("--sampling", default=None,
                       help="poisson, shuffle, or auto: shuffle without DP, poisson with "
                       "(mlbench-1a)")
    train.add_argument("--noise-multiplier", type=float, default=1.0,
                       help="sigma of the DP runs (default: 1.0)")
    train.add_argument("--max-grad-norm", type=float, default=1.0,
                       help="clipping bound C of the DP runs (default: 1.0)")
    train.add_argument("--seed", type=seed_value, default=1, help="seed of every run (default: 1)")
    train.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                       help="cpu, or cuda: one GPU per rank, for mpidp and the peers (NCCL) "
                       "(default: cpu)")
    train.add_argument("--train-args", default="",
                       help="more options for mpidp train, one quoted string")
    stop = parser.add_argument_group("time to accuracy / accuracy after time")
    stop.add_argument("--target-accuracy", type=float, default=None,
                      help="report the training time to this test accuracy (runs stop "
                      "there unless --time-budget is given) (mlbench-2a: 0.89, "
                      "mlbench-1a: 0.70)")
    stop.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                      help="runs stop after this much training; report the accuracy "
                      "reached within it")
    out = parser.add_argument_group("output")
    out.add_argument("--json", metavar="FILE", help="write summaries and every epoch as JSON")
    out.add_argument("--plot", metavar="FILE.png", help="speed-up, time per epoch, comm/compute "
                     "(dp-sweep: examples/s, first-epoch overhead, mpidp / peer)")
    out.add_argument("--markdown", action="store_true", help="also print a markdown table")
    out.add_argument("--price-per-node-hour", type=float, default=None, metavar="PRICE",
                     help="print the cost table: nodes x training hours x PRICE")
    out.add_argument("--keep", metavar="DIR", help="keep every run's metrics in DIR (default: "
                     "a temporary folder, removed however the benchmark ends)")
    out.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    how = parser.add_argument_group("where")
    how.add_argument("--launcher", default="mpiexec -n {ranks}",
                     help="launch command; it must contain {ranks}, replaced by each run's "
                     "rank count (default: 'mpiexec -n {ranks}'; e.g. 'srun --mpi=pmi2 -n "
                     "{ranks}' inside an allocation)")
    how.add_argument("--cache", default=os.environ.get("MPIDP_CACHE") or str(cache_dir()),
                     help="where synthetic files are kept (default: $MPIDP_CACHE, else "
                     "mpidp's cache folder, $XDG_CACHE_HOME/mpidp or ~/.cache/mpidp)")
    how.add_argument("--collect", nargs="+", metavar="DIR",
                     help="run nothing: tabulate the runs in these directories (each with "
                     "metrics.jsonl and the sweep-point.json of jobs/sweep_scaling.sh)")


# ------------------------------------------------------------ machine
def machine() -> dict:
    """Where the benchmark ran (for the JSON and the header)."""
    from kernels.probe import mlp_step_mode  # deferred: imports torch

    return {**machine_facts.describe(), "memory_gib": _memory_gib(),
            "python": platform.python_version(), "mlp_step": mlp_step_mode(runs=True)}


def _memory_gib() -> float | None:
    memory = machine_facts.physical_memory()
    return None if memory is None else round(memory / 2 ** 30, 1)


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# ------------------------------------------------------------ command
def _dry_run(configs: list[dict], settings: argparse.Namespace, refused: str | None) -> None:
    """Print the commands a real run would launch (stdout) and what it cannot say
    yet (stderr)."""
    for config in configs:
        print(shown_command(config, settings.launcher))
    if undecided_delta(configs):
        print("note: the DP runs' --delta is decided once --data can be read (1e-05, or "
              "for more than 100,000 training rows the power of ten at or below 1/rows)",
              file=sys.stderr)
    if refused:
        print(f"note: this mpidp train refuses these options ({refused}); "
              f"--preset {settings.preset} needs a newer mpidp", file=sys.stderr)


def _launch_all(configs: list[dict], settings: argparse.Namespace,
                notes: list[str]) -> list[dict]:
    """Every configuration, --repeat rounds, one launch each; returns the runs.
    A peer's failed run adds a line to ``notes`` and leaves its rows out.

    Raises:
        BenchError: a run of mpidp failed, or ran on another number of ranks
            than planned.
    """
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
            try:
                run_ = execute(config, settings.launcher, cores)
            except BenchError as exc:
                if config["impl"] == "mpidp":
                    raise
                # A peer that cannot run (Opacus missing or refusing a layer)
                # leaves its rows out; mpidp's rows stand.
                notes.append(f"{config['impl']} peer failed, its rows are left out: "
                             + " ".join(str(exc).split()))
                print(f"[{n}/{total}] failed: {notes[-1]}", file=sys.stderr, flush=True)
                continue
            last = run_["epochs"][-1]
            steady = [e["epoch_time_s"] for e in run_["epochs"][1:]] or \
                [run_["epochs"][0]["epoch_time_s"]]
            print(f"[{n}/{total}] {len(run_['epochs'])} epochs, "
                  f"{sum(steady) / len(steady):.3f} s/epoch after the first, test "
                  f"accuracy {last.get('test_accuracy') or float('nan'):.4f} "
                  f"({run_['launch_s']:.1f} s)", file=sys.stderr, flush=True)
            runs.append(run_)
    return runs


def run(args: argparse.Namespace) -> int:
    """One process: launch ``mpidp train`` (and its peer) per configuration (or
    --collect job directories), then print the tables and write --json / --plot.

    The temporary folder of the runs' metrics is removed however they end
    (success, a failed run, an interrupt); a --keep folder stays.

    Raises:
        BenchError: bad settings (before any data is written or run launched), a
            missing file, or a run of mpidp that failed or ran on another number
            of ranks than planned (a peer's such run is reported in the notes
            instead).
    """
    if MPI.COMM_WORLD.Get_size() > 1:
        raise BenchError("run the benchmark as one process (`mpidp bench scaling`); it "
                         "starts one mpiexec per configuration itself")
    # Every number and the launch command before any output is probed or data written.
    check_numbers(args)
    if not args.collect:
        check_launcher(args.launcher)
    # Every output before any work (engine.outputs): not a failed write after the runs.
    outputs.check_all({"--json": args.json, "--plot": args.plot})
    if args.keep and not args.collect:
        outputs.check_directory(args.keep, "--keep")
    where = machine()
    load_before = _load()
    notes: list[str] = []
    preset = None
    if args.collect:
        settings = args
        runs = collect(args.collect)
        source = f"collected from {len(args.collect)} job directories"
    else:
        settings = resolve(args)
        preset = settings.preset
        notes += settings.notes
        # Fail now, not after writing the data (a dry run needs no launcher binary).
        (launcher_words if settings.dry_run else launcher_argv)(settings.launcher, 1)
        refused = check_train_options(plan(settings, {r: "-" for r in settings.repeat_list},
                                           "")[0])
        if refused and not settings.dry_run:
            raise BenchError(f"this mpidp train refuses the planned options ({refused}); "
                             f"--preset {settings.preset} needs an mpidp train that has them")
        data, source = ensure_data(settings, write=not settings.dry_run)
        keep = settings.keep
        workdir = keep or tempfile.mkdtemp(prefix="mpidp-scaling-")
        try:  # the temporary folder goes however the runs end (failed, interrupted)
            os.makedirs(workdir, exist_ok=True)
            configs = plan(settings, data, workdir)
            if settings.dry_run:
                _dry_run(configs, settings, refused)
                return 0
            runs = _launch_all(configs, settings, notes)
        finally:
            if not keep:
                shutil.rmtree(workdir, ignore_errors=True)
    target = settings.target_accuracy
    budget = settings.time_budget
    summaries = [report.summarize(group, target, budget) for group in report.group_runs(runs)]
    report.add_speedups(summaries)
    report.add_peers(summaries)
    if args.price_per_node_hour is not None:
        report.add_cost(summaries, args.price_per_node_hour)
    load_after = _load()
    print(f"\nmpidp bench scaling{f' --preset {preset}' if preset else ''}: {source}")
    print(f"machine: {machine_facts.one_line(where)}; {where['memory_gib']} GiB; "
          f"{where['mlp_step']}; load average before {load_before}, after {load_after}\n")
    sweep = preset == "dp-sweep"
    print(report.format_sweep_table(summaries) if sweep else report.format_table(summaries))
    if (preset or "").startswith("mlbench") and target is not None and budget is None:
        print("(mlbench's other metric, the accuracy after a time budget: give --time-budget "
              "SECONDS)")
    for note in notes:
        print(f"note: {note}")
    if args.price_per_node_hour is not None:
        print("\n" + report.format_cost_table(summaries))
    if args.markdown:
        print("\n" + report.markdown_table(summaries))
    if args.json:
        document = {"benchmark": "mpidp bench scaling", "preset": preset, "machine": where,
                    "load_average": {"before": load_before, "after": load_after},
                    "data": source, "target_accuracy": target, "time_budget": budget,
                    "baseline": getattr(settings, "baseline", None), "notes": notes,
                    "summaries": summaries, "runs": runs,
                    "provenance": machine_facts.provenance(where)}
        outputs.write_json(args.json, document, "--json")
    if args.plot:
        data_label = (os.path.basename(settings.data) if getattr(settings, "data", None)
                      else source.split(" (")[0] if getattr(settings, "image", False)
                      else os.path.basename(source))
        title = (f"mpidp bench scaling{f' --preset {preset}' if preset else ''} on "
                 f"{where['host']} ({where['cores']} cores): {data_label}")
        try:
            (plot_sweep if sweep else plot)(summaries, args.plot, title)
        except OSError as exc:
            raise WriteFailed(f"--plot {args.plot}: cannot write it: {exc.strerror}") from None
    return 0
