"""What some of ``mpidp train``'s options choose among, importable without torch.

The command checks every option before it imports the trainer (torch,
Numba: over a second), so a refused run answers at once; the modules that
implement these choices (:mod:`engine.nn.optim`, :mod:`engine.dp.noise`,
:mod:`engine.nn.mlp`) import torch, and take their names from here.
"""
from __future__ import annotations

import argparse

from engine.errors import ConfigError

#: ``--optimizer`` (:mod:`engine.nn.optim`).
OPTIMIZERS = ("sgd", "adam")
#: ``--noise-scheme`` (:mod:`engine.dp.noise`).
NOISE_SCHEMES = ("partition", "split")
#: ``--sampling`` (:mod:`engine.run.state`): Poisson, which the accountant
#: assumes, or shuffled batches (not covered by the epsilon).
SAMPLINGS = ("poisson", "shuffle")


#: ``--kernels``: the kernel back-ends (:mod:`kernels.registry`).
KERNEL_BACKENDS = ("numba", "cupy", "torch")


def parse_hidden(text: str) -> tuple[int, ...]:
    """``--hidden``: ``"128,128"`` -> ``(128, 128)``; ``""`` -> ``()`` (logistic
    regression). Raises ConfigError (collective) for anything else."""
    text = text.strip()
    if not text:
        return ()
    try:
        widths = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"--hidden {text!r}: expected comma-separated layer widths, "
                          "e.g. 128,128 (empty for logistic regression)",
                          collective=True) from None
    if any(w <= 0 for w in widths):
        raise ConfigError(f"--hidden {text!r}: widths must be positive", collective=True)
    return widths


def seed_value(text: str) -> int:
    """A ``--seed`` (argparse type): a whole number >= 0 (numpy's generators
    refuse a negative one with a traceback)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be a whole number >= 0")
    return value


def thread_count(text: str) -> int:
    """A ``--threads`` (argparse type): a whole number >= 1 (torch refuses
    others with a traceback); leaving the option out picks mpidp's own count
    (:func:`engine.run.threads.configure_threads`)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1 (leave --threads out "
                                         "for a rank's bound cores, or cores // ranks per "
                                         "node)")
    return value
