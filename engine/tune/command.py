"""Search hyperparameters: trials trained with the engine side by side, chosen on val.

Every trial is `mpidp train` on the training split with one point of the
space; the trials run side by side (--parallel P groups of ranks, each a
sub-communicator of the job, one trial at a time each), every trained model
is scored on the file's val split (`mpidp prep --val-fraction`), and the
trial with the best val accuracy is chosen (--select-on
worst_group_val_accuracy: the best accuracy of its worst --group-by
group). The test split is never used to choose. Rank 0 prints a line per
finished trial, then a table, the privacy the tuning itself costs, and the
chosen settings as an `mpidp train` command; OUT/tune.json holds it all,
and the chosen trial's model is kept in OUT/trials/trial-NNNN/best.pt, the
file to publish: its epsilon is the one including the tuning, and it holds
no exact score (`mpidp eval
--checkpoint OUT/trials/trial-NNNN` scores it and prints that epsilon).

Examples:
  mpiexec -n 2 mpidp tune --data pums.h5 --no-dp --out runs/tune \\
      --space 'lr=0.01,0.05,0.2;batch_size=256,1024;hidden=128,128|64;epochs=3'
  mpiexec -n 4 mpidp tune --data pums.h5 --target-epsilon 1 --trials 12 --parallel 4 \\
      --space-file space.toml --out runs/tune-dp            # private random search
  mpiexec -n 2 mpidp tune --data pums.h5 --target-epsilon 1 --tuning-privacy public \\
      --public-split val --space 'lr=0.02,0.1;optimizer=sgd,adam;epochs=2' --out runs/t

The space: KEY=VALUES separated by ';', values by ',' (hidden: width lists
separated by '|', 'none' for no hidden layer); tunable keys: lr, batch_size,
max_grad_norm, epochs, optimizer, momentum, weight_decay, lr_schedule,
model, hidden, noise_multiplier. --space-file: the same as TOML (key =
[values]). A key with one value is fixed for every trial.

The search: grid (every valid point) unless --trials N is given (N points
drawn at random without replacement), or the tuning privacy is
random-search (then the number of trials K is itself random, with mean N,
and each trial draws its point uniformly: Papernot & Steinke's private
random search).

The privacy of the tuning (DP runs; docs/training.md#tuning): choosing the
best of several private runs by a score of private data is not free.
  random-search (default)  K ~ truncated negative binomial (--eta 1:
                geometric) or Poisson (--trials-distribution poisson), the
                released val scores noised (--score-noise, unless
                --public-split val declares the val split public); the
                report's "epsilon incl. tuning" bounds releasing the chosen
                trial (Papernot & Steinke 2022, Theorems 2 and 6).
  public        scores on a split the user declares public (--public-split
                val: the val split of a private file is NOT public unless
                you say so); the choice still depends on every trial's
                model, so "epsilon incl. tuning" is all trials composed.
Training the printed command again spends its own epsilon on top of the
tuning's (the settings were chosen on private data); the chosen trial's
model needs no retraining.

Resuming: every finished trial is a line of OUT/trials.jsonl; the same
command again (same space and options, same --out) skips them, and keeps
a random search's drawn trials. Another search in the same --out is refused.

Not done: one Slurm job per trial (--launcher, as `mpidp bench scaling`
has): trials run inside this job only; continuous ranges (values are lists).

Exit codes: 0 done, 2 bad input (nothing run or written), 3 no trial
finished (every trial failed; the report is written), 73 --out in use by
another search, 74 an output could not be written, 75 stopped by a signal
(finished trials kept: run the same command again to continue), 128+n
stopped by signal n before the first trial.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from collectives import MPI
from engine.config import TrainConfig
from engine.dp.accountant import DEFAULT_KIND, KINDS
from engine.errors import (EXIT_CHECKPOINTED, EXIT_DIVERGED, ConfigError, DataError, GroupError,
                           MpidpError, OutputError, PrivacyError, agree)
from engine.tune import space as space_mod
from engine.tune.privacy import DISTRIBUTIONS

#: Stop signals are acted on between trials and at the trainer's steps (not raised).
STOPS_AT_STEPS = True

MODES = ("random-search", "public")
FORMAT = "mpidp-tune"
VERSION = 1
DEFAULT_SCORE_NOISE = 20.0
DEFAULT_MEAN_TRIALS = 10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = TrainConfig(data="")
    what = parser.add_argument_group("data, space and search")
    what.add_argument("--data", required=True,
                      help="prepared HDF5 file with a val split (mpidp prep --val-fraction)")
    what.add_argument("--space", default=None, metavar="SPEC",
                      help="KEY=V1,V2;KEY=... (hidden: 128,128|64); see above")
    what.add_argument("--space-file", default=None, metavar="FILE.toml",
                      help="the space as TOML (key = [values]); may be combined with --space")
    what.add_argument("--search", choices=("grid", "random"), default=None,
                      help="grid: every valid point; random: --trials points drawn without "
                      "replacement (default: grid, random with --trials; always random for "
                      "--tuning-privacy random-search)")
    what.add_argument("--trials", type=int, default=None, metavar="N",
                      help="random search: points to draw; private random search: the "
                      f"expected number of trials E[K] (default {DEFAULT_MEAN_TRIALS})")
    what.add_argument("--parallel", type=int, default=None, metavar="P",
                      help="trials side by side: the ranks split into P groups of contiguous "
                      "ranks, one trial each at a time (default: one group per rank, at most "
                      "one per trial); every rank holds its group's copy of the data")
    what.add_argument("--seed", type=int, default=None,
                      help="seed of the plan, of each trial (derived from it) and of the score "
                      "noise (default: random; experiments only)")
    what.add_argument("--select-on", choices=("val_accuracy", "worst_group_val_accuracy"),
                      default="val_accuracy",
                      help="the score a trial is chosen by, on the val split: its accuracy, "
                      "or the accuracy of its worst --group-by group of at least "
                      "--min-group-size val rows (default: val_accuracy)")
    what.add_argument("--group-by", default=None, metavar="ATTR",
                      help="with --select-on worst_group_val_accuracy: a group attribute the "
                      "file keeps (SEX, RAC1P, AGEP, ST; default: the task's group, RAC1P)")
    what.add_argument("--min-group-size", type=int, default=100, metavar="N",
                      help="with --select-on worst_group_val_accuracy: val groups with fewer "
                      "rows (noisy rows, in a private random search) are not scored "
                      "(default: 100)")
    what.add_argument("--out", default="tune", metavar="DIR",
                      help="the search's directory: search.json, trials.jsonl, tune.json and "
                      "the chosen trial's checkpoint; created if missing (its parent must "
                      "exist); the same DIR again continues the search (default: tune)")
    privacy = parser.add_argument_group("privacy of every trial (as mpidp train)")
    sigma = privacy.add_mutually_exclusive_group()
    sigma.add_argument("--target-epsilon", type=float, default=None,
                       help="each trial calibrates sigma to spend this epsilon")
    sigma.add_argument("--noise-multiplier", type=float, default=None,
                       help="sigma of every trial (or tune noise_multiplier in the space)")
    privacy.add_argument("--no-dp", dest="dp", action="store_false",
                         help="non-private trials (no tuning privacy either)")
    privacy.add_argument("--delta", type=float, default=d.delta,
                         help=f"delta of each trial and of the tuning (default: {d.delta})")
    privacy.add_argument("--accountant", default=DEFAULT_KIND, choices=KINDS,
                         help="each trial's accountant (default: pld); the tuning's cost is "
                         "computed in RDP")
    privacy.add_argument("--privacy-unit", default="person", choices=("person", "household"),
                         help="whom epsilon protects (default: person)")
    tuning = parser.add_argument_group("privacy of the tuning (DP runs)")
    tuning.add_argument("--tuning-privacy", choices=MODES, default=None,
                        help="random-search (default): Papernot & Steinke's private random "
                        "search; public: score on --public-split, cost = the trials composed")
    tuning.add_argument("--public-split", default=None, metavar="NAME",
                        help="a split of the file you declare public (val): its scores are "
                        "exact and cost nothing. The val split of a private file is NOT public "
                        "unless you say so")
    tuning.add_argument("--trials-distribution", choices=DISTRIBUTIONS, default=None,
                        help="law of the number of trials K of a private random search "
                        "(default: negative-binomial)")
    tuning.add_argument("--eta", type=float, default=None,
                        help="shape eta >= 0 of the truncated negative binomial: 1 geometric "
                        "(default), 0 logarithmic")
    tuning.add_argument("--score-noise", type=float, default=None, metavar="STD",
                        help="std of the Gaussian noise on each released val score, in correct "
                        "predictions (persons, or households' shares) (default: "
                        f"{DEFAULT_SCORE_NOISE:g}; private random search with a private val)")
    system = parser.add_argument_group("system")
    system.add_argument("--threads", type=int, default=None,
                        help="torch/numba threads per rank (default: cores // ranks per node)")
    system.add_argument("--allreduce", default="auto",
                        help="all-reduce algorithm of the trials (default: auto)")


def _fail(message: str, cls=ConfigError):
    raise cls(message, collective=True)


class Options:
    """The command line, checked (all ranks alike)."""

    def __init__(self, args: argparse.Namespace, size: int) -> None:
        self.data = args.data
        self.dp = args.dp
        self.out = args.out
        self.seed = args.seed
        if args.trials is not None and args.trials < 1:
            _fail(f"--trials {args.trials} must be at least 1")
        if args.parallel is not None and args.parallel < 1:
            _fail(f"--parallel {args.parallel} must be at least 1")
        if args.parallel is not None and args.parallel > size:
            _fail(f"--parallel {args.parallel} needs at least {args.parallel} ranks (this job "
                  f"has {size}): run with mpiexec -n {args.parallel} or more")
        if not self.dp:
            for flag, value in (("--tuning-privacy", args.tuning_privacy),
                                ("--public-split", args.public_split),
                                ("--trials-distribution", args.trials_distribution),
                                ("--eta", args.eta), ("--score-noise", args.score_noise),
                                ("--target-epsilon", args.target_epsilon),
                                ("--noise-multiplier", args.noise_multiplier)):
                if value is not None:
                    _fail(f"{flag} is about DP trials: drop it with --no-dp")
            self.mode = None
        else:
            self.mode = args.tuning_privacy or "random-search"
        if self.mode == "public" and not args.public_split:
            _fail("--tuning-privacy public needs --public-split NAME: the split you declare "
                  "public (val)")
        random_search = self.mode == "random-search"
        if not random_search:
            for flag, value in (("--trials-distribution", args.trials_distribution),
                                ("--eta", args.eta)):
                if value is not None:
                    _fail(f"{flag} is for --tuning-privacy random-search")
        self.distribution = args.trials_distribution or "negative-binomial"
        if args.eta is not None and self.distribution == "poisson":
            _fail("--eta is the shape of the negative binomial: drop it with "
                  "--trials-distribution poisson")
        self.eta = 1.0 if args.eta is None else float(args.eta)
        if not self.eta >= 0:
            _fail(f"--eta {args.eta} must be >= 0 (0 logarithmic, 1 geometric)")
        self.public_split = args.public_split
        if args.score_noise is not None and (not random_search or args.public_split):
            _fail("--score-noise is for a private random search with a private val split "
                  "(drop it: the scores are exact here)")
        if args.score_noise is not None and not args.score_noise > 0:
            _fail(f"--score-noise {args.score_noise} must be positive")
        self.score_std = None
        if random_search and not args.public_split:
            self.score_std = DEFAULT_SCORE_NOISE if args.score_noise is None \
                else float(args.score_noise)
        if random_search:
            if args.search == "grid":
                _fail("a private random search draws its trials at random (Papernot & "
                      "Steinke): drop --search grid, or use --tuning-privacy public or --no-dp")
            self.search = "random"
            self.trials = args.trials or DEFAULT_MEAN_TRIALS
        else:
            if args.search == "grid" and args.trials is not None:
                _fail("--trials is for --search random (a grid runs every valid point)")
            if args.search == "random" and args.trials is None:
                _fail("--search random needs --trials N (the points to draw)")
            self.search = args.search or ("random" if args.trials is not None else "grid")
            self.trials = args.trials
        self.objective = args.select_on
        self.group_by = args.group_by.upper() if args.group_by else None
        self.min_group_size = args.min_group_size
        worst = self.objective == "worst_group_val_accuracy"
        if self.group_by and not worst:
            _fail(f"--group-by {args.group_by} chooses the groups of --select-on "
                  "worst_group_val_accuracy: add it, or leave --group-by out")
        if self.min_group_size < 1:
            _fail(f"--min-group-size {self.min_group_size}: give at least 1 (default 100)")
        if worst and self.score_std is not None and args.privacy_unit == "household":
            _fail("--select-on worst_group_val_accuracy with --privacy-unit household in a "
                  "private random search: a household may span groups, and the noise of the "
                  "per-group counts is calibrated to one person; use --privacy-unit person, "
                  "or --tuning-privacy public with --public-split val")
        self.parallel = args.parallel
        self.privacy = {"dp": self.dp, "target_epsilon": args.target_epsilon,
                        "noise_multiplier": args.noise_multiplier, "delta": args.delta,
                        "accountant": args.accountant, "privacy_unit": args.privacy_unit}
        if not self.dp:
            self.privacy = {"dp": False, "privacy_unit": args.privacy_unit}
        self.base = {**self.privacy, "allreduce": args.allreduce}
        if args.threads is not None:
            self.base["threads"] = args.threads

    def identity(self, space, info) -> dict:
        """What makes two invocations the same search (compared on a re-run)."""
        return {"data": os.path.abspath(self.data), "fingerprint": info.fingerprint,
                "rows": dict(info.rows), "space": space.to_json(), "search": self.search,
                "trials": self.trials, "seed": self.seed, "privacy": self.privacy,
                "tuning_privacy": self.mode, "public_split": self.public_split,
                "distribution": self.distribution if self.mode == "random-search" else None,
                "eta": (self.eta if self.mode == "random-search"
                        and self.distribution != "poisson" else None),
                "score_noise": self.score_std,
                **({"select_on": self.objective, "group_by": self.group_by,
                    "min_group_size": self.min_group_size}
                   if self.objective != "val_accuracy" else {})}


def _check_space(space, opts: Options) -> None:
    if not opts.dp:
        for key in ("max_grad_norm", "noise_multiplier"):
            if key in space.values:
                _fail(f"--space {key}: not used by --no-dp trials (no clipping, no noise)")
    if "noise_multiplier" in space.values and opts.privacy.get("target_epsilon") is not None:
        _fail("--space noise_multiplier with --target-epsilon: each trial's sigma comes from "
              "one of them; drop one")
    if "noise_multiplier" in space.values and opts.privacy.get("noise_multiplier") is not None:
        _fail("noise_multiplier is both in --space and given as --noise-multiplier; give it once")
    if opts.dp and "noise_multiplier" not in space.values \
            and opts.privacy.get("target_epsilon") is None \
            and opts.privacy.get("noise_multiplier") is None:
        _fail("give --target-epsilon EPS or --noise-multiplier SIGMA (or noise_multiplier in "
              "the space), or --no-dp for non-private trials")


def _check_file(info, opts: Options) -> None:
    if not info.has_val or info.rows.get("val", 0) == 0:
        _fail(f"{opts.data} has no val split (or an empty one): a search is chosen on val "
              "only; prepare the file with `mpidp prep --val-fraction 0.1`", DataError)
    if opts.public_split is not None:
        if opts.public_split in ("train", "test"):
            _fail(f"--public-split {opts.public_split}: the {opts.public_split} split is not "
                  "scored for the choice (training on train, the final estimate on test); "
                  "the scored split is val")
        if opts.public_split not in info.splits:
            _fail(f"--public-split {opts.public_split}: {opts.data} has no such split (it has "
                  f"{', '.join(info.splits)})")
    if opts.privacy["privacy_unit"] == "household" and not info.households:
        _fail(f"{opts.data} has no household keys; --privacy-unit household needs a file "
              "prepared by this mpidp", DataError)
    if opts.objective == "worst_group_val_accuracy":
        opts.group_by = opts.group_by or info.group or "RAC1P"
        if opts.group_by not in info.groups:
            kept = (f"keeps the group columns {', '.join(info.groups)}" if info.groups
                    else "keeps no group columns (prepare it again with mpidp prep)")
            _fail(f"--select-on worst_group_val_accuracy --group-by {opts.group_by}: "
                  f"{opts.data} {kept}", GroupError)


def _training_units(info, unit: str, comm) -> int:
    """N of the accountant: training rows, or training households."""
    if unit != "household":
        return int(info.rows["train"])
    count, error = None, None
    if comm.Get_rank() == 0:
        try:
            from engine.shard import household_layout

            # the households the trainer's shards hold: rows grouped by key,
            # whatever their order in the file
            count = household_layout(info.path, "train").households
        except (OSError, KeyError) as exc:
            error = DataError(f"{info.path}: cannot read /train/household: {exc}")
    agree(comm, error)
    return int(comm.bcast(count, root=0))


def _check_values(space, info, units: int, opts: Options) -> None:
    """Values that can never work on this file: one line each, exit 2."""
    from engine.models import check_layout

    what = "rows" if opts.privacy["privacy_unit"] == "person" else "households"
    for batch in space.values.get("batch_size", ()):
        if batch > units:
            _fail(f"--space batch_size={batch}: exceeds the {units} training {what} of "
                  f"{opts.data}")
    default = TrainConfig(data="").batch_size
    if "batch_size" not in space.values and default > units:
        _fail(f"batch_size {default} (the default) exceeds the {units} training {what} of "
              f"{opts.data}: give batch_size in the space")
    for model in space.values.get("model", ("mlp",)):
        try:
            check_layout(model, info.code_columns, opts.data)
        except ConfigError as exc:
            _fail(f"--space model={model}: {exc}")


def _valid_points(space, opts: Options) -> tuple[list[dict], int, str | None]:
    """The points TrainConfig accepts with the search's options; the count of the
    others and the first one's reason."""
    points, dropped, reason = [], 0, None
    for point in space.points():
        fields = {k: v for k, v in opts.base.items() if k != "threads"}
        try:
            TrainConfig(data=opts.data, **{**fields, **point}).validate()
        except ConfigError as exc:
            dropped += 1
            reason = reason or f"{space_mod.describe_point(point)}: {exc}"
            continue
        points.append(point)
    return points, dropped, reason


