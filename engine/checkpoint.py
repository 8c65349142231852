"""A run's checkpoint directory: the atomic checkpoint, and the lock of the run using it.

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
model.

``<dir>/lock`` exists while a run uses the directory (:func:`acquire`): one
JSON object naming the holder (host, PID, Slurm job, step and restart
count, start time, command). A second run into the same directory is
refused, naming the holder; a lock whose holder is provably gone (same host
and the process no longer runs; an earlier run of the same Slurm job,
before its requeue; a Slurm job that no longer runs) is taken over and the
run says so, and a lock whose holder cannot be checked (another host,
no Slurm) is never broken: the message says how to remove it.

The checkpoint is the resume file, never a file to publish: it is as
sensitive as the training data (the run's seed and the noise generators'
states, which with the model undo the noise; the exact validation and test
figures of every epoch, which a bit-identical resume needs to keep
selecting and to rewrite the metrics file): keep the directory private.
``<dir>/best.pt`` (:func:`published`) is the file to publish: the selected
model and only what the epsilon it states covers.

torch is imported inside the functions that need it: the lock and the
output checks run before it loads, so a refused run answers at once.
"""
from __future__ import annotations

import datetime
import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import kernels.files
from engine import outputs
from engine.errors import (CheckpointError, DataError, DirectoryLocked, MpidpError,
                           WriteFailed, agree)

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
LOCK_NAME = "lock"
FORMAT = "mpidp-checkpoint"
#: 2: the contents carry a SHA-256 (``digest``). Version 1 files (no digest) still load.
VERSION = 2
_READABLE = (1, 2)
_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_ZIP_SIGNATURE = b"PK\x03\x04"


def path_in(directory: str | os.PathLike) -> Path:
    return Path(directory) / FILENAME


def best_path_in(directory: str | os.PathLike) -> Path:
    return Path(directory) / BEST_NAME


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
    return load_file(path_in(directory), missing_ok=True)


