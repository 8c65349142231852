"""The lock of a checkpoint directory: one run at a time, a gone holder taken over.

``<dir>/lock`` exists while a run uses the directory (:func:`acquire`): one
JSON object naming the holder (host, PID, Slurm job, step and restart
count, start time, command). A second run into the same directory is
refused, naming the holder; a lock whose holder is provably gone (same host
and the process no longer runs; an earlier run of the same Slurm job,
before its requeue; a Slurm job that no longer runs) is taken over and the
run says so, and a lock whose holder cannot be checked (another host,
no Slurm) is never broken: the message says how to remove it.
:func:`open_directory` checks a run's outputs and takes the lock, before
any data is read and before torch loads, so a refused run answers at once.
"""
from __future__ import annotations

import datetime
import json
import os
import shutil
import socket
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import kernels.files
from engine import outputs
from engine.checkpoint import BEST_NAME, FILENAME, best_path_in, exists_in, run_files
from engine.errors import (CheckpointError, ConfigError, DirectoryLocked, MpidpError,
                           OutputError, WriteFailed, agree)

LOCK_NAME = "lock"


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
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(holder, handle, indent=1)
            handle.write("\n")
            handle.flush()
            os.fsync(handle.fileno())
    except OSError:  # a full disk: an empty lock left here would refuse every later run
        path.unlink(missing_ok=True)
        raise
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


#: Where ``--resume`` is given without a directory (the command checks the rest of a
#: resume's settings only after reading its checkpoint, so this comes first).
RESUME_NEEDS_DIRECTORY = ("--resume needs --checkpoint-dir DIR, the directory of the run to "
                          "continue; without it a fresh run would start, spending the privacy "
                          "budget again")


def _check_run_files(directory: str) -> None:
    """Raise OutputError when the run's own files in ``directory`` (checkpoint.pt,
    best.pt) are there as something no file can replace (a directory, a device):
    found only at the first write, after the run had spent privacy budget."""
    for path in run_files(directory, "the run").values():
        what = ("a directory" if path.is_dir() else kernels.files.not_a_file(path))
        if what is not None:
            raise OutputError(f"--checkpoint-dir {directory}: {path} is {what}, where the run "
                              f"keeps its file {path.name}: remove it, or choose another "
                              "--checkpoint-dir")


def open_directory(directory: str | None, resume: bool, metrics: str | None,
                   comm, data: str | None = None) -> Lock | None:
    """Collective: check the run's outputs and lock its checkpoint directory,
    before any data is read (rank 0 checks and writes; every rank gets the verdict).

    ``--resume`` needs a directory (``resume`` without one is refused) holding
    a checkpoint (a fresh run in its place
    would spend the privacy budget again); the directory is created when
    missing (its parent must exist: :mod:`engine.outputs`), must accept
    files, and is then locked for this run. Returns the lock on rank 0,
    None elsewhere (and without a directory).

    ``data`` (the run's input file) and the directory's own files are no
    place for the metrics.

    Raises (on every rank): ConfigError (``resume`` without a directory),
    CheckpointError, OutputError (exit 2: also a
    ``--metrics`` that names ``data`` or one of the directory's files, and an
    empty path),
    DirectoryLocked (73), WriteFailed (74).
    """
    error, lock, created = None, None, False
    if comm.Get_rank() == 0:
        try:
            for option, path in (("--checkpoint-dir", directory), ("--metrics", metrics)):
                outputs.check_not_empty(path, option)
            if resume and not directory:
                raise ConfigError(RESUME_NEEDS_DIRECTORY)
            if directory:
                where = directory
                created = not os.path.exists(where)
                if os.path.isdir(where):  # before --resume's check, which would say "none"
                    _check_run_files(where)
                if resume and not exists_in(where):
                    if os.path.isdir(where) and os.path.exists(Path(where) / LOCK_NAME):
                        # a run that holds it and has not written its first
                        # checkpoint yet: say who (73), not "nothing to resume"
                        acquire(where).release()
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
                # not the data, nor a file the checkpoint directory keeps
                kept = {**run_files(directory, "the checkpoint"),
                        f"the checkpoint's {LOCK_NAME}": Path(directory) / LOCK_NAME} \
                    if directory else {}
                outputs.check_apart({"--metrics": metrics}, {"--data": data, **kept})
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