def _privacy_key(point: dict, opts: Options) -> tuple:
    d = TrainConfig(data="")
    return (int(point.get("batch_size", d.batch_size)), int(point.get("epochs", d.epochs)),
            point.get("noise_multiplier", opts.privacy.get("noise_multiplier")))


def _privacy_plans(keys: list[tuple], units: int, opts: Options, comm) -> dict:
    """(q, sigma, steps) of each privacy setting, as the trainer will plan it;
    the calibrations are shared out over the ranks."""
    from engine.dp.accountant import calibrate

    size, rank = comm.Get_size(), comm.Get_rank()
    p = opts.privacy
    mine = []
    for i, key in enumerate(keys):
        if i % size != rank:
            continue
        batch, epochs, sigma = key
        q = batch / units
        steps = epochs * max(1, round(units / batch))
        try:
            if sigma is None:
                sigma = calibrate(q, steps, p["target_epsilon"], p["delta"], p["accountant"]).sigma
            mine.append((key, (q, float(sigma), steps), None))
        except PrivacyError as exc:
            mine.append((key, None, f"--space batch_size={batch} epochs={epochs}: {exc}"))
    found = [item for part in comm.allgather(mine) for item in part]
    errors = sorted(message for _, _, message in found if message)
    if errors:
        _fail(errors[0], PrivacyError)
    return {key: plan for key, plan, _ in found}


