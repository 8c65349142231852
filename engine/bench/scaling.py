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
import contextlib
import functools
import hashlib
import importlib.util
import io
import json
import math
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
from collectives import MPI, machine as machine_facts
from collectives.launch import child_env, launcher_argv, launcher_words
from collectives.runtime import available_cores
from engine import outputs
from engine.bench import scaling_report as report, synthetic
from engine.bench.scaling_plot import plot, plot_sweep
from engine.errors import ConfigError, WriteFailed
from engine.shard import read_info

#: The tabular models the tabular presets train (the MLP of --hidden).
TABULAR_MODELS = ("mlp",)
#: The image models (engine.nn.image_models.IMAGE_MODELS; not imported here: torch).
IMAGE_MODELS = ("mnist-small", "mnist-large", "resnet20")
#: Preset values for options left unset on the command line. ``kind``: tabular
#: or image data; ``models``: the models a preset may train (the first ones by
#: default); ``lr_reference_batch``: --lr is per that many examples of the global
#: batch, scaled linearly; ``schedule_args``: mpidp train options of the
#: schedule; ``sampling`` ``auto``: shuffled fixed batches without DP, Poisson with.
PRESETS: dict[str, dict] = {
    "seed": dict(kind="tabular", rows=790_000, test_rows=200_000, features=100, dense=False,
                 hidden="128,128", batch_size=256, local_batch=None, scaling="strong",
                 privacy="dp,nodp", lr="0.05", lr_schedule="constant", momentum=0.9,
                 weight_decay=0.0, sampling="poisson", epochs=10, target_accuracy=None),
    "mlbench-2a": dict(kind="tabular", rows=400_000, test_rows=100_000, features=2000,
                       dense=True, hidden="", batch_size=None, local_batch=100,
                       scaling="weak", privacy="nodp",
                       lr="1:200,2:400,3:500,4:600,8:700,16:800",
                       lr_schedule="inv-sqrt", momentum=0.0, weight_decay=2.5e-6,
                       sampling="shuffle", epochs=10, target_accuracy=0.89),
    "mlbench-1a": dict(kind="image", models=("resnet20",), default_models="resnet20",
                       image_shape="3x32x32", real="CIFAR-10", rows=50_000, test_rows=10_000,
                       batch_size=None, local_batch=32, scaling="weak", privacy="nodp",
                       lr="0.1", lr_reference_batch=256, lr_schedule="step",
                       schedule_args="--nesterov --lr-warmup-epochs 5 "
                       "--lr-milestones 82,109 --lr-decay 0.1",
                       momentum=0.9, weight_decay=1e-4, sampling="auto", epochs=164,
                       target_accuracy=0.70),
    "dp-sweep": dict(kind="image", models=("mnist-small", "mnist-large"),
                     default_models="mnist-small,mnist-large", image_shape="1x28x28",
                     real="MNIST", rows=60_000, test_rows=10_000, batch_size=None,
                     batch_sizes="128,256,512", data_repeats="1,4,8", local_batch=None,
                     scaling="strong", privacy="nodp,dp", lr="0.05", lr_schedule="constant",
                     momentum=0.9, weight_decay=0.0, sampling="poisson", epochs=2,
                     target_accuracy=None),
}
#: Options only some presets take: option -> (argparse name, presets).
PRESET_ONLY = {
    "--batch-sizes": ("batch_sizes", ("dp-sweep",)),
    "--data-repeats": ("data_repeats", ("dp-sweep",)),
    "--image-shape": ("image_shape", ("mlbench-1a", "dp-sweep")),
    "--model": ("model", ("mlbench-1a", "dp-sweep")),
    "--models": ("models", ("dp-sweep",)),
    "--hidden": ("hidden", ("seed", "mlbench-2a")),
    "--features": ("features", ("seed", "mlbench-2a")),
}
#: The peer of each privacy mode (``--baseline ddp``), as the tables name it.
PEERS = {False: "torch-ddp", True: "opacus-ddp"}


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
                      help="weak scaling: expected batch per rank (mlbench-2a: 100, "
                      "mlbench-1a: 32)")
    what.add_argument("--batch-sizes", default=None,
                      help="dp-sweep: comma-separated global batches (default: 128,256,512)")
    what.add_argument("--privacy", default=None,
                      help="dp, nodp or dp,nodp (default: the preset's)")
    what.add_argument("--allreduce", default="auto",
                      help="comma-separated all-reduce algorithms (default: auto)")
    what.add_argument("--threads", default="auto",
                      help="comma-separated thread policies per rank: auto (cores // ranks, "
                      "as mpidp train) or a number (default: auto)")
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
    train.add_argument("--seed", type=int, default=1, help="seed of every run (default: 1)")
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