def file_kind(path: str | os.PathLike) -> str:
    """``"hdf5"``, ``"zip"`` (torch's format) or ``"other"``, by the first bytes."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(8)
    except OSError:
        return "other"
    if head.startswith(_HDF5_SIGNATURE):
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
        raise CheckpointError(f"{option} {path} is a prepared data file (HDF5), not a "
                              "checkpoint: are --checkpoint and --data swapped?")
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


# ---------------------------------------------------------------------- lock
def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux), or None."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            text = handle.read()
        return int(text[text.rindex(")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _slurm_env(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value else None


def _me(command: str | None) -> dict:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "pid_started": _start_time(pid),
            "slurm_job_id": _slurm_env("SLURM_JOB_ID"),
            "slurm_step_id": _slurm_env("SLURM_STEP_ID"),
            "slurm_restart_count": int(os.environ.get("SLURM_RESTART_COUNT") or 0),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": command if command is not None else " ".join(sys.argv),
            "nonce": uuid.uuid4().hex}


def holder_text(holder: dict) -> str:
    """``pid 123 on host n1 (Slurm job 45, step 0), since 2026-...``"""
    text = f"pid {holder.get('pid')} on host {holder.get('host')}"
    if holder.get("slurm_job_id"):
        text += f" (Slurm job {holder['slurm_job_id']}"
        if holder.get("slurm_step_id") is not None:
            text += f", step {holder['slurm_step_id']}"
        text += ")"
    if holder.get("started"):
        text += f", since {holder['started']}"
    return text


def _squeue(*args: str) -> tuple[int, str, str] | None:
    tool = shutil.which("squeue")
    if tool is None:
        return None
    try:
        done = subprocess.run([tool, "-h", *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.returncode, done.stdout.strip(), done.stderr.strip()


def _slurm_verdict(job: str, step: str | None) -> tuple[str, str]:
    """("alive" | "gone" | "unknown", why) for a holder inside Slurm job ``job``."""
    found = _squeue("-j", job, "-o", "%T")
    if found is None:
        return "unknown", f"cannot ask Slurm about job {job} (no squeue here)"
    code, out, err = found
    if code != 0:
        if "Invalid job id" in err:
            return "gone", f"Slurm job {job} has ended"
        return "unknown", f"squeue could not tell about job {job} ({err or code})"
    state = out.split()[0] if out else ""
    if state not in ("RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STOPPED",
                     "SIGNALING", "RESIZING"):
        return "gone", f"Slurm job {job} is {state or 'no longer listed'}"
    if step is not None:
        steps = _squeue("-s", "-j", job, "-o", "%i")
        if steps is not None and steps[0] == 0 and f"{job}.{step}" not in steps[1].split():
            return "gone", f"step {step} of Slurm job {job} has ended"
    return "alive", f"Slurm job {job} is {state}"


def holder_verdict(holder: dict) -> tuple[str, str]:
    """Whether the run named by a lock still runs: ("alive" | "gone" | "unknown", why).

    "gone" only when provably so: on this host, by the process table (PID and
    start time); in Slurm, an earlier run of this same job (it was requeued)
    or a job or step that no longer runs.
    """
    job = holder.get("slurm_job_id")
    mine = _slurm_env("SLURM_JOB_ID")
    restarts = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    if job and job == mine and int(holder.get("slurm_restart_count") or 0) < restarts:
        return "gone", f"it was an earlier run of this Slurm job {job}, before its requeue"
    pid = holder.get("pid")
    if holder.get("host") == socket.gethostname() and isinstance(pid, int):
        if not _pid_alive(pid):
            return "gone", f"process {pid} no longer runs"
        started = holder.get("pid_started")
        if started is not None and _start_time(pid) not in (None, started):
            return "gone", f"process {pid} no longer runs (its number now belongs to another)"
        return "alive", f"process {pid} runs"
    if job:
        return _slurm_verdict(str(job), holder.get("slurm_step_id"))
    return "unknown", ("it was taken on another host outside Slurm, where mpidp cannot check "
                       "whether it still runs")


@dataclass
class Lock:
    """This run's hold on a checkpoint directory (see :func:`acquire`)."""

    path: Path
    holder: dict
    note: str | None = None  # a stale lock that was taken over, said once by the run
    created: bool = False  # this run created the directory: removed again if left empty

    def held(self) -> bool:
        """Whether the lock file still names this run."""
        try:
            return json.loads(self.path.read_text()).get("nonce") == self.holder["nonce"]
        except (OSError, ValueError, AttributeError):
            return False

    def check(self) -> None:
        """Raise :class:`DirectoryLocked` unless the lock still names this run
        (checked before each checkpoint: never overwrite another run's)."""
        if not self.held():
            try:
                other = holder_text(json.loads(self.path.read_text()))
            except (OSError, ValueError, AttributeError):
                other = "nobody (the lock file was removed)"
            raise DirectoryLocked(f"{self.path.parent}: this run no longer holds its lock "
                                  f"(now {other}); not writing the checkpoint")

    def release(self) -> None:
        """Remove the lock file if it still names this run (idempotent), and the
        directory too when this run created it and wrote nothing there (a run
        refused at start-up leaves nothing behind)."""
        if self.held():
            try:
                self.path.unlink()
            except OSError:
                pass
        if self.created:
            _remove_if_empty(self.path.parent)


def release_everywhere(lock: "Lock | None", comm) -> None:
    """Collective: the holder (rank 0) removes ``lock``, then every rank
    returns, so no rank returns while the directory still looks busy to the
    caller's next command or check."""
    if lock is not None:
        lock.release()
    comm.Barrier()


def _remove_if_empty(directory: Path) -> None:
    try:
        directory.rmdir()  # only succeeds when empty
    except OSError:
        pass