def _load_state(out: str, identity: dict) -> dict | None:
    """Rank 0: the search state of ``out`` when it is this search's; None for a new
    directory. Raises OutputError for another search, or a directory that is not one."""
    path = Path(out) / "search.json"
    if not Path(out).exists():
        return None
    if not Path(out).is_dir():
        raise OutputError(f"--out {out}: is a file, not a directory")
    if not path.exists():
        others = sorted(p.name for p in Path(out).iterdir() if p.name != "lock")
        if others:
            raise OutputError(f"--out {out}: holds files that are not an mpidp tune search "
                              f"({', '.join(others[:3])}); choose a new directory")
        return None
    try:
        state = json.loads(path.read_text())
        if state.get("format") != FORMAT:
            raise ValueError("not an mpidp tune search")
    except (OSError, ValueError) as exc:
        raise OutputError(f"--out {out}: {path} cannot be read ({exc}); choose a new "
                          "directory") from None
    theirs = state.get("identity", {})
    if theirs != identity:
        if theirs.get("space") != identity["space"]:
            was = space_mod.Space({k: tuple(tuple(x) if isinstance(x, list) else x for x in v)
                                   for k, v in theirs.get("space", {}).items()}).describe()
            raise OutputError(f"--out {out} holds a search of another space ({was!r}); "
                              "continue it with the same space, or choose another --out")
        diffs = sorted(k for k in set(theirs) | set(identity) if theirs.get(k) != identity.get(k))
        raise OutputError(f"--out {out} holds another search (it differs in "
                          f"{', '.join(diffs)}: {theirs.get(diffs[0])!r} there, "
                          f"{identity.get(diffs[0])!r} now); continue it with the same options, "
                          "or choose another --out")
    return state


