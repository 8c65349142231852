"""The settings of a training run: one dataclass, filled from the command line.

:class:`TrainConfig` holds every option of ``mpidp train``;
:func:`add_arguments` defines them (with the help text users see) and
:func:`from_args` builds and validates the config. A resumed run takes every
setting from its checkpoint (docs/lifecycle.md): the fields in
:data:`ADJUSTABLE_ON_RESUME` may be given again with a new value, those in
:data:`PER_INVOCATION` belong to one invocation, and every other field (the
data, model, sampling and privacy parameters: :data:`FIXED_ON_RESUME` and
any field added later) must not differ.
"""
from __future__ import annotations

import argparse
import math
import numbers
import types
import typing
from dataclasses import asdict, dataclass, field

import numpy as np

import collectives
from engine.checkpoint_lock import RESUME_NEEDS_DIRECTORY
from engine.choices import KERNEL_BACKENDS, NOISE_SCHEMES as SCHEMES, OPTIMIZERS as NAMES, \
    SAMPLINGS, parse_hidden, seed_value, thread_count
from engine.dp.accountant import DEFAULT_KIND, KINDS
from engine.errors import ConfigError
from engine.groups import MIN_GROUP_SIZE
from engine.nn import model_names
from engine.nn.schedule import SCHEDULES

#: Options a resume must repeat unchanged (they define the run and its privacy).
FIXED_ON_RESUME = ("batch_size", "lr", "optimizer", "momentum", "max_grad_norm",
                   "noise_multiplier", "target_epsilon", "delta", "dp", "accountant",
                   "sampling", "noise_scheme", "model", "hidden", "seed", "device",
                   "weight_decay", "lr_schedule", "privacy_unit", "secure_noise",
                   "select_on", "nesterov", "lr_warmup_epochs", "lr_milestones", "lr_decay",
                   "group_by", "min_group_size")
#: What the run's final model is (``--select-on``): the parameters of the epoch
#: with the best validation accuracy, or with the best accuracy of its worst
#: validation group (``--group-by``), or those of the last epoch.
SELECT_ON = ("val_accuracy", "worst_group_val_accuracy", "last")
#: Whose privacy epsilon is about (``--privacy-unit``), the default first.
PRIVACY_UNITS = ("person", "household")
#: Options a resume may change (given again, they replace the recorded value).
ADJUSTABLE_ON_RESUME = ("epochs", "checkpoint_every", "metrics", "eval_every",
                        "target_accuracy", "time_budget", "allreduce", "threads", "kernels",
                        "progress", "cuda_graph")
#: ``--cuda-graph``: capture the step as one CUDA graph where it can be
#: (``auto``), always (``on``: an error where it cannot), never (``off``).
CUDA_GRAPH = ("auto", "on", "off")
#: Options of one invocation, never taken from a checkpoint.
PER_INVOCATION = ("data", "checkpoint_dir", "resume", "stop_after")


