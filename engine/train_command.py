"""Train a model with DP-SGD over MPI ranks (or without privacy: --no-dp).

Every rank reads its shard of a file written by `mpidp prep`, samples its
rows with Poisson sampling (rate q = B/N), clips every example's gradient to
norm C, adds its share of Gaussian noise N(0, sigma^2 C^2) so the sum over
ranks carries it exactly once, and all-reduces one flat buffer per step.
The accountant (dp-accounting's PLD, or RDP with --accountant rdp) reports
epsilon every epoch and refuses a run past its budget; --delta must not
exceed 1/N (N training rows). Epsilon protects one person (one row); with
--privacy-unit household it protects each household as a whole (households
sampled and clipped as one, N and B in households).

Examples:
  mpiexec -n 2 mpidp train --data pums.h5 --target-epsilon 1 --epochs 10
  mpiexec -n 2 mpidp train --data pums.h5 --noise-multiplier 1.1 --metrics runs/a/m.jsonl \\
      --checkpoint-dir runs/a
  mpiexec -n 2 mpidp train --data pums.h5 --checkpoint-dir runs/a --resume
  mpiexec -n 2 mpidp train --data pums.h5 --no-dp          # non-private baseline
  mpiexec -n 2 mpidp train --data pums.h5 --target-epsilon 1 --privacy-unit household

Life-cycle (docs/lifecycle.md):
  --checkpoint-dir DIR  holds checkpoint.pt (model, optimizer, accountant,
                generator states, settings, per-epoch history) and, while a
                run uses it, a lock naming that run (host, PID, Slurm job): a
                second run into DIR is refused. DIR is created if missing;
                its parent must exist (as for every output of mpidp).
  --resume      needs only --data and --checkpoint-dir: every other setting
                comes from the checkpoint. An option given again must not
                differ, except --epochs, --checkpoint-every, --metrics,
                --eval-every, --target-accuracy, --time-budget and system
                options. No checkpoint in DIR is an error; a run without
                --resume into a DIR that holds one is an error too.
  Records       the metrics file is rewritten atomically from the
                checkpoint's history: one record per epoch, whatever stops.
  Signals       SIGINT (Ctrl-C), SIGTERM, SIGUSR1 during training: every
                rank stops after the same step, the checkpoint is written,
                the resume command is printed, exit 75. SIGINT before the
                first step: one line, exit 130, nothing written. SIGKILL of
                a rank or a lost node: the launcher ends the job; resume
                from the last checkpoint (at most --checkpoint-every epochs
                are trained again, bit for bit as before).

Exit codes: 0 done (or nothing left to do), 1 internal error (traceback),
2 bad input or settings (nothing was run), 3 diverged (NaN/inf), 71 out of
memory (the model, batch or data too large for the machine), 73 the
checkpoint directory is in use by another run, 74 an output could not be
written midway (disk full, read-only; the last checkpoint is intact), 75
stopped by a signal or --stop-after with a checkpoint written (resume),
128+n stopped by signal n before training, or without --checkpoint-dir.
"""
from __future__ import annotations

import argparse
import dataclasses

from collectives import MPI
from engine import checkpoint_lock, config

#: Stop signals are acted on at step boundaries (engine.stopping), not raised.
STOPS_AT_STEPS = True


class _Default:
    """A default value of an option, so that a resumed run can tell the options
    given on the command line (they override the checkpoint's) from defaults
    (they never do)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)


_FIELDS = {f.name for f in dataclasses.fields(config.TrainConfig)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``mpidp train`` (:func:`engine.config.add_arguments`)."""
    config.add_arguments(parser)
    defaults: dict[str, _Default] = {}
    for action in parser._actions:
        if action.dest in _FIELDS and not action.required:
            # The first option of a dest holds its default, as argparse reads it:
            # --progress's None (a bar when stderr is a terminal), not the True of
            # --no-progress's store_false.
            defaults.setdefault(action.dest, _Default(action.default))
    parser.set_defaults(**defaults)


def given_options(args: argparse.Namespace) -> set[str]:
    """The :class:`~engine.config.TrainConfig` fields given on the command line;
    replaces the defaults' wrappers in ``args`` by their values."""
    given = set()
    for name, value in vars(args).items():
        if isinstance(value, _Default):
            setattr(args, name, value.value)
        elif name in _FIELDS:
            given.add(name)
    return given


def run(args: argparse.Namespace) -> int:
    """Collective: train; returns the exit code (module docstring).

    The outputs are checked and the checkpoint directory locked before the
    trainer (torch, Numba) is imported, so a refused run answers at once.
    """
    given = given_options(args)
    config.check_group_size_given(given, args.select_on, args.resume)
    cfg = config.from_args(args, check=not args.resume)
    comm = MPI.COMM_WORLD
    lock = checkpoint_lock.open_directory(cfg.checkpoint_dir, cfg.resume, cfg.metrics, comm,
                                          data=cfg.data)
    try:
        # deferred: the trainer's kernels and Numba, kept out of `mpidp train --help`
        from engine.trainer import Trainer

        return Trainer(cfg, comm, given=given, lock=lock, opened=True).run()
    finally:
        if lock is not None:
            lock.release()
