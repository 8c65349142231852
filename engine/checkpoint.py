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

import contextlib
import contextvars
import hashlib
import io
import math
import os
import stat
import zipfile
from pathlib import Path
from typing import BinaryIO

import numpy as np

from engine import outputs
from engine.errors import CheckpointError, DataError
from kernels.files import not_a_file
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
    one, else its ``checkpoint.pt``; a file gives itself. A directory's
    ``best.pt`` takes its ``data`` from the ``checkpoint.pt`` beside it (the
    run's own record, with the encoding fingerprint and the split sizes that
    ``best.pt`` leaves out), so the commands check the data file as fully as
    for the checkpoint itself; a ``best.pt`` alone is checked by its layout.

    Raises:
        CheckpointError: as :func:`load_file`, and a file that is not a model
            file (:func:`check_model_file`).
    """
    path = Path(checkpoint)
    run = path if path.is_dir() else None
    if run is not None and os.path.lexists(best_path_in(run)):  # a FIFO too: refused
        path = best_path_in(run)
    payload = load_file(path)
    check_model_file(payload, path)
    if run is not None and path == best_path_in(run) and exists_in(run):
        private = load_file(path_in(run))
        check_model_file(private, path_in(run))
        if isinstance(private.get("data"), dict):
            payload["data"] = private["data"]
    return payload


#: Settings that are paths: ``best.pt`` keeps their last component only (an
#: absolute path names the user's directories, a home directory the user).
PATH_SETTINGS = ("data", "checkpoint_dir", "metrics")


def published_data(data: dict | None) -> dict | None:
    """The data description ``best.pt`` keeps of a checkpoint's ``data``
    (``DataInfo.summary()``): the file's name, task, label definition, feature
    and class counts and ``layout_fingerprint`` (None where the checkpoint predates it), which
    ``mpidp eval`` and ``mpidp audit`` compare. Left out: the encoding's
    ``fingerprint`` (a sha256 of statistics of the training rows: one row more
    or less changes it, so it would tell who was trained on) and the rows per
    split (the validation and test sizes are not covered by the epsilon)."""
    if data is None:
        return None
    path = str(data.get("path") or "")
    return {"path": os.path.basename(path), "task": data.get("task"),
            "n_features": data.get("n_features"), "n_classes": data.get("n_classes"),
            "layout_fingerprint": data.get("layout_fingerprint"), "label": data.get("label")}


#: The stop rule that reads the data (the validation accuracy, or the test
#: accuracy of a file without a validation split): a run it stopped states its
#: budget, not what its steps spent (:func:`stated_privacy`).
DATA_STOP = "target_accuracy"
#: Why a shuffled run's epsilon is no guarantee.
SHUFFLE_REASON = ("--sampling shuffle is outside the accountant's assumption (Poisson "
                  "sampling)")

#: The ``mpidp tune`` trial being trained in this process, or None
#: (:func:`tune_trial`).
_TRIAL: contextvars.ContextVar[dict | None] = contextvars.ContextVar("mpidp_tune_trial",
                                                                    default=None)


@contextlib.contextmanager
def tune_trial(search: str | os.PathLike, trial: int):
    """Within it, every ``best.pt`` written (:func:`published`) is marked as one
    trial of the unfinished ``mpidp tune`` search ``search`` (its ``--out``):
    ``privacy.trial_of_search`` names it and ``guarantee`` is False, since the
    trial was trained and scored inside a search whose chosen model is covered
    only by the epsilon including the tuning. The search's end rewrites the
    chosen trial's file (:func:`engine.tune.report.publish`) and removes the
    others. ``mpidp tune`` wraps each trial's ``engine.train`` in it."""
    token = _TRIAL.set({"search": os.path.basename(os.path.normpath(str(search))),
                        "trial": int(trial)})
    try:
        yield
    finally:
        _TRIAL.reset(token)


def current_trial() -> dict | None:
    """The ``mpidp tune`` trial this process trains (:func:`tune_trial`), or None:
    the trainer records it in the checkpoint, so that the checkpoint and its
    ``best.pt`` both say so."""
    trial = _TRIAL.get()
    return None if trial is None else dict(trial)