@dataclass
class TrainConfig:
    data: str
    epochs: int = 10
    batch_size: int = 256
    lr: float = 0.05
    optimizer: str = "sgd"
    momentum: float = 0.9
    weight_decay: float = 0.0
    lr_schedule: str = "constant"
    nesterov: bool = False
    lr_warmup_epochs: float = 0.0
    lr_milestones: tuple[int, ...] = ()
    lr_decay: float = 0.1
    max_grad_norm: float = 1.0
    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    delta: float = 1e-5
    allow_large_delta: bool = False
    dp: bool = True
    accountant: str = DEFAULT_KIND
    privacy_unit: str = "person"
    sampling: str = "poisson"
    noise_scheme: str = "partition"
    secure_noise: bool = False
    allreduce: str = "auto"
    model: str = "mlp"
    hidden: tuple[int, ...] = field(default=(128, 128))
    seed: int | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 1
    resume: bool = False
    stop_after: int | None = None
    metrics: str | None = None
    eval_every: int = 1
    select_on: str | None = None  # None: val_accuracy when the file has /val, else last
    group_by: str | None = None  # worst_group_val_accuracy's attribute (None: the file's group)
    min_group_size: int = 100  # the smallest validation group worst_group_val_accuracy counts
    target_accuracy: float | None = None
    time_budget: float | None = None
    threads: int | None = None
    device: str = "cpu"
    kernels: str | None = None
    cuda_graph: str = "auto"
    progress: bool | None = None

    def to_dict(self) -> dict:
        data = asdict(self)
        data["hidden"] = list(self.hidden)
        return data

    def validate(self) -> None:
        """Raise :class:`ConfigError` (collective) for impossible settings."""
        def fail(message: str):
            raise ConfigError(message, collective=True)

        if self.epochs < 1:
            fail(f"--epochs {self.epochs} must be at least 1")
        if self.seed is not None and self.seed < 0:
            fail(f"--seed {self.seed} must be a whole number >= 0")
        if self.threads is not None and self.threads < 1:
            fail(f"--threads {self.threads} must be at least 1 (None: mpidp's own count)")
        if self.allreduce not in collectives.names():
            fail(f"--allreduce {self.allreduce!r}: choose from {', '.join(collectives.names())}")
        for option, value, allowed in (("--optimizer", self.optimizer, NAMES),
                                       ("--lr-schedule", self.lr_schedule, SCHEDULES),
                                       ("--noise-scheme", self.noise_scheme, SCHEMES),
                                       ("--sampling", self.sampling, SAMPLINGS)):
            if value not in allowed:  # engine.train's keywords: argparse checks the command's
                fail(f"{option} {value!r}: choose {', '.join(allowed)}")
        if self.batch_size < 1:
            fail(f"--batch-size {self.batch_size} must be at least 1")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            fail(f"--lr {self.lr} must be a positive number")
        if not 0 <= self.momentum < 1:
            fail(f"--momentum {self.momentum} must be in [0, 1)")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            fail(f"--weight-decay {self.weight_decay} must be a number >= 0")
        if self.nesterov and (self.optimizer != "sgd" or not self.momentum):
            fail("--nesterov is a form of SGD momentum: it needs --optimizer sgd and "
                 "--momentum above 0")
        if self.lr_schedule != "step" and (self.lr_warmup_epochs or self.lr_milestones):
            fail("--lr-warmup-epochs and --lr-milestones shape --lr-schedule step; add it")
        if not (self.lr_warmup_epochs >= 0 and math.isfinite(self.lr_warmup_epochs)):
            fail(f"--lr-warmup-epochs {self.lr_warmup_epochs} must be a number >= 0")
        if any(m < 1 for m in self.lr_milestones) or \
                list(self.lr_milestones) != sorted(set(self.lr_milestones)):
            fail(f"--lr-milestones {','.join(map(str, self.lr_milestones))}: epochs "
                 "counted from 0, each at least 1, increasing")
        if not 0 < self.lr_decay <= 1:
            fail(f"--lr-decay {self.lr_decay} must be in (0, 1]")
        if self.target_accuracy is not None and not 0 < self.target_accuracy <= 1:
            fail(f"--target-accuracy {self.target_accuracy} must be in (0, 1]")
        if self.time_budget is not None and not self.time_budget > 0:
            fail(f"--time-budget {self.time_budget} must be a positive number of seconds")
        if self.select_on is not None and self.select_on not in SELECT_ON:
            fail(f"--select-on {self.select_on!r}: choose {', '.join(SELECT_ON)}")
        if self.group_by is not None and self.select_on != "worst_group_val_accuracy":
            fail(f"--group-by {self.group_by} chooses the groups of --select-on "
                 "worst_group_val_accuracy: add it, or leave --group-by out")
        if self.min_group_size < 1:
            fail(f"--min-group-size {self.min_group_size}: give at least 1 (default 100)")
        if self.checkpoint_every < 1 or self.eval_every < 1:
            fail("--checkpoint-every and --eval-every must be at least 1")
        if self.stop_after is not None and self.stop_after < 1:
            fail(f"--stop-after {self.stop_after} must be at least 1")
        try:
            if self.model != "python":  # the library's model= object
                model_names.check_name(self.model)
        except ConfigError as exc:
            fail(str(exc))
        if any(width < 1 for width in self.hidden):
            fail(f"--hidden {','.join(map(str, self.hidden))}: widths must be positive")
        if self.device not in ("cpu", "cuda"):
            fail(f"--device {self.device!r}: choose cpu or cuda")
        if self.kernels is not None and self.kernels not in KERNEL_BACKENDS:
            fail(f"--kernels {self.kernels!r}: choose {', '.join(KERNEL_BACKENDS)}")
        if self.cuda_graph not in CUDA_GRAPH:
            fail(f"--cuda-graph {self.cuda_graph!r}: choose {', '.join(CUDA_GRAPH)}")
        if self.cuda_graph == "on" and self.device != "cuda":
            fail("--cuda-graph on needs --device cuda: a CUDA graph replays a GPU's kernels "
                 "(auto, the default, uses one where it can)")
        if self.kernels == "cupy" and self.device != "cuda":
            fail("--kernels cupy runs on GPUs only: add --device cuda (or use --kernels "
                 "numba or torch)")
        if self.privacy_unit not in PRIVACY_UNITS:
            fail(f"--privacy-unit {self.privacy_unit!r}: choose person or household")
        if self.privacy_unit == "household" and self.sampling != "poisson":
            fail("--privacy-unit household samples households by Poisson sampling; drop "
                 "--sampling shuffle")
        if self.resume and not self.checkpoint_dir:
            fail(RESUME_NEEDS_DIRECTORY)
        if self.stop_after is not None and not self.checkpoint_dir:
            fail("--stop-after needs --checkpoint-dir (to continue later with --resume)")
        if not self.dp:
            if self.noise_multiplier is not None or self.target_epsilon is not None:
                fail("--no-dp trains without privacy: drop --noise-multiplier and "
                     "--target-epsilon")
            return
        if not (self.max_grad_norm > 0 and math.isfinite(self.max_grad_norm)):
            fail(f"--max-grad-norm {self.max_grad_norm} must be a positive number")
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            fail("give exactly one of --noise-multiplier SIGMA and --target-epsilon EPS "
                 "(or --no-dp for a non-private run)")
        if self.noise_multiplier is not None and not (
                self.noise_multiplier > 0 and math.isfinite(self.noise_multiplier)):
            fail(f"--noise-multiplier {self.noise_multiplier} must be a finite positive "
                 "number (use --no-dp for a non-private run)")
        if self.target_epsilon is not None and not self.target_epsilon > 0:
            fail(f"--target-epsilon {self.target_epsilon} must be positive")
        if not 0 < self.delta < 1:
            fail(f"--delta {self.delta} must be in (0, 1)")
        if self.accountant not in KINDS:
            fail(f"--accountant {self.accountant!r} is not an accountant; choose "
                 f"{' or '.join(KINDS)} (default {DEFAULT_KIND})")
        if self.allow_large_delta and not self.dp:
            fail("--allow-large-delta is about DP's delta: drop it with --no-dp")


