"""The life-cycle of a run (docs/lifecycle.md): outputs checked first, one run per
directory, resume from the checkpoint alone, records kept with it, signals.

Serial tests for the pieces, ``@pytest.mark.mpi`` where ranks must agree, and
user-style runs of ``mpidp`` under mpiexec with a timeout.
"""
import errno
import io
import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import h5py
import pytest
import torch

from engine import checkpoint as ckpt
from engine import checkpoint_lock
from engine import metrics, outputs, stopping
from engine.bench import synthetic
from engine.config import ADJUSTABLE_ON_RESUME, FIXED_ON_RESUME, PER_INVOCATION, TrainConfig
from engine.errors import (CheckpointError, ConfigError, DataError, DirectoryLocked,
                           OutputError, PrivacyError, WriteFailed)
from engine.run.resume import resumed_config
from engine.trainer import Trainer
from launcher import clean_env, mpidp, mpiexec_path

# A fixed all-reduce: auto picks by timing, and at 3 or more ranks algorithms
# sum in different orders, so two runs may differ in the last bits.
FAST = dict(epochs=3, batch_size=50, hidden=(8,), noise_multiplier=1.0, seed=5,
            progress=False, allreduce="ring")
#: Fields of a record that depend on the clock, not on the training.
TIMING = {"epoch_time_s", "train_time_s", "examples_per_s", "comm_s", "compute_s",
          "comm_compute_ratio", "step_breakdown_s", "threads", "resumed_mid_epoch"}


def _self():
    from collectives.runtime import MPI

    return MPI.COMM_SELF


def _cfg(data, **kw):
    return TrainConfig(data=str(data), **{**FAST, **kw})


def _train(cfg, comm=None, given=None):
    out = io.StringIO()
    trainer = Trainer(cfg, comm or _self(), out=out, given=given)
    code = trainer.run()
    return trainer, code, out.getvalue()


def _records(history):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in history]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    # 1000 rows / batch 50: 20 steps per epoch
    path = tmp_path_factory.mktemp("data") / "d.h5"
    return synthetic.write(path, rows=1000, features=5, test_rows=100, seed=3)


# ---------------------------------------------------------------- outputs
def test_outputs_one_rule_for_missing_parents(tmp_path):
    with pytest.raises(OutputError, match="does not exist.*never its parent"):
        outputs.check_file(tmp_path / "no" / "m.jsonl", "--metrics")
    with pytest.raises(OutputError, match="never its parent"):
        outputs.check_directory(tmp_path / "no" / "run", "--checkpoint-dir")
    assert not (tmp_path / "no").exists()
    created = outputs.check_directory(tmp_path / "run", "--checkpoint-dir")
    assert created.is_dir() and not list(created.iterdir())  # the probe is gone
    outputs.check_file(tmp_path / "run" / "m.jsonl", "--metrics")  # inside it: fine


def test_outputs_not_a_file_where_a_directory_is_expected(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputError, match="is a file, not a directory"):
        outputs.check_directory(tmp_path / "f", "--checkpoint-dir")
    with pytest.raises(OutputError, match="is a directory"):
        outputs.check_file(tmp_path, "--json")
    with pytest.raises(OutputError, match="is a file, not a directory"):
        outputs.check_file(tmp_path / "f" / "x.json", "--json")


def test_outputs_refuse_devices_pipes_and_paths_spelt_as_directories(tmp_path):
    """An output is renamed over its path: /dev/null or a named pipe would be
    replaced (as root, /dev/null itself); ``m/`` names a directory, which
    ``Path`` would turn into the file ``m``."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for path, what in ((os.devnull, "is a character device, not a file"),
                       (fifo, "is a named pipe (FIFO), not a file")):
        with pytest.raises(OutputError, match=re.escape(f"--metrics {path}: {what}")):
            outputs.check_file(path, "--metrics")
    with pytest.raises(OutputError, match=re.escape("--json m/: names a directory (ends with /)")):
        outputs.check_file("m/", "--json")
    assert stat.S_ISFIFO(fifo.stat().st_mode) and stat.S_ISCHR(os.stat(os.devnull).st_mode)


def test_outputs_free_space(tmp_path):
    outputs.check_free_space(tmp_path, 1, "--checkpoint-dir")
    with pytest.raises(OutputError, match="free on its file system; a checkpoint needs"):
        outputs.check_free_space(tmp_path, 1 << 62, "--checkpoint-dir")


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory no one may write (a read-only tmpfs as root, where permission
    bits would not stop us)."""
    path = tmp_path / "ro"
    path.mkdir()
    if os.geteuid() == 0:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)],
                              capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs: {done.stderr.decode().strip()}")
        yield path
        subprocess.run(["umount", str(path)], capture_output=True)
    else:
        path.chmod(0o555)
        yield path
        path.chmod(0o755)


