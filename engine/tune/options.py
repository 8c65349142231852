"""``mpidp tune``'s options, checked on every rank alike, and against the space
and the file.

:class:`Options` is the command line checked (the tuning privacy mode, the
search, the selection); :func:`check_space` (with :func:`check_hidden`),
:func:`check_file` and :func:`check_values` refuse what can never work, one
line each (exit 2), before anything runs; :func:`valid_points` keeps the
points ``mpidp train`` accepts, and :func:`without_unused_hidden` merges
those that differ only in a ``hidden`` their model ignores;
:func:`privacy_plans` computes each privacy setting's (q, sigma, steps) as
the trainer will plan it, the calibrations shared out over the ranks.
"""
from __future__ import annotations

import argparse
import os

from engine.config import TrainConfig
from engine.dp.accountant import DEFAULT_KIND
from engine.errors import ConfigError, DataError, GroupError, PrivacyError, agree
from engine.groups import MIN_GROUP_SIZE
from engine.run.report import HIDDEN_MODELS, hidden_unused
from engine.run.selection import check_scorable, groups_kept, val_group_sizes
from engine.tune import space as space_mod

MODES = ("random-search", "public")
DEFAULT_SCORE_NOISE = 20.0
DEFAULT_MEAN_TRIALS = 10


def fail(message: str, cls=ConfigError):
    raise cls(message, collective=True)


class Options:
    """The command line, checked (all ranks alike)."""

    def __init__(self, args: argparse.Namespace, size: int) -> None:
        self.data = args.data
        self.dp = args.dp
        self.out = args.out
        self.seed = args.seed
        if args.trials is not None and args.trials < 1:
            fail(f"--trials {args.trials} must be at least 1")
        if args.parallel is not None and args.parallel < 1:
            fail(f"--parallel {args.parallel} must be at least 1")
        if args.parallel is not None and args.parallel > size:
            fail(f"--parallel {args.parallel} needs at least {args.parallel} ranks (this job "
                  f"has {size}): run with mpiexec -n {args.parallel} or more")
        if not self.dp:
            for flag, value in (("--tuning-privacy", args.tuning_privacy),
                                ("--public-split", args.public_split),
                                ("--trials-distribution", args.trials_distribution),
                                ("--eta", args.eta), ("--score-noise", args.score_noise),
                                ("--target-epsilon", args.target_epsilon),
                                ("--noise-multiplier", args.noise_multiplier),
                                ("--delta", args.delta), ("--accountant", args.accountant)):
                if value is not None:
                    fail(f"{flag} is about DP trials: drop it with --no-dp")
            self.mode = None
        else:
            self.mode = args.tuning_privacy or "random-search"
        if self.mode == "public" and not args.public_split:
            fail("--tuning-privacy public needs --public-split NAME: the split you declare "
                  "public (val)")
        random_search = self.mode == "random-search"
        if not random_search:
            for flag, value in (("--trials-distribution", args.trials_distribution),
                                ("--eta", args.eta)):
                if value is not None:
                    fail(f"{flag} is for --tuning-privacy random-search")
        self.distribution = args.trials_distribution or "negative-binomial"
        if args.eta is not None and self.distribution == "poisson":
            fail("--eta is the shape of the negative binomial: drop it with "
                  "--trials-distribution poisson")
        self.eta = 1.0 if args.eta is None else float(args.eta)
        if not self.eta >= 0:
            fail(f"--eta {args.eta} must be >= 0 (0 logarithmic, 1 geometric)")
        self.public_split = args.public_split
        if args.score_noise is not None and (not random_search or args.public_split):
            fail("--score-noise is for a private random search with a private val split "
                  "(drop it: the scores are exact here)")
        if args.score_noise is not None and not args.score_noise > 0:
            fail(f"--score-noise {args.score_noise} must be positive")
        self.score_std = None
        if random_search and not args.public_split:
            self.score_std = DEFAULT_SCORE_NOISE if args.score_noise is None \
                else float(args.score_noise)
        if random_search:
            if args.search == "grid":
                fail("a private random search draws its trials at random (Papernot & "
                      "Steinke): drop --search grid, or use --tuning-privacy public or --no-dp")
            self.search = "random"
            self.trials = args.trials or DEFAULT_MEAN_TRIALS
        else:
            if args.search == "grid" and args.trials is not None:
                fail("--trials is for --search random (a grid runs every valid point)")
            if args.search == "random" and args.trials is None:
                fail("--search random needs --trials N (the points to draw)")
            self.search = args.search or ("random" if args.trials is not None else "grid")
            self.trials = args.trials
        self.objective = args.select_on
        self.group_by = args.group_by.upper() if args.group_by else None
        self.min_group_size = (MIN_GROUP_SIZE if args.min_group_size is None
                               else args.min_group_size)
        worst = self.objective == "worst_group_val_accuracy"
        if self.group_by and not worst:
            fail(f"--group-by {args.group_by} chooses the groups of --select-on "
                  "worst_group_val_accuracy: add it, or leave --group-by out")
        if args.min_group_size is not None and not worst:
            fail(f"--min-group-size {self.min_group_size} sizes the groups of --select-on "
                  "worst_group_val_accuracy: add it, or leave --min-group-size out")
        if self.min_group_size < 1:
            fail(f"--min-group-size {self.min_group_size}: give at least 1 (default 100)")
        if worst and self.score_std is not None and args.privacy_unit == "household":
            fail("--select-on worst_group_val_accuracy with --privacy-unit household in a "
                  "private random search: a household may span groups, and the noise of the "
                  "per-group counts is calibrated to one person; use --privacy-unit person, "
                  "or --tuning-privacy public with --public-split val")
        self.parallel = args.parallel
        self.privacy = {"dp": self.dp, "target_epsilon": args.target_epsilon,
                        "noise_multiplier": args.noise_multiplier,
                        "delta": TrainConfig.delta if args.delta is None else args.delta,
                        "accountant": args.accountant or DEFAULT_KIND,
                        "privacy_unit": args.privacy_unit}
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