def check_preset_options(args: argparse.Namespace) -> None:
    """Raise BenchError (one line) for an option that contradicts ``--preset``."""
    preset = args.preset
    for option, (name, presets) in PRESET_ONLY.items():
        if getattr(args, name, None) is not None and preset not in presets:
            what = ("the image presets" if presets == ("mlbench-1a", "dp-sweep")
                    else "--preset " + " and ".join(presets))
            raise BenchError(f"{option} applies to {what}, not to --preset {preset}")
    if args.model is not None and args.models is not None:
        raise BenchError("give --model or --models, not both")
    spec = PRESETS[preset]
    if spec["kind"] != "image":
        return
    for model in _split(args.models if args.models is not None else args.model):
        if model not in spec["models"]:
            raise BenchError(f"--model {model}: --preset {preset} trains "
                             f"{' or '.join(spec['models'])}")
    fixed = {"mlbench-1a": "weak", "dp-sweep": "strong"}[preset]
    if args.scaling is not None and args.scaling.strip() != fixed:
        raise BenchError(f"--scaling {args.scaling}: --preset {preset} is {fixed} scaling "
                         + ("(32 examples per rank)" if fixed == "weak"
                            else "(--batch-sizes are global batches)"))
    if preset == "mlbench-1a" and args.batch_size is not None:
        raise BenchError("--batch-size: --preset mlbench-1a is weak scaling; use "
                         "--local-batch (examples per rank, default 32)")
    if preset == "dp-sweep" and args.batch_size is not None:
        raise BenchError("--batch-size: --preset dp-sweep takes --batch-sizes (its grid)")
    if preset == "dp-sweep" and args.local_batch is not None:
        raise BenchError("--local-batch: --preset dp-sweep is strong scaling; use "
                         "--batch-sizes (global batches)")
    if args.data and args.image_shape is not None:
        raise BenchError("--image-shape is the shape of synthetic images; the --data file "
                         "has its own")


def _split(text) -> list[str]:
    return [v.strip() for v in str(text or "").split(",") if v.strip()]


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with the preset's values filled in where none was given; checked."""
    check_preset_options(args)
    settings = argparse.Namespace(**vars(args))
    preset = PRESETS[args.preset]
    for name, value in preset.items():
        if getattr(settings, name, None) is None:
            setattr(settings, name, value)
    settings.image = preset["kind"] == "image"
    settings.rank_list = parse_ints(settings.ranks, "--ranks")
    settings.modes = _choices(settings.scaling, ("strong", "weak"), "--scaling")
    settings.privacy_list = _choices(settings.privacy, ("dp", "nodp"), "--privacy")
    settings.algorithms = _choices(settings.allreduce, _algorithm_names(), "--allreduce")
    if settings.image:
        settings.model_list = _split(args.models if args.models is not None else
                                     args.model if args.model is not None
                                     else preset["default_models"])
        try:
            settings.image_shape_tuple = synthetic.parse_image_shape(settings.image_shape)
        except ValueError as exc:
            raise BenchError(f"--image-shape: {exc}") from None
    else:
        from engine.choices import parse_hidden

        try:
            parse_hidden(settings.hidden)
        except ConfigError as error:
            raise BenchError(str(error)) from None
        settings.model_list = [None]
    settings.batch_list = (parse_ints(settings.batch_sizes, "--batch-sizes")
                           if getattr(settings, "batch_sizes", None) else None)
    settings.repeat_list = parse_ints(getattr(settings, "data_repeats", None) or "1",
                                      "--data-repeats")
    settings.thread_policies = _choices(settings.threads, None, "--threads")
    for policy in settings.thread_policies:
        if policy != "auto" and not (policy.isdigit() and int(policy) > 0):
            raise BenchError(f"--threads {policy!r}: use auto or a positive number")
    settings.lr_by_ranks = parse_lr(settings.lr, settings.rank_list)
    settings.lr_reference_batch = preset.get("lr_reference_batch")
    settings.schedule_args = preset.get("schedule_args", "") \
        if args.lr_schedule is None else ""
    if settings.sampling not in ("poisson", "shuffle", "auto"):
        raise BenchError(f"--sampling {settings.sampling!r}: choose poisson, shuffle or auto")
    if "strong" in settings.modes and not (settings.batch_size or settings.batch_list):
        raise BenchError("strong scaling needs --batch-size (the global batch)")
    if "weak" in settings.modes and not settings.local_batch:
        raise BenchError("weak scaling needs --local-batch (the batch per rank)")
    if settings.epochs < 1 or settings.repeat < 1:
        raise BenchError("--epochs and --repeat must be at least 1")
    settings.baseline = args.baseline or ("ddp" if _distributed_available() else "none")
    settings.notes = []
    settings.have_opacus = importlib.util.find_spec("opacus") is not None
    if settings.baseline == "ddp" and "dp" in settings.privacy_list and not settings.have_opacus:
        settings.notes.append("Opacus is not installed: the DP runs have no Opacus-DDP peer "
                              "(pip install opacus)")
    return settings