def test_outputs_read_only(read_only_dir):
    with pytest.raises(OutputError, match="cannot write in"):
        outputs.check_file(read_only_dir / "m.jsonl", "--metrics")
    with pytest.raises(OutputError, match="cannot (create|write)"):
        outputs.check_directory(read_only_dir / "run", "--checkpoint-dir")


def test_train_checks_outputs_before_reading_data(tmp_path, read_only_dir):
    missing = tmp_path / "missing.h5"  # never read: the outputs fail first
    with pytest.raises(OutputError, match="--metrics"):
        _train(_cfg(missing, metrics=str(read_only_dir / "m.jsonl")))
    with pytest.raises(OutputError, match="--checkpoint-dir"):
        _train(_cfg(missing, checkpoint_dir=str(read_only_dir / "ck")))
    (tmp_path / "file").write_text("")
    with pytest.raises(OutputError, match="is a file"):
        _train(_cfg(missing, checkpoint_dir=str(tmp_path / "file")))
    with pytest.raises(CheckpointError, match="--resume.*does not exist.*budget"):
        _train(_cfg(missing, checkpoint_dir=str(tmp_path / "typo"), resume=True))
    assert not (tmp_path / "typo").exists()


def test_outputs_never_replace_an_input_or_each_other(tmp_path):
    """Another spelling, a symbolic or hard link of the same file is the same
    file; a file not yet written is compared by its resolved path."""
    data = tmp_path / "d.h5"
    data.write_text("x")
    (tmp_path / "sym.h5").symlink_to(data)
    os.link(data, tmp_path / "hard.h5")
    for same in (data, tmp_path / "sym.h5", tmp_path / "hard.h5", tmp_path / "." / "d.h5"):
        with pytest.raises(OutputError, match=rf"^--json {same} is the file of --data "
                           rf"\({data}\): writing it would replace that file"):
            outputs.check_apart({"--json": same}, {"--data": data, "--other": None})
    with pytest.raises(OutputError, match="^--json .* is the file of --plot"):
        outputs.check_apart({"--json": tmp_path / "o", "--plot": tmp_path / "o"}, {})
    outputs.check_apart({"--json": tmp_path / "o.json", "--plot": None, "--x": "-"},
                        {"--data": data})


def test_train_refuses_metrics_over_its_data_or_its_checkpoint(data, tmp_path):
    """Before any work, and the checkpoint directory it would have created is gone."""
    with pytest.raises(OutputError, match="^--metrics .* is the file of --data"):
        _train(_cfg(data, metrics=data))
    run = tmp_path / "run"
    with pytest.raises(OutputError, match="^--metrics .* is the file of the checkpoint's "
                                          "checkpoint.pt"):
        _train(_cfg(data, checkpoint_dir=str(run), metrics=str(run / "checkpoint.pt")))
    assert not run.exists()
    assert h5py.File(data, "r")  # intact


def test_metrics_file_is_replaced_atomically(tmp_path, read_only_dir):
    path = tmp_path / "m.jsonl"
    metrics.write_records(path, [{"epoch": 1}, {"epoch": 2}])
    assert metrics.read_records(path) == [{"epoch": 1}, {"epoch": 2}]
    metrics.write_records(path, [{"epoch": 1}])
    assert metrics.read_records(path) == [{"epoch": 1}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.jsonl", "ro"]  # no temporary
    with pytest.raises(WriteFailed, match="cannot write the metrics file"):
        metrics.write_records(read_only_dir / "m.jsonl", [{"epoch": 1}])


# -------------------------------------------------------------- checkpoints
def _payload():
    return {"params": torch.arange(10, dtype=torch.float32), "step": 3,
            "config": {"epochs": 2}, "steps_per_epoch": 2, "epsilon": 0.5, "history": []}


def test_checkpoint_detects_corruption_and_truncation(tmp_path):
    path = ckpt.save(tmp_path, _payload())
    assert torch.equal(ckpt.load(tmp_path)["params"], torch.arange(10, dtype=torch.float32))
    blob = bytearray(path.read_bytes())
    # flip a byte inside the tensor's data: torch itself would load it silently
    at = blob.find(torch.arange(10, dtype=torch.float32).numpy().tobytes()[8:24])
    assert at > 0
    blob[at + 2] ^= 0x10
    path.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match="corrupt: its contents do not match"):
        ckpt.load(tmp_path)
    ckpt.save(tmp_path, _payload())
    path.write_bytes(path.read_bytes()[:300])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        ckpt.load(tmp_path)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_checkpoint_swapped_with_data_and_foreign_files(tmp_path, data):
    with pytest.raises(CheckpointError, match="--checkpoint .*HDF5.*swapped"):
        ckpt.load_file(data)
    torch.save({"x": socket.socket}, tmp_path / "foreign.pt")  # a pickled class
    with pytest.raises(CheckpointError, match="never runs code") as info:
        ckpt.load_file(tmp_path / "foreign.pt")
    assert "weights_only" not in str(info.value)
    ckpt.save(tmp_path, _payload())
    with pytest.raises(DataError, match="--data .* is a checkpoint.*swapped"):
        ckpt.check_data_path(tmp_path / "checkpoint.pt")