def trial_reason(trial: dict) -> str:
    """Why a trial's file states no guarantee (:func:`tune_trial`)."""
    return (f"the epsilon of trial {trial.get('trial')} alone, in the unfinished mpidp tune "
            f"search {trial.get('search')}: the model that search chooses is covered only by "
            "the epsilon incl. tuning, which the search states in the chosen trial's best.pt "
            "when it ends")


def stated_privacy(config: dict, spent: float | None, budget: float | None,
                   history: list[dict] | None, trial: dict | None = None) -> dict:
    """What a run states of its privacy, from its settings (``dp``,
    ``sampling``), the epsilon its steps ``spent``, its ``budget`` and its
    per-epoch ``history``:

    - ``epsilon``: the (epsilon, delta) guarantee stated. The steps run's
      epsilon, except for a run that ``--target-accuracy`` stopped (a record
      with ``stop_reason`` ``target_accuracy``): that stop depends on the data
      (the model's validation accuracy), so the mechanism that ran is "train up
      to the planned steps, stop when the accuracy reaches the target", whose
      guarantee is the planned run's: the run's budget, which bounds every plan
      the run (resumed or not) may take. What the steps spent is then an
      ex-post privacy loss, not a guarantee (Rogers, Roth, Ullman and Vadhan
      2016, privacy odometers and filters). A ``--time-budget`` stop (the wall
      clock) and a stop by a signal read no data: their steps run are the
      mechanism.
    - ``epsilon_of``: ``"steps_run"`` or ``"budget"`` (that stop).
    - ``spent_epsilon``: the steps run's epsilon.
    - ``guarantee``: False where the figure is no guarantee
      (``not_a_guarantee`` says why: ``--sampling shuffle``; for a
      ``mpidp tune`` trial, ``trial`` or else :func:`current_trial`), True
      otherwise; None for a non-private run.
    """
    history = history or []
    trial = trial or current_trial()
    extra = {} if trial is None else {"trial_of_search": dict(trial)}
    if not (bool(config.get("dp", True)) and spent is not None):
        return {"epsilon": None, "epsilon_of": None, "spent_epsilon": None, "guarantee": None,
                "not_a_guarantee": None, **extra}
    spent = float(spent)
    on_data = budget is not None and any(r.get("stop_reason") == DATA_STOP for r in history)
    reasons = []
    if config.get("sampling") == "shuffle" or any(r.get("epsilon_valid") is False
                                                  for r in history):
        reasons.append(SHUFFLE_REASON)
    if trial is not None:
        reasons.append(trial_reason(trial))
    return {"epsilon": max(float(budget), spent) if on_data else spent,
            "epsilon_of": "budget" if on_data else "steps_run", "spent_epsilon": spent,
            "guarantee": not reasons, "not_a_guarantee": "; ".join(reasons) or None, **extra}


def statement_of(payload: dict) -> dict:
    """The privacy statement of a loaded model file, for ``mpidp eval``: a
    published file's ``privacy`` (one written before the statement said whether
    it is a guarantee: not one where its sampling was ``shuffle``), or what
    :func:`stated_privacy` states for a ``checkpoint.pt``. Adds ``delta`` and
    ``unit`` where missing (from the settings)."""
    config = payload.get("config") or {}
    privacy = payload.get("privacy")
    if isinstance(privacy, dict):
        statement = dict(privacy)
        statement.setdefault("epsilon", payload.get("epsilon"))
        if "guarantee" not in statement and statement.get("epsilon") is not None:
            shuffled = (statement.get("sampling") or config.get("sampling")) == "shuffle"
            statement.update(guarantee=not shuffled,
                             not_a_guarantee=SHUFFLE_REASON if shuffled else None)
    else:
        statement = stated_privacy(config, payload.get("epsilon"),
                                   payload.get("budget_epsilon"), payload.get("history"),
                                   payload.get("trial_of_search"))
    statement.setdefault("delta", config.get("delta") if statement.get("epsilon") is not None
                         else None)
    statement.setdefault("unit", config.get("privacy_unit", "person"))
    return statement


def stated_unit(statement: dict, is_image: bool) -> str:
    """What the epsilon of ``statement`` (:func:`statement_of`) protects, in the
    words ``mpidp eval`` and ``mpidp audit`` print: ``person``, ``household``,
    or ``image`` for a person-level run on an image file (a row is an image)."""
    unit = statement.get("unit")
    unit = unit if unit in ("person", "household") else "person"
    return "image" if unit == "person" and is_image else unit