def _distributed_available() -> bool:
    try:
        import torch.distributed as dist  # deferred: torch, out of `mpidp bench --help`
    except ImportError:
        return False
    return bool(dist.is_available())


def parse_ints(text: str, option: str) -> list[int]:
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
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


def plan(settings: argparse.Namespace, data: dict[int, str], workdir: str) -> list[dict]:
    """The configurations to launch, in order (grid and series outer, ranks inner);
    with ``--baseline ddp`` each mpidp run is followed by its peer's."""
    runs = []
    peers = settings.baseline == "ddp"
    for model in settings.model_list:
        for mode in settings.modes:
            grid = (settings.batch_list or [settings.batch_size]) if mode == "strong" \
                else [settings.local_batch]
            for grid_batch in grid:
                for repeat in settings.repeat_list:
                    for privacy in settings.privacy_list:
                        dp = privacy == "dp"
                        for algorithm in settings.algorithms:
                            for threads in settings.thread_policies:
                                for ranks in settings.rank_list:
                                    config = _config(settings, data[repeat], workdir, mode,
                                                     dp, algorithm, threads, ranks, model,
                                                     grid_batch, repeat)
                                    runs.append(config)
                                    if peers and (not dp or settings.have_opacus):
                                        runs.append(peer_config(config))
    return runs


def _config(s, data, workdir, mode, dp, algorithm, threads, ranks, model=None,
            grid_batch=None, repeat=1) -> dict:
    grid_batch = grid_batch or (s.batch_size if mode == "strong" else s.local_batch)
    batch = grid_batch if mode == "strong" else grid_batch * ranks
    lr = s.lr_by_ranks[ranks]
    if getattr(s, "lr_reference_batch", None):
        lr = lr * batch / s.lr_reference_batch
    sampling = s.sampling if s.sampling != "auto" else ("poisson" if dp else "shuffle")
    prefix = "" if model is None else f"{model}-b{grid_batch}-x{repeat}-"
    name = f"{prefix}{mode}-{'dp' if dp else 'nodp'}-{algorithm}-t{threads}-n{ranks}"
    argv = ["--data", data, "--epochs", str(s.epochs), "--batch-size", str(batch)]
    argv += ["--model", model] if model is not None else ["--hidden", s.hidden]
    argv += ["--lr", repr(lr), "--lr-schedule", s.lr_schedule, "--momentum", repr(s.momentum),
             "--weight-decay", repr(s.weight_decay), "--sampling", sampling,
             "--allreduce", algorithm, "--seed", str(s.seed), "--no-progress"]
    argv += (["--noise-multiplier", repr(s.noise_multiplier), "--max-grad-norm",
              repr(s.max_grad_norm)] if dp else ["--no-dp"])
    train_args = shlex.split(s.train_args)
    delta = _delta_for(data) if dp and "--delta" not in train_args else None
    if delta is not None:
        argv += ["--delta", repr(delta)]
    if threads != "auto":
        argv += ["--threads", threads]
    if getattr(s, "device", "cpu") != "cpu":
        argv += ["--device", s.device]
    if s.time_budget is not None:  # the target is then read off the history
        argv += ["--time-budget", repr(s.time_budget)]
    elif s.target_accuracy is not None:
        argv += ["--target-accuracy", repr(s.target_accuracy)]
    argv += shlex.split(getattr(s, "schedule_args", "") or "") + train_args
    return {"name": name, "impl": "mpidp", "program": "engine.cli", "mode": mode, "dp": dp,
            "allreduce": algorithm, "threads": threads, "ranks": ranks, "nodes": 1,
            "layout": f"1x{ranks}", "batch_size": batch, "model": model,
            "grid_batch": grid_batch if model is not None else None,
            "data_repeat": repeat if model is not None else None,
            "metrics": os.path.join(workdir, name + ".jsonl"), "train_argv": ["train", *argv]}