def test_checkpoint_write_failure_keeps_the_previous_one(tmp_path):
    ckpt.save(tmp_path, _payload())
    before = (tmp_path / "checkpoint.pt").read_bytes()
    os.rename(tmp_path, tmp_path.with_name(tmp_path.name + "-moved"))
    with pytest.raises(WriteFailed, match="previous checkpoint .* intact"):
        ckpt.save(tmp_path, _payload())
    moved = tmp_path.with_name(tmp_path.name + "-moved")
    assert (moved / "checkpoint.pt").read_bytes() == before


# --------------------------------------------------------------------- lock
def test_lock_refuses_a_second_run_naming_the_holder(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    lock = checkpoint_lock.acquire(tmp_path, command="mpidp train ...")
    holder = json.loads((tmp_path / "lock").read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    assert holder["slurm_job_id"] == "4242" and holder["command"] == "mpidp train ..."
    with pytest.raises(DirectoryLocked, match=f"in use by another run: pid {os.getpid()} "
                       f"on host {socket.gethostname()} \\(Slurm job 4242"):
        checkpoint_lock.acquire(tmp_path)
    lock.check()
    lock.release()
    assert not (tmp_path / "lock").exists()
    checkpoint_lock.acquire(tmp_path).release()


def test_resume_of_a_directory_a_run_holds_before_its_first_checkpoint(tmp_path):
    """--resume while another run holds the directory and has not checkpointed
    yet: that run is named (exit 73), as for a fresh run. It said "holds no
    checkpoint; nothing to resume ... drop --resume to start a new run"."""
    from collectives.runtime import MPI

    busy = tmp_path / "busy"
    busy.mkdir()
    holder = checkpoint_lock.acquire(busy, command="mpidp train ...")
    try:
        with pytest.raises(DirectoryLocked, match=f"in use by another run: pid {os.getpid()}"):
            checkpoint_lock.open_directory(str(busy), True, None, MPI.COMM_SELF)
        assert holder.held()
    finally:
        holder.release()
    with pytest.raises(CheckpointError, match="holds no checkpoint; nothing to resume"):
        checkpoint_lock.open_directory(str(busy), True, None, MPI.COMM_SELF)
    assert not (busy / "lock").exists()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_lock_of_a_dead_holder_is_taken_over_and_said(tmp_path):
    (tmp_path / "lock").write_text(json.dumps({
        "host": socket.gethostname(), "pid": _dead_pid(), "started": "yesterday"}))
    lock = checkpoint_lock.acquire(tmp_path)
    assert "no longer runs" in lock.note and "taken over" in lock.note
    assert lock.held()
    lock.release()


def test_a_lock_the_disk_cannot_hold_is_not_left_behind(tmp_path, monkeypatch):
    """A full disk at the lock's write left an empty lock file, which refused
    every later run of the directory (its resume included) as locked."""
    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoint_lock.os, "fsync", full)
    with pytest.raises(WriteFailed, match="cannot take the lock .*No space left on device"):
        checkpoint_lock.acquire(tmp_path)
    assert not (tmp_path / "lock").exists()
    monkeypatch.undo()
    checkpoint_lock.acquire(tmp_path).release()  # once the disk has room: no stale lock


def test_lock_that_cannot_be_checked_is_never_broken(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    (tmp_path / "lock").write_text(json.dumps({"host": "elsewhere", "pid": 1}))
    with pytest.raises(DirectoryLocked, match=f"remove {tmp_path / 'lock'}"):
        checkpoint_lock.acquire(tmp_path)
    assert json.loads((tmp_path / "lock").read_text())["host"] == "elsewhere"


def test_lock_of_an_earlier_run_of_the_same_job_is_stale(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    (tmp_path / "lock").write_text(json.dumps({"host": "othernode", "pid": 5,
                                               "slurm_job_id": "77",
                                               "slurm_restart_count": 1}))
    lock = checkpoint_lock.acquire(tmp_path)
    assert "before its requeue" in lock.note
    (tmp_path / "lock").write_text(json.dumps({"host": "x", "pid": 1, "nonce": "other"}))
    with pytest.raises(DirectoryLocked, match="no longer holds its lock"):
        lock.check()


def test_run_takes_and_releases_the_lock(data, tmp_path):
    d = tmp_path / "ck"
    d.mkdir()
    (d / "lock").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                                        "started": "now"}))
    with pytest.raises(DirectoryLocked, match="One run per checkpoint directory"):
        _train(_cfg(data, checkpoint_dir=str(d)))
    (d / "lock").unlink()
    _, code, text = _train(_cfg(data, checkpoint_dir=str(d), epochs=1))
    assert code == 0 and not (d / "lock").exists()