def api_options(options: dict) -> dict:
    """``engine.train``'s keyword options, checked against :class:`TrainConfig`'s
    field types: returns them with integral numbers as ``int``, numbers as
    ``float``, sequences as tuples, and ``hidden`` given as text
    (``"128,128"``, as ``--hidden`` takes it) parsed.

    Raises:
        ConfigError (collective): an option of the wrong type (``epochs="two"``,
            ``hidden=[1.5]``, ``dp="no"``), named with what it takes.
    """
    hints = typing.get_type_hints(TrainConfig)
    checked = dict(options)
    for name, value in options.items():
        if name not in hints:
            continue  # the caller names unknown options
        if name == "hidden" and isinstance(value, str):
            checked[name] = parse_hidden(value)
            continue
        kinds = _kinds(hints[name])
        if value is None and type(None) in kinds:
            continue
        converted = _as_kind(value, kinds[0])
        if converted is _WRONG:
            what = " or ".join(_KIND_NAMES.get(k, "a sequence of integers") for k in kinds)
            raise ConfigError(f"engine.train(): {name}={value!r} ({type(value).__name__}); "
                              f"{name} takes {what}", collective=True)
        checked[name] = converted
    return checked


def _kinds(hint) -> tuple:
    """The types a field's annotation allows (``float | None`` -> float, None)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


#: How a message names a type an option takes.
_KIND_NAMES = {int: "an integer", float: "a number", bool: "True or False", str: "a string",
               type(None): "None"}
#: :func:`_as_kind`'s answer for a value of another type.
_WRONG = object()


def _as_kind(value, kind):
    """``value`` as ``kind`` (int, float, bool, str or ``tuple[int, ...]``)
    where it is one (any integral number for an int, any real for a float,
    numpy's scalars included, a sequence of integers for a tuple), else
    ``_WRONG``. A bool is not a number here, nor a number a bool."""
    if kind is bool:
        return bool(value) if isinstance(value, (bool, np.bool_)) else _WRONG
    if kind in (int, float):
        wanted = numbers.Integral if kind is int else numbers.Real
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, wanted):
            return _WRONG
        return kind(value)
    if kind is str:
        return value if isinstance(value, str) else _WRONG
    if typing.get_origin(kind) is tuple:
        if isinstance(value, (str, bytes)) or not isinstance(value, typing.Iterable):
            return _WRONG
        items = tuple(_as_kind(v, int) for v in value)
        return _WRONG if any(v is _WRONG for v in items) else items
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``mpidp train``."""
    d = TrainConfig(data="")
    data = parser.add_argument_group("data and model")
    data.add_argument("--data", required=True, help="prepared HDF5 file (mpidp prep)")
    data.add_argument("--model", default=d.model,
                      metavar="mlp|logreg|embedding-mlp|mnist-small|mnist-large|resnet20|"
                      "MODULE:FACTORY",
                      help="mlp (fused kernels, widths from --hidden), logreg (no hidden "
                      "layer), embedding-mlp (for files prepared with --encoding codes: "
                      "8 learned numbers per category of each categorical feature, then an "
                      "MLP of the --hidden widths; clipped per layer); for image files "
                      "(prep --format mnist|cifar10): mnist-small (conv 32, pool, conv 64, "
                      "pool, linear 120: 0.40 M parameters on MNIST), mnist-large (conv 32, "
                      "conv 64, pool, linear 206: 2.6 M) or resnet20 (the ResNet-20 of "
                      "mlbench 1a, 0.27 M, with GroupNorm in place of BatchNorm: BatchNorm "
                      "normalises by the whole batch's statistics, so one example's "
                      "gradient depends on the others and clipping no longer bounds its "
                      "influence); or MODULE:FACTORY: "
                      "your function (n_features, n_classes) -> "
                      "torch.nn.Module in an importable module, called on every rank after "
                      "seeding torch with the run's seed; it is clipped per layer "
                      "(torch.func where a layer has no rule) (default: mlp)")
    data.add_argument("--hidden", default="128,128",
                      help="hidden layer widths of --model mlp and embedding-mlp, "
                      "comma-separated; empty ('') "
                      "for logistic regression (default: 128,128)")
    train = parser.add_argument_group("optimisation")
    train.add_argument("--epochs", type=int, default=d.epochs,
                       help=f"passes over the training set (default: {d.epochs})")
    train.add_argument("--batch-size", type=int, default=d.batch_size,
                       help="expected global batch size B, in privacy units (rows, or "
                       "households with --privacy-unit household); Poisson rate q = B/N "
                       f"for N units (default: {d.batch_size})")
    train.add_argument("--lr", type=float, default=d.lr,
                       help=f"learning rate (default: {d.lr})")
    train.add_argument("--optimizer", choices=NAMES, default=d.optimizer,
                       help=f"update rule (default: {d.optimizer})")
    train.add_argument("--momentum", type=float, default=d.momentum,
                       help=f"SGD momentum (default: {d.momentum})")
    train.add_argument("--weight-decay", type=float, default=d.weight_decay, metavar="L2",
                       help="L2 regularisation: adds L2 * parameters to the gradient, i.e. "
                       "minimises loss + L2/2 |w|^2 (torch's weight_decay; no privacy cost) "
                       "(default: 0)")
    train.add_argument("--lr-schedule", choices=SCHEDULES, default=d.lr_schedule,
                       help="constant; inv-sqrt: lr / sqrt(t) at update t = 1, 2, ... "
                       "(mlbench task 2a); or step: a linear warm-up over "
                       "--lr-warmup-epochs from lr / ranks to lr, then lr times --lr-decay "
                       "at each of --lr-milestones (mlbench task 1a) (default: constant)")
    train.add_argument("--lr-warmup-epochs", type=float, default=d.lr_warmup_epochs,
                       metavar="E", help="--lr-schedule step: epochs of linear warm-up "
                       "(default: 0)")
    train.add_argument("--lr-milestones", type=int_list, default=d.lr_milestones,
                       metavar="E,E", help="--lr-schedule step: epochs (from 0) at whose "
                       "start the rate is multiplied by --lr-decay, e.g. 82,109")
    train.add_argument("--lr-decay", type=float, default=d.lr_decay,
                       help=f"--lr-schedule step: factor at each milestone (default: "
                       f"{d.lr_decay})")
    train.add_argument("--nesterov", action="store_true",
                       help="Nesterov momentum (SGD): p -= lr (g + momentum v)")
    train.add_argument("--sampling", choices=SAMPLINGS, default=d.sampling,
                       help="poisson (what the accountant assumes) or shuffle (fixed-size "
                       "batches: epsilon is then NOT a guarantee) (default: poisson)")
    privacy = parser.add_argument_group("privacy")
    privacy.add_argument("--max-grad-norm", type=float, default=d.max_grad_norm,
                         help=f"per-example clipping bound C (default: {d.max_grad_norm})")
    sigma = privacy.add_mutually_exclusive_group()
    sigma.add_argument("--noise-multiplier", type=float, default=None,
                       help="noise std / C (sigma)")
    sigma.add_argument("--target-epsilon", type=float, default=None,
                       help="calibrate sigma so the planned epochs spend this epsilon")
    privacy.add_argument("--delta", type=float, default=d.delta,
                         help=f"delta of the (epsilon, delta) guarantee (default: {d.delta})")
    privacy.add_argument("--allow-large-delta", action="store_true",
                         help="experts: accept a --delta above 1/N (N training rows), which "
                         "permits releasing a row in the clear; said in the run's first line")
    privacy.add_argument("--accountant", default=d.accountant, metavar="{pld,rdp}",
                         help="pld: privacy loss distributions, a tight upper bound on "
                         "epsilon; rdp: Renyi DP, looser (up to twice pld's epsilon), "
                         "for comparison with older runs (default: pld)")
    privacy.add_argument("--privacy-unit", default=d.privacy_unit,
                         metavar="{person,household}",
                         help="whom epsilon protects. person: any one row (one person); a "
                         "household of k persons is then protected only at about k times "
                         "epsilon. household: all the rows of any one household at once "
                         "(households are sampled, and each one's summed gradient is "
                         "clipped to C; --batch-size counts households); choose it when "
                         "the persons of a household share what the model must not reveal "
                         "(home, income, answers), as in PUMS person files "
                         "(default: person)")
    privacy.add_argument("--no-dp", dest="dp", action="store_false",
                         help="the same loop without clipping and noise (non-private baseline)")
    privacy.add_argument("--noise-scheme", choices=SCHEMES, default=d.noise_scheme,
                         help="partition: each coordinate's noise drawn by one rank; split: "
                         "every rank adds 1/p of the variance (default: partition)")
    privacy.add_argument("--secure-noise", action="store_true",
                         help="for models you release: key the noise from the OS's CSPRNG "
                         "(never from --seed) and sum four half-deviation draws per "
                         "coordinate, closing the floating-point attacks on Gaussian "
                         "samplers as Opacus' secure_mode does; costs more noise draws, and "
                         "the run is not reproducible (docs/training.md)")
    system = parser.add_argument_group("system")
    system.add_argument("--allreduce", default=d.allreduce,
                        help="all-reduce algorithm from collectives (default: auto)")
    system.add_argument("--seed", type=seed_value, default=None,
                        help="seed of the model init, sampling and noise (default: random; "
                        "a known seed makes the noise reproducible: experiments only)")
    system.add_argument("--threads", type=thread_count, default=None,
                        help="torch/numba threads per rank (default: the cores the launcher "
                        "bound the rank to, else the node's cores // its ranks)")
    system.add_argument("--device", choices=("cpu", "cuda"), default=d.device,
                        help="cpu, or cuda: one GPU per rank, chosen by the rank's place on "
                        "its node; needs the GPU extra (docs/gpus.md) (default: cpu)")
    system.add_argument("--kernels", choices=KERNEL_BACKENDS, default=None,
                        help="kernel back-end: numba (CPU, or @cuda.jit on GPUs), cupy (CUDA C, "
                        "GPUs only) or torch (generic ops) (default: numba on the CPU, cupy "
                        "then numba on GPUs, whichever is installed)")
    system.add_argument("--cuda-graph", choices=CUDA_GRAPH, default=d.cuda_graph,
                        help="with --device cuda, run each step as one captured CUDA graph on "
                        "a batch of fixed shape: auto (where the model can be captured; the "
                        "run's first lines say which), on (an error where it cannot), off "
                        "(the eager step) (default: auto; docs/gpus.md)")
    out = parser.add_argument_group("checkpoints and metrics")
    out.add_argument("--checkpoint-dir", default=None,
                     help="the run's directory: an atomic checkpoint every --checkpoint-every "
                     "epochs and on SIGINT/SIGTERM/SIGUSR1, and a lock while the run uses it; "
                     "created if missing (its parent must exist)")
    out.add_argument("--checkpoint-every", type=int, default=1,
                     help="epochs between checkpoints (default: 1)")
    out.add_argument("--resume", action="store_true",
                     help="continue the run in --checkpoint-dir; needs only --data: every "
                     "other setting comes from the checkpoint (an error if it holds none)")
    out.add_argument("--stop-after", type=int, default=None, metavar="STEPS",
                     help="checkpoint and exit (code 75) after STEPS steps of this invocation")
    out.add_argument("--metrics", default=None,
                     help="per-epoch metrics as JSON lines, rewritten atomically with each "
                     "epoch and checkpoint (its directory must exist)")
    out.add_argument("--eval-every", type=int, default=1,
                     help="epochs between evaluations of the validation split (of the "
                     "test split for a file without one) (default: 1)")
    out.add_argument("--select-on", default=None, choices=SELECT_ON,
                     help="the run's final model: the parameters of the evaluated epoch "
                     "with the best validation accuracy (kept in memory, and in "
                     "--checkpoint-dir as best.pt), or those of the last epoch; the test "
                     "split is scored once, at the end, with that model. No privacy cost: "
                     "the validation rows are not training rows (default: val_accuracy "
                     "when the file has a validation split, else last). "
                     "worst_group_val_accuracy: the epoch whose worst --group-by group "
                     "(of at least --min-group-size validation rows) is most accurate")
    add_group_selection(out, "validation groups with fewer rows are not scored")
    stop = parser.add_argument_group(
        "stopping early (checked at epoch boundaries; the same decision on every rank)")
    stop.add_argument("--target-accuracy", type=float, default=None, metavar="A",
                      help="stop after the first evaluated epoch with validation accuracy "
                      ">= A (test accuracy for a file without a validation split) (time to "
                      "accuracy); --epochs is then the maximum")
    stop.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                      help="stop at the first epoch boundary where the training time (epoch "
                      "times: no evaluation, checkpoints or start-up) reaches SECONDS "
                      "(accuracy after time)")
    out.add_argument("--progress", dest="progress", action="store_true", default=None,
                     help="progress bar on rank 0 (default: when stderr is a terminal)")
    out.add_argument("--no-progress", dest="progress", action="store_false")