def _plan(points: list[dict], opts: Options) -> list[dict]:
    """Rank 0: the settings of every trial, in order (module docstring)."""
    from engine.tune import privacy
    from engine.tune.search import plan_rng

    rng = plan_rng(opts.seed)
    if opts.mode == "random-search":
        k = privacy.draw_trials(rng, opts.distribution, float(opts.trials), opts.eta)
        return [points[int(rng.integers(len(points)))] for _ in range(k)]
    if opts.search == "random":
        n = min(opts.trials, len(points))
        return [points[int(i)] for i in rng.choice(len(points), size=n, replace=False)]
    return list(points)


def _open_out(out: str, state: dict, created_state: bool, trials, finished: dict):
    """Rank 0: create and lock ``out``, write the state, clear what unfinished
    trials left. Returns the lock."""
    from engine import checkpoint, outputs
    from engine.tune import search

    created = not os.path.exists(out)
    outputs.check_directory(out, "--out")
    try:
        lock = checkpoint.acquire(out, command="mpidp tune")
    except MpidpError:
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise
    try:
        if created_state:
            outputs.write_json(Path(out) / search.STATE_FILE, state, "--out")
        (Path(out) / search.TRIALS_DIR).mkdir(exist_ok=True)
        results = Path(out) / search.TRIALS_FILE
        if results.exists():  # drop a line a crash cut short
            keep = [r for r in finished.values()]
            search.rewrite_results(str(results), sorted(keep, key=lambda r: r["trial"]))
        for trial in trials:
            if trial.key not in finished:
                shutil.rmtree(trial.directory(out), ignore_errors=True)
    except OSError as exc:
        lock.release()
        raise OutputError(f"--out {out}: {exc}") from None
    except MpidpError:
        lock.release()
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise
    return lock