def test_a_best_pt_without_its_checkpoint_is_not_left_to_a_fresh_run(data, tmp_path):
    """best.pt belongs to the run whose checkpoint.pt sits next to it: a fresh run
    into the directory removes one left alone (it would pass for the new run's
    model), a run refused for a checkpoint in the way touches nothing."""
    d = tmp_path / "ck"
    d.mkdir()
    (d / ckpt.BEST_NAME).write_bytes(b"an older run's model")
    (d / f".{ckpt.BEST_NAME}.123.tmp").write_bytes(b"half")
    _, code, _ = _train(_cfg(data, checkpoint_dir=str(d), epochs=1))  # no val: no best.pt
    assert code == 0 and sorted(os.listdir(d)) == ["checkpoint.pt"]
    (d / ckpt.BEST_NAME).write_bytes(b"kept")
    with pytest.raises(CheckpointError, match="pass --resume"):
        _train(_cfg(data, checkpoint_dir=str(d), epochs=1))
    assert (d / ckpt.BEST_NAME).read_bytes() == b"kept"


# ------------------------------------------------------------------- resume
def test_resumed_settings_come_from_the_checkpoint():
    saved = TrainConfig(data="d.h5", noise_multiplier=1.3, seed=9, hidden=(8, 8),
                        lr=0.01, epochs=4).to_dict()
    saved["metrics"] = "/abs/m.jsonl"
    mine = TrainConfig(data="d.h5", checkpoint_dir="ck", resume=True)
    merged = resumed_config(mine, saved, given={"data", "checkpoint_dir", "resume"})
    assert merged.seed == 9 and merged.noise_multiplier == 1.3 and merged.hidden == (8, 8)
    assert merged.lr == 0.01 and merged.epochs == 4 and merged.metrics == "/abs/m.jsonl"
    merged.validate()  # neither --noise-multiplier nor --target-epsilon needed again
    longer = resumed_config(TrainConfig(data="d.h5", epochs=6, seed=9), saved,
                            given={"epochs", "seed"})
    assert longer.epochs == 6 and longer.seed == 9  # the same seed restated: fine
    with pytest.raises(ConfigError) as info:
        resumed_config(TrainConfig(data="d.h5", dp=False, seed=8, noise_multiplier=2.0),
                       saved, given={"dp", "seed", "noise_multiplier"})
    message = str(info.value)
    assert "--no-dp (the run is differentially private)" in message
    assert "--seed 8 (the run has --seed 9)" in message
    assert "--noise-multiplier 2 (the run has --noise-multiplier 1.3)" in message
    assert "False" not in message


def test_every_option_is_fixed_adjustable_or_per_invocation():
    import dataclasses

    names = {f.name for f in dataclasses.fields(TrainConfig)}
    assert set(FIXED_ON_RESUME) <= names - set(ADJUSTABLE_ON_RESUME) - set(PER_INVOCATION)
    assert not set(ADJUSTABLE_ON_RESUME) & set(PER_INVOCATION)


def test_resume_with_only_data_and_directory(data, tmp_path):
    d = str(tmp_path / "ck")
    whole, code, _ = _train(_cfg(data, checkpoint_dir=str(tmp_path / "whole")))
    assert code == 0
    _, code, _ = _train(_cfg(data, checkpoint_dir=d, stop_after=7))
    assert code == 75
    bare = TrainConfig(data=str(data), checkpoint_dir=d, resume=True, progress=False)
    second, code, text = _train(bare, given={"data", "checkpoint_dir", "resume"})
    assert code == 0 and torch.equal(second.params, whole.params)
    assert text.splitlines()[0].startswith(f"mpidp train: resumed the run in {d} at step 7 "
                                           "(0 of 3 epochs done), epsilon")
    assert ckpt.load(d)["config"]["seed"] == 5  # not rewritten to None
    with pytest.raises(CheckpointError, match="pass --resume"):  # a fresh run into it
        _train(_cfg(data, checkpoint_dir=d))