def epsilon_text(statement: dict, unit: str) -> str:
    """The epsilon a statement states, in words, as the done line of ``mpidp
    train`` and ``mpidp eval`` print it: ``epsilon 1.000 per person (delta
    1e-05)``, ``... incl. tuning``, ``..., the budget of the planned run, which
    --target-accuracy stopped on the data (0.583 spent by the steps run)``,
    ``..., NOT a guarantee: REASON``; ``non-private`` without an epsilon.
    ``unit``: ``person``, ``household`` or ``image``."""
    eps = statement.get("epsilon")
    if eps is None:
        return "non-private"
    delta = statement.get("delta")
    text = f"epsilon {eps:.3f} per {unit}" + (f" (delta {delta:g})" if delta is not None
                                               else "")
    if statement.get("includes_tuning"):
        text += " incl. tuning"
    if statement.get("epsilon_of") == "budget":
        spent = statement.get("spent_epsilon")
        text += (", the budget of the planned run, which --target-accuracy stopped on the data"
                 + (f" ({spent:.3f} spent by the steps run)" if spent is not None else ""))
    if statement.get("guarantee") is False:
        text += f", NOT a guarantee: {statement.get('not_a_guarantee') or 'see its privacy'}"
    return text


def published(checkpoint: dict, best: dict | None) -> dict:
    """The contents of ``best.pt`` for a checkpoint's payload: the selected
    model and only what the epsilon it states covers.

    Kept: the model description, the data's public layout
    (:func:`published_data`), the settings without the seed (paths cut to
    their last component), the parameters of ``best`` (the selected epoch:
    ``{"epoch", "step", "params", ...}``; None: the checkpoint's own), the
    epsilon stated and a ``privacy`` statement (epsilon, delta, unit,
    accountant, noise multiplier, sampling; :func:`stated_privacy`'s
    ``epsilon_of``, ``spent_epsilon``, ``guarantee`` and ``not_a_guarantee``,
    and ``trial_of_search`` inside ``mpidp tune``; ``includes_tuning`` False:
    the chosen trial's is rewritten by ``mpidp tune``). The epsilon stated is
    the steps run's, or for a run that ``--target-accuracy`` stopped its
    budget. Left out: the seed (with
    it the noise and the batches can be drawn again, and the guarantee is
    gone), the generator states and optimizer, the history, every exact
    validation or test figure (the epsilon covers the training rows, not the
    scores), the split sizes, and anything computed from the training rows'
    values (the encoding's fingerprint hashes their means and deviations).
    """
    config = {k: (os.path.basename(os.path.normpath(v)) if k in PATH_SETTINGS and v else v)
              for k, v in checkpoint["config"].items() if k != "seed"}
    accountant = checkpoint.get("accountant") or {}
    stated = stated_privacy(checkpoint["config"], checkpoint.get("epsilon"),
                            checkpoint.get("budget_epsilon"), checkpoint.get("history"),
                            checkpoint.get("trial_of_search"))
    dp = stated["epsilon"] is not None
    privacy = {"epsilon": stated["epsilon"],
               "delta": config.get("delta") if dp else None,
               "unit": config.get("privacy_unit", "person"),
               "accountant": config.get("accountant") if dp else None,
               "noise_multiplier": accountant.get("sigma") if dp else None,
               "sampling": config.get("sampling"), "includes_tuning": False,
               **{k: v for k, v in stated.items() if k != "epsilon"}}
    selected = None
    if best is not None:
        selected = {"epoch": best["epoch"], "step": best["step"],
                    "on": config.get("select_on") or "val_accuracy",
                    "run_step": checkpoint["step"]}
    return {"config": config, "world_size": checkpoint.get("world_size"),
            "data": published_data(checkpoint.get("data")), "model": checkpoint["model"],
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


def _not_regular(path: str | os.PathLike) -> str | None:
    """What ``path`` is where it exists but is no regular file (``"a named pipe
    (FIFO)"``, ``"a directory"``, ...), else None: opening a FIFO or a device
    blocks or has effects, so nothing is opened before this is None."""
    if os.path.isdir(path):
        return "a directory"
    return not_a_file(path)


def _open_regular(path: str | os.PathLike) -> BinaryIO:
    """``path`` opened for reading, refused unless it is a regular file.

    Checked before opening (a FIFO's open would wait for a writer), and again
    on the open file (without blocking), so a path swapped in between is
    refused too.

    Raises:
        CheckpointError: not a regular file.
        OSError: it cannot be opened.
    """
    special = _not_regular(path)
    if special is None:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.set_blocking(fd, True)
            return os.fdopen(fd, "rb")
        os.close(fd)
        special = "no regular file"
    raise CheckpointError(f"{path} is {special}, not a checkpoint file: name a file "
                          "written by mpidp train (checkpoint.pt, best.pt) or its run's "
                          "directory")


def file_kind(path: str | os.PathLike) -> str:
    """``"hdf5"``, ``"zip"`` (torch's format) or ``"other"``, by the first bytes;
    ``"other"`` without opening it for anything but a regular file."""
    try:
        with _open_regular(path) as handle:
            head = handle.read(8)
    except (OSError, CheckpointError):
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
        CheckpointError: missing (unless ``missing_ok``), no regular file (a
            FIFO, a device, a socket, a directory: refused before it is
            opened), not a checkpoint (a prepared HDF5 file: probably
            ``--checkpoint`` and ``--data`` swapped), a zip archive with a
            compressed record or records larger than the file
            (:func:`check_archive`, before torch reads it), truncated,
            corrupt, or of an unknown version.
    """
    path = Path(path)
    if path.is_dir():
        path = path_in(path)
    if not path.exists():
        if missing_ok:
            return None
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        with _open_regular(path) as handle:
            return _load_open(path, handle, option)
    except OSError as exc:
        raise CheckpointError(f"checkpoint {path} cannot be read: "
                              f"{exc.strerror or exc}") from None


def check_archive(handle: BinaryIO, path: str | os.PathLike) -> None:
    """Refuse a zip archive that torch would inflate or allocate beyond the file.

    ``torch.save`` stores every record uncompressed, so a record compressed
    (deflate: a small file that inflates to gigabytes) is no checkpoint, and
    the records' declared sizes together cannot exceed the file's size. Read
    from the central directory only; nothing is inflated.

    Raises:
        CheckpointError: a compressed record, sizes beyond the file's, or an
            archive zipfile cannot read (truncated or corrupt).
    """
    size = os.fstat(handle.fileno()).st_size
    try:
        records = zipfile.ZipFile(handle).infolist()
    except Exception as exc:  # noqa: BLE001 - any failure to read the directory: corrupt
        raise CheckpointError(f"{path} is truncated or corrupt ({type(exc).__name__}); "
                              "it cannot be loaded") from None
    declared = 0
    for record in records:
        if record.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(f"{path} holds a compressed record ({record.filename[:80]!r})"
                                  "; mpidp never compresses a checkpoint: not loaded")
        declared += record.file_size
    if declared > size:
        raise CheckpointError(f"{path}: its records declare {declared:,} bytes in a file of "
                              f"{size:,}; it is damaged or forged: not loaded")
    handle.seek(0)


#: Nesting a checkpoint never exceeds (dicts and lists inside one another).
MAX_DEPTH = 32


def check_tensors_held(payload: dict, file_size: int, path: str | os.PathLike) -> None:
    """Refuse a loaded payload whose tensors claim more memory than the file
    holds, or that nests deeper than :data:`MAX_DEPTH`, before anything
    copies or hashes it.

    ``torch.save`` writes the storages it saves: a view with zero strides over
    one stored element (``expand``) would become gigabytes in the digest, the
    checks and the forward pass; so every tensor's storage must hold as many
    bytes as its elements, and the storages together fit in the file.

    Raises:
        CheckpointError: ``"{path} is not an mpidp model file: ..."``.
    """
    import torch  # deferred: module docstring

    storages: dict[int, int] = {}
    stack = [(payload, 0)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise CheckpointError(f"{path} is not an mpidp model file: it nests deeper than "
                                  f"{MAX_DEPTH} levels")
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend((v, depth + 1) for v in value)
        elif isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            need = value.numel() * value.element_size()
            held = storage.nbytes() - value.storage_offset() * value.element_size()
            if need > held:
                raise CheckpointError(f"{path} is not an mpidp model file: a tensor of "
                                      f"shape {tuple(value.shape)} is a view over "
                                      f"{max(held, 0):,} stored bytes, not {need:,}")
            storages[storage.data_ptr()] = storage.nbytes()
    total = sum(storages.values())
    if total > file_size:
        raise CheckpointError(f"{path} is not an mpidp model file: its tensors claim "
                              f"{total:,} bytes in a file of {file_size:,}")


def _load_open(path: Path, handle: BinaryIO, option: str) -> dict:
    """:func:`load_file` once ``path`` is open as a regular file."""
    import torch  # deferred: module docstring

    head = handle.read(8)
    handle.seek(0)
    kind = "hdf5" if head.startswith(HDF5_SIGNATURE) else \
        "zip" if head.startswith(_ZIP_SIGNATURE) else "other"
    if kind == "hdf5":
        raise CheckpointError(
            f"--checkpoint {path} is a prepared data file (HDF5), not a checkpoint: are "
            "--checkpoint and --data swapped?" if option == "--checkpoint" else
            f"{path} is a prepared data file (HDF5), not the run's checkpoint ({option} "
            "names the directory a run keeps its checkpoint in)")
    if kind != "zip":
        raise CheckpointError(f"{path} is not an mpidp checkpoint (not a file written by "
                              "mpidp train, or its beginning is damaged)")
    check_archive(handle, path)
    try:
        payload = torch.load(handle, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means "corrupt"
        if "weights_only" in str(exc) or "Weights only" in str(exc):
            raise CheckpointError(f"{path} holds objects an mpidp checkpoint never "
                                  "contains; it was not loaded (mpidp never runs code "
                                  "from a checkpoint)") from None
        raise CheckpointError(f"{path} is truncated or corrupt ({type(exc).__name__}); "
                              "it cannot be loaded") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an mpidp checkpoint")
    check_tensors_held(payload, os.fstat(handle.fileno()).st_size, path)
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


# ------------------------------------------------------- what a model file holds
def check_model_file(payload: dict, path: str | os.PathLike, resume: bool = False,
                     collective: bool = False) -> None:
    """Refuse a loaded file whose contents are not what mpidp writes, in one line.

    A valid digest proves only that the file is whole: anyone can write one
    with :func:`save`. Checked: the keys and types that ``mpidp eval``,
    ``mpidp audit`` and (``resume``) ``mpidp train --resume`` read, the
    model's description against its parameters (an MLP's widths must give
    exactly the parameter count; nothing is built to find out), and finite
    parameters.

    Raises:
        CheckpointError: ``PATH is not an mpidp model file: WHAT``
            (``collective`` as given: True where every rank read the file).
    """
    problem = _model_file_problem(payload, resume)
    if problem is not None:
        raise CheckpointError(f"{path} is not an mpidp model file: {problem}",
                              collective=collective)


def _what(value) -> str:
    """``a str ('lots')``: a value of the wrong type, shortly."""
    text = repr(value)
    return f"a {type(value).__name__} ({text if len(text) <= 40 else text[:37] + '...'})"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and not math.isnan(value)


def _params_problem(name: str, params, count: int | None) -> str | None:
    """Why ``params`` is not a flat, finite float vector (of ``count`` values)."""
    import torch  # deferred: module docstring

    if not isinstance(params, torch.Tensor):
        return f"{name} is {_what(params)}, not a tensor"
    if params.dim() != 1 or not params.is_floating_point() or params.numel() == 0:
        return (f"{name} is a {params.dtype} tensor of shape {list(params.shape)}, not a "
                "flat vector of floats")
    if count is not None and params.numel() != count:
        return f"{name} holds {params.numel():,} values, params {count:,}"
    if not bool(torch.isfinite(params).all()):
        return f"{name} holds NaN or infinite values (a diverged or altered model)"
    return None


def _mlp_problem(entry: dict, where: str, n_params: int) -> str | None:
    """Why an MLP's ``{"dims", "activation"}`` does not describe ``n_params`` values."""
    from engine.nn.mlp import ACTIVATIONS  # deferred: torch

    dims = entry.get("dims")
    if not isinstance(dims, list) or len(dims) < 2 \
            or not all(_is_int(d) and d >= 1 for d in dims):
        return f"{where} dims are {_what(dims)}, not two or more positive widths"
    activation = entry.get("activation", "relu")
    if activation not in ACTIVATIONS:
        return f"{where} activation is {_what(activation)}, not one of {list(ACTIVATIONS)}"
    count = sum(dims[i + 1] * (dims[i] + 1) for i in range(len(dims) - 1))
    if count != n_params:
        shown = "-".join(map(str, dims))
        return f"{where} dims {shown[:60]} need {count:,} parameters, params holds {n_params:,}"
    return None


