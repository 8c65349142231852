"""What ``mpidp bench scaling`` runs: its presets, the settings resolved from
them and the options, and the configurations those settings plan.

:func:`resolve` fills a preset's values into the options left unset and
checks them (:class:`BenchError`, one line, for a contradiction);
:func:`plan` turns the settings into the launches, in order, each a dict
with the ``mpidp train`` (or peer, :func:`peer_config`) argument list;
:func:`shown_command` is a launch as a user would type it. Nothing here
launches or writes anything (:mod:`engine.bench.scaling_runs` does).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import io
import math
import os
import shlex
import string

import collectives
from collectives.launch import launcher_words
from engine.bench.synthetic_images import parse_image_shape
from engine.errors import ConfigError
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


#: Options that take a count: refused below 1 (None: not given, the preset's value).
COUNTS = ("rows", "test_rows", "features", "batch_size", "local_batch", "epochs", "repeat")


def check_numbers(args: argparse.Namespace) -> None:
    """Raise BenchError (one line) for a number out of its range, before any data
    is written or any run launched: a count (:data:`COUNTS`) below 1, a
    --target-accuracy outside (0, 1], a --time-budget, --noise-multiplier or
    --max-grad-norm that is not a finite positive number, a negative
    --price-per-node-hour. Options left unset (None) and options this
    ``args`` lacks (``--collect`` checks only those it has) pass."""
    for name in COUNTS:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise BenchError(f"--{name.replace('_', '-')} {value} must be at least 1")
    target = getattr(args, "target_accuracy", None)
    if target is not None and not 0 < target <= 1:
        raise BenchError(f"--target-accuracy {target:g} must be in (0, 1]")
    for name, what in (("time_budget", "a positive number of seconds"),
                       ("noise_multiplier", "a finite positive number"),
                       ("max_grad_norm", "a finite positive number")):
        value = getattr(args, name, None)
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise BenchError(f"--{name.replace('_', '-')} {value:g} must be {what}")
    price = getattr(args, "price_per_node_hour", None)
    if price is not None and not (price >= 0 and math.isfinite(price)):
        raise BenchError(f"--price-per-node-hour {price:g} must be a finite number >= 0")


def check_launcher(template: str) -> None:
    """Raise BenchError (one line) unless the launch command passes each run's rank
    count on: without ``{ranks}`` every launch would start the launcher's own
    number of ranks, and the rows would be labelled with counts that never ran.
    A template that cannot be filled in or split raises
    :class:`collectives.launch.LaunchError` (:func:`launcher_words`)."""
    launcher_words(template, 1)
    fields = {field for _, field, _, _ in string.Formatter().parse(template) if field}
    if "ranks" not in fields:
        raise BenchError(f"--launcher {template!r} has no {{ranks}}: every run would start "
                         "the launcher's own number of ranks, not --ranks; e.g. "
                         "'mpiexec -n {ranks}' or 'srun --mpi=pmi2 -n {ranks}'")


def _split(text) -> list[str]:
    return [v.strip() for v in str(text or "").split(",") if v.strip()]


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with the preset's values filled in where none was given; checked
    (:func:`check_preset_options`; the caller checks :func:`check_numbers` and
    :func:`check_launcher` first, before any other work)."""
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
            settings.image_shape_tuple = parse_image_shape(settings.image_shape)
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
    rows = {repeat: planned_rows(settings, repeat) for repeat in settings.repeat_list}
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
                                                     grid_batch, repeat, rows[repeat])
                                    runs.append(config)
                                    if peers and (not dp or settings.have_opacus):
                                        runs.append(peer_config(config))
    return runs


def _config(s, data, workdir, mode, dp, algorithm, threads, ranks, model=None,
            grid_batch=None, repeat=1, rows=None) -> dict:
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
    delta = _delta_for(data, rows) if dp and not _has_delta(train_args) else None
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


def planned_rows(settings: argparse.Namespace, repeat: int) -> int | None:
    """The training rows of data repeat ``repeat``'s file, known before it exists:
    the preset's synthetic rows (x ``repeat``), or the rows of --data (x
    ``repeat``: the tiled copy); None when --data cannot be read."""
    if not getattr(settings, "data", None):
        return settings.rows * repeat
    try:
        return read_info(settings.data).rows["train"] * repeat
    except Exception:  # noqa: BLE001 - any unreadable file: ensure_data reports it if run
        return None


def delta_for_rows(rows: int) -> float:
    """mpidp train's default delta (1e-5), or for a training set of more than
    100,000 rows the largest power of ten not above 1/N (train refuses a delta
    above 1/N: the seed's 790,000 rows get 1e-6)."""
    return min(1e-5, 10.0 ** math.floor(math.log10(1.0 / max(1, rows))))


@functools.lru_cache(maxsize=None)
def _delta_for(data: str, rows: int | None = None) -> float | None:
    """:func:`delta_for_rows` of the file's training rows, else (the file is not
    written yet: a dry run) of the planned ``rows`` (:func:`planned_rows`), so a
    dry run prints the delta the real run passes; None when neither is known
    (an unreadable --data in a dry run: see :func:`undecided_delta`)."""
    try:
        rows = read_info(data).rows["train"]
    except Exception:  # noqa: BLE001 - any unreadable file: train reports it if run
        pass
    return None if rows is None else delta_for_rows(rows)


def undecided_delta(configs: list[dict]) -> bool:
    """Whether a planned DP run has no --delta yet (its data's rows unknown): it is
    decided once the data can be read, so a dry run says so."""
    return any(config["dp"] and not _has_delta(config["train_argv"]) for config in configs)


def _has_delta(argv: list[str]) -> bool:
    """Whether an argument list gives --delta (``--delta X`` or ``--delta=X``)."""
    return any(a == "--delta" or a.startswith("--delta=") for a in argv)


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