@functools.lru_cache(maxsize=None)
def _delta_for(data: str) -> float | None:
    """mpidp train's default delta (1e-5), or for a training set of more than
    100,000 rows the largest power of ten not above 1/N (train refuses a delta
    above 1/N: the seed's 790,000 rows get 1e-6); None when the file cannot be
    read (a dry run's placeholder), so the run uses train's default."""
    try:
        n = read_info(data).rows["train"]
    except Exception:  # noqa: BLE001 - any unreadable file: train reports it if run
        return None
    return min(1e-5, 10.0 ** math.floor(math.log10(1.0 / max(1, n))))


def peer_config(config: dict) -> dict:
    """The peer's run of an mpidp configuration (:mod:`engine.bench.ddp_baseline`)."""
    impl = PEERS[config["dp"]]
    name = f"{config['name']}-{impl}"
    return dict(config, name=name, impl=impl, program="engine.bench.ddp_baseline",
                metrics=os.path.join(os.path.dirname(config["metrics"]), name + ".jsonl"),
                train_argv=config["train_argv"][1:])


def shown_command(config: dict, launcher: str) -> str:
    """The command as a user would type it."""
    program = (["mpidp"] if config.get("program", "engine.cli") == "engine.cli"
               else ["python", "-m", config["program"]])
    argv = [*launcher_words(launcher, config["ranks"]), *program, *config["train_argv"],
            "--metrics", os.path.basename(config["metrics"])]
    return shlex.join(argv)


def check_train_options(config: dict) -> str | None:
    """Why this mpidp's ``train`` would refuse the planned options (argparse's
    message), or None: a preset's options that need a newer mpidp (the
    schedule of mlbench-1a) are refused here, before any data is written."""
    # deferred: torch, kept out of `mpidp bench --help`
    from engine.config import add_arguments as train_arguments

    parser = argparse.ArgumentParser(prog="mpidp train", add_help=False)
    train_arguments(parser)
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            parser.parse_args(config["train_argv"][1:])
    except SystemExit:
        lines = [line for line in stderr.getvalue().splitlines() if line.strip()]
        return lines[-1] if lines else "refused"
    return None