def run(args: argparse.Namespace) -> int:
    """Collective: the search (module docstring); returns the exit code."""
    from engine import checkpoint, stopping
    from engine.shard import read_info
    from engine.tune import privacy, search

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    say = (lambda text: print(text, flush=True)) if rank == 0 else (lambda text: None)
    started = time.perf_counter()
    opts = Options(args, size)
    space = space_mod.parse(args.space, args.space_file)
    _check_space(space, opts)
    info = read_info(args.data, comm)
    _check_file(info, opts)
    units = _training_units(info, opts.privacy["privacy_unit"], comm)
    _check_values(space, info, units, opts)
    if opts.dp:
        from engine.dp.privacy import check_delta_for_rows
        try:
            check_delta_for_rows(opts.privacy["delta"], units, where=opts.data)
        except PrivacyError as exc:
            _fail(str(exc), PrivacyError)
    points, dropped, reason = _valid_points(space, opts)
    if not points:
        _fail(f"the space has no valid point ({space.size} tried; e.g. {reason})")
    identity = opts.identity(space, info)
    error, state = None, None
    if rank == 0:
        try:
            state = _load_state(opts.out, identity)
            if state is None:
                trials = [search.Trial.make(i + 1, point, opts.seed)
                          for i, point in enumerate(_plan(points, opts))]
                state = {"format": FORMAT, "version": VERSION, "identity": identity,
                         "trials": [t.to_json() for t in trials], "new": True}
        except MpidpError as exc:
            error = exc
    agree(comm, error)
    state = comm.bcast(state, root=0)
    trials = [search.Trial.from_json(t) for t in state["trials"]]
    created_state = bool(state.pop("new", False))
    # What the tuning costs, stated before any trial spends it.
    statement = None
    if opts.dp:
        keys = sorted({_privacy_key(p, opts) for p in points},
                      key=lambda k: (k[0], k[1], -1 if k[2] is None else k[2]))
        if opts.mode == "public":
            keys = sorted({_privacy_key(space_mod.from_plain(t.settings), opts) for t in trials},
                          key=lambda k: (k[0], k[1], -1 if k[2] is None else k[2]))
        plans = _privacy_plans(keys, units, opts, comm)
        if opts.mode == "random-search":
            curves = [privacy.trial_curve(*plans[k]) for k in keys]
            from engine.tune.search import GROUP_SENSITIVITY

            statement = privacy.random_search(
                curves, opts.privacy["delta"], opts.distribution, float(opts.trials), opts.eta,
                opts.score_std, GROUP_SENSITIVITY if opts.objective != "val_accuracy" else 1.0)
        else:
            curves = [privacy.trial_curve(*plans[_privacy_key(space_mod.from_plain(t.settings),
                                                              opts)]) for t in trials]
            statement = privacy.public_search(curves, opts.privacy["delta"], opts.public_split)
    stopping.check_startup(comm, stop_on_any=True)
    error, lock, finished = None, None, {}
    if rank == 0:
        try:
            keys_planned = {t.key for t in trials}
            finished = {k: r for k, r in search.read_results(
                os.path.join(opts.out, search.TRIALS_FILE)).items() if k in keys_planned}
            lock = _open_out(opts.out, {**state, "statement": None if statement is None
                                        else statement.to_json()},
                             created_state, trials, finished)
        except MpidpError as exc:
            error = exc
    agree(comm, error)
    try:
        done_keys = comm.bcast(set(finished), root=0)
        pending = [t for t in trials if t.key not in done_keys]
        parallel = min(opts.parallel or size, max(1, len(pending)))
        shown = space.varied
        kind = ("grid" if opts.search == "grid" else "random search" if opts.mode !=
                "random-search" else "private random search")
        drop = (f"; {dropped} invalid combination(s) left out, e.g. {reason}" if dropped
                else "")
        say(f"mpidp tune: {len(trials)} trial(s) ({kind} over {len(points)} valid point(s) of "
            f"{space.size}{drop}) on {opts.data}; {size} rank(s) in {parallel} group(s); "
            f"chosen on val accuracy ({info.rows['val']:,} val rows), never on test")
        if len(pending) < len(trials):
            say(f"mpidp tune: {len(trials) - len(pending)} trial(s) already done in "
                f"{opts.out}/{search.TRIALS_FILE}: skipped")
        if statement is not None:
            say(f"privacy of the tuning: {statement.text}")
        elif not opts.dp:
            say("non-private trials (--no-dp): no privacy to account")
        fixed = {k: v[0] for k, v in space.values.items() if len(v) == 1}
        if fixed:
            say(f"fixed for every trial: {space_mod.describe_point(fixed)}")
        records, stopped = [], False
        if pending:
            settings = search.Settings(data=opts.data, out=opts.out, base=opts.base,
                                       score_std=opts.score_std, seed=opts.seed,
                                       total=len(trials), shown=shown,
                                       unit=opts.privacy["privacy_unit"],
                                       objective=opts.objective, group_by=opts.group_by,
                                       min_group_size=opts.min_group_size)
            records, stopped = search.run_search(settings, info, pending, parallel, comm)
        if stopped:
            left = len(pending) - len(records) if rank == 0 else 0
            say(f"mpidp tune: stopped by a signal with {left} trial(s) not finished; the "
                f"finished ones are kept in {opts.out}/{search.TRIALS_FILE}: run the same "
                f"command again to continue (exit code {EXIT_CHECKPOINTED})")
            checkpoint.release_everywhere(lock, comm)
            return EXIT_CHECKPOINTED
        code = 0
        if rank == 0:
            code = _report(opts, space, info, trials, {**finished, **{r["key"]: r
                                                                        for r in records}},
                           statement, size, parallel, time.perf_counter() - started)
        checkpoint.release_everywhere(lock, comm)
        return int(comm.bcast(code, root=0))
    finally:
        if lock is not None:
            lock.release()


