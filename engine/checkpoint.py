"""A run's checkpoint: the atomic checkpoint file, and the model file to publish.

``<dir>/checkpoint.pt`` is one ``torch.save`` file of plain data and tensors
(loaded with ``weights_only=True``, so a foreign file cannot run code): the
parameters, the optimizer, the accountant and the budget, the step, every
rank's sampler and noise generator states, the run's settings and its
per-epoch history (the records of the metrics file). Rank 0 writes it after
gathering the ranks' states: serialised in memory, written to a temporary
file, fsync'ed and renamed over the previous one, so a reader (or a run
killed mid-write) only ever sees a complete file. A SHA-256 of the contents
travels inside the file: torch does not check its own archive's CRCs, and
a flipped byte in a tensor would otherwise load as a silently different
model. The lock of the run using the directory is
:mod:`engine.checkpoint_lock`.

The checkpoint is the resume file, never a file to publish: it is as
sensitive as the training data (the run's seed and the noise generators'
states, which with the model undo the noise; the exact validation and test
figures of every epoch, which a bit-identical resume needs to keep
selecting and to rewrite the metrics file): keep the directory private.
``<dir>/best.pt`` (:func:`published`) is the file to publish: the selected
model and only what the epsilon it states covers.

torch is imported inside the functions that need it, so a refused run
answers before it loads.
"""
from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

import numpy as np

from engine import outputs
from engine.errors import CheckpointError, DataError
from preprocessing.h5format import HDF5_SIGNATURE

FILENAME = "checkpoint.pt"
#: The model a run selected (``--select-on val_accuracy``), the file to publish
#: (:func:`published`): its parameters, the model and data descriptions, the
#: settings and the epsilon that covers it; no seed, generator states or
#: exact scores.
BEST_NAME = "best.pt"
#: Every key a published model file (best.pt) may hold, besides the format's own.
PUBLISHED_KEYS = frozenset({"config", "world_size", "data", "model", "params", "budget_epsilon",
                            "epsilon", "privacy", "step", "steps_per_epoch", "selected"})
#: The keys of ``selected`` in a published file: which epoch, never its scores.
PUBLISHED_SELECTION = frozenset({"epoch", "step", "on", "run_step", "tuning"})
FORMAT = "mpidp-checkpoint"
#: 2: the contents carry a SHA-256 (``digest``). Version 1 files (no digest) still load.
VERSION = 2
_READABLE = (1, 2)
_ZIP_SIGNATURE = b"PK\x03\x04"


def path_in(directory: str | os.PathLike) -> Path:
    return Path(directory) / FILENAME


def best_path_in(directory: str | os.PathLike) -> Path:
    return Path(directory) / BEST_NAME


def run_files(directory: str | os.PathLike, label: str) -> dict[str, Path]:
    """A run directory's checkpoint and selected model, named ``LABEL's NAME``
    (for messages about outputs that must not replace them)."""
    return {f"{label}'s {name}": Path(directory) / name for name in (FILENAME, BEST_NAME)}


def model_of(payload: dict, checkpoint: str | os.PathLike):
    """(model description, parameters, the selection or None) that ``--checkpoint``
    names, for ``mpidp eval`` and ``mpidp audit``, from :func:`load_model`'s
    payload: a run's directory whose checkpoint holds a selected epoch gives
    that epoch's parameters (the run's model); a file (``best.pt`` included)
    gives the parameters it holds."""
    best = payload.get("best")
    if os.path.isdir(checkpoint) and best:
        return payload["model"], best["params"], best
    return payload["model"], payload["params"], payload.get("selected")


def load_model(checkpoint: str | os.PathLike) -> dict:
    """The payload ``--checkpoint`` names for ``mpidp eval`` and ``mpidp audit``:
    a run's directory gives its ``best.pt`` (the model it publishes, with the
    epsilon that covers it: a tuned trial's includes the tuning) when there is
    one, else its ``checkpoint.pt``; a file gives itself.

    Raises:
        CheckpointError: as :func:`load_file`.
    """
    if os.path.isdir(checkpoint) and best_path_in(checkpoint).is_file():
        return load_file(best_path_in(checkpoint))
    return load_file(checkpoint)