def _module_problem(model: dict, n_params: int) -> str | None:
    """Why a ``{"kind": "module", ...}`` entry is not one mpidp writes."""
    from engine.nn.model_names import BUILTIN

    name = model.get("name")
    if not isinstance(name, str) or not name:
        return f"model name is {_what(name)}, not a model's name"
    if "n_params" in model and model["n_params"] != n_params:
        return f"model n_params is {_what(model['n_params'])}, params holds {n_params:,}"
    if "fused" in model:
        if not isinstance(model["fused"], dict):
            return f"model fused is {_what(model['fused'])}, not a dict"
        return _mlp_problem(model["fused"], "model fused", n_params)
    frozen = model.get("frozen", {"names": [], "sha256": ""})
    if not isinstance(frozen, dict) or not isinstance(frozen.get("names"), list) \
            or not all(isinstance(n, str) for n in frozen["names"]) \
            or not isinstance(frozen.get("sha256"), str):
        return f"model frozen is {_what(frozen)}, not {{'names': [...], 'sha256': '...'}}"
    buffers = model.get("buffers", {})
    if not isinstance(buffers, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in buffers.items()):
        return f"model buffers is {_what(buffers)}, not {{name: sha256}}"
    if name in BUILTIN:  # embedding-mlp, the image models: rebuilt from their spec
        spec = model.get("spec")
        if not isinstance(spec, dict) or not _is_int(spec.get("n_classes")):
            return f"model spec of {name} is {_what(spec)}, not its widths"
        widths = spec.get("image_shape" if name != "embedding-mlp" else "hidden")
        if not isinstance(widths, list) or not all(_is_int(w) and w >= 1 for w in widths):
            return f"model spec of {name} holds {_what(widths)}, not positive widths"
        if name == "embedding-mlp" and (
                not _is_int(spec.get("n_features"))
                or not isinstance(spec.get("code_columns"), list)
                or not all(isinstance(c, list) and len(c) >= 2
                           and all(_is_int(v) and v >= 0 for v in c[:2])
                           for c in spec["code_columns"])):
            return f"model spec of {name} is {_what(spec)}, not its columns and widths"
    return None