# ------------------------------------------------------------ data
def ensure_data(settings: argparse.Namespace, write: bool = True) -> tuple[dict[int, str], str]:
    """The file to train on for each data repeat ({repeat: path}) and a line saying
    what the data is: --data (tiled into --cache for repeats above 1), or the
    preset's synthetic file (written once into --cache; not with ``write=False``)."""
    if settings.data:
        if not os.path.isfile(settings.data):
            raise BenchError(f"--data {settings.data}: no such file")
        files = {1: settings.data}
        for repeat in settings.repeat_list:
            if repeat > 1:
                files[repeat] = _tiled(settings, repeat, write)
        return files, _describe_file(settings, write)
    if settings.image:
        c, h, w = settings.image_shape_tuple
        files = {}
        for repeat in settings.repeat_list:
            rows = settings.rows * repeat
            path = Path(settings.cache) / (f"images-{c}x{h}x{w}-{rows}-{settings.test_rows}-"
                                           "c10-seed0.h5")
            if write and not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                print(f"writing {path} (once) ...", file=sys.stderr, flush=True)
                synthetic.write_images(path, (c, h, w), rows=rows,
                                       test_rows=settings.test_rows, seed=0)
            files[repeat] = str(path)
        rows = ", ".join(f"{settings.rows * r:,}" for r in settings.repeat_list)
        what = (f"synthetic {c}x{h}x{w} images ({rows} training / {settings.test_rows:,} test "
                f"rows, 10 classes; not {settings.real}: give --data FILE of `mpidp prep "
                f"--format {settings.real.lower().replace('-', '')}` for the real set)")
        return files, what
    kind = f"dense-decay{synthetic.DENSE_DECAY:g}" if settings.dense else "synth"
    path = Path(settings.cache) / (f"{kind}-{settings.rows}x{settings.features}-"
                                   f"{settings.test_rows}-seed0.h5")
    if write and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"writing {path} (once) ...", file=sys.stderr, flush=True)
        if settings.dense:
            synthetic.write_dense(path, rows=settings.rows, features=settings.features,
                                  test_rows=settings.test_rows, seed=0)
        else:
            synthetic.write(path, rows=settings.rows, features=settings.features,
                            test_rows=settings.test_rows, seed=0)
    return {1: str(path)}, str(path)


def _tiled(settings: argparse.Namespace, repeat: int, write: bool) -> str:
    """The --data file with its training rows repeated, cached under a name that
    changes with the source's path, size and modification time."""
    source = os.path.abspath(settings.data)
    stat = os.stat(source)
    digest = hashlib.sha256(f"{source}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    path = Path(settings.cache) / f"{Path(source).stem}-x{repeat}-{digest[:12]}.h5"
    if write and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"writing {path} ({settings.data} with its training rows x{repeat}, once) ...",
              file=sys.stderr, flush=True)
        synthetic.tile_rows(source, path, repeat)
    return str(path)


def _describe_file(settings: argparse.Namespace, read: bool) -> str:
    """``--data``'s line in the report (an image preset checks it holds images)."""
    if not read:
        return settings.data
    from preprocessing import h5format

    try:
        info = h5format.read_info(settings.data)
    except h5format.FormatError as exc:
        raise BenchError(str(exc)) from None
    if settings.image and not info.is_image:
        raise BenchError(f"--data {settings.data} holds tabular rows; --preset "
                         f"{settings.preset} needs images (`mpidp prep --format "
                         f"{settings.real.lower().replace('-', '')}`)")
    if not settings.image and info.is_image:
        raise BenchError(f"--data {settings.data} holds images; --preset {settings.preset} "
                         "trains an MLP on tabular rows (image presets: mlbench-1a, dp-sweep)")
    if not info.is_image:
        return settings.data
    shape = "x".join(map(str, info.image_shape))
    return (f"{settings.data} ({info.task or 'image'} images {shape}, {info.rows['train']:,} "
            f"training / {info.rows['test']:,} test rows, {info.n_classes} classes)")


# ------------------------------------------------------------ running
def execute(config: dict, launcher: str, cores: int | None) -> dict:
    """Launch one configuration; returns the run (config + its epoch records)."""
    argv = [*launcher_argv(launcher, config["ranks"]), sys.executable, "-m",
            config.get("program", "engine.cli"), *config["train_argv"],
            "--metrics", config["metrics"]]
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
    run.pop("program", None)
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
    from kernels.probe import mlp_step_mode  # deferred: imports torch

    return {**machine_facts.describe(), "memory_gib": _memory_gib(),
            "python": platform.python_version(), "mlp_step": mlp_step_mode(runs=True)}


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
    """One process: launch ``mpidp train`` (and its peer) per configuration (or
    --collect job directories), then print the tables and write --json / --plot.

    Raises:
        BenchError: bad settings, a missing file, or a run of mpidp that failed
            (a peer's failed run is reported in the notes instead).
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
        os.makedirs(workdir, exist_ok=True)
        configs = plan(settings, data, workdir)
        if settings.dry_run:
            for config in configs:
                print(shown_command(config, settings.launcher))
            if refused:
                print(f"note: this mpidp train refuses these options ({refused}); "
                      f"--preset {settings.preset} needs a newer mpidp", file=sys.stderr)
            if not keep:
                shutil.rmtree(workdir, ignore_errors=True)
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
