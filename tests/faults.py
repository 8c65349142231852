"""Fault injection for ``mpidp train``: every way a run is stopped, and what it leaves.

Each trial runs ``mpiexec -n R mpidp train`` on one small file and injects one
fault at a random moment (start-up included), then resumes the run until it
finishes, as a user or a batch script would:

  sigkill    SIGKILL to one random rank (a crash, the OOM killer, a lost node)
  sigterm    SIGTERM to mpiexec, which passes it to every rank (time limit, scancel)
  sigint     SIGINT to mpiexec (Ctrl-C)
  sigusr1    SIGUSR1 to mpiexec (Slurm's warning before the time limit)
  disk-full  the outputs' file system fills up, before the run or midway
             (a small tmpfs mounted for the trial)
  read-only  the outputs' file system turns read-only midway (tmpfs remount)
  corrupt    the checkpoint of a stopped run is truncated, or bytes in it
             flipped, before the resume

A trial **survives** when every invocation ended with an exit code the
life-cycle allows for that fault (docs/lifecycle.md), printed no Python
traceback, llvmlite message or MPICH "BAD TERMINATION" banner (except mpiexec's
own report of a rank killed by SIGKILL), and the run ended either in a clean
refusal (a damaged checkpoint: one line, exit 2) or finished with parameters
bit-identical to an uninterrupted run of the same settings and one record
per epoch, identical to that run's records apart from timings.

  python tests/faults.py --runs 56 --seed 1 --json faults.json   # the full suite
  python tests/faults.py --each --size small                       # every kind once

The first is the documented suite whose figures docs/lifecycle.md reports
(about 12 s a trial on 2 cores); the second is tests/test_faults.py (make test).

Needs root for the tmpfs kinds (disk-full, read-only); without it they are
skipped and the report says so. Prints one line per trial and a summary; with
``--json FILE`` writes every trial's record.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

KINDS = ("sigkill", "sigterm", "sigint", "sigusr1", "disk-full", "read-only", "corrupt")
#: Record fields that depend on the clock (and on the resume), not on the training.
TIMING = {"epoch_time_s", "train_time_s", "examples_per_s", "comm_s", "compute_s",
          "comm_compute_ratio", "step_breakdown_s", "threads", "resumed_mid_epoch"}
#: Exit codes each fault may end the interrupted invocation with.
ALLOWED = {
    "sigkill": {9, 137, 143, 1, 255 - 1},  # mpiexec reports the killed rank's signal
    "sigterm": {0, 75, 143},
    "sigint": {0, 75, 130},
    "sigusr1": {0, 75, 138},
    "disk-full": {0, 2, 74},
    "read-only": {0, 74},
    "corrupt": {75},
}
BANNED = ("Traceback", "BAD TERMINATION", "Exception ignored", "KeyboardInterrupt",
          "llvmlite", "Abort(")

EPOCHS, BATCH = 3, 20
#: Training rows per --size: "full" (300 steps an epoch) is the documented
#: suite's; "small" (100) is make test's, where start-up dominates anyway.
ROWS = {"full": 6000, "small": 2000}
# --progress: the bar (every 32 steps) tells the harness which step the run is at.
# --allreduce ring: auto picks an algorithm by timing, and at 3 or more ranks
# algorithms sum in different orders, so two runs could differ in the last bits.
TRAIN_ARGS = ["--epochs", str(EPOCHS), "--batch-size", str(BATCH), "--hidden", "8",
              "--noise-multiplier", "1", "--seed", "7", "--progress", "--allreduce", "ring"]


@dataclass
class Invocation:
    argv: str
    code: int
    seconds: float
    clean: bool
    note: str = ""
    tail: str = ""  # the output's last lines, kept when the trial was not survived


@dataclass
class Trial:
    number: int
    kind: str
    detail: str = ""
    invocations: list[Invocation] = field(default_factory=list)
    outcome: str = ""  # identical | refused | LOST: ...
    survived: bool = False
    missed: int = 0  # attempts whose run ended before the fault could land (redone)


class Faults:
    """One session: the data, the uninterrupted reference, then the trials."""

    def __init__(self, work: Path, ranks: int, rng: random.Random, timeout: float,
                 size: str = "full"):
        from launcher import clean_env, mpiexec_path

        self.work, self.ranks, self.rng, self.timeout = work, ranks, rng, timeout
        self.rows = ROWS[size]
        self.steps = EPOCHS * round(self.rows / BATCH)
        self.progress = re.compile(rf"(\d+)/{self.steps} \[")
        self.mpiexec = mpiexec_path()
        # TQDM_MININTERVAL=0: the bar prints every 32 steps, the harness's step clock.
        self.env = clean_env(NUMBA_CACHE_DIR=os.environ.get(
            "NUMBA_CACHE_DIR", str(ROOT / ".numba_cache")), TQDM_MININTERVAL="0")
        self.data = str(work / "data.h5")
        self.can_mount = os.geteuid() == 0 and shutil.which("mount") is not None

    # -- runs ------------------------------------------------------------------
    def argv(self, out: Path, *extra: str) -> list[str]:
        return [self.mpiexec, "-n", str(self.ranks), sys.executable, "-m", "engine.cli",
                "train", "--data", self.data, "--checkpoint-dir", str(out / "ck"),
                "--metrics", str(out / "ck" / "metrics.jsonl"), *TRAIN_ARGS, *extra]

    def start(self, argv: list[str], log: Path) -> tuple[subprocess.Popen, float]:
        env = dict(self.env, MPIEXEC_TIMEOUT=str(int(self.timeout)))
        handle = open(log, "w")
        proc = subprocess.Popen(argv, stdout=handle, stderr=subprocess.STDOUT, env=env,
                                text=True)
        proc._log_handle = handle  # type: ignore[attr-defined]
        return proc, time.monotonic()

    def finish(self, proc: subprocess.Popen, started: float, log: Path, argv: list[str],
               banner_ok: bool = False) -> Invocation:
        try:
            code = proc.wait(timeout=self.timeout + 30)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        proc._log_handle.close()  # type: ignore[attr-defined]
        text = log.read_text(errors="replace")
        banned = [b for b in BANNED if b in text
                  and not (banner_ok and b in ("BAD TERMINATION",))]
        errors = [line for line in text.splitlines() if line.startswith("mpidp: error")]
        clean = not banned and len(errors) <= 1
        note = ", ".join(banned) + (f"{len(errors)} error lines" if len(errors) > 1 else "")
        shown = " ".join(a for a in argv[6:] if not a.startswith(str(self.work)))
        return Invocation(shown, code, time.monotonic() - started, clean, note,
                          "\n".join(text.splitlines()[-12:]))

    def log(self) -> Path:
        """A new log file outside the trial's outputs (which may fill up or turn
        read-only: mpiexec itself would fail writing there)."""
        return self.work / f"run-{time.monotonic_ns()}.log"

    def run(self, out: Path, *extra: str, banner_ok: bool = False) -> Invocation:
        log = self.log()
        argv = self.argv(out, *extra)
        proc, started = self.start(argv, log)
        return self.finish(proc, started, log, argv, banner_ok)

    # -- reference -------------------------------------------------------------
    def prepare(self) -> None:
        from engine.bench import synthetic

        synthetic.write(self.data, rows=self.rows, features=8, test_rows=400, seed=3)
        ref = self.work / "reference"
        ref.mkdir()
        log = ref / "run.log"
        proc, started = self.start(self.argv(ref), log)
        header_at = self._wait_for(log, "epoch  train_loss", proc, 300)
        code = proc.wait(timeout=300)
        proc._log_handle.close()  # type: ignore[attr-defined]
        if code != 0:
            raise SystemExit(f"faults: the reference run failed ({code}):\n{log.read_text()}")
        self.startup_s = header_at - started
        self.train_s = time.monotonic() - header_at
        self.reference = self.result(ref)

    @staticmethod
    def _wait_for(log: Path, text: str, proc: subprocess.Popen, limit: float) -> float:
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if text in log.read_text(errors="replace"):
                return time.monotonic()
            if proc.poll() is not None:
                return time.monotonic()
            time.sleep(0.02)
        return time.monotonic()

    @staticmethod
    def result(out: Path) -> dict:
        """The final parameters and the records of a finished run."""
        import torch

        payload = torch.load(out / "ck" / "checkpoint.pt", map_location="cpu",
                             weights_only=True)
        lines = (out / "ck" / "metrics.jsonl").read_text().splitlines()
        strip = (lambda r: {k: v for k, v in r.items() if k not in TIMING})
        return {"params": payload["params"], "step": payload["step"],
                "history": [strip(r) for r in payload["history"]],
                "metrics": [strip(json.loads(line)) for line in lines if line.strip()]}

    def compare(self, out: Path) -> str:
        import torch

        try:
            got = self.result(out)
        except Exception as exc:  # noqa: BLE001 - any failure to read is a loss
            return f"LOST: cannot read the finished run ({type(exc).__name__}: {exc})"
        ref = self.reference
        if got["step"] != ref["step"]:
            return f"LOST: finished at step {got['step']}, reference {ref['step']}"
        if not torch.equal(got["params"], ref["params"]):
            return "LOST: parameters differ from the uninterrupted run"
        epochs = [r["epoch"] for r in got["metrics"]]
        if epochs != list(range(1, EPOCHS + 1)):
            return f"LOST: metrics file has epochs {epochs}"
        if got["history"] != ref["history"] or got["metrics"] != ref["history"]:
            return "LOST: records differ from the uninterrupted run's"
        return "identical"

    # -- a trial ---------------------------------------------------------------
    def moment(self, startup: bool = True) -> tuple[str, float]:
        """When to strike: ("start-up", seconds after the launch) for a quarter of
        the faults, else ("step", a random step of the run)."""
        if startup and self.rng.random() < 0.25:
            return "start-up", self.rng.uniform(0.2, self.startup_s)
        return "step", float(self.rng.randrange(self.steps))

    def wait_until(self, moment: tuple[str, float], proc: subprocess.Popen, started: float,
                   log: Path) -> str:
        """Sleep until ``moment``; returns where the run was."""
        kind, value = moment
        if kind == "start-up":
            time.sleep(max(0.0, started + value - time.monotonic()))
            if proc.poll() is not None:  # a quick run: already over
                return f"after the run ended (aimed at {value:.1f} s after launch)"
            return f"{value:.1f} s after launch"
        while proc.poll() is None:
            found = self.progress.findall(log.read_text(errors="replace"))
            if found and int(found[-1]) >= value:
                return f"step ~{found[-1]} (aimed at {int(value)})"
            time.sleep(0.005)
        return f"after the run ended (aimed at step {int(value)})"

    def trial(self, number: int, kind: str) -> Trial:
        """One fault of ``kind``; an attempt whose run ended before the fault
        landed is not counted and is done again (up to 5 times)."""
        for attempt in range(5):
            trial = self._attempt(number, kind)
            if not trial.detail.startswith("after the run ended") or attempt == 4:
                trial.missed = attempt
                return trial
        return trial

    def _attempt(self, number: int, kind: str) -> Trial:
        trial = Trial(number, kind)
        out = Path(tempfile.mkdtemp(prefix=f"t{number}-", dir=self.work))
        mounted = False
        try:
            if kind in ("disk-full", "read-only"):
                subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(out)],
                               check=True, capture_output=True)
                mounted = True
            getattr(self, "_" + kind.replace("-", "_"), self._signal)(trial, out)
            if not trial.outcome:
                trial.outcome = self._resume(trial, out)
        except Exception as exc:  # noqa: BLE001 - a harness failure is a lost trial
            trial.outcome = f"LOST: harness {type(exc).__name__}: {exc}"
        finally:
            if mounted:
                subprocess.run(["mount", "-o", "remount,rw", str(out)], capture_output=True)
                subprocess.run(["umount", "-l", str(out)], capture_output=True)
            shutil.rmtree(out, ignore_errors=True)
            remove_stale_shm()
        allowed = ALLOWED[kind]
        first = trial.invocations[0] if trial.invocations else None
        trial.survived = (first is not None and first.code in allowed
                          and all(i.clean for i in trial.invocations)
                          and trial.outcome in ("identical", "refused"))
        if first is not None and first.code not in allowed and not trial.outcome.startswith(
                "LOST"):
            trial.outcome = f"LOST: exit code {first.code} not in {sorted(allowed)}"
        if trial.survived:
            for inv in trial.invocations:
                inv.tail = ""
        return trial

    def _resume(self, trial: Trial, out: Path) -> str:
        """Continue until done: --resume with a checkpoint, else a fresh start."""
        for _ in range(3):
            extra = ("--resume",) if (out / "ck" / "checkpoint.pt").exists() else ()
            inv = self.run(out, *extra)
            trial.invocations.append(inv)
            if inv.code == 0:
                return self.compare(out)
            if inv.code == 2 and trial.kind == "corrupt":
                return "refused"
        return f"LOST: no successful resume (last exit {trial.invocations[-1].code})"

    def _signal(self, trial: Trial, out: Path) -> None:
        sig = {"sigterm": signal.SIGTERM, "sigint": signal.SIGINT,
               "sigusr1": signal.SIGUSR1}[trial.kind]
        log = self.log()
        argv = self.argv(out)
        proc, started = self.start(argv, log)
        trial.detail = self.wait_until(self.moment(), proc, started, log)
        if proc.poll() is None:
            proc.send_signal(sig)
        trial.invocations.append(self.finish(proc, started, log, argv))

    def _sigkill(self, trial: Trial, out: Path) -> None:
        log = self.log()
        argv = self.argv(out)
        proc, started = self.start(argv, log)
        where = self.wait_until(self.moment(), proc, started, log)
        ranks: list[int] = []
        deadline = time.monotonic() + 10  # the ranks may not have been started yet
        while proc.poll() is None and time.monotonic() < deadline:
            ranks = rank_pids(str(out / "ck"))
            if ranks:
                break
            time.sleep(0.02)
        victim = self.rng.choice(ranks) if ranks else None
        if victim is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim, signal.SIGKILL)
        trial.invocations.append(self.finish(proc, started, log, argv, banner_ok=True))
        if proc.returncode == 0 and not where.startswith("after the run ended"):
            where = f"after the run ended (the kill came too late: {where})"
        trial.detail = f"{where}, rank pid {victim} of {len(ranks)}"

    def _disk_full(self, trial: Trial, out: Path) -> None:
        filler = out / "filler"
        midway = self.rng.random() < 0.75
        left = self.rng.randint(0, 12) * 1024  # a checkpoint here: ~6 KiB
        log = self.log()
        argv = self.argv(out)
        where = "before the run"
        if not midway:
            fill(out, filler, left)
        proc, started = self.start(argv, log)
        if midway:
            where = self.wait_until(self.moment(startup=False), proc, started, log)
            fill(out, filler, left)
        trial.detail = f"{where}, {left // 1024} KiB left"
        trial.invocations.append(self.finish(proc, started, log, argv))
        filler.unlink(missing_ok=True)

    def _read_only(self, trial: Trial, out: Path) -> None:
        log = self.log()
        argv = self.argv(out)
        proc, started = self.start(argv, log)
        trial.detail = self.wait_until(self.moment(startup=False), proc, started, log)
        subprocess.run(["mount", "-o", "remount,ro", str(out)], check=True,
                       capture_output=True)
        trial.invocations.append(self.finish(proc, started, log, argv))
        subprocess.run(["mount", "-o", "remount,rw", str(out)], check=True,
                       capture_output=True)

    def _corrupt(self, trial: Trial, out: Path) -> None:
        stop = self.rng.randint(1, self.steps - 1)
        trial.invocations.append(self.run(out, "--stop-after", str(stop)))
        path = out / "ck" / "checkpoint.pt"
        data = bytearray(path.read_bytes())
        if self.rng.random() < 0.5:
            cut = self.rng.randint(0, len(data) - 1)
            path.write_bytes(bytes(data[:cut]))
            trial.detail = f"stopped at step {stop}, truncated to {cut} of {len(data)} bytes"
        else:
            spots = sorted(self.rng.sample(range(len(data)), self.rng.randint(1, 8)))
            for spot in spots:
                data[spot] ^= 1 << self.rng.randint(0, 7)
            path.write_bytes(bytes(data))
            trial.detail = f"stopped at step {stop}, {len(spots)} bit(s) flipped"


def fill(directory: Path, filler: Path, left: int) -> None:
    """Grow ``filler`` until ``directory``'s file system has about ``left`` bytes free."""
    free = shutil.disk_usage(directory).free
    with contextlib.suppress(OSError), open(filler, "ab") as handle:
        handle.write(b"\0" * max(0, free - left))