#: Entries that are numbers where present (None allowed).
_NUMBERS = ("epsilon", "budget_epsilon")
#: Entries that are dicts where present (None allowed).
_DICTS = ("privacy", "selected", "accountant", "config")
#: What ``mpidp train --resume`` reads besides a model file's entries.
_RESUME_KEYS = {"config": dict, "data": dict, "seed": int, "world_size": int, "ranks": list,
                "optimizer": dict, "history": list}


def _model_file_problem(payload: dict, resume: bool) -> str | None:
    """What is wrong with a loaded payload (:func:`check_model_file`), or None."""
    for key in ("model", "params"):
        if key not in payload:
            return f"it has no {key!r} entry (a model file holds 'model' and 'params')"
    model = payload["model"]
    if not isinstance(model, dict):
        return f"model is {_what(model)}, not a dict"
    problem = _params_problem("params", payload["params"], None)
    if problem is not None:
        return problem
    n_params = payload["params"].numel()
    kind = model.get("kind", "mlp")
    if kind not in ("mlp", "module"):
        return f"model kind is {_what(kind)}, not 'mlp' or 'module'"
    problem = (_mlp_problem(model, "model", n_params) if kind == "mlp"
               else _module_problem(model, n_params))
    if problem is not None:
        return problem
    best = payload.get("best")
    if best is not None:
        if not isinstance(best, dict) or "params" not in best:
            return f"best is {_what(best)}, not a selected epoch with its params"
        problem = _params_problem("best params", best["params"], n_params)
        if problem is not None:
            return problem
    for key in _NUMBERS:
        if payload.get(key) is not None and not _is_number(payload[key]):
            return f"{key} is {_what(payload[key])}, not a number"
    for key in ("step", "steps_per_epoch"):
        if payload.get(key) is not None and not (_is_int(payload[key]) and payload[key] >= 0):
            return f"{key} is {_what(payload[key])}, not a count"
    data = payload.get("data")
    if data is not None and not isinstance(data, dict):
        return f"data is {_what(data)}, not a dict"
    for key in _DICTS:
        if payload.get(key) is not None and not isinstance(payload[key], dict):
            return f"{key} is {_what(payload[key])}, not a dict"
    problem = _details_problem(payload)
    if problem is None and resume:
        problem = _resume_problem(payload)
    return problem