@pytest.mark.parametrize("stops", [[20], [20, 20], [7, 13, 20], [40, 1, 1]])
def test_records_survive_any_stop_sequence(data, tmp_path, stops):
    """Stops on epoch boundaries (20 steps per epoch) and inside epochs: one record
    per epoch, in order, equal to the uninterrupted run's; the metrics file too."""
    whole, code, _ = _train(_cfg(data, checkpoint_dir=str(tmp_path / "w")))
    assert code == 0
    d, m = str(tmp_path / "ck"), str(tmp_path / "m.jsonl")
    for n, stop in enumerate(stops):
        _, code, text = _train(_cfg(data, checkpoint_dir=d, metrics=m, stop_after=stop,
                                    resume=n > 0))
        assert code == 75, text
        assert "mpiexec" not in text and f"mpidp train --data {data} --checkpoint-dir {d} " \
            "--resume" in text
    last, code, text = _train(_cfg(data, checkpoint_dir=d, metrics=m, resume=True))
    assert code == 0 and torch.equal(last.params, whole.params)
    assert _records(last.history) == _records(whole.history)
    assert [r["epoch"] for r in metrics.read_records(m)] == [1, 2, 3]
    assert _records(metrics.read_records(m)) == _records(whole.history)
    assert "done: 3 epochs" in text


def test_metrics_rewound_to_the_checkpoint(data, tmp_path):
    """Epochs recorded after the last checkpoint are trained again: their records
    must not appear twice."""
    d, m = str(tmp_path / "ck"), str(tmp_path / "m.jsonl")
    whole, _, _ = _train(_cfg(data, checkpoint_dir=str(tmp_path / "w"), epochs=4))
    _, code, _ = _train(_cfg(data, epochs=4, checkpoint_dir=d, metrics=m, checkpoint_every=2,
                             stop_after=70))  # checkpoint at 40, records to epoch 3
    assert code == 75
    assert [r["epoch"] for r in metrics.read_records(m)] == [1, 2, 3]
    # As if the run had been killed after epoch 3's record and before its next
    # checkpoint: the checkpoint's history ends at epoch 2 (only the records are
    # checked here; the generator states are those of step 70).
    payload = ckpt.load(d)
    ckpt.save(d, {**payload, "history": payload["history"][:2], "step": 40})
    trainer = Trainer(_cfg(data, epochs=4, checkpoint_dir=d, metrics=m, resume=True,
                           checkpoint_every=2), _self(), out=io.StringIO())
    trainer.opened = True
    trainer.setup()
    trainer.write_metrics()
    assert [r["epoch"] for r in metrics.read_records(m)] == [1, 2]


# ------------------------------------------------------------------ privacy
def test_delta_above_one_over_n_is_refused(data):
    with pytest.raises(PrivacyError, match=r"--delta 0.01 is above 1/N = 0.001 for the "
                       r"1,000 training rows.*--allow-large-delta"):
        _train(_cfg(data, delta=0.01))
    _, code, text = _train(_cfg(data, delta=0.01, allow_large_delta=True, epochs=1))
    assert code == 0
    assert text.splitlines()[0].startswith("mpidp train: WARNING --allow-large-delta: "
                                           "delta 0.01 is above 1/N")


def test_privacy_command_checks_delta():
    from engine.cli import build_parser

    def run(*argv):
        args = build_parser().parse_args(["privacy", *argv])
        return args._run(args)

    with pytest.raises(PrivacyError, match="above the sample rate"):
        run("--sample-rate", "0.01", "--steps", "10", "--noise-multiplier", "1",
            "--delta", "0.5")
    with pytest.raises(PrivacyError, match="1/N = 6.35e-05 for the 15,742"):
        run("--batch-size", "256", "--train-rows", "15742", "--epochs", "3",
            "--noise-multiplier", "1", "--delta", "0.01")
    assert run("--sample-rate", "0.01", "--steps", "10", "--noise-multiplier", "1",
               "--delta", "0.5", "--allow-large-delta") == 0


def test_one_step_one_epoch_in_words(tmp_path):
    path = synthetic.write(tmp_path / "small.h5", rows=40, features=3, test_rows=10)
    _, code, text = _train(_cfg(path, epochs=1, batch_size=40, delta=1e-3))
    assert code == 0
    assert "1 step/epoch" in text and "1 steps" not in text
    assert "done: 1 epoch," in text