def check_group_size_given(given: set[str], select_on: str | None, resume: bool) -> None:
    """Refuse ``--min-group-size`` given (``given``: the options named) to a new
    run that does not select on ``worst_group_val_accuracy``, which alone reads
    it (it was accepted and ignored). A resume's recorded settings are not
    checked: an older run may hold such a value, which never had an effect.

    Raises:
        ConfigError: (collective) naming the option.
    """
    if "min_group_size" in given and not resume and select_on != "worst_group_val_accuracy":
        raise ConfigError("--min-group-size sizes the groups of --select-on "
                          "worst_group_val_accuracy: add it, or leave --min-group-size out",
                          collective=True)


def add_group_selection(group, too_small: str) -> None:
    """``--group-by`` and ``--min-group-size`` of ``--select-on
    worst_group_val_accuracy`` (``mpidp train`` and ``mpidp tune``); ``too_small``
    says what becomes of the groups under the size."""
    group.add_argument("--group-by", default=None, metavar="ATTR",
                       help="with --select-on worst_group_val_accuracy: a group attribute the "
                       "file keeps (SEX, RAC1P, AGEP, ST; default: the task's group, RAC1P)")
    group.add_argument("--min-group-size", type=int, default=None, metavar="N",  # None: not given
                       help=f"with --select-on worst_group_val_accuracy: {too_small} "
                       f"(default: {MIN_GROUP_SIZE})")