def _details_problem(payload: dict) -> str | None:
    """The entries inside ``data``, ``config``, ``privacy`` and ``selected``
    that eval and audit print, compare or train a reference model with."""
    data = payload.get("data") or {}
    for key in ("path", "task", "fingerprint"):
        if data.get(key) is not None and not isinstance(data[key], str):
            return f"data {key} is {_what(data[key])}, not a text"
    for key in ("n_features", "n_classes"):
        if data.get(key) is not None and not _is_int(data[key]):
            return f"data {key} is {_what(data[key])}, not a count"
    rows = data.get("rows")
    if rows is not None and (not isinstance(rows, dict)
                             or not all(_is_int(v) for v in rows.values())):
        return f"data rows is {_what(rows)}, not the rows per split"
    config = payload.get("config") or {}
    for key in ("epochs", "batch_size"):
        if config.get(key) is not None and not (_is_int(config[key]) and config[key] >= 1):
            return f"config {key} is {_what(config[key])}, not a count"
    for key in ("lr", "delta"):
        if config.get(key) is not None and not _is_number(config[key]):
            return f"config {key} is {_what(config[key])}, not a number"
    for key in ("model", "optimizer"):
        if config.get(key) is not None and not isinstance(config[key], str):
            return f"config {key} is {_what(config[key])}, not a text"
    if payload.get("trial_of_search") is not None \
            and not isinstance(payload["trial_of_search"], dict):
        return f"trial_of_search is {_what(payload['trial_of_search'])}, not a dict"
    privacy = payload.get("privacy") or {}
    for key in ("epsilon", "trial_epsilon", "spent_epsilon", "delta", "noise_multiplier"):
        if privacy.get(key) is not None and not _is_number(privacy[key]):
            return f"privacy {key} is {_what(privacy[key])}, not a number"
    for key in ("unit", "not_a_guarantee", "epsilon_of", "sampling"):
        if privacy.get(key) is not None and not isinstance(privacy[key], str):
            return f"privacy {key} is {_what(privacy[key])}, not a text"
    for key, kind in (("guarantee", bool), ("includes_tuning", bool),
                      ("trial_of_search", dict)):
        if privacy.get(key) is not None and not isinstance(privacy[key], kind):
            return f"privacy {key} is {_what(privacy[key])}, not a {kind.__name__}"
    selected = payload.get("selected") or {}
    for key in ("epoch", "step", "run_step"):
        if selected.get(key) is not None and not _is_int(selected[key]):
            return f"selected {key} is {_what(selected[key])}, not a count"
    return None


def _resume_problem(payload: dict) -> str | None:
    """What ``mpidp train --resume`` reads beyond a model file (the caller has
    already told a published model, which lacks the generator states, apart)."""
    for key, kind in _RESUME_KEYS.items():
        value = payload.get(key)
        if not isinstance(value, kind) or kind is int and not _is_int(value):
            return f"{key} is {_what(value)}, not a {kind.__name__}"
    if not isinstance(payload["config"].get("model", "mlp"), str):
        return f"config model is {_what(payload['config']['model'])}, not a text"
    if payload["world_size"] < 1 or len(payload["ranks"]) != payload["world_size"]:
        return (f"ranks holds {len(payload['ranks'])} states for world_size "
                f"{payload['world_size']}")
    data = payload["data"]
    for key in ("rows", "n_features", "path", "fingerprint"):
        if key not in data:
            return f"data has no {key!r} entry (the training file a resume compares)"
    return None
