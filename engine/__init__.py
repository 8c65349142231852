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
    print(run.selected_epoch, run.history[-1]["val_accuracy"])  # the best validation epoch
    run = engine.train("pums.h5", model=my_factory, epochs=5, target_epsilon=1.0)

The DP components also stand alone for a loop of your own:
:class:`engine.dp.sampler.PoissonSampler`, :class:`engine.dp.noise.GaussianNoise`,
:class:`engine.dp.accountant.Accountant`, per-example clipping rules in
:mod:`engine.dp.clipping`, and :func:`collectives.allreduce`.

In the ``mpidp`` program (not in programs that import the engine), stop
signals are recorded from here on, the first of its modules to run, so a
Ctrl-C in the first instants never becomes a traceback (:mod:`engine.stopping`).
"""
from __future__ import annotations

from engine import stopping as _stopping

if _stopping.is_mpidp_program():
    _stopping.record_signals()

import atexit  # noqa: E402
import io  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from importlib.metadata import PackageNotFoundError, version  # noqa: E402
from typing import Any  # noqa: E402

try:
    # The version lives in setup.py only; an installed copy knows it.
    __version__ = version("mpidp")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["__version__", "Run", "train"]


def _mark_ended_at_exit() -> None:
    """At interpreter exit, where MPI runs with several ranks: leave this
    rank's mark that its program ended (:mod:`collectives.core.ended`), so
    that a peer waiting for it in :func:`train`'s entry raises instead of
    waiting for ever (:mod:`engine.entry`). Also done by collectives' own
    exit hook; this one covers a program that never imported collectives."""
    import sys

    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return
    if mpi.COMM_WORLD.Get_size() > 1:
        from collectives.core.ended import mark_ended

        mark_ended(mpi.COMM_WORLD.Get_rank())


atexit.register(_mark_ended_at_exit)


@dataclass
class Run:
    """What :func:`train` returns, the same on every rank.

    Attributes:
        model: the trained model: the MLP as a ``torch.nn.Sequential`` on the
            CPU, or the module you gave (trained in place), with the selected
            epoch's parameters (see ``selected_epoch``).
        epsilon, delta: the (epsilon, delta) guarantee the run states, as
            ``mpidp train``'s last line and ``best.pt`` do (None for a
            non-private run): the epsilon its steps spent, except after a
            ``target_accuracy`` stop, which read the data: the run's budget
            (docs/privacy.md). ``spent_epsilon``: what the steps spent.
        guarantee: False where the epsilon is no guarantee (``sampling=
            "shuffle"``), True otherwise, None for a non-private run.
        history: one record per epoch (train loss, validation accuracy,
            epsilon, timings), as ``--metrics`` writes them; the last one also
            holds the test accuracy (scored once, at the end, with ``model``),
            ``selected_epoch`` and ``select_on``. For a file without a
            validation split every evaluated record holds the test accuracy.
        selected_epoch: the epoch whose parameters ``model`` holds when the run
            finished on a file with a validation split: the best validation
            epoch (``select_on="val_accuracy"``, the default there) or the last;
            None otherwise (the last epoch's parameters).
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
    selected_epoch: int | None = None
    spent_epsilon: float | None = None
    guarantee: bool | None = None


def train(data: str, *, model: Any = None, comm: Any = None, quiet: bool = False,
          **options: Any) -> Run:
    """Train a model on a prepared file with DP-SGD over ``comm``; every rank calls it.

    Args:
        data: a file written by ``mpidp prep``.
        model: ``"mlp"`` (the fused MLP; widths from ``hidden``), ``"logreg"``,
            ``"MODULE:FACTORY"``, a ``torch.nn.Module`` (trained in place; it
            must be built identically on every rank, float32, on the run's
            device), or a factory ``(n_features, n_classes) -> nn.Module``
            (called after seeding torch with the run's seed). The same on
            every rank: the ranks compare its class's or factory's name, its
            modules, parameters and buffers.
        comm: an mpi4py intracommunicator (default ``COMM_WORLD``).
        quiet: print nothing (rank 0 prints the run's table otherwise).
        **options: the options of ``mpidp train`` by keyword (the fields of
            :class:`engine.config.TrainConfig`), e.g. ``epochs=5,
            target_epsilon=1.0, batch_size=256, hidden=(128, 128),
            checkpoint_dir="runs/a"``; ``dp=False`` for a non-private run. Each
            of the field's type (numpy's scalars too; any sequence of integers
            for ``hidden`` and ``lr_milestones``, or ``hidden`` as the text
            ``--hidden`` takes, ``"128,128"``); another type is a ConfigError
            naming the option. The
            same life-cycle as the command (docs/lifecycle.md): the outputs
            are checked and the checkpoint directory locked before any work;
            ``resume=True`` needs only ``data`` and ``checkpoint_dir`` (the
            other settings come from the checkpoint, and an option given that
            differs is refused by name); a resume without a checkpoint, and a
            fresh run into a directory that holds one, are errors. A stop
            signal during training (SIGINT, SIGTERM, SIGUSR1) checkpoints and
            returns with ``exit_code`` 75.

    Failures: an error raised on some ranks only (``collective`` False: a
    model that fails on one rank, a bug, a file one rank cannot read)
    ends the whole job, as under ``mpidp train``: the rank prints it
    (``[rank r] ...``, with the traceback unless it is a user error) and
    calls ``MPI_Abort`` with its exit code (1 for a bug), because its
    peers would otherwise wait for it in their next collective for ever.
    ``collectives.abort_on_error(False)`` (or ``MPIDP_ABORT_ON_ERROR=0``)
    before the call raises it instead, on that rank only (freeing the
    others is then up to you). Errors raised on every rank alike are
    raised on every rank.

    Returns:
        A :class:`Run`.

    Raises:
        ConfigError, DataError, PrivacyError, CheckpointError, OutputError
            (``exit_code`` 2): bad settings, input or outputs, raised on every
            rank alike before any work. The keywords are checked on each rank
            and agreed on: one refused on one rank only (an unknown option, a
            wrong type, an impossible value) is raised on every rank, ending
            ``(on rank r)``; options that differ between ranks are refused,
            naming what each rank gave. A ConfigError also for a call after
            ``MPI.Finalize()`` (on the calling rank: the job cannot be ended),
            and, on every rank, for a model whose buffers changed in training
            (not returned: :meth:`engine.models.TorchModel.check_buffers_unchanged`).
        DirectoryLocked (73): the checkpoint directory is in use by another run.
        WriteFailed (74): an output could not be written midway (the last
            checkpoint is intact).
    """
    _check_comm(comm)  # before the try: ending the job needs a communicator
    try:
        return _train(data, model=model, comm=comm, quiet=quiet, **options)
    except BaseException as exc:  # noqa: B902 - a rank failing alone must end the job
        from engine.spmd import end_job_on_error  # deferred: keeps `import engine` light

        end_job_on_error(exc, comm)
        raise


def _check_comm(comm: Any) -> None:
    """Raise ConfigError unless ``comm`` is None or a usable mpi4py intracommunicator
    (an int or ``COMM_NULL`` failed deep inside, twice: in the run, then in the
    error handling that needs the communicator to end the job), and MPI is not
    finalized (the MPI library killed the process then, with nothing to catch)."""
    from collectives import MPI
    from engine.errors import ConfigError

    if MPI.Is_finalized():
        raise ConfigError("engine.train(): MPI is finalized (the program called "
                          "MPI.Finalize()); call engine.train before MPI.Finalize(), or leave "
                          "finalizing to mpi4py, which does it at exit", collective=True)
    if comm is None:
        return
    if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
        shown = "MPI.COMM_NULL" if comm == MPI.COMM_NULL else repr(comm)
        raise ConfigError(f"engine.train(comm={shown}): takes an mpi4py intracommunicator "
                          "(MPI.COMM_WORLD, the default, or one made from it with Split or "
                          "Dup)", collective=True)


def _train(data: str, *, model: Any = None, comm: Any = None, quiet: bool = False,
           **options: Any) -> Run:
    """:func:`train` itself (it ends the job when this raises on some ranks only)."""
    # deferred: torch and the trainer; `import engine` stays light
    from collectives import MPI
    from engine.entry import wait_for_peers
    from engine.models import label_of
    from engine.run.collective import every_rank_check
    from engine.run import report
    from engine.trainer import Trainer

    comm = MPI.COMM_WORLD if comm is None else comm
    wait_for_peers(comm)
    # Each rank checks its own keywords; a refusal on one rank is raised on all.
    cfg, given, model_object = every_rank_check(comm, lambda: _settings(data, model, options))
    _check_same_given(cfg, given, comm,
                      None if model_object is None else label_of(model_object))
    trainer = Trainer(cfg, comm, out=io.StringIO() if quiet else None, given=given,
                      model=model_object)
    code = trainer.run()
    cfg = trainer.cfg  # for a resume: the recorded settings with the given ones
    last = trainer.history[-1] if trainer.history and code == 0 else {}
    stated = report.stated_privacy(trainer, trainer.epsilon_spent())
    # a model whose buffers changed in training is refused on every rank
    trained = every_rank_check(comm, lambda: trainer.model.module(trainer.params))
    return Run(model=trained, epsilon=stated["epsilon"],
               delta=cfg.delta if cfg.dp else None, history=list(trainer.history),
               exit_code=code, config=cfg, selected_epoch=last.get("selected_epoch"),
               spent_epsilon=stated["spent_epsilon"], guarantee=stated["guarantee"])


def _settings(data: str, model: Any, options: dict) -> tuple[Any, set[str], Any]:
    """This rank's settings from :func:`train`'s arguments, checked on this rank
    alone (the caller makes the ranks agree): ``(TrainConfig, the names of the
    options given, the model object or None)``.

    Raises:
        ConfigError: an unknown option, one of the wrong type, or (for a new
            run) settings that :meth:`TrainConfig.validate` refuses.
    """
    from engine.config import TrainConfig, api_options, check_group_size_given
    from engine.errors import ConfigError

    known = set(TrainConfig.__dataclass_fields__) - {"data"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(f"engine.train() got unknown option(s) {', '.join(unknown)}; "
                          f"choose from {', '.join(sorted(known))}", collective=True)
    # the options given: a resume takes every other setting from the checkpoint
    given = set(options)
    options = api_options(options)
    check_group_size_given(given, options.get("select_on"), bool(options.get("resume")))
    options.setdefault("progress", False)
    model_object = None
    if isinstance(model, str):
        options["model"] = model
        given.add("model")
    elif model is not None:
        model_object = model
        options["model"] = "python"  # recorded; the object itself is not serialisable
        given.add("model")
    cfg = TrainConfig(data=str(data), **options)
    if not cfg.resume:  # a resume validates the recorded settings with the given ones
        cfg.validate()
    return cfg, given, model_object


def _check_same_given(cfg: Any, given: set[str], comm: Any, label: str | None = None) -> None:
    """Collective: every rank was given the same options, but those a rank may
    hold for itself (:data:`engine.run.alike.OWN`). For a new run an option
    not given counts as its default; for a resume it stands for the
    checkpoint's value, so an option given on some ranks only differs (where
    the checkpoint keeps it). The message says what each rank gave. ``label``:
    this rank's model given as a Python object, by name
    (:func:`engine.models.label_of`: ``python:CLASS``), compared as its
    ``model`` (which the settings hold as ``python`` alone).

    Raises:
        ConfigError: (collective) naming the first option that differs (``resume``
            first), the first rank that differs from rank 0, and what each gave.
    """
    from engine.config import PER_INVOCATION
    from engine.errors import ConfigError
    from engine.run.alike import OWN

    mine = {name: (name in given, value) for name, value in cfg.to_dict().items()
            if name not in OWN}
    if label is not None:
        mine["model"] = (True, label)
    every = comm.allgather(mine)
    resume = every[0]["resume"][1]
    names = ["resume", *(name for name in every[0] if name != "resume")]
    for rank, theirs in enumerate(every[1:], start=1):
        for name in names:
            (given_0, value_0), (given_r, value_r) = every[0][name], theirs[name]
            from_checkpoint = resume and name not in PER_INVOCATION
            if value_0 == value_r and (given_0 == given_r or not from_checkpoint):
                continue
            raise ConfigError(
                f"engine.train(): rank {rank} {_gave(name, given_r, value_r, from_checkpoint)} "
                f"but rank 0 {_gave(name, given_0, value_0, from_checkpoint)}: every rank must "
                "call it with the same settings (the ranks train one model in lock-step)",
                collective=True)


def _gave(name: str, given: bool, value: Any, from_checkpoint: bool) -> str:
    """What a rank gave for option ``name`` (:func:`_check_same_given`'s words)."""
    if given:
        return f"was given {name}={value!r}"
    if from_checkpoint:
        return f"did not give {name} (a resume takes it from the checkpoint)"
    return f"did not give {name} (its default, {value!r})"