def _write_new(path: Path, holder: dict) -> bool:
    """Create the lock file with ``holder``; False when it exists."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as handle:
        json.dump(holder, handle, indent=1)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())
    return True


def acquire(directory: str | os.PathLike, command: str | None = None) -> Lock:
    """Take ``<directory>/lock`` for this run (rank 0, before any work).

    Raises:
        DirectoryLocked: another run holds it, or held it and cannot be shown
            to be gone (the message names it and says how to proceed).
        WriteFailed: the lock file cannot be written.
    """
    path = Path(directory) / LOCK_NAME
    me = _me(command)
    try:
        if _write_new(path, me):
            return Lock(path, me)
        try:
            holder = json.loads(path.read_text())
            if not isinstance(holder, dict):
                raise ValueError("not an object")
        except (OSError, ValueError) as exc:
            raise DirectoryLocked(f"{directory} is locked ({path} exists but cannot be read: "
                                  f"{exc}); if no run uses the directory, remove {path}") \
                from None
        verdict, why = holder_verdict(holder)
        who = holder_text(holder)
        if verdict == "alive":
            raise DirectoryLocked(f"{directory} is in use by another run: {who} ({why}). "
                                  "One run per checkpoint directory: wait for it, stop it, "
                                  "or choose another --checkpoint-dir")
        if verdict == "unknown":
            raise DirectoryLocked(f"{directory} is locked by {who}, and {why}. If that run "
                                  f"has ended, remove {path} and start again")
        # a run on another host may take it over at the same moment, with the
        # same process id: the temporary file is named by this run's nonce
        kernels.files.replace_file(path, json.dumps(me, indent=1) + "\n", tag=me["nonce"])
    except OSError as exc:
        raise WriteFailed(f"cannot take the lock {path}: {exc.strerror}") from None
    lock = Lock(path, me, note=f"{path} was left by {who}; {why}: taken over")
    if not lock.held():  # another run took it over at the same moment
        raise DirectoryLocked(f"{directory} was taken over by another run at the same time; "
                              "one run per checkpoint directory")
    return lock


def open_directory(directory: str | None, resume: bool, metrics: str | None,
                   comm) -> Lock | None:
    """Collective: check the run's outputs and lock its checkpoint directory,
    before any data is read (rank 0 checks and writes; every rank gets the verdict).

    ``--resume`` needs a checkpoint in the directory (a fresh run in its place
    would spend the privacy budget again); the directory is created when
    missing (its parent must exist: :mod:`engine.outputs`), must accept
    files, and is then locked for this run. Returns the lock on rank 0,
    None elsewhere (and without a directory).

    Raises (on every rank): CheckpointError, OutputError (exit 2),
    DirectoryLocked (73), WriteFailed (74).
    """
    error, lock, created = None, None, False
    if comm.Get_rank() == 0:
        try:
            if directory:
                where = directory
                created = not os.path.exists(where)
                if resume and not exists_in(where):
                    what = ("does not exist" if not os.path.exists(where)
                            else "holds no checkpoint" if os.path.isdir(where)
                            else "is not a directory")
                    raise CheckpointError(
                        f"--resume: --checkpoint-dir {where} {what}; nothing to resume. A "
                        "fresh run would spend the privacy budget again, so mpidp does not "
                        "start one: check the path, or drop --resume to start a new run")
                outputs.check_directory(where, "--checkpoint-dir")
            if metrics:
                outputs.check_file(metrics, "--metrics")
            if directory:
                lock = acquire(directory)
                lock.created = created
                # Under the lock no other run writes here: a temporary file is a
                # write that a killed run left behind.
                for name in (FILENAME, BEST_NAME):
                    for stale in Path(directory).glob(f".{name}.*.tmp"):
                        stale.unlink(missing_ok=True)
                if not resume and not exists_in(directory):
                    # a best.pt without its checkpoint belongs to no run here: a
                    # fresh run must not leave it to be taken for its own model
                    best_path_in(directory).unlink(missing_ok=True)
        except MpidpError as exc:
            error = exc
    try:
        agree(comm, error)
    except MpidpError:
        if lock is not None:
            lock.release()
        elif created:
            _remove_if_empty(Path(directory))
        raise
    return lock