# ------------------------------------------------------------------ signals
def test_signals_recorded_in_the_program_only(monkeypatch):
    """The mpidp program records stop signals from the engine package's first
    line; a program that imports the engine keeps Python's own handlers."""
    for argv, orig, expected in (
            (["/venv/bin/mpidp", "train"], ["/venv/bin/python", "/venv/bin/mpidp", "train"],
             True),
            (["-m"], ["python", "-u", "-m", "engine.cli", "train"], True),
            (["train_api.py"], ["python", "train_api.py", "-m", "x"], False)):
        monkeypatch.setattr(sys, "argv", argv)
        monkeypatch.setattr(sys, "orig_argv", orig, raising=False)
        assert stopping.is_mpidp_program() is expected, argv
    monkeypatch.undo()
    # Python's handler set first: a child inherits SIGINT ignored from a
    # parent started in the background (bash without job control), and then
    # Python installs none of its own
    probe = ("import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
             "import engine; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=60, env=clean_env())
    assert result.stdout.strip() == "True", result.stderr


def test_sigint_before_the_first_step_ends_cleanly(data, tmp_path):
    stopping.forget_signals()
    with stopping.handled_signals(raising=False):
        os.kill(os.getpid(), signal.SIGINT)  # recorded, not raised
        with pytest.raises(stopping.StartupInterrupted, match="nothing was trained or "
                           "written") as info:
            _train(_cfg(data, checkpoint_dir=str(tmp_path / "ck")))
    assert info.value.exit_code == 130 and info.value.collective
    assert not ckpt.exists_in(tmp_path / "ck") and not (tmp_path / "ck" / "lock").exists()


def test_sigterm_before_the_first_step_stops_after_it(data, tmp_path):
    """SIGTERM/SIGUSR1 during start-up: a checkpoint after the first step, so a
    job warned early still leaves a point to resume from."""
    stopping.forget_signals()
    with stopping.handled_signals(raising=False):
        os.kill(os.getpid(), signal.SIGUSR1)
        trainer, code, text = _train(_cfg(data, checkpoint_dir=str(tmp_path / "ck")))
    assert code == 75 and trainer.step == 1 and ckpt.load(tmp_path / "ck")["step"] == 1
    assert "on SIGUSR1" in text
    stopping.forget_signals()
    with stopping.handled_signals(raising=False):
        os.kill(os.getpid(), signal.SIGTERM)  # without a directory: nothing to save
        with pytest.raises(stopping.StartupInterrupted) as info:
            _train(_cfg(data))
    assert info.value.exit_code == 143


def test_sigint_during_training_checkpoints_like_sigterm(tmp_path):
    path = synthetic.write(tmp_path / "long.h5", rows=4000, features=5, test_rows=50)
    d, m = str(tmp_path / "ck"), tmp_path / "m.jsonl"

    def interrupt_once_training():  # after the first epoch's record
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (m.exists() and m.read_text()):
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)

    stopping.forget_signals()
    thread = threading.Thread(target=interrupt_once_training, daemon=True)
    with stopping.handled_signals(raising=False):
        thread.start()
        trainer, code, text = _train(_cfg(path, epochs=500, batch_size=20, checkpoint_dir=d,
                                          metrics=str(m)))
        thread.join()
    assert code == 75, text
    assert f"on SIGINT; checkpoint written to {d}/checkpoint.pt" in text
    assert f"mpidp train --data {path} --checkpoint-dir {d} --resume" in text
    assert ckpt.load(d)["step"] == trainer.step


@pytest.mark.mpi(min_size=2)
def test_a_signal_on_one_rank_stops_every_rank_at_start_up(comm, shared_tmp):
    path = str(shared_tmp / "d.h5")
    if comm.Get_rank() == 0:
        synthetic.write(path, rows=400, features=4, test_rows=40, seed=2)
    comm.Barrier()
    stopping.forget_signals()
    with stopping.handled_signals(raising=False):
        if comm.Get_rank() == comm.Get_size() - 1:
            os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(stopping.StartupInterrupted) as info:
            _train(_cfg(path, checkpoint_dir=str(shared_tmp / "ck")), comm)
    assert info.value.exit_code == 130 and info.value.collective


@pytest.mark.mpi(min_size=2)
def test_records_on_an_epoch_boundary_at_several_ranks(comm, shared_tmp):
    path = str(shared_tmp / "d.h5")
    if comm.Get_rank() == 0:
        synthetic.write(path, rows=600, features=4, test_rows=60, seed=4)
    comm.Barrier()
    whole, code, _ = _train(_cfg(path, checkpoint_dir=str(shared_tmp / "w")), comm)
    d, m = str(shared_tmp / "ck"), str(shared_tmp / "m.jsonl")
    _, code, text = _train(_cfg(path, checkpoint_dir=d, metrics=m, stop_after=12), comm)
    assert code == 75  # 12 steps: exactly one epoch
    if comm.Get_rank() == 0:
        assert f"mpiexec -n {comm.Get_size()} mpidp train" in text
    last, code, _ = _train(_cfg(path, checkpoint_dir=d, metrics=m, resume=True), comm)
    assert code == 0 and torch.equal(last.params, whole.params)
    assert _records(last.history) == _records(whole.history)
    if comm.Get_rank() == 0:
        assert [r["epoch"] for r in metrics.read_records(m)] == [1, 2, 3]


