"""The DP-SGD training loop: it wires the modules together and holds no DP math.

One step on every rank: sample this rank's rows (:mod:`engine.dp.sampler`,
Poisson at rate q), then :class:`engine.step.DPStep`: clipped gradient sum
of those rows into the flat buffer, this rank's share of the Gaussian noise,
ONE all-reduce of the preallocated buffer (gradient + one control float
that carries stop requests), update with the sum divided by the public
expected batch size B = qN. The accountant counts the step
(:mod:`engine.dp.accountant`).

Every rank takes the same number of steps (N and B are known everywhere);
an empty local batch is a valid step. With ``--privacy-unit household`` the
units are households: shards end on household boundaries, the sampler draws
households, each household's summed gradient is clipped as one, and N and B
count households. Per epoch: train loss (all-reduced), validation accuracy
(evaluated in parallel; the test split instead for a file without a
validation split), epsilon, time split into compute and communication; JSON
lines and a table on rank 0. With a validation split the test split is
scored once, when the run finishes, with the run's selected model
(``--select-on``: the best validation epoch's parameters, kept in memory,
in the checkpoint and in ``best.pt``, or the last ones). Checkpoints are atomic and
carry everything a bit-identical resume needs (:mod:`engine.checkpoint`),
the per-epoch history included: the metrics file is rewritten from it, so
any sequence of stops and resumes leaves one record per epoch
(:mod:`engine.metrics`). The life-cycle of a run (locks, signals, resume,
exit codes) is written down in docs/lifecycle.md.
"""
from __future__ import annotations

import dataclasses
import math
import os
import secrets
import shlex
import sys
import time

import numba
import numpy as np
import torch
from tqdm import tqdm

import collectives
from collectives import MPI
from collectives.runtime import available_cores, launch_info
from engine import checkpoint as ckpt
from engine import metrics as metrics_mod
from engine import outputs
from engine.dp.accountant import Accountant
from engine.config import ADJUSTABLE_ON_RESUME, PER_INVOCATION, TrainConfig
from engine.nn.device import select as select_device
from engine.dp.privacy import check_delta_for_rows
from engine.errors import (EXIT_CHECKPOINTED, CheckpointError, ConfigError, DataError,
                           DivergedError, MpidpError, PrivacyError, agree)
from engine.evaluate import evaluate_shard
from engine.nn import models
from engine.nn.module_engine import parameter_digest
from engine.dp.noise import GaussianNoise
from engine.nn.optim import build as build_optimizer
from engine.dp.sampler import HouseholdSampler, PoissonSampler, ShuffleSampler
from engine.nn.schedule import learning_rate
from engine.shard import read_info, read_shard
from engine.stopping import monitored_accuracy
from engine import fixed_step
from engine.step import PHASES, DPStep
from engine.stopping import (StopRequest, check_startup, forget_signals, signal_name,
                             stop_reason)
from kernels import registry

#: Steps between progress-bar updates and between finiteness checks.
PROGRESS_EVERY = 32
FINITE_CHECK_EVERY = 256


def configure_threads(requested: int | None) -> tuple[int, int]:
    """One rank per core: ``threads = cores // ranks on this node`` (at least 1).

    Applies to torch and Numba, and turns on flush-to-zero for denormals.
    Returns (threads, ranks on this node).
    """
    local = launch_info().local_ranks or 1
    threads = requested or max(1, available_cores() // local)
    torch.set_num_threads(threads)
    # Flush denormals to zero: once a model fits well, softmax gradients of
    # confident examples underflow into the denormal range, where x86 float
    # arithmetic is many times slower. Values below 1.2e-38 change nothing.
    torch.set_flush_denormal(True)
    numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))
    return threads, local