def int_list(text: str) -> tuple[int, ...]:
    """``"82,109"`` -> ``(82, 109)`` (argparse type; empty: none)."""
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of integers, e.g. "
                                         "82,109") from None


def from_args(args: argparse.Namespace, check: bool = True) -> TrainConfig:
    """Build the config from parsed arguments; validate it unless ``check`` is
    false (a resume validates after taking the recorded settings).

    Raises:
        ConfigError: impossible settings (collective: every rank parsed the same line).
    """
    cfg = TrainConfig(
        data=args.data, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
        optimizer=args.optimizer, momentum=args.momentum,
        weight_decay=args.weight_decay, lr_schedule=args.lr_schedule,
        nesterov=args.nesterov, lr_warmup_epochs=args.lr_warmup_epochs,
        lr_milestones=tuple(args.lr_milestones), lr_decay=args.lr_decay,
        target_accuracy=args.target_accuracy, time_budget=args.time_budget,
        max_grad_norm=args.max_grad_norm,
        noise_multiplier=args.noise_multiplier, target_epsilon=args.target_epsilon,
        delta=args.delta, allow_large_delta=args.allow_large_delta, dp=args.dp,
        accountant=args.accountant, privacy_unit=args.privacy_unit, sampling=args.sampling,
        noise_scheme=args.noise_scheme, secure_noise=args.secure_noise,
        allreduce=args.allreduce,
        model=args.model, hidden=parse_hidden(args.hidden), seed=args.seed,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every, resume=args.resume,
        stop_after=args.stop_after, metrics=args.metrics, eval_every=args.eval_every,
        select_on=args.select_on,
        group_by=args.group_by.upper() if args.group_by else None,
        min_group_size=MIN_GROUP_SIZE if args.min_group_size is None else args.min_group_size,
        threads=args.threads, device=args.device, kernels=args.kernels,
        cuda_graph=args.cuda_graph, progress=args.progress)
    if check:
        cfg.validate()
    return cfg
