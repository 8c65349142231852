"""Train a model with DP-SGD over MPI ranks (or without privacy: --no-dp).

Every rank reads its shard of a file written by `mpidp prep`, samples its
rows with Poisson sampling (rate q = B/N), clips every example's gradient to
norm C, adds its share of Gaussian noise N(0, sigma^2 C^2) so the sum over
ranks carries it exactly once, and all-reduces one flat buffer per step.
The accountant (dp-accounting's PLD, or RDP with --accountant rdp) reports
epsilon every epoch and refuses a run past its budget. Epsilon protects one
person (one row); with --privacy-unit household it protects each household
as a whole (households sampled and clipped as one, N and B in households).

Examples:
  mpiexec -n 2 mpidp train --data pums.h5 --target-epsilon 1 --epochs 10
  mpiexec -n 2 mpidp train --data pums.h5 --noise-multiplier 1.1 --metrics m.jsonl \\
      --checkpoint-dir runs/a          # then add --resume after an interruption
  mpiexec -n 2 mpidp train --data pums.h5 --no-dp          # non-private baseline
  mpiexec -n 2 mpidp train --data pums.h5 --target-epsilon 1 --privacy-unit household

Exit codes: 0 done, 2 bad input or settings, 3 diverged (NaN/inf loss),
75 stopped by SIGTERM/SIGUSR1 or --stop-after with a checkpoint written
(rerun with --resume), 128+signal when stopped without --checkpoint-dir.
"""
from __future__ import annotations

import argparse

from engine import config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``mpidp train`` (:func:`engine.config.add_arguments`)."""
    config.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Collective: train; returns the exit code (module docstring)."""
    # deferred: the trainer's kernels and Numba, kept out of `mpidp train --help`
    from engine.trainer import Trainer

    return Trainer(config.from_args(args)).run()