def publish(directory: str, chosen: dict, statement, opts: Options) -> bool:
    """Rank 0: the chosen trial's directory keeps one file, ``best.pt``, the
    model to publish, stating the epsilon including the tuning.

    From the trial's ``best.pt`` (or its checkpoint's last parameters, through
    :func:`engine.checkpoint.published`): ``epsilon`` and ``privacy`` become
    the tuning's statement (``includes_tuning``, the trial's own epsilon
    beside it), and ``selected["tuning"]`` names the trial, its settings and,
    where the statement covers it, the score that chose it (noised, or from
    a split declared public). The trial's ``checkpoint.pt`` is removed: it
    holds the seed, the exact val and test figures and the trial's epsilon
    alone, none of which the statement covers, and a finished trial has
    nothing to resume. Idempotent (a re-run of a finished search publishes
    the same file again). Returns False, writing nothing, when the trial left
    no model (a re-run chose a trial whose model an earlier run had already
    removed as not chosen).

    Raises:
        CheckpointError: the trial's files cannot be read.
        WriteFailed: ``best.pt`` cannot be written (the directory is unchanged).
    """
    from engine import checkpoint as ckpt

    best = ckpt.best_path_in(directory)
    if best.is_file():
        payload = ckpt.load_file(best)
    elif ckpt.exists_in(directory):
        payload = ckpt.published(ckpt.load_file(ckpt.path_in(directory)), None)
    else:
        return False
    payload = {k: v for k, v in payload.items() if k in ckpt.PUBLISHED_KEYS}
    privacy = dict(payload.get("privacy") or {})
    if statement is not None:
        privacy.update(epsilon=statement.epsilon, delta=statement.delta, includes_tuning=True,
                       trial_epsilon=chosen.get("epsilon"), tuning=statement.text,
                       tuning_mode=statement.mode)
    payload["privacy"] = privacy
    payload["epsilon"] = privacy.get("epsilon")
    tuning = {"trial": chosen["trial"], "settings": chosen["settings"]}
    worst = {k: chosen[k] for k in ("val_worst_group_accuracy", "val_worst_group", "group_by")
             if chosen.get(k) is not None}
    if chosen.get("val_noise_std") is not None:  # the noisy score the statement covers
        tuning.update(val_accuracy=chosen["val_accuracy"],
                      val_noise_std=chosen["val_noise_std"], val_split="val, noised", **worst)
    elif opts.public_split:  # exact, from a split the user declared public
        tuning.update(val_accuracy=chosen["val_accuracy"], val_noise_std=None,
                      val_split=f"{opts.public_split}, declared public", **worst)
    selected = {k: v for k, v in (payload.get("selected") or {}).items()
                if k in ckpt.PUBLISHED_SELECTION}
    payload["selected"] = {**selected, "tuning": tuning}
    ckpt.save(directory, payload, ckpt.BEST_NAME)
    ckpt.path_in(directory).unlink(missing_ok=True)
    return True