def check_space(space, opts: Options) -> None:
    if not opts.dp:
        for key in ("max_grad_norm", "noise_multiplier"):
            if key in space.values:
                fail(f"--space {key}: not used by --no-dp trials (no clipping, no noise)")
    if "noise_multiplier" in space.values and opts.privacy.get("target_epsilon") is not None:
        fail("--space noise_multiplier with --target-epsilon: each trial's sigma comes from "
              "one of them; drop one")
    if "noise_multiplier" in space.values and opts.privacy.get("noise_multiplier") is not None:
        fail("noise_multiplier is both in --space and given as --noise-multiplier; give it once")
    if opts.dp and "noise_multiplier" not in space.values \
            and opts.privacy.get("target_epsilon") is None \
            and opts.privacy.get("noise_multiplier") is None:
        fail("give --target-epsilon EPS or --noise-multiplier SIGMA (or noise_multiplier in "
              "the space), or --no-dp for non-private trials")
    check_hidden(space)


def check_file(info, opts: Options) -> None:
    if not info.has_val or info.rows.get("val", 0) == 0:
        fail(f"{opts.data} has no val split (or an empty one): a search is chosen on val "
              "only; prepare the file with `mpidp prep --val-fraction 0.1`", DataError)
    if opts.public_split is not None:
        if opts.public_split in ("train", "test"):
            fail(f"--public-split {opts.public_split}: the {opts.public_split} split is not "
                  "scored for the choice (training on train, the final estimate on test); "
                  "the scored split is val")
        if opts.public_split not in info.splits:
            fail(f"--public-split {opts.public_split}: {opts.data} has no such split (it has "
                  f"{', '.join(info.splits)})")
    if opts.privacy["privacy_unit"] == "household" and info.is_image:  # as mpidp train
        fail(f"{opts.data} holds images, which have no households: tune with "
             "--privacy-unit person (each image its own unit)", DataError)
    if opts.privacy["privacy_unit"] == "household" and not info.households:
        fail(f"{opts.data} has no household keys; --privacy-unit household needs a file "
              "prepared by this mpidp", DataError)
    if opts.objective == "worst_group_val_accuracy":
        opts.group_by = opts.group_by or info.group or "RAC1P"
        if opts.group_by not in info.groups:
            fail(f"--select-on worst_group_val_accuracy --group-by {opts.group_by}: "
                  f"{opts.data} {groups_kept(info)}", GroupError)
        try:  # as mpidp train refuses it: before any trial spends privacy
            check_scorable(val_group_sizes(info, opts.group_by), opts.group_by,
                           opts.min_group_size)
        except GroupError as exc:
            fail(str(exc), GroupError)


