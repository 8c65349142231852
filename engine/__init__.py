"""mpidp engine: the SPMD trainer, its command line and its run-time helpers.

Layout: the DP components in :mod:`engine.dp`, the model and its optimizers
in :mod:`engine.nn`, the one DP-SGD step that composes them in
:mod:`engine.step`, the loop around it in :mod:`engine.trainer`; benchmarks
in :mod:`engine.bench`, attacks in :mod:`engine.audit`.

The Python API is :func:`train` (what ``mpidp train`` runs), called by every
rank of an SPMD program::

    import engine
    run = engine.train("pums.h5", epochs=5, target_epsilon=1.0, seed=0)
    print(run.epsilon, run.history[-1]["test_accuracy"])   # run.model: a torch MLP
    run = engine.train("pums.h5", model=my_factory, epochs=5, target_epsilon=1.0)

The DP components also stand alone for a loop of your own:
:class:`engine.dp.sampler.PoissonSampler`, :class:`engine.dp.noise.GaussianNoise`,
:class:`engine.dp.accountant.Accountant`, per-example clipping rules in
:mod:`engine.dp.clipping`, and :func:`collectives.allreduce`.
"""
from __future__ import annotations

import io
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    # The version lives in setup.py only; an installed copy knows it.
    __version__ = version("mpidp")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["__version__", "Run", "train"]


@dataclass
class Run:
    """What :func:`train` returns, the same on every rank.

    Attributes:
        model: the trained model: the MLP as a ``torch.nn.Sequential`` on the
            CPU, or the module you gave (trained in place).
        epsilon, delta: the privacy spent (None for a non-private run).
        history: one record per epoch (train loss, test accuracy, epsilon,
            timings), as ``--metrics`` writes them.
        exit_code: 0 when done, 75 when stopped with a checkpoint written
            (``stop_after`` or a signal; continue with ``resume=True``).
        config: the settings the run used.
    """

    model: Any
    epsilon: float | None
    delta: float | None
    history: list[dict] = field(default_factory=list)
    exit_code: int = 0
    config: Any = None


def train(data: str, *, model: Any = "mlp", comm: Any = None, quiet: bool = False,
          **options: Any) -> Run:
    """Train a model on a prepared file with DP-SGD over ``comm``; every rank calls it.

    Args:
        data: a file written by ``mpidp prep``.
        model: ``"mlp"`` (the fused MLP; widths from ``hidden``), ``"logreg"``,
            ``"MODULE:FACTORY"``, a ``torch.nn.Module`` (trained in place; it
            must be built identically on every rank, float32, on the run's
            device), or a factory ``(n_features, n_classes) -> nn.Module``
            (called after seeding torch with the run's seed).
        comm: an mpi4py intracommunicator (default ``COMM_WORLD``).
        quiet: print nothing (rank 0 prints the run's table otherwise).
        **options: the options of ``mpidp train`` by keyword (the fields of
            :class:`engine.config.TrainConfig`), e.g. ``epochs=5,
            target_epsilon=1.0, batch_size=256, hidden=(128, 128),
            checkpoint_dir="runs/a"``; ``dp=False`` for a non-private run. The
            same checkpoint, resume and budget rules as the command apply.

    Returns:
        A :class:`Run`.

    Raises:
        ConfigError, DataError, PrivacyError, CheckpointError (``exit_code`` 2):
            bad settings or input, raised on every rank alike.
    """
    # deferred: torch and the trainer; `import engine` stays light
    from engine.config import TrainConfig
    from engine.errors import ConfigError
    from engine.trainer import Trainer

    known = set(TrainConfig.__dataclass_fields__) - {"data"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(f"engine.train() got unknown option(s) {', '.join(unknown)}; "
                          f"choose from {', '.join(sorted(known))}", collective=True)
    options.setdefault("progress", False)
    if "hidden" in options:
        options["hidden"] = tuple(options["hidden"])
    given = None
    if isinstance(model, str):
        options["model"] = model
    else:
        given = model
        options["model"] = "python"  # recorded; the object itself is not serialisable
    cfg = TrainConfig(data=str(data), **options)
    cfg.validate()
    trainer = Trainer(cfg, comm, out=io.StringIO() if quiet else None, model=given)
    code = trainer.run()
    accountant = getattr(trainer, "accountant", None)
    return Run(model=trainer.model.module(trainer.params),
               epsilon=None if accountant is None else accountant.epsilon(),
               delta=cfg.delta if cfg.dp else None, history=list(trainer.history),
               exit_code=code, config=cfg)