def _report(opts: Options, space, info, trials, results: dict, statement, size: int,
            parallel: int, elapsed: float) -> int:
    """Rank 0: the table, tune.json, the chosen settings; prunes the other trials'
    checkpoints. Returns the exit code."""
    from engine import outputs
    from engine.tune import report, search

    records = sorted((results[t.key] for t in trials if t.key in results),
                     key=lambda r: r["trial"])
    tuned = statement.epsilon if statement is not None else None
    for r in records:
        r["epsilon_incl_tuning"] = tuned if r.get("epsilon") is not None else None
    chosen = report.choose(records, report.SCORES[opts.objective])
    by_number = {t.number: t for t in trials}
    command, checkpoint_dir = None, None
    if chosen is not None:
        settings = space_mod.from_plain(chosen["settings"])
        command = report.train_command(opts.data, settings, opts.privacy, size)
        checkpoint_dir = by_number[chosen["trial"]].directory(opts.out)
    # Only the chosen trial's model is kept: the others are not covered by the
    # tuning's privacy statement, and nothing else reads them.
    for trial in trials:
        if chosen is None or trial.number != chosen["trial"]:
            shutil.rmtree(trial.directory(opts.out), ignore_errors=True)
    kept = chosen is not None and publish(checkpoint_dir, chosen, statement, opts)
    document = {
        "format": FORMAT, "version": VERSION, "data": opts.data, "ranks": size,
        "parallel": parallel, "space": space.to_json(), "search": opts.search,
        "trials_planned": len(trials), "selection": (
            ("val accuracy" if opts.objective == "val_accuracy" else
             f"the accuracy of the worst {opts.group_by} group of at least "
             f"{opts.min_group_size} val rows")
            + ("" if opts.score_std is None else
                              f" with Gaussian noise of std {opts.score_std:g} on the count"
                              + (" (households' shares)" if opts.privacy["privacy_unit"]
                                 == "household" else ""))),
        "privacy": None if statement is None else statement.to_json(),
        "trials": records,
        "chosen": None if chosen is None else {
            **chosen, "checkpoint": checkpoint_dir, "train_command": command,
            "model": os.path.join(checkpoint_dir, "best.pt") if kept else None,
            "test_accuracy_note": "the test accuracy of the chosen trial, as mpidp train "
            "reports it; never used for the choice"},
        "elapsed_s": elapsed,
    }
    outputs.write_json(Path(opts.out) / search.REPORT_FILE, document, "--out")
    if not trials:
        print("the number of trials drawn (K ~ Poisson) is 0: nothing was trained, nothing "
              f"chosen, no privacy spent; report: {opts.out}/{search.REPORT_FILE}", flush=True)
        return 0
    print("")
    for line in report.table(records, space.varied, chosen, tuned,
                             worst=opts.objective != "val_accuracy"):
        print(line)
    for r in records:
        if r["status"] == "failed":
            print(f"  trial {r['trial']} failed: {r['message']}")
    if chosen is None:
        print(f"mpidp: error: no trial finished ({len(records)} failed); the report is in "
              f"{opts.out}/{search.REPORT_FILE}", file=sys.stderr, flush=True)
        return EXIT_DIVERGED
    eps = chosen.get("epsilon")
    worst = (f", worst {opts.group_by} group {chosen['val_worst_group']} "
             f"{chosen['val_worst_group_accuracy']:.4f}"
             if opts.objective != "val_accuracy" else "")
    print(f"\nchosen: trial {chosen['trial']}, val accuracy {chosen['val_accuracy']:.4f}"
          + worst
          + (f", epsilon {eps:.3f} per trial, {tuned:.3f} incl. tuning "
             f"(delta {opts.privacy['delta']:g})" if eps is not None and tuned is not None
             else "")
          + (f"; model: {os.path.join(checkpoint_dir, 'best.pt')}"
             + (" (it states the epsilon incl. tuning)" if tuned is not None else "")
             if kept else "; its model is no longer kept (an earlier run of this search "
             "chose another trial and removed it): train it again with the command below"))
    print(f"train it again with:\n  {command}")
    if opts.dp:
        print("(training again spends that run's epsilon on top of the tuning's: the settings "
              "were chosen on private data; the chosen trial's model needs no retraining)")
    print(f"report: {opts.out}/{search.REPORT_FILE}", flush=True)
    return 0