def published(checkpoint: dict, best: dict | None) -> dict:
    """The contents of ``best.pt`` for a checkpoint's payload: the selected
    model and only what the epsilon it states covers.

    Kept: the model and data descriptions, the settings without the seed,
    the parameters of ``best`` (the selected epoch: ``{"epoch", "step",
    "params", ...}``; None: the checkpoint's own), the epsilon spent and a
    ``privacy`` statement (epsilon, delta, unit, accountant, noise
    multiplier, sampling; ``includes_tuning`` False: a tuned trial's is
    rewritten by ``mpidp tune``). Left out: the seed (with it the noise and
    the batches can be drawn again, and the guarantee is gone), the
    generator states and optimizer, the history, and every exact validation
    or test figure (the epsilon covers the training rows, not the scores).
    """
    config = {k: v for k, v in checkpoint["config"].items() if k != "seed"}
    accountant = checkpoint.get("accountant") or {}
    dp = bool(config.get("dp", True)) and checkpoint.get("epsilon") is not None
    privacy = {"epsilon": checkpoint.get("epsilon") if dp else None,
               "delta": config.get("delta") if dp else None,
               "unit": config.get("privacy_unit", "person"),
               "accountant": config.get("accountant") if dp else None,
               "noise_multiplier": accountant.get("sigma") if dp else None,
               "sampling": config.get("sampling"), "includes_tuning": False}
    selected = None
    if best is not None:
        selected = {"epoch": best["epoch"], "step": best["step"],
                    "on": config.get("select_on") or "val_accuracy",
                    "run_step": checkpoint["step"]}
    return {"config": config, "world_size": checkpoint.get("world_size"),
            "data": checkpoint.get("data"), "model": checkpoint["model"],
            "params": checkpoint["params"] if best is None else best["params"],
            "budget_epsilon": checkpoint.get("budget_epsilon"),
            "epsilon": privacy["epsilon"], "privacy": privacy,
            "step": checkpoint["step"] if best is None else best["step"],
            "steps_per_epoch": checkpoint.get("steps_per_epoch"), "selected": selected}


def recorded_metrics(metrics: str | None, directory: str | os.PathLike) -> str | None:
    """How a checkpoint records the run's ``--metrics``: relative to the run's
    ``directory`` when inside it (a copied or moved run writes its own), else
    absolute (a resume from another working directory finds it)."""
    if not metrics:
        return metrics
    path, home = os.path.abspath(metrics), os.path.abspath(directory)
    return os.path.relpath(path, home) if os.path.commonpath([path, home]) == home else path


def metrics_of(config: dict, directory: str | os.PathLike) -> str | None:
    """The ``--metrics`` path a checkpoint's ``config`` records (the inverse of
    :func:`recorded_metrics`; older checkpoints recorded absolute paths only)."""
    metrics = config.get("metrics")
    return os.path.join(directory, metrics) if metrics and not os.path.isabs(metrics) \
        else metrics