@pytest.mark.mpi(min_size=2)
def test_a_locked_directory_is_refused_on_every_rank(comm, shared_tmp):
    path = str(shared_tmp / "d.h5")
    d = shared_tmp / "ck"
    if comm.Get_rank() == 0:
        synthetic.write(path, rows=300, features=4, test_rows=30, seed=5)
        d.mkdir()
        (d / "lock").write_text(json.dumps({"host": socket.gethostname(),
                                            "pid": os.getppid(), "started": "now"}))
    comm.Barrier()
    with pytest.raises(DirectoryLocked, match="in use by another run") as info:
        _train(_cfg(path, checkpoint_dir=str(d)), comm)
    assert info.value.collective and info.value.exit_code == 73


# ------------------------------------------------------- the command itself
BANNED = ("Traceback", "BAD TERMINATION", "KeyboardInterrupt", "Exception ignored",
          "MPI_Abort")


def _clean(result_text: str) -> None:
    for word in BANNED:
        assert word not in result_text, result_text


def _train_argv(data, d, *extra):
    return [sys.executable, "-m", "engine.cli", "train", "--data", str(data),
            "--checkpoint-dir", str(d), "--noise-multiplier", "1", "--seed", "1",
            "--hidden", "8", "--no-progress", *extra]


def _popen(argv, env=None, ranks=2):
    return subprocess.Popen([mpiexec_path(), "-n", str(ranks), *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env=env or clean_env(MPIEXEC_TIMEOUT="150"))


def _wait_for(path: Path, text: str, proc, limit=90):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and proc.poll() is None:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.05)