def plural(n: int, word: str) -> str:
    """``1 epoch``, ``2 epochs``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _option_text(name: str, value) -> str:
    """How the command line says ``name=value`` (``--no-dp``, ``--hidden 8,8``)."""
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else f"no {flag}"
    if value is None:
        return f"no {flag}"
    if name == "hidden":
        return f"{flag} {','.join(str(v) for v in value)}" if value else f"{flag} ''"
    if isinstance(value, float):
        return f"{flag} {value:g}"
    return f"{flag} {value}"


def _same(a, b) -> bool:
    norm = (lambda v: list(v) if isinstance(v, (list, tuple)) else v)
    return norm(a) == norm(b)


def resumed_config(cfg: TrainConfig, saved: dict, given: set[str] | None) -> TrainConfig:
    """The settings of a resumed run: the checkpoint's, with the options given now.

    ``given`` names the options on the command line (None: the fields of
    ``cfg`` that differ from :class:`TrainConfig`'s defaults). An option
    that is not given never overwrites the recorded value; one that is given
    must equal it unless it is in :data:`ADJUSTABLE_ON_RESUME`.

    Raises:
        ConfigError: (collective) naming every given option that differs.
    """
    defaults = TrainConfig(data="")
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    if given is None:
        given = {n for n in names if not _same(getattr(cfg, n), getattr(defaults, n))}
    merged, diffs = {}, []
    for name in names:
        mine = getattr(cfg, name)
        if name in PER_INVOCATION:
            merged[name] = mine
            continue
        # A setting the checkpoint predates had its default then.
        theirs = saved[name] if name in saved else getattr(defaults, name)
        if isinstance(getattr(defaults, name), tuple) and theirs is not None:
            theirs = tuple(theirs)
        if name not in given:
            merged[name] = theirs
            continue
        if name not in ADJUSTABLE_ON_RESUME and not _same(mine, theirs):
            if name == "dp":
                diffs.append("--no-dp (the run is differentially private)" if not mine
                             else "DP (the run has --no-dp)")
            else:
                diffs.append(f"{_option_text(name, mine)} (the run has "
                             f"{_option_text(name, theirs)})")
        merged[name] = mine
    if diffs:
        raise ConfigError("a resumed run keeps the settings it started with, and --resume "
                          "needs none of them; leave out what differs: " + "; ".join(diffs),
                          collective=True)
    return TrainConfig(**merged)


def _number(value: float | None) -> str:
    """An accuracy in a message: 4 decimals, or nan when there is none."""
    return f"{value:.4f}" if value is not None else "nan"


def shared_seed(comm, seed: int | None) -> int:
    """Collective: ``seed``, or rank 0's random one on every rank (when None)."""
    if seed is not None:
        return int(seed)
    return int(comm.bcast(secrets.randbits(62) if comm.Get_rank() == 0 else None, root=0))


class Trainer:
    """A DP-SGD (or ``--no-dp``) run of :class:`TrainConfig` over ``comm``.

    ``given`` names the options of the command line (for a resume: the others
    come from the checkpoint; None: the fields that differ from the
    defaults). ``opened``: the command already checked the outputs and took the
    lock (``lock`` on rank 0, None elsewhere; the command takes it before
    importing this module: :func:`engine.checkpoint.open_directory`); without
    one, :meth:`run` takes it. ``model``: the library's ``model=`` object (a
    module or a factory), else ``cfg.model`` names the model.
    """

    def __init__(self, cfg: TrainConfig, comm=None, out=None, given: set[str] | None = None,
                 lock: "ckpt.Lock | None" = None, opened: bool = False, model=None):
        self.cfg = cfg
        #: the library's ``model=`` (a module or a factory), else cfg.model decides
        self.given_model = model
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.out = sys.stdout if out is None else out
        self.given = given
        self.lock = lock
        self.opened = opened
        self.history: list[dict] = []
        #: the best validation epoch so far (``--select-on val_accuracy``): epoch,
        #: step, val_accuracy, val_loss and its parameters (CPU), or None
        self.best: dict | None = None
        self.resumed_from: dict | None = None  # the checkpoint's step, epsilon, budget
        self.large_delta: str | None = None

    # ------------------------------------------------------------------ set-up
    def _say(self, text: str) -> None:
        if self.rank == 0:
            self.out.write(text + "\n")
            self.out.flush()

    def _rank0_check(self, check) -> None:
        """Collective: run ``check()`` on rank 0 (the rank that writes); its
        MpidpError is raised on every rank."""
        error = None
        if self.rank == 0:
            try:
                check()
            except MpidpError as exc:
                error = exc
        agree(self.comm, error)

    def _rank0_value(self, compute):
        """Collective: ``compute()`` on rank 0 alone, its value on every rank;
        its MpidpError is raised on every rank (:meth:`_rank0_check`)."""
        box: list = []
        self._rank0_check(lambda: box.append(compute()))
        return self.comm.bcast(box[0] if box else None, root=0)

    def resume_command(self) -> str:
        """The command that continues this run (what a stop message shows)."""
        cfg = self.cfg
        launch = f"mpiexec -n {self.size} " if self.size > 1 else ""
        return (f"{launch}mpidp train --data {shlex.quote(str(cfg.data))} --checkpoint-dir "
                f"{shlex.quote(str(cfg.checkpoint_dir))} --resume")

    def _startup_check(self) -> None:
        """Collective: a phase boundary of the start-up (engine.stopping)."""
        hint = ""
        if self.cfg.checkpoint_dir and self.cfg.resume:
            hint = (f"the checkpoint in {self.cfg.checkpoint_dir} is unchanged; continue with: "
                    + self.resume_command())
        check_startup(self.comm, stop_on_any=not self.cfg.checkpoint_dir, resume_hint=hint)

    def setup(self) -> None:
        """Collective: everything before the first step, in the order that lets a
        run fail before it reads data: the checkpoint (and with it, for a
        resume, the settings), then the data file's header, the checks that
        need its size (batch, delta, free space), the model, then the shards
        (for the household unit the training shard comes first: its
        households are the N that every check counts)."""
        comm = self.comm
        payload = self._load_checkpoint()
        cfg = self.cfg  # a resume replaced it by the recorded settings
        self._startup_check()
        self.threads, self.local_ranks = configure_threads(cfg.threads)
        self.placement = select_device(cfg.device, comm)
        self.info = read_info(cfg.data, comm)
        self._check_splits()
        self.train = None
        if cfg.privacy_unit == "household":
            self.train = read_shard(self.info, "train", comm, min_rows_per_rank=1,
                                    unit=cfg.privacy_unit)
            n = self.train.units_total
        else:
            n = self.info.rows["train"]
        if cfg.batch_size > n:
            units = "rows" if cfg.privacy_unit == "person" else "households"
            raise ConfigError(f"--batch-size {cfg.batch_size} exceeds the {n} training {units} "
                              f"of {cfg.data}", collective=True)
        self.n_train = n
        self.q = cfg.batch_size / n
        self.steps_per_epoch = max(1, round(n / cfg.batch_size))
        self.total_steps = cfg.epochs * self.steps_per_epoch
        if payload is not None:
            self._check_same_data(payload)
        if cfg.dp:
            try:
                self.large_delta = check_delta_for_rows(cfg.delta, n, cfg.allow_large_delta,
                                                        cfg.data)
            except PrivacyError as exc:
                exc.collective = True
                raise
        self.seed = shared_seed(comm, payload["seed"] if payload else cfg.seed)
        self.model = models.resolve(cfg.model, cfg.hidden, self.info.n_features,
                                    self.info.n_classes, self.seed, self.placement.device,
                                    given=self.given_model,
                                    code_columns=self.info.code_columns, path=cfg.data,
                                    image_shape=self.info.image_shape)
        if payload is not None:
            models.check_resume(payload["model"], self.model,
                                str(ckpt.path_in(cfg.checkpoint_dir)))
        if cfg.checkpoint_dir:
            needed = ckpt.estimate_size(self.model.n_params, self.size, cfg.epochs)
            existing = ckpt.path_in(cfg.checkpoint_dir)
            if payload is not None and existing.is_file():
                needed = max(needed, existing.stat().st_size)
            self._rank0_check(lambda: outputs.check_free_space(
                cfg.checkpoint_dir, needed, "--checkpoint-dir"))
        self._plan_privacy(payload)
        self._startup_check()
        if self.train is None:
            self.train = read_shard(self.info, "train", comm, min_rows_per_rank=1,
                                    unit=cfg.privacy_unit)
        self.test = read_shard(self.info, "test", comm, min_rows_per_rank=0)
        self.val = (read_shard(self.info, "val", comm, min_rows_per_rank=0)
                    if self.info.has_val else None)
        self._build_state(payload)
        self._startup_check()

    def _check_splits(self) -> None:
        """Collective (every rank read the same header): a file with training rows,
        and the validation split that ``--select-on`` needs; sets ``select_on``."""
        cfg, info = self.cfg, self.info
        if info.rows["train"] == 0:
            raise DataError(f"{cfg.data} has no training rows (a file only for scoring, "
                            "made with mpidp prep --test-fraction 1?): train on a file with "
                            "a training split, and score this one with mpidp eval",
                            collective=True)
        self.select_on = cfg.select_on or ("val_accuracy" if info.has_val else "last")
        if self.select_on != "val_accuracy":
            return
        default = "" if cfg.select_on else " (the default for a file with one)"
        if not info.has_val:
            raise ConfigError(f"--select-on val_accuracy: {cfg.data} has no validation "
                              "split (prepared by an older mpidp, or with --val-fraction 0); "
                              "prepare it again with mpidp prep --val-fraction F, or use "
                              "--select-on last", collective=True)
        if info.rows["val"] == 0:
            raise ConfigError(f"{cfg.data}: the validation split /val has no rows, and "
                              f"--select-on val_accuracy{default} needs some; prepare the "
                              "file again with a larger --val-fraction, or pass "
                              "--select-on last", collective=True)

    def _load_checkpoint(self) -> dict | None:
        """Collective: the checkpoint of a resumed run (None for a fresh one), with
        ``self.cfg`` replaced by the recorded settings and the options given now."""
        cfg = self.cfg
        if not cfg.checkpoint_dir:
            return None
        error, payload = None, None
        try:
            payload = ckpt.load(cfg.checkpoint_dir)
        except CheckpointError as exc:
            error = exc
        agree(self.comm, error)
        where = ckpt.path_in(cfg.checkpoint_dir)
        if payload is None:
            if cfg.resume:
                raise CheckpointError(f"--resume: {where} does not exist; nothing to resume "
                                      "(drop --resume to start a new run)", collective=True)
            return None
        if not cfg.resume:
            spent = payload.get("epsilon")
            raise CheckpointError(
                f"{where} holds a run at step {payload['step']}"
                + (f" that has spent epsilon={spent:.3f}" if spent is not None else "")
                + "; pass --resume to continue it, or choose another --checkpoint-dir",
                collective=True)
        if payload["world_size"] != self.size:
            raise CheckpointError(f"{where} was written by {payload['world_size']} ranks; "
                                  f"resume it with {payload['world_size']} ranks (this job "
                                  f"has {self.size})", collective=True)
        merged = resumed_config(cfg, payload["config"], self.given)
        try:
            merged.validate()
        except ConfigError as exc:
            raise ConfigError(f"{exc} (the settings of the resumed run: the checkpoint's, "
                              "with the options given now)", collective=True) from None
        if merged.metrics and merged.metrics != cfg.metrics:
            self._rank0_check(lambda: outputs.check_file(merged.metrics, "--metrics"))
        self.cfg = merged
        self.resumed_from = {"step": int(payload["step"]), "epsilon": payload.get("epsilon"),
                             "budget": payload.get("budget_epsilon"),
                             "text": ckpt.describe(payload)}
        return payload

    def _check_same_data(self, payload: dict) -> None:
        data, where = payload["data"], ckpt.path_in(self.cfg.checkpoint_dir)
        if data["rows"] != self.info.rows or data["n_features"] != self.info.n_features \
                or data["fingerprint"] != self.info.fingerprint:
            raise CheckpointError(f"{where} was trained on {data['path']} "
                                  f"({data['rows']}), not on {self.cfg.data} "
                                  f"({self.info.rows}); resume with the same data",
                                  collective=True)

    def _plan_privacy(self, payload: dict | None) -> None:
        """Collective: the accountant and budget, planned (or restored and
        checked) on rank 0 alone and broadcast. dp-accounting takes about 1.5 s
        of CPU to import and a calibration seconds more; one rank doing it
        spares every other rank both, and the plan is the same everywhere by
        construction. A PrivacyError there is raised on every rank."""
        cfg = self.cfg
        self.accountant: Accountant | None = None
        self.budget: float | None = None
        self.planned_epsilon: float | None = None
        if not cfg.dp:
            return

        def plan() -> tuple[Accountant, float, float]:
            if payload is not None:
                acct = Accountant.from_state(payload["accountant"])
                budget = float(payload["budget_epsilon"])
            else:
                acct, budget = Accountant.plan(
                    self.q, cfg.delta, self.total_steps, cfg.accountant,
                    target_epsilon=cfg.target_epsilon, sigma=cfg.noise_multiplier)
            acct.check_plan(budget, cfg.epochs, self.steps_per_epoch)
            return acct, budget, acct.epsilon(self.total_steps)

        self.accountant, self.budget, self.planned_epsilon = self._rank0_value(plan)

    def _choose_kernels(self, device: torch.device) -> str | None:
        """Collective: the kernel family every rank runs (``--kernels``, checked
        by a probe kernel on GPUs; the first that runs when not given)."""
        chosen, error = self.cfg.kernels, None
        try:
            chosen = registry.choose(device, self.cfg.kernels)
        except registry.BackendUnusable as exc:
            error = ConfigError(f"--kernels {self.cfg.kernels}: {exc}")
        agree(self.comm, error)
        return chosen

    def _build_state(self, payload: dict | None) -> None:
        cfg, n_params = self.cfg, self.model.n_params
        device = self.placement.device
        # The all-reduce buffer: the flat gradient and one control float; a
        # numpy array on the CPU, a tensor on a GPU (collectives stage it
        # through host memory unless MPI is CUDA-aware).
        if self.placement.host_buffer:
            self.buffer = np.zeros(n_params + 1, dtype=np.float32)
            self.grad = torch.from_numpy(self.buffer[:n_params])
        else:
            self.buffer = torch.zeros(n_params + 1, dtype=torch.float32, device=device)
            self.grad = self.buffer[:n_params]
        self.control = self.buffer[n_params:]
        n_local = self.train.n_local
        if self.train.groups is not None:
            self.sampler = HouseholdSampler(self.train.groups, self.q, self.seed, self.rank)
        elif cfg.sampling == "poisson":
            self.sampler = PoissonSampler(n_local, self.q, self.seed, self.rank)
        else:
            b = cfg.batch_size
            local_batch = b * (self.rank + 1) // self.size - b * self.rank // self.size
            self.sampler = ShuffleSampler(n_local, local_batch, self.steps_per_epoch,
                                          self.seed, self.rank)
        expected = self.sampler.expected_local_batch()
        capacity = int(expected + 6 * math.sqrt(expected) + 16)
        kernels = self._choose_kernels(device)
        probe = (torch.from_numpy(self.train.X[:4]), torch.from_numpy(self.train.y[:4]))
        self.engine = self.model.build_engine(self.grad, self.seed, probe, self.info.n_classes,
                                              capacity, kernels)
        self.params = params = self.engine.params
        if payload is not None:
            with torch.no_grad():
                params.copy_(payload["params"].to(device))
        self._check_ranks_agree_on_the_model()
        self.noise = None
        if cfg.dp:
            std = self.accountant.sigma * cfg.max_grad_norm
            self.noise = GaussianNoise(n_params, std, self.size, self.rank, self.seed,
                                       cfg.noise_scheme, device=device, backend=kernels,
                                       secure=cfg.secure_noise)
        self.optimizer = build_optimizer(cfg.optimizer, params, cfg.lr, cfg.momentum,
                                         cfg.weight_decay, backend=kernels,
                                         nesterov=cfg.nesterov)
        self.step = 0
        self.local = {"loss_sum": 0.0, "examples": 0, "clipped": 0}
        if payload is not None:
            self.optimizer.load_state_dict(payload["optimizer"])
            self.step = int(payload["step"])
            mine = payload["ranks"][self.rank]
            try:
                self.sampler.set_state(mine["sampler"])
                if self.noise is not None:
                    self.noise.set_state(mine["noise"])
            except (ValueError, TypeError, KeyError) as exc:
                raise CheckpointError(f"{ckpt.path_in(cfg.checkpoint_dir)}: its random "
                                      f"generator states do not fit this mpidp ({exc})",
                                      collective=True) from None
            self.local = dict(mine["local"])
            self.history = list(payload.get("history", []))
            self.best = payload.get("best")  # the best epoch so far travels with the run
        # The shard moves to the device once; a step gathers its rows there.
        self.X = torch.from_numpy(self.train.X).to(device)
        self.y = torch.from_numpy(self.train.y).to(device)
        self.dp_step = DPStep(self.engine, self.X, self.y, self.buffer, self.grad,
                              self.optimizer, 1.0 / cfg.batch_size, self.comm,
                              max_norm=cfg.max_grad_norm if cfg.dp else None,
                              noise=self.noise, algorithm=cfg.allreduce)
        shuffled = isinstance(self.sampler, ShuffleSampler)
        self.dp_step, self.step_note = fixed_step.choose(
            self.dp_step, cfg.cuda_graph, self.comm, n_local=n_local, q=self.q,
            fixed_batch=int(expected) if shuffled else None,
            households=self.train.groups is not None)

    def _check_ranks_agree_on_the_model(self) -> None:
        """Collective: every rank must start from the same parameters (a user's
        factory that draws without the run's seed would train a different
        model per rank, and the all-reduced sum would fit none of them)."""
        digests = self.comm.allgather(parameter_digest(self.params))
        odd = [r for r, d in enumerate(digests) if d != digests[0]]
        if odd:
            raise ConfigError(f"the model's initial parameters differ between ranks (rank "
                              f"{odd[0]} differs from rank 0): build it the same way on every "
                              "rank (a factory is called after seeding torch with the run's "
                              "seed; draw with torch's default generator)", collective=True)

    # ------------------------------------------------------------ checkpoints
    def _epsilon(self) -> float | None:
        """The epsilon spent so far; computed where it is called (rank 0 alone
        imports dp-accounting: :meth:`epsilon_spent` for every rank)."""
        return None if self.accountant is None else self.accountant.epsilon()

    def epsilon_spent(self) -> float | None:
        """Collective: the epsilon spent so far on every rank, computed on rank 0
        (None for a non-private run, or one stopped before its plan)."""
        if getattr(self, "accountant", None) is None:
            return None
        return self._rank0_value(self._epsilon)

    def save_checkpoint(self) -> str | None:
        """Collective: rank 0 writes the checkpoint with every rank's state, then
        the metrics file from the same history; returns the checkpoint's path.

        Raises (on every rank): DivergedError, DirectoryLocked (another run
        took the directory), WriteFailed (disk full, read-only: the previous
        checkpoint and metrics file are intact).
        """
        if not self.cfg.checkpoint_dir:
            self.write_metrics()
            return None
        self._settle()
        if not bool(torch.isfinite(self.params).all()):
            raise DivergedError("the parameters are NaN or infinite: not checkpointing a "
                                "diverged model; lower --lr or --max-grad-norm",
                                collective=True)
        mine = {"sampler": self.sampler.get_state(),
                "noise": None if self.noise is None else self.noise.get_state(),
                "local": dict(self.local)}
        ranks = self.comm.gather(mine, root=0)

        def write() -> None:
            if self.lock is not None:
                self.lock.check()
            config = self.cfg.to_dict()
            if config["metrics"]:
                config["metrics"] = os.path.abspath(config["metrics"])
            payload = {
                "config": config, "seed": self.seed, "world_size": self.size,
                "data": self.info.summary(), "model": self.model.to_dict(),
                "params": self.params.detach().cpu().clone(),
                "optimizer": self.optimizer.state_dict(),
                "accountant": None if self.accountant is None else self.accountant.state_dict(),
                "budget_epsilon": self.budget, "epsilon": self._epsilon(),
                "step": self.step, "steps_per_epoch": self.steps_per_epoch,
                "ranks": ranks, "history": self.history, "best": self.best}
            ckpt.save(self.cfg.checkpoint_dir, payload)
            if self.best is not None:
                ckpt.save(self.cfg.checkpoint_dir, self._best_payload(payload),
                          ckpt.BEST_NAME)
            self._write_metrics_file()

        self._rank0_check(write)
        return str(ckpt.path_in(self.cfg.checkpoint_dir))

    def _best_payload(self, payload: dict) -> dict:
        """``best.pt``: the selected model to publish, readable by ``mpidp eval``
        (:func:`engine.checkpoint.published`: no seed, generator states,
        optimizer or exact scores; those stay in the checkpoint, which a
        resume needs). Its epsilon is the run's so far: choosing an epoch
        looked at every epoch's parameters."""
        return ckpt.published(payload, self.best)

    def _write_metrics_file(self) -> None:
        if self.cfg.metrics:
            metrics_mod.write_records(self.cfg.metrics, self.history)

    def write_metrics(self) -> None:
        """Collective: rank 0 rewrites the metrics file from the history.

        Raises (on every rank): WriteFailed.
        """
        if self.cfg.metrics:
            self._rank0_check(self._write_metrics_file)

    # ------------------------------------------------------------------- loop
    def _settle(self) -> None:
        """Add what the step kept on the device (loss, clipped count) to the
        epoch's sums (:meth:`engine.fixed_step.FixedShapeStep.settle`)."""
        loss, clipped = self.dp_step.settle()
        self.local["loss_sum"] += loss
        self.local["clipped"] += clipped

    def _epoch_end(self, epoch: int, times: dict, wall: float, resumed: bool) -> dict:
        self._settle()
        # Rank 0's epsilon rides in the sum (the others add 0, exactly): only
        # rank 0 runs the accountant (_plan_privacy).
        dp = self.accountant is not None
        spent = [(self._epsilon() if self.rank == 0 else 0.0)] if dp else []
        sums = np.array([self.local["loss_sum"], self.local["examples"],
                         self.local["clipped"], *(times[p] for p in PHASES), wall, *spent],
                        dtype=np.float64)
        collectives.allreduce(sums, self.comm, algorithm=self.cfg.allreduce)
        loss_sum, examples, clipped = sums[0], int(sums[1]), int(sums[2])
        mean_times = {p: float(v) / self.size for p, v in zip(PHASES, sums[3:3 + len(PHASES)])}
        wall = float(sums[3 + len(PHASES)]) / self.size
        epsilon = float(sums[-1]) if dp else None
        train_loss = loss_sum / examples if examples else float("nan")
        if (examples and not math.isfinite(train_loss)) \
                or not bool(torch.isfinite(self.params).all()):
            raise DivergedError(f"epoch {epoch + 1}: the training loss or the parameters "
                                "became NaN or infinite; lower --lr (or --max-grad-norm)",
                                collective=True)
        record = {
            "epoch": epoch + 1, "step": self.step, "train_loss": train_loss,
            "train_examples": examples,
            "clipped_fraction": clipped / examples if examples else None,
            "epsilon": epsilon, "delta": self.cfg.delta if self.cfg.dp else None,
            "noise_multiplier": None if self.accountant is None else self.accountant.sigma,
            "epoch_time_s": wall,
            "train_time_s": (self.history[-1].get("train_time_s") or 0.0 if self.history
                             else 0.0) + wall,
            "examples_per_s": examples / wall if wall > 0 else None,
            "comm_s": mean_times["comm_s"], "compute_s": wall - mean_times["comm_s"],
            "comm_compute_ratio": (mean_times["comm_s"] / (wall - mean_times["comm_s"])
                                   if wall > mean_times["comm_s"] else None),
            "step_breakdown_s": mean_times, "ranks": self.size, "threads": self.threads,
            "resumed_mid_epoch": resumed,
        }
        if (epoch + 1) % self.cfg.eval_every == 0 or epoch + 1 == self.cfg.epochs:
            if self.val is not None:  # the test split waits for the end (_final_test)
                result = self._evaluate(self.val)
                record.update(val_accuracy=result["accuracy"], val_loss=result["loss"])
                self._consider(record)
            else:  # a file without a validation split: test every epoch, as before
                result = self._evaluate(self.test)
                record.update(test_accuracy=result["accuracy"], test_loss=result["loss"])
        if self.cfg.dp and not self.sampler.assumption_met:
            record["epsilon_valid"] = False  # shuffled batches: not what was accounted
        self.local.update(loss_sum=0.0, examples=0, clipped=0)  # in place: the loop holds it
        return {k: metrics_mod.finite_or_none(v) if isinstance(v, float) else v
                for k, v in record.items()}

    def _evaluate(self, shard) -> dict:
        """Collective: accuracy and loss of the current parameters on ``shard``."""
        return evaluate_shard(self.engine.logits, shard.X, shard.y, self.comm,
                              self.cfg.allreduce)

    def _consider(self, record: dict) -> None:
        """Keep this epoch's parameters if its validation accuracy is the best so far
        (``--select-on val_accuracy``; the first of equal ones). The accuracy is
        all-reduced: every rank keeps the same epoch."""
        accuracy = record.get("val_accuracy")
        if self.select_on != "val_accuracy" or accuracy is None \
                or not math.isfinite(accuracy):
            return
        if self.best is None or accuracy > self.best["val_accuracy"]:
            self.best = {"epoch": record["epoch"], "step": record["step"],
                         "val_accuracy": float(accuracy),
                         "val_loss": metrics_mod.finite_or_none(record.get("val_loss")),
                         "params": self.params.detach().to("cpu", copy=True)}

    def _selected_epoch(self, last_epoch: int) -> int:
        """The epoch whose parameters are the run's model."""
        return self.best["epoch"] if self.best is not None else last_epoch

    def _final_test(self, record: dict) -> None:
        """Collective, when a run with a validation split finishes: score the test
        split once, with the selected parameters, into the last epoch's record."""
        if self.val is None:
            return  # tested every --eval-every epochs, the last one included
        selected = self._selected_epoch(record["epoch"])
        if self.best is not None:
            last = self.params.detach().clone()
            with torch.no_grad():
                self.params.copy_(self.best["params"].to(self.params.device))
            try:
                result = self._evaluate(self.test)
            finally:
                with torch.no_grad():
                    self.params.copy_(last)  # the checkpoint keeps training's state
        else:
            result = self._evaluate(self.test)
        record.update(test_accuracy=metrics_mod.finite_or_none(result["accuracy"]),
                      test_loss=metrics_mod.finite_or_none(result["loss"]),
                      test_rows=result["rows"], selected_epoch=selected,
                      select_on=self.select_on)

    def _test_line(self, record: dict) -> str:
        """``test (once, at the end): accuracy ...`` for a run with a validation split."""
        accuracy, loss = record.get("test_accuracy"), record.get("test_loss")
        numbers = (f"accuracy {accuracy:.4f}, loss {loss:.4f} on "
                   f"{record.get('test_rows', 0):,} rows" if accuracy is not None
                   else "the test split has no rows")
        if self.best is not None:
            whose = (f"the parameters of epoch {self.best['epoch']}, selected on "
                     f"val_accuracy ({self.best['val_accuracy']:.4f})")
        elif self.select_on == "val_accuracy":
            whose = "the last parameters (no epoch was scored on the validation split)"
        else:
            whose = "the last parameters (--select-on last)"
        return f"test (once, at the end): {numbers}; {whose}"

    def adopt_selection(self) -> None:
        """Make the selected epoch's parameters the run's (``Run.model``); the
        checkpoint already holds the last ones, which a resume continues from."""
        if self.best is not None:
            with torch.no_grad():
                self.params.copy_(self.best["params"].to(self.params.device))

    def run(self) -> int:
        """Collective: train; returns the exit code (0 done, 75 checkpointed on a
        stop request, 128 + n stopped by signal n without a checkpoint directory).

        Takes the lock of the checkpoint directory first unless the caller did;
        releases it at the end, however the run ends.
        """
        with StopRequest() as stop:
            try:
                if not self.opened:
                    self.opened = True
                    self.lock = ckpt.open_directory(self.cfg.checkpoint_dir, self.cfg.resume,
                                                    self.cfg.metrics, self.comm)
                code = self._run(stop)
                ckpt.release_everywhere(self.lock, self.comm)
                return code
            finally:
                if self.lock is not None:
                    self.lock.release()
                forget_signals()  # acted on (or the run ended anyway)

    def _first_line(self) -> str | None:
        """The first line of a resumed run, or of one with --allow-large-delta."""
        parts = []
        if self.resumed_from is not None:
            budget = self.resumed_from.get("budget")
            parts.append(f"resumed the run in {self.cfg.checkpoint_dir} at "
                         f"{self.resumed_from['text']}"
                         + (f" of budget {budget:.3f}" if budget is not None else ""))
        if self.large_delta:
            parts.append(f"WARNING --allow-large-delta: {self.large_delta}")
        return "mpidp train: " + "; ".join(parts) if parts else None

    def _describe(self) -> None:
        cfg = self.cfg
        first = self._first_line()
        if first:
            self._say(first)
        if self.lock is not None and self.lock.note:
            self._say(f"note: {self.lock.note}")
        if self.step_note:
            self._say(f"mpidp train: on {self.placement.device.type}, {self.step_note}")
        unit = ("" if not cfg.dp else "epsilon protects each person (one row); "
                if cfg.privacy_unit == "person"
                else "epsilon protects each household (all its rows at once); ")
        households = ("" if cfg.privacy_unit == "person"
                      else f" in {self.n_train:,} households")
        self._say(f"mpidp train: {unit}{self.model.describe()} on {cfg.data} "
                  f"({self.info.rows['train']:,} training rows{households}, "
                  f"{self.info.n_features} features), "
                  f"{self.size} rank(s) x {self.threads} thread(s), kernels "
                  f"{self.engine.backends['clip_rows']}"
                  + ("" if self.engine.backends.get("mlp_step", "composed") == "composed"
                     else " (the MLP step in one call)" if self.engine.parts == 1
                     else f" (the MLP step in one call, its rows cut over "
                          f"{self.engine.parts} threads)")
                  + ("" if self.placement.device.type == "cpu"
                     else f", rank 0 on {self.placement.describe()}"))
        if cfg.dp:
            acct = self.accountant
            per = "" if cfg.privacy_unit == "person" else " households"
            self._say(f"DP-SGD: C={cfg.max_grad_norm:g}, sigma={acct.sigma:.4f}, expected "
                      f"batch {cfg.batch_size}{per} (q={self.q:.3g}, {cfg.sampling}), "
                      f"{plural(self.steps_per_epoch, 'step')}/epoch; planned epsilon="
                      f"{self.planned_epsilon:.3f} at delta={cfg.delta:g} "
                      f"({acct.describe()}), budget {self.budget:.3f}")
            if not self.sampler.assumption_met:
                self._say("WARNING: --sampling shuffle is outside the accountant's "
                          "assumption (Poisson sampling): epsilon is NOT a guarantee")
        else:
            self._say(f"non-private (--no-dp): expected batch {cfg.batch_size}, "
                      f"{plural(self.steps_per_epoch, 'step')}/epoch")

    def _run(self, stop: StopRequest) -> int:
        self.setup()
        cfg = self.cfg  # for a resume: the recorded settings
        self._describe()
        if self.step > 0:
            self.write_metrics()  # back to the checkpoint's history (module docstring)
        if self.step >= self.total_steps:
            self._say(f"nothing to do: the run in {cfg.checkpoint_dir} has finished "
                      f"{plural(self.step // self.steps_per_epoch, 'epoch')}")
            self.adopt_selection()
            return 0
        show = (sys.stderr.isatty() if cfg.progress is None else cfg.progress) and self.rank == 0
        bar = tqdm(total=self.total_steps, initial=self.step, unit="step", disable=not show,
                   dynamic_ncols=True, leave=False)
        self._say(metrics_mod.header(val=self.val is not None))
        start_step = self.step
        scheduled = cfg.lr_schedule != "constant"
        sampler, dp_step, opt, control = self.sampler, self.dp_step, self.optimizer, self.control
        pc, from_numpy = time.perf_counter, torch.from_numpy
        local = self.local
        grouped = self.train.groups is not None  # households: clipped as one each
        # One rank reads its own stop request: no control float to write or read
        # back (on a GPU, a read would wait for the step to finish).
        alone = self.size == 1
        try:
            while self.step < self.total_steps:
                epoch, first = divmod(self.step, self.steps_per_epoch)
                times = dict.fromkeys(PHASES, 0.0)
                t_epoch = pc()
                stopping = False
                for _ in range(first, self.steps_per_epoch):
                    if not alone:
                        control[0] = 1.0 if stop.requested else 0.0
                    if scheduled:
                        opt.lr = learning_rate(
                            cfg.lr_schedule, cfg.lr, self.step + 1, self.steps_per_epoch,
                            cfg.lr_warmup_epochs, cfg.lr / self.size, cfg.lr_milestones,
                            cfg.lr_decay)
                    t0 = pc()
                    rows = from_numpy(sampler.sample(self.step))
                    k, loss, clipped = dp_step(rows, times, t0,
                                               from_numpy(sampler.groups) if grouped else None)
                    self.step += 1
                    if self.accountant is not None:
                        self.accountant.step()
                    local["loss_sum"] += loss
                    local["examples"] += k
                    local["clipped"] += clipped
                    if self.step % PROGRESS_EVERY == 0:
                        bar.update(PROGRESS_EVERY)
                    # control[0] is all-reduced: every rank stops after the same step.
                    asked = stop.requested if alone else control[0] > 0
                    if asked or (cfg.stop_after is not None
                                 and self.step - start_step >= cfg.stop_after):
                        stopping = True
                        break
                    if self.step % FINITE_CHECK_EVERY == 0 \
                            and not bool(torch.isfinite(self.params).all()):
                        raise DivergedError(f"step {self.step}: the parameters became NaN "
                                            "or infinite; lower --lr (or --max-grad-norm)",
                                            collective=True)
                if stopping and self.step % self.steps_per_epoch != 0:
                    return self._interrupt(stop)  # mid-epoch: the checkpoint carries the sums
                # An epoch ended (also when a stop landed on its last step): its record
                # first, then the checkpoint that carries it.
                record = self._epoch_end(epoch, times, pc() - t_epoch, resumed=first > 0)
                # Read from all-reduced values: the same verdict on every rank.
                reason = stop_reason(record, cfg.target_accuracy, cfg.time_budget)
                if reason is not None:
                    record["stop_reason"] = reason
                finished = self.step >= self.total_steps or reason is not None
                if finished:
                    self._final_test(record)  # before the checkpoint that carries it
                self.history.append(record)
                if self.rank == 0:
                    bar.clear()
                self._say(metrics_mod.row(record, val=self.val is not None))
                if finished and self.val is not None:
                    self._say(self._test_line(record))
                if (epoch + 1) % cfg.checkpoint_every == 0 or finished or stopping:
                    self.save_checkpoint()
                else:
                    self.write_metrics()
                if stopping and not finished:
                    return self._interrupt(stop, saved=True)
                if reason is not None:
                    break
        finally:
            bar.close()
        self._summary()
        self.adopt_selection()
        return 0

    def _interrupt(self, stop: StopRequest, saved: bool = False) -> int:
        """Collective: the checkpoint (unless ``saved``) and the stop message;
        returns the exit code."""
        if stop.requested or self.control[0] > 0:
            why = signal_name(stop.signum) + ("" if stop.requested else " (on another rank)")
        else:
            why = f"--stop-after {self.cfg.stop_after}"
        if not saved:
            where = self.save_checkpoint()
        else:
            where = str(ckpt.path_in(self.cfg.checkpoint_dir)) if self.cfg.checkpoint_dir \
                else None
        if where is None:
            code = 128 + (stop.signum or 15)
            self._say(f"stopped at step {self.step} of {self.total_steps} on {why}; no "
                      f"--checkpoint-dir, nothing saved (exit code {code})")
            return code
        self._say(f"stopped at step {self.step} of {self.total_steps} on {why}; checkpoint "
                  f"written to {where}. Continue with:\n  {self.resume_command()}\n"
                  f"(exit code {EXIT_CHECKPOINTED})")
        return EXIT_CHECKPOINTED

    def _summary(self) -> None:
        last = self.history[-1] if self.history else {}
        times = [r["epoch_time_s"] for r in self.history if r.get("epoch_time_s")]
        eps = last.get("epsilon")
        val = ""
        if self.val is not None:
            chosen = (self.best["val_accuracy"] if self.best is not None
                      else last.get("val_accuracy"))
            val = (f"val accuracy {_number(chosen)} (epoch "
                   f"{self._selected_epoch(last.get('epoch', 0))}, "
                   + ("selected), " if self.best is not None else "the last), "))
        self._say(f"done: {plural(len(self.history), 'epoch')}, {val}test accuracy "
                  f"{_number(last.get('test_accuracy'))}, "
                  + (f"epsilon {eps:.3f} per {self.cfg.privacy_unit} (delta {self.cfg.delta:g}), "
                     if eps is not None
                     else "non-private, ")
                  + f"{np.median(times) if times else float('nan'):.2f} s/epoch (median)")
        if not self.cfg.checkpoint_dir:
            self._say("the trained model was not saved: give --checkpoint-dir DIR to keep it "
                      "(for mpidp eval and resuming); engine.train returns it as Run.model")
        if last.get("stop_reason") == "target_accuracy":
            which = "validation" if self.val is not None else "test"
            self._say(f"stopped early: {which} accuracy {monitored_accuracy(last):.4f} >= "
                      f"--target-accuracy {self.cfg.target_accuracy:g} after "
                      f"{last['train_time_s']:.2f} s of training (time to accuracy)")
        elif last.get("stop_reason") == "time_budget":
            self._say(f"stopped early: {last['train_time_s']:.2f} s of training reached "
                      f"--time-budget {self.cfg.time_budget:g} s")