def exists_in(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` holds a checkpoint file (any content)."""
    return path_in(directory).is_file()


def _plain(value):
    """Numpy scalars and tuples -> Python types (``weights_only`` loading accepts
    only plain containers, numbers, strings and tensors)."""
    import torch  # deferred: module docstring

    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.copy())
    return value


def _digest(value) -> str:
    """SHA-256 of a payload of plain data and tensors, independent of how
    ``torch.save`` lays it out (dict keys sorted, tensors by dtype, shape and
    bytes)."""
    import torch  # deferred: module docstring

    h = hashlib.sha256()

    def walk(v) -> None:
        if isinstance(v, dict):
            h.update(b"{")
            for key in sorted(v, key=repr):
                h.update(repr(key).encode() + b":")
                walk(v[key])
            h.update(b"}")
        elif isinstance(v, (list, tuple)):
            h.update(b"[")
            for item in v:
                walk(item)
                h.update(b",")
            h.update(b"]")
        elif isinstance(v, torch.Tensor):
            t = v.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(repr(v).encode())

    walk(value)
    return h.hexdigest()


def estimate_size(n_params: int, ranks: int, epochs: int) -> int:
    """Bytes one checkpoint takes, about (an upper estimate for the free-space check):
    parameters, the best epoch's parameters and up to two optimizer slots in
    float32, each rank's generator states, one history record per epoch, and
    best.pt (the best epoch's parameters again)."""
    return 20 * n_params + 8192 * ranks + 4096 * epochs + (512 << 10)


def save(directory: str | os.PathLike, payload: dict, name: str = FILENAME) -> Path:
    """Write ``payload`` atomically to ``<directory>/<name>`` (``checkpoint.pt``, or
    ``best.pt``: :data:`BEST_NAME`); returns the path.

    The directory must exist (the run created it when it checked its outputs).

    Raises:
        WriteFailed: the file cannot be written (disk full, read-only, the
            directory removed); the previous checkpoint is intact.
    """
    import torch  # deferred: module docstring

    directory = Path(directory)
    target = directory / name
    body = _plain({"format": FORMAT, "version": VERSION, **payload})
    body["digest"] = _digest(body)
    buffer = io.BytesIO()
    torch.save(body, buffer)
    outputs.replace_file(target, buffer.getbuffer(), lambda reason: (
        f"cannot write the checkpoint {target}: {reason}; the previous checkpoint (if any) "
        "is intact"), mode=0o600, sync_directory=True)
    return target


def load(directory: str | os.PathLike) -> dict | None:
    """The checkpoint in ``directory``, or None when there is none.

    Raises:
        CheckpointError: the file exists but is not a readable mpidp checkpoint.
    """
    return load_file(path_in(directory), missing_ok=True, option="--checkpoint-dir")


def file_kind(path: str | os.PathLike) -> str:
    """``"hdf5"``, ``"zip"`` (torch's format) or ``"other"``, by the first bytes."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(8)
    except OSError:
        return "other"
    if head.startswith(HDF5_SIGNATURE):
        return "hdf5"
    if head.startswith(_ZIP_SIGNATURE):
        return "zip"
    return "other"


def check_data_path(path: str | os.PathLike) -> None:
    """Raise DataError when the ``--data`` of eval or audit is a checkpoint
    (the two options swapped), before the HDF5 reader says something obscure."""
    if os.path.isdir(path) and exists_in(path) or file_kind(path) == "zip":
        raise DataError(f"--data {path} is a checkpoint, not a prepared data file: are "
                        "--checkpoint and --data swapped?")


def load_file(path: str | os.PathLike, missing_ok: bool = False,
              option: str = "--checkpoint") -> dict | None:
    """Load a checkpoint file or the checkpoint of a directory (see :func:`load`).

    Raises:
        CheckpointError: missing (unless ``missing_ok``), not a checkpoint
            (a prepared HDF5 file: probably ``--checkpoint`` and ``--data``
            swapped), truncated, corrupt, or of an unknown version.
    """
    import torch  # deferred: module docstring

    path = Path(path)
    if path.is_dir():
        path = path_in(path)
    if not path.exists():
        if missing_ok:
            return None
        raise CheckpointError(f"checkpoint {path} does not exist")
    kind = file_kind(path)
    if kind == "hdf5":
        raise CheckpointError(
            f"--checkpoint {path} is a prepared data file (HDF5), not a checkpoint: are "
            "--checkpoint and --data swapped?" if option == "--checkpoint" else
            f"{path} is a prepared data file (HDF5), not the run's checkpoint ({option} "
            "names the directory a run keeps its checkpoint in)")
    if kind != "zip":
        raise CheckpointError(f"{path} is not an mpidp checkpoint (not a file written by "
                              "mpidp train, or its beginning is damaged)")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means "corrupt"
        if "weights_only" in str(exc) or "Weights only" in str(exc):
            raise CheckpointError(f"{path} holds objects an mpidp checkpoint never "
                                  "contains; it was not loaded (mpidp never runs code "
                                  "from a checkpoint)") from None
        raise CheckpointError(f"{path} is truncated or corrupt ({type(exc).__name__}); "
                              "it cannot be loaded") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an mpidp checkpoint")
    if payload.get("version") not in _READABLE:
        raise CheckpointError(f"{path}: checkpoint version {payload.get('version')} is not "
                              f"supported (this mpidp reads {_READABLE})")
    if payload["version"] >= 2:
        recorded = payload.pop("digest", None)
        if recorded is None or recorded != _digest(payload):
            raise CheckpointError(f"{path} is corrupt: its contents do not match the "
                                  "digest written with them; it cannot be loaded")
    return payload


def describe(payload: dict) -> str:
    """``step 150 (1 of 3 epochs done), epsilon 0.712 spent`` for messages."""
    step, per_epoch = int(payload.get("step", 0)), int(payload.get("steps_per_epoch") or 1)
    epochs = payload.get("config", {}).get("epochs")
    text = f"step {step} ({step // per_epoch}" + (f" of {epochs}" if epochs else "")
    text += " epochs done)"
    if payload.get("epsilon") is not None:
        text += f", epsilon {payload['epsilon']:.3f} spent"
    return text