def test_command_sigint_at_start_up_and_in_training(tmp_path):
    """mpiexec forwards Ctrl-C to every rank: during start-up one line and exit 130;
    during training a checkpoint and the resume command (exit 75); never a
    traceback or an MPICH banner."""
    path = synthetic.write(tmp_path / "d.h5", rows=4000, features=6, test_rows=50)
    for delay in (0.5, 2.0):  # torch's import, Numba, the data
        proc = _popen(_train_argv(path, tmp_path / f"s{delay}", "--epochs", "5"))
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        if proc.returncode == 130:
            _clean(out + err)
            lines = [x for x in err.splitlines() if x.startswith("mpidp")]
            assert lines == ["mpidp: stopped by SIGINT during start-up, before the first "
                             "step: nothing was trained or written (exit code 130)"], err
        else:  # the machine was quick: training had started
            assert proc.returncode == 75, err
    d = tmp_path / "ck"
    proc = _popen(_train_argv(path, d, "--epochs", "400", "--batch-size", "16",
                              "--metrics", str(tmp_path / "m.jsonl")))
    _wait_for(tmp_path / "m.jsonl", '"epoch": 1', proc)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    _clean(out + err)
    assert proc.returncode == 75, err
    assert "on SIGINT; checkpoint written" in out
    assert f"mpiexec -n 2 mpidp train --data {path} --checkpoint-dir {d} --resume" in out
    resumed = mpidp(2, "train", "--data", path, "--checkpoint-dir", str(d), "--resume",
                    "--epochs", str(ckpt.load(d)["step"] // 250 + 1), timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.splitlines()[0].startswith(f"mpidp train: resumed the run in {d}")


def test_command_second_run_into_a_directory_is_refused(tmp_path):
    path = synthetic.write(tmp_path / "d.h5", rows=4000, features=6, test_rows=50)
    d = tmp_path / "ck"
    first = _popen(_train_argv(path, d, "--epochs", "400", "--batch-size", "16"))
    try:
        _wait_for(d / "lock", '"pid"', first)
        second = mpidp(2, *_train_argv(path, d, "--epochs", "400")[3:], timeout=120)
        holder = json.loads((d / "lock").read_text())
    finally:
        first.send_signal(signal.SIGTERM)
        out, err = first.communicate(timeout=120)
    assert second.returncode == 73, second.stderr
    lines = [x for x in second.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and f"in use by another run: pid {holder['pid']} on host" in lines[0]
    assert first.returncode == 75, err  # the first run was not disturbed
    _clean(second.stderr + err)


def test_command_outputs_refused_before_any_work(tmp_path, read_only_dir):
    for argv, words in (
            (["--metrics", str(read_only_dir / "m.jsonl")], "--metrics"),
            (["--checkpoint-dir", str(tmp_path / "no" / "ck")], "never its parent"),
            (["--checkpoint-dir", str(tmp_path / "typo"), "--resume"], "nothing to resume")):
        result = mpidp(2, "train", "--data", str(tmp_path / "not-read.h5"),
                       "--noise-multiplier", "1", *argv, timeout=120)
        assert result.returncode == 2, result.stderr
        lines = [x for x in result.stderr.splitlines() if x.strip()]
        assert len(lines) == 1 and words in lines[0], lines


def test_command_interrupt_of_other_commands(tmp_path):
    """Commands without steps (prep here) stop at once on SIGINT: one line, 130,
    nothing written, no MPI library message, late at 2 ranks and early at 3
    (the exit code when some rank waits inside MPI: tests/test_spmd.py)."""
    csv = tmp_path / "p.csv"
    subprocess.run([sys.executable, "-m", "engine.cli", "synth", "--rows", "400000",
                    "--seed", "0", "--out", str(csv), "--quiet"], check=True, timeout=300)
    for ranks, delay in ((2, 1.0), (3, 0.5)):
        out_file = tmp_path / f"p{ranks}-{delay}.h5"
        proc = _popen([sys.executable, "-m", "engine.cli", "prep", str(csv), "--out",
                       str(out_file)], ranks=ranks)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        _clean(out + err)
        if proc.returncode == 0:  # finished before the signal: the file is whole
            assert out_file.exists()
            continue
        assert proc.returncode == 130, (ranks, delay, err)
        assert [x for x in err.splitlines() if x.strip()] == \
            ["mpidp: stopped by SIGINT (exit code 130)"], (ranks, delay)
        assert not out_file.exists()


def test_eval_names_the_task_before_the_feature_count(tmp_path, data):
    from engine.cli import build_parser

    d = str(tmp_path / "ck")
    _, code, _ = _train(_cfg(data, checkpoint_dir=d, epochs=1))
    assert code == 0

    def run(*argv):
        args = build_parser().parse_args(["eval", *argv])
        return args._run(args)

    other = synthetic.write(tmp_path / "income.h5", rows=50, features=9, seed=9,
                            attrs={"task": "income"})
    with pytest.raises(DataError, match="holds task 'income'"):
        run("--checkpoint", d, "--data", other)
    with pytest.raises(DataError, match="swapped"):
        run("--checkpoint", d, "--data", d + "/checkpoint.pt")
    with pytest.raises(CheckpointError, match="swapped"):
        run("--checkpoint", data, "--data", data)


def test_bench_outputs_checked_before_running(tmp_path):
    for argv in (["bench", "scaling", "--dry-run", "--json", str(tmp_path / "no" / "s.json")],
                 ["bench", "allreduce", "-e", "64", "--plot", str(tmp_path / "no" / "a.png")],
                 ["bench", "dpsgd", "--rows", "100", "--json", str(tmp_path)]):
        result = subprocess.run([sys.executable, "-m", "engine.cli", *argv],
                                capture_output=True, text=True, timeout=120,
                                env=clean_env())
        assert result.returncode == 2, (argv, result.stderr)
        assert "Traceback" not in result.stderr
        assert ("never its parent" in result.stderr or "is a directory" in result.stderr), \
            result.stderr


@pytest.mark.parametrize("argv", [
    ["train", "--noise-multiplier", "1", "--metrics", ""],
    ["train", "--noise-multiplier", "1", "--checkpoint-dir", " "],
    ["eval", "--checkpoint", "CK", "--json", ""],
    ["eval", "--checkpoint", "CK", "--plot", ""],
    ["audit", "--checkpoint", "CK", "--json", ""],
    ["bench", "dpsgd", "--rows", "100", "--json", ""],
    ["bench", "scaling", "--dry-run", "--plot", ""],
    ["bench", "noise", "--json", ""],
    ["bench", "accountant", "--json", ""],
    ["bench", "allreduce", "-e", "64", "--json", ""],
    ["prep", "IN", "--out", ""],
    ["synth", "--rows", "300000", "--out", ""],
])
def test_an_empty_output_path_is_refused_before_any_work(argv, tmp_path, data, capsys):
    """``--json ''`` names no file (to pathlib, the current directory): eval
    raised a ValueError traceback at its end, audit wrote nothing without a
    word, prep and synth did all their work first. Every command refuses it
    in one line, exit 2, before reading anything."""
    from engine.cli import main

    argv = [{"CK": str(tmp_path / "no-checkpoint"), "IN": str(tmp_path / "no.csv")}.get(a, a)
            for a in argv]
    if argv[0] in ("train", "eval", "audit"):
        argv += ["--data", str(data)]
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as stop:  # a usage error
        code = stop.code
    assert code == 2
    option = argv[argv.index("") - 1] if "" in argv else "--checkpoint-dir"
    assert capsys.readouterr().err == (f"mpidp: error: {option} is empty; give a "
                                       + ("file name, e.g. " if argv[0] in ("prep", "synth")
                                          else "path, or leave ")
                                       + (f"{option} pums.h5\n" if argv[0] == "prep" else
                                          f"{option} persons.csv\n" if argv[0] == "synth" else
                                          f"{option} out\n"))
    assert not list(tmp_path.iterdir())
