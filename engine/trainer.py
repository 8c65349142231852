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
(``--select-on``, :mod:`engine.run.selection`). Checkpoints are atomic and
carry everything a bit-identical resume needs (:mod:`engine.checkpoint`),
the per-epoch history included: the metrics file is rewritten from it, so
any sequence of stops and resumes leaves one record per epoch
(:mod:`engine.metrics`). The life-cycle of a run (locks, signals, resume,
exit codes) is written down in docs/lifecycle.md.

The set-up's parts live in :mod:`engine.run` (resume, the state and step,
selection, what is printed, the hooks a program composes into a run); this
module wires them and holds the loop, the epoch's record and checkpoints.
"""
from __future__ import annotations

import math
import shlex
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

import collectives
from collectives import MPI
from engine import checkpoint as ckpt
from engine import checkpoint_lock
from engine import metrics as metrics_mod
from engine import outputs
from engine.config import TrainConfig
from engine.dp.privacy import check_delta_for_rows
from engine.errors import EXIT_CHECKPOINTED, ConfigError, DivergedError, PrivacyError
from engine.evaluate import evaluate_shard
from engine import models
from engine.nn import model_names
from engine.nn.device import select as select_device
from engine.nn.schedule import learning_rate
from engine import warmup
from engine.run import alike, report
from engine.run.collective import every_rank_check, rank0_check, rank0_value, shared_seed
from engine.run.hooks import RunHooks
from engine.run.report import plural
from engine.run.resume import check_same_data, load_checkpoint
from engine.run.selection import GroupScore, Selection, select_on
from engine.run.plan import choose_kernels, plan_privacy
from engine.run.state import build_state
from engine.run.threads import configure_threads
from engine.shard import read_info, read_shard
from engine.step import PHASES
from engine.stopping import (StopRequest, check_startup, forget_signals, signal_name,
                             stop_reason)

#: Steps between progress-bar updates and between finiteness checks.
PROGRESS_EVERY = 32
FINITE_CHECK_EVERY = 256


class Trainer:
    """A DP-SGD (or ``--no-dp``) run of :class:`TrainConfig` over ``comm``.

    ``given`` names the options of the command line (for a resume: the others
    come from the checkpoint; None: the fields that differ from the
    defaults). ``opened``: the command already checked the outputs and took the
    lock (``lock`` on rank 0, None elsewhere; the command takes it before
    importing this module: :func:`engine.checkpoint_lock.open_directory`); without
    one, :meth:`run` takes it. ``model``: the library's ``model=`` object (a
    module or a factory), else ``cfg.model`` names the model. ``hooks``:
    where a program composes its own parts into the run
    (:class:`engine.run.hooks.RunHooks`).
    """

    def __init__(self, cfg: TrainConfig, comm=None, out=None, given: set[str] | None = None,
                 lock: "checkpoint_lock.Lock | None" = None, opened: bool = False, model=None,
                 hooks: RunHooks | None = None):
        self.cfg = cfg
        #: the library's ``model=`` (a module or a factory), else cfg.model decides
        self.given_model = model
        self.hooks = hooks or RunHooks()
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.out = sys.stdout if out is None else out
        self.given = given
        self.lock = lock
        self.opened = opened
        self.history: list[dict] = []
        self.selection = Selection("last")  # set up from the file and --select-on
        #: whether this machine's caches are filled (engine.warmup; rank 0 reads it)
        self.warm = True
        self.group_score: GroupScore | None = None  # --select-on worst_group_val_accuracy
        self.resumed_from: dict | None = None  # the checkpoint's step, epsilon, budget
        self.large_delta: str | None = None

    @property
    def best(self) -> dict | None:
        """The selected epoch so far (:class:`engine.run.selection.Selection`)."""
        return self.selection.best

    @property
    def select_on(self) -> str:
        return self.selection.on

    # ------------------------------------------------------------------ set-up
    def _say(self, text: str) -> None:
        if self.rank == 0:
            self.out.write(text + "\n")
            self.out.flush()

    def resume_command(self) -> str:
        """The command that continues this run (what a stop message shows)."""
        cfg = self.cfg
        launch = f"mpiexec -n {self.size} " if self.size > 1 else ""
        # a factory of the user's is imported on resume only when named again
        model = (f" --model {shlex.quote(cfg.model)}"
                 if model_names.is_user_factory(cfg.model) else "")
        return (f"{launch}mpidp train --data {shlex.quote(str(cfg.data))} --checkpoint-dir "
                f"{shlex.quote(str(cfg.checkpoint_dir))}{model} --resume")

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
        alike.check_same_settings(self.cfg, comm)
        self.cfg, payload, self.resumed_from = load_checkpoint(self.cfg, comm, self.given)
        cfg = self.cfg  # a resume replaced it by the recorded settings
        self._startup_check()
        self.threads, self.local_ranks, self.thread_note = configure_threads(cfg.threads, comm)
        self.placement = select_device(cfg.device, comm)
        self.info = read_info(cfg.data, comm)
        alike.check_same_file(self.info, comm)
        self.selection = Selection(select_on(cfg, self.info),
                                   payload.get("best") if payload else None)
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
            check_same_data(payload, self.info, cfg)
        if cfg.dp:
            try:
                self.large_delta = check_delta_for_rows(cfg.delta, n, cfg.allow_large_delta,
                                                        cfg.data, unit=cfg.privacy_unit)
            except PrivacyError as exc:
                exc.collective = True
                raise
        self.seed = shared_seed(comm, payload["seed"] if payload else cfg.seed)
        self.model = models.resolve(cfg.model, cfg.hidden, self.info.n_features,
                                    self.info.n_classes, self.seed, self.placement.device,
                                    given=self.given_model,
                                    code_columns=self.info.code_columns, path=cfg.data,
                                    image_shape=self.info.image_shape)
        if payload is not None:  # a model built otherwise on one rank: raised on all
            every_rank_check(comm, lambda: models.check_resume(
                payload["model"], self.model, str(ckpt.path_in(cfg.checkpoint_dir))))
        if cfg.checkpoint_dir:
            needed = ckpt.estimate_size(self.model.n_params, self.size, cfg.epochs)
            existing = ckpt.path_in(cfg.checkpoint_dir)
            if payload is not None and existing.is_file():
                needed = max(needed, existing.stat().st_size)
            rank0_check(comm, lambda: outputs.check_free_space(
                cfg.checkpoint_dir, needed, "--checkpoint-dir"))
        self._plan_privacy(payload)
        self._startup_check()
        if self.train is None:
            self.train = read_shard(self.info, "train", comm, min_rows_per_rank=1,
                                    unit=cfg.privacy_unit)
        self.test = read_shard(self.info, "test", comm, min_rows_per_rank=0)
        self.val = (read_shard(self.info, "val", comm, min_rows_per_rank=0)
                    if self.info.has_val else None)
        self.group_score = (GroupScore(cfg, self.info, self.val, comm)
                            if self.select_on == "worst_group_val_accuracy" else None)
        if self.hooks.train_shard is not None:
            self.train = self.hooks.train_shard(self.train, self)
        self._build_state(payload)
        self._startup_check()

    def _plan_privacy(self, payload: dict | None) -> None:
        """Collective: the accountant, budget and planned epsilon
        (:func:`engine.run.plan.plan_privacy`); None for a non-private run."""
        self.accountant, self.budget, self.planned_epsilon = plan_privacy(
            self.cfg, payload, self.q, self.total_steps, self.steps_per_epoch, self.comm)

    def _build_state(self, payload: dict | None) -> None:
        """Collective: the sampler, engine and step (:mod:`engine.run.state`),
        kept as this trainer's attributes; then the step hook."""
        cfg = self.cfg
        state = build_state(
            cfg, model=self.model, train=self.train, n_classes=self.info.n_classes,
            placement=self.placement, seed=self.seed, q=self.q,
            steps_per_epoch=self.steps_per_epoch,
            sigma=self.accountant.sigma if self.accountant is not None else None,
            kernels=choose_kernels(self.cfg, self.placement.device, self.comm), comm=self.comm,
            payload=payload)
        for name in ("buffer", "grad", "control", "sampler", "engine", "params", "noise",
                     "optimizer", "X", "y", "dp_step", "step_note", "step", "local"):
            setattr(self, name, getattr(state, name))
        if payload is not None:
            self.history = list(payload.get("history", []))
        if self.hooks.step is not None:
            self.dp_step = self.hooks.step(self.dp_step, self)

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
        return rank0_value(self.comm, self._epsilon)

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
            config["metrics"] = ckpt.recorded_metrics(config["metrics"], self.cfg.checkpoint_dir)
            payload = {
                "config": config, "seed": self.seed, "world_size": self.size,
                "data": self.info.summary(), "model": self.model.to_dict(),
                "params": self.params.detach().cpu().clone(),
                "optimizer": self.optimizer.state_dict(),
                "accountant": None if self.accountant is None else self.accountant.state_dict(),
                "budget_epsilon": self.budget, "epsilon": self._epsilon(),
                # one trial of an unfinished mpidp tune search: not a guarantee
                "trial_of_search": ckpt.current_trial(),
                "step": self.step, "steps_per_epoch": self.steps_per_epoch,
                "ranks": ranks, "history": self.history, "best": self.best}
            ckpt.save(self.cfg.checkpoint_dir, payload)
            if self.best is not None:
                # the model to publish: only what its epsilon covers
                ckpt.save(self.cfg.checkpoint_dir, ckpt.published(payload, self.best),
                          ckpt.BEST_NAME)
            self._write_metrics_file()

        rank0_check(self.comm, write)
        return str(ckpt.path_in(self.cfg.checkpoint_dir))

    def _write_metrics_file(self) -> None:
        if self.cfg.metrics:
            metrics_mod.write_records(self.cfg.metrics, self.history)

    def write_metrics(self) -> None:
        """Collective: rank 0 rewrites the metrics file from the history.

        Raises (on every rank): WriteFailed.
        """
        if self.cfg.metrics:
            rank0_check(self.comm, self._write_metrics_file)

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
                if self.group_score is not None:  # --select-on worst_group_val_accuracy
                    record.update(self.group_score(self.engine.logits))
                self.selection.consider(record, self.params)
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

    def adopt_selection(self) -> None:
        """Make the selected epoch's parameters the run's (``Run.model``)."""
        self.selection.adopt(self.params)

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
                    self.lock = checkpoint_lock.open_directory(
                        self.cfg.checkpoint_dir, self.cfg.resume, self.cfg.metrics, self.comm,
                        data=self.cfg.data)
                code = self._run(stop)
                checkpoint_lock.release_everywhere(self.lock, self.comm)
                return code
            finally:
                if self.lock is not None:
                    self.lock.release()
                forget_signals()  # acted on (or the run ended anyway)

    def _run(self, stop: StopRequest) -> int:
        self.setup()
        cfg = self.cfg  # for a resume: the recorded settings
        if self.rank == 0:
            self.warm = warmup.is_warm()
        if self.step > 0:
            self.write_metrics()  # back to the checkpoint's history (module docstring)
        # A run that stopped early stays stopped while its rule (as given now) holds.
        early = self.history and self.history[-1].get("stop_reason") and stop_reason(
            self.history[-1], cfg.target_accuracy, cfg.time_budget)
        if self.step >= self.total_steps or early:  # before the plan: below what is spent
            for line in filter(None, [report.first_line(self)]):
                self._say(line)
            fewer = "" if self.step == self.total_steps else \
                f" (--epochs {cfg.epochs} asks for fewer: a run never goes back)"
            if early:
                fewer = (f", stopped early by --{early.replace('_', '-')} (give a higher one "
                         "to continue it)")
            self._say(f"nothing to do: the run in {cfg.checkpoint_dir} has finished "
                      f"{plural(self.step // self.steps_per_epoch, 'epoch')}{fewer}")
            self.selection.adopt(self.params)
            return 0
        for line in report.describe(self):
            self._say(line)
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
                if finished and self.val is not None:  # before the checkpoint carrying it
                    self.selection.final_test(record, self.params,
                                              lambda: self._evaluate(self.test))
                self.history.append(record)
                if self.rank == 0:
                    bar.clear()
                self._say(metrics_mod.row(record, val=self.val is not None))
                if finished and self.val is not None:
                    self._say(self.selection.test_line(record))
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
        for line in report.summary(self):
            self._say(line)
        if self.rank == 0 and not self.warm:
            warmup.mark_warm()  # a finished run compiled and measured what it needed
        self.selection.adopt(self.params)
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