def rank_pids(marker: str) -> list[int]:
    """The PIDs of the Python ranks whose command line holds ``marker``."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        words = [w.decode(errors="replace") for w in argv if w]
        if marker in words and "engine.cli" in words and "mpiexec" not in words[0] \
                and "hydra" not in words[0]:
            pids.append(int(entry))
    return pids


def remove_stale_shm() -> None:
    """Unlink MPICH's /dev/shm files that no process maps (left by killed ranks)."""
    try:
        names = [n for n in os.listdir("/dev/shm") if n.startswith("mpich")]
    except OSError:
        return
    if not names:
        return
    mapped = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                mapped.update(line.split()[-1] for line in
                              Path(f"/proc/{entry}/maps").read_text().splitlines()
                              if "/dev/shm/" in line)
    for name in names:
        path = f"/dev/shm/{name}"
        if path not in mapped:
            with contextlib.suppress(OSError):
                if time.time() - os.stat(path).st_mtime > 5:
                    os.unlink(path)


def commit() -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain",
                                "--untracked-files=no"], capture_output=True, text=True)
        if out.returncode == 0:
            return out.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")
    return "unknown"


def cpu_model() -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:]))
    parser.add_argument("--runs", type=int, default=len(KINDS), help="trials (default: 7)")
    parser.add_argument("--each", action="store_true",
                        help="every kind once, in order (ignores --runs)")
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help=f"comma-separated subset of {','.join(KINDS)}")
    parser.add_argument("--ranks", type=int, default=2, help="ranks per run (default: 2)")
    parser.add_argument("--size", choices=sorted(ROWS), default="full",
                        help="the run's size: full (6,000 rows, 900 steps; default) or small "
                        "(2,000 rows, 300 steps: make test)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the faults (default: 1)")
    parser.add_argument("--timeout", type=float, default=180,
                        help="seconds allowed per invocation (default: 180)")
    parser.add_argument("--json", default=None, help="write every trial as JSON")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = set(kinds) - set(KINDS)
    if unknown:
        parser.error(f"unknown kinds {sorted(unknown)}")
    started = datetime.datetime.now().astimezone()
    clock = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mpidp-faults-") as tmp:
        faults = Faults(Path(tmp), args.ranks, rng, args.timeout, args.size)
        if not faults.can_mount:
            skipped = [k for k in kinds if k in ("disk-full", "read-only")]
            kinds = [k for k in kinds if k not in skipped]
            if skipped:
                print(f"faults: skipping {', '.join(skipped)} (needs root to mount a tmpfs)")
        faults.prepare()
        print(f"faults: reference run: start-up {faults.startup_s:.1f} s, training "
              f"{faults.train_s:.1f} s, {faults.ranks} ranks", flush=True)
        plan = kinds if args.each else [rng.choice(kinds) for _ in range(args.runs)]
        trials = []
        for number, kind in enumerate(plan, 1):
            trial = faults.trial(number, kind)
            trials.append(trial)
            codes = " -> ".join(str(i.code) for i in trial.invocations)
            verdict = ("  (not landed: not counted)"
                       if trial.detail.startswith("after the run ended")
                       else "" if trial.survived else "  <-- NOT SURVIVED")
            print(f"[{number}/{len(plan)}] {kind:<9} {trial.detail:<44} exits {codes:<14} "
                  f"{trial.outcome}{verdict}"
                  + "".join(f" [{i.note}]" for i in trial.invocations if i.note), flush=True)
            for inv in trial.invocations:
                if inv.tail:
                    print("    | " + inv.tail.replace("\n", "\n    | "), flush=True)
    # A fault that never landed (the run ended first, five attempts in a row)
    # is no fault: reported, not counted.
    every = trials
    unlanded = [t for t in trials if t.detail.startswith("after the run ended")]
    trials = [t for t in trials if not t.detail.startswith("after the run ended")]
    survived = sum(t.survived for t in trials)
    identical = sum(t.outcome == "identical" for t in trials)
    refused = sum(t.outcome == "refused" for t in trials)
    resumes = sum(max(0, len(t.invocations) - 1) for t in trials)
    lost = [t for t in trials if not t.survived]
    by_kind = {k: sum(1 for t in trials if t.kind == k) for k in KINDS}
    summary = {
        "command": "python tests/faults.py " + " ".join(sys.argv[1:] if argv is None
                                                        else argv),
        "date": started.isoformat(timespec="seconds"), "cpu": cpu_model(),
        "commit": commit(), "seconds": round(time.monotonic() - clock),
        "ranks": args.ranks, "size": args.size, "rows": faults.rows,
        "steps": faults.steps, "faults_injected": len(trials), "by_kind": by_kind,
        "survived": survived, "bit_identical_finishes": identical, "clean_refusals": refused,
        "invocations": sum(len(t.invocations) for t in trials), "resumes": resumes,
        "lost": len(lost), "not_landed": len(unlanded)}
    print(f"faults: {len(trials)} injected ({', '.join(f'{k} {n}' for k, n in by_kind.items() if n)}); "
          f"{survived} survived: {identical} finished bit-identical to the uninterrupted run, "
          f"{refused} refused cleanly (damaged checkpoint); {len(lost)} lost"
          + (f"; {len(unlanded)} not landed (the run ended first), not counted"
             if unlanded else ""))
    print(f"faults: {summary['date']}, {summary['cpu']}, {args.ranks} ranks, size "
          f"{args.size}, commit {summary['commit']}, {summary['seconds']} s")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"summary": summary, "trials": [asdict(t) for t in every]}, indent=1))
    return 0 if not lost else 1


if __name__ == "__main__":
    sys.exit(main())
