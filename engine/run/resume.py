"""A resumed run: its settings (the checkpoint's, with the options given now)
and its checkpoint, checked against the job and the data before any work."""
from __future__ import annotations

import dataclasses

from engine import checkpoint as ckpt
from engine import outputs
from engine.config import ADJUSTABLE_ON_RESUME, PER_INVOCATION, TrainConfig
from engine.errors import CheckpointError, ConfigError, OutputError, agree
from engine.run.collective import rank0_check


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
            elif theirs is None:  # its default, or no privacy options at all (--no-dp)
                private = "" if saved.get("dp", True) else ", non-private (--no-dp)"
                diffs.append(f"{_option_text(name, mine)} (the run was started without "
                             f"--{name.replace('_', '-')}{private})")
            else:
                diffs.append(f"{_option_text(name, mine)} (the run has "
                             f"{_option_text(name, theirs)})")
        merged[name] = mine
    if diffs:
        raise ConfigError("a resumed run keeps the settings it started with, and --resume "
                          "needs none of them; leave out what differs: " + "; ".join(diffs),
                          collective=True)
    return TrainConfig(**merged)


def _check_recorded_metrics(path: str) -> None:
    """:func:`engine.outputs.check_file` for the ``--metrics`` a resume inherits,
    its message saying where the path came from and how to write elsewhere."""
    try:
        outputs.check_file(path, "--metrics")
    except OutputError as exc:
        raise OutputError(f"{exc} (the run's --metrics, recorded in its checkpoint: give "
                          "--metrics FILE to write its metrics elsewhere)") from None


def check_named_model(given: str, recorded: str, where) -> None:
    """Refuse to resume a run of a user's ``MODULE:FACTORY`` unless the command
    names it again: a resume takes its settings from the checkpoint, and a name
    read from a file alone is never imported (anyone can write a checkpoint
    naming ``os:kill``).

    Args:
        given: this invocation's model (``--model``; ``mlp``, the default, when
            not given, ``python`` for the library's ``model=`` object).
        recorded: the checkpoint's ``config["model"]``.

    Raises:
        CheckpointError: (collective) ``recorded`` is a user's factory that
            ``given`` is not.
    """
    from engine.nn.model_names import is_user_factory  # no torch

    if not is_user_factory(recorded) or given == recorded:
        return
    other = "" if given == TrainConfig(data="").model else f" (this command has {given})"
    raise CheckpointError(f"{where} is a run of the model {recorded}, code that mpidp imports "
                          f"and runs only when you name it{other}: if you trust that "
                          f"checkpoint, resume with --model {recorded}", collective=True)


def load_checkpoint(cfg: TrainConfig, comm, given: set[str] | None
                    ) -> tuple[TrainConfig, dict | None, dict | None]:
    """Collective: the checkpoint of a resumed run (None for a fresh one).

    Returns:
        (the run's settings: ``cfg``, or for a resume the recorded ones with the
        options given now; the checkpoint's payload or None; for a resume
        ``{"step", "epsilon", "budget", "text"}`` of where it resumes, else None).

    Raises (on every rank):
        CheckpointError: ``--resume`` without a checkpoint, a checkpoint without
            ``--resume``, another number of ranks, an unreadable file, one whose
            contents are not a run's checkpoint
            (:func:`engine.checkpoint.check_model_file`), a run of a user's
            ``MODULE:FACTORY`` that ``--model`` does not name
            (:func:`check_named_model`).
        ConfigError: the merged settings are invalid, or differ where they may not.
    """
    if not cfg.checkpoint_dir:
        return cfg, None, None
    error, payload = None, None
    try:
        payload = ckpt.load(cfg.checkpoint_dir)
    except CheckpointError as exc:
        error = exc
    agree(comm, error)
    where = ckpt.path_in(cfg.checkpoint_dir)
    if payload is None:
        if cfg.resume:
            raise CheckpointError(f"--resume: {where} does not exist; nothing to resume "
                                  "(drop --resume to start a new run)", collective=True)
        return cfg, None, None
    ckpt.check_model_file(payload, where, collective=True)  # before any entry is read
    if not cfg.resume:
        spent = payload.get("epsilon")
        raise CheckpointError(
            f"{where} holds a run at step {payload['step']}"
            + (f" that has spent epsilon={spent:.3f}" if spent is not None else "")
            + "; pass --resume to continue it, or choose another --checkpoint-dir",
            collective=True)
    if not all(key in payload for key in ("seed", "ranks", "optimizer")):
        raise CheckpointError(f"{where} is a published model (as {ckpt.BEST_NAME}: no seed, "
                              "generator states or optimizer), not a run's checkpoint; a run "
                              "resumes only from the checkpoint it wrote", collective=True)
    ckpt.check_model_file(payload, where, resume=True, collective=True)
    check_named_model(cfg.model, payload["config"].get("model", "mlp"), where)
    size = comm.Get_size()
    if payload["world_size"] != size:
        raise CheckpointError(f"{where} was written by {payload['world_size']} ranks; "
                              f"resume it with {payload['world_size']} ranks (this job "
                              f"has {size})", collective=True)
    saved = dict(payload["config"], metrics=ckpt.metrics_of(payload["config"],
                                                           cfg.checkpoint_dir))
    merged = resumed_config(cfg, saved, given)
    try:
        merged.validate()
    except ConfigError as exc:
        raise ConfigError(f"{exc} (the settings of the resumed run: the checkpoint's, "
                          "with the options given now)", collective=True) from None
    if merged.metrics and merged.metrics != cfg.metrics:
        rank0_check(comm, lambda: _check_recorded_metrics(merged.metrics))
    resumed_from = {"step": int(payload["step"]), "epsilon": payload.get("epsilon"),
                    "budget": payload.get("budget_epsilon"), "text": ckpt.describe(payload)}
    return merged, payload, resumed_from


def check_same_data(payload: dict, info, cfg: TrainConfig) -> None:
    """Raise (collective) CheckpointError unless the checkpoint was trained on
    data like ``info`` (rows per split, features, encoding fingerprint)."""
    data, where = payload["data"], ckpt.path_in(cfg.checkpoint_dir)
    if data["rows"] != info.rows or data["n_features"] != info.n_features \
            or data["fingerprint"] != info.fingerprint:
        raise CheckpointError(f"{where} was trained on {data['path']} "
                              f"({data['rows']}), not on {cfg.data} "
                              f"({info.rows}); resume with the same data",
                              collective=True)