def training_units(info, unit: str, comm) -> int:
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


def check_values(space, info, units: int, opts: Options) -> None:
    """Values that can never work on this file: one line each, exit 2.

    A batch larger than the training set, and each ``model`` value refused
    as ``mpidp train --model`` refuses it on this file (:func:`check_model`).
    """
    what = "rows" if opts.privacy["privacy_unit"] == "person" else "households"
    for batch in space.values.get("batch_size", ()):
        if batch > units:
            fail(f"--space batch_size={batch}: exceeds the {units} training {what} of "
                  f"{opts.data}")
    default = TrainConfig(data="").batch_size
    if "batch_size" not in space.values and default > units:
        fail(f"batch_size {default} (the default) exceeds the {units} training {what} of "
              f"{opts.data}: give batch_size in the space")
    for model in space.values.get("model", ("mlp",)):
        try:
            check_model(model, info, opts.data)
        except ConfigError as exc:
            fail(f"--space model={model}: {exc}")


def check_model(name: str, info, path: str) -> None:
    """Refuse ``name`` where ``mpidp train --model name`` would refuse the file:
    :func:`engine.models.resolve` itself, run on torch's meta device (the
    model's layers are built without memory or arithmetic). A
    ``MODULE:FACTORY`` is the user's code: it is imported when its trial runs.

    Raises:
        ConfigError: (collective) an image model on tabular rows or on images
            too small for it, ``embedding-mlp`` on images or on a one-hot
            file, ``mlp``/``logreg`` on a file of integer codes.
    """
    import torch  # deferred: the options above are checked without it

    from engine.models import resolve
    from engine.nn.model_names import BUILTIN

    if name not in BUILTIN:
        return
    meta = torch.device("meta")
    with meta:
        resolve(name, TrainConfig(data="").hidden, info.n_features, info.n_classes, 0, meta,
                code_columns=info.code_columns, path=path, image_shape=info.image_shape)


def check_hidden(space) -> None:
    """Refuse ``hidden`` in a space none of whose models it shapes (one line):
    every trial would train the same model, and spend privacy on it again.

    Raises:
        ConfigError: (collective) ``hidden`` with only ``logreg``, image
            models or ``MODULE:FACTORY`` models.
    """
    if "hidden" not in space.values:
        return
    models = space.values.get("model", ("mlp",))
    if any(hidden_unused(m) is None for m in models):
        return
    values = "|".join(space_mod.format_value(v) for v in space.values["hidden"])
    fail(f"--space hidden={values}: model={models[0]} {hidden_unused(models[0])}"
         + (" (as every model of the space)" if len(models) > 1 else "")
         + f"; hidden sets the layers of {' and '.join(HIDDEN_MODELS)} only: drop hidden "
         "from the space, or add one of them to model")


def without_unused_hidden(points: list[dict]) -> tuple[list[dict], int]:
    """``points`` with ``hidden`` dropped where the point's model ignores it
    (:func:`engine.run.report.hidden_unused`), each resulting point once, in
    order; and the count of points merged away. No two trials then train the
    same settings, and no command printed for such a model names --hidden."""
    out, seen = [], set()
    for point in points:
        if "hidden" in point and hidden_unused(point.get("model", "mlp")):
            point = {k: v for k, v in point.items() if k != "hidden"}
        key = space_mod.settings_key(0, point)
        if key not in seen:
            seen.add(key)
            out.append(point)
    return out, len(points) - len(out)


def valid_points(space, opts: Options) -> tuple[list[dict], int, str | None]:
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


def privacy_key(point: dict, opts: Options) -> tuple:
    d = TrainConfig(data="")
    return (int(point.get("batch_size", d.batch_size)), int(point.get("epochs", d.epochs)),
            point.get("noise_multiplier", opts.privacy.get("noise_multiplier")))


def privacy_plans(keys: list[tuple], units: int, opts: Options, comm) -> dict:
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
        fail(errors[0], PrivacyError)
    return {key: plan for key, plan, _ in found}
