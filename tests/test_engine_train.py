"""mpidp train end to end: metrics, bit-identical resume, signals, budgets, errors."""
import json
import signal
import subprocess
import sys
import time

import pytest
import torch

from engine import checkpoint as ckpt
from engine.bench import synthetic
from engine.config import TrainConfig
from engine.errors import (CheckpointError, ConfigError, DataError, DivergedError,
                           PrivacyError)
from engine.trainer import Trainer
from launcher import mpidp, mpiexec_path

# A fixed all-reduce: auto picks by timing, and at 3 or more ranks algorithms
# sum in different orders, so two runs may differ in the last bits.
FAST = dict(epochs=2, batch_size=64, hidden=(8,), noise_multiplier=1.0, seed=5,
            progress=False, allreduce="ring")


def _cfg(path, **kw):
    return TrainConfig(data=str(path), **{**FAST, **kw})


class _Null:
    def write(self, text):
        pass

    def flush(self):
        pass


def _train(cfg, comm):
    cfg.validate()
    trainer = Trainer(cfg, comm, out=_Null())
    return trainer, trainer.run()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "tiny.h5"
    return synthetic.write(path, rows=600, features=6, test_rows=100, seed=1)


@pytest.mark.mpi(min_size=2)
def test_resume_is_bit_identical(comm, shared_tmp):
    """Stop mid-epoch (checkpoint), resume: same parameters, optimizer and metrics
    as an uninterrupted run, to the bit."""
    path = str(shared_tmp / "d.h5")
    if comm.Get_rank() == 0:
        synthetic.write(path, rows=500, features=5, test_rows=60, seed=2)
    comm.Barrier()
    base = dict(epochs=3, optimizer="adam", lr=0.01)
    whole, code = _train(_cfg(path, checkpoint_dir=str(shared_tmp / "a"), **base), comm)
    assert code == 0
    first, code = _train(_cfg(path, checkpoint_dir=str(shared_tmp / "b"), stop_after=11,
                              **base), comm)
    assert code == 75 and first.step == 11
    second, code = _train(_cfg(path, checkpoint_dir=str(shared_tmp / "b"), resume=True,
                               **base), comm)
    assert code == 0 and second.step == whole.step
    assert torch.equal(second.params, whole.params)
    assert torch.equal(second.optimizer.m, whole.optimizer.m)
    assert second.accountant.steps == whole.accountant.steps
    keys = ("train_loss", "test_accuracy", "epsilon", "train_examples")
    assert [[r[k] for k in keys] for r in second.history] == \
        [[r[k] for k in keys] for r in whole.history]


@pytest.mark.mpi(min_size=1)
def test_every_rank_takes_the_same_steps_and_the_same_model(comm, shared_tmp):
    path = str(shared_tmp / "d.h5")
    if comm.Get_rank() == 0:
        synthetic.write(path, rows=300, features=4, test_rows=40, seed=4)
    comm.Barrier()
    trainer, code = _train(_cfg(path, epochs=1, batch_size=8), comm)
    assert code == 0
    steps = comm.allgather(trainer.step)
    assert len(set(steps)) == 1 and steps[0] == round(300 / 8)
    params = comm.allgather(trainer.params.numpy().tobytes())
    assert len(set(params)) == 1


def test_one_rank_learns_and_writes_metrics(tiny, tmp_path):
    from collectives.runtime import MPI

    metrics = tmp_path / "m.jsonl"
    trainer, code = _train(_cfg(tiny, epochs=3, batch_size=32, noise_multiplier=0.5,
                                metrics=str(metrics), hidden=(16,)), MPI.COMM_SELF)
    assert code == 0
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2, 3]
    assert rows[-1]["test_accuracy"] > 0.6  # majority class is 0.5 by construction
    assert rows[0]["epsilon"] < rows[1]["epsilon"] < rows[2]["epsilon"]
    for key in ("train_loss", "examples_per_s", "comm_s", "compute_s", "threads",
                "step_breakdown_s", "clipped_fraction", "epoch_time_s"):
        assert key in rows[-1]


def test_no_dp_is_the_same_loop_without_noise(tiny):
    from collectives.runtime import MPI

    trainer, code = _train(_cfg(tiny, dp=False, noise_multiplier=None), MPI.COMM_SELF)
    assert code == 0 and trainer.noise is None and trainer.accountant is None
    assert trainer.history[-1]["epsilon"] is None


def test_user_errors_in_process(tiny, tmp_path):
    from collectives.runtime import MPI

    self = MPI.COMM_SELF
    with pytest.raises(DataError, match="does not exist"):
        _train(_cfg(tmp_path / "nope.h5"), self)
    with pytest.raises(ConfigError, match="exceeds"):
        _train(_cfg(tiny, batch_size=10_000), self)
    with pytest.raises(PrivacyError, match="out of reach"):
        _train(_cfg(tiny, noise_multiplier=None, target_epsilon=1e-7, epochs=50), self)
    with pytest.raises(ConfigError, match="exactly one"):
        _cfg(tiny, noise_multiplier=None).validate()
    with pytest.raises(ConfigError, match="--allreduce 'rings': choose from naive"):
        _cfg(tiny, allreduce="rings").validate()  # before any step, not at the first
    with pytest.raises(DivergedError):
        _train(_cfg(tiny, dp=False, noise_multiplier=None, lr=1e30, momentum=0.0), self)


def test_checkpoint_guards_the_budget(tiny, tmp_path):
    from collectives.runtime import MPI

    d = str(tmp_path / "ck")
    _, code = _train(_cfg(tiny, checkpoint_dir=d), MPI.COMM_SELF)
    assert code == 0
    spent = ckpt.load(d)["epsilon"]
    with pytest.raises(CheckpointError, match="pass --resume"):  # no silent restart
        _train(_cfg(tiny, checkpoint_dir=d), MPI.COMM_SELF)
    with pytest.raises(PrivacyError, match="budget"):  # more epochs than budgeted
        _train(_cfg(tiny, checkpoint_dir=d, resume=True, epochs=4), MPI.COMM_SELF)
    with pytest.raises(ConfigError, match="noise-multiplier"):  # privacy settings fixed
        _train(_cfg(tiny, checkpoint_dir=d, resume=True, noise_multiplier=2.0), MPI.COMM_SELF)
    assert ckpt.load(d)["epsilon"] == spent
    (tmp_path / "ck" / "checkpoint.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="not an mpidp checkpoint"):
        _train(_cfg(tiny, checkpoint_dir=d, resume=True), MPI.COMM_SELF)


def test_errors_exit_nonzero_on_all_ranks(tmp_path):
    """A collective user error: one message, exit code 2 from every rank (no abort)."""
    path = synthetic.write(tmp_path / "two.h5", rows=2, features=3, test_rows=1)
    result = mpidp(3, "train", "--data", path, "--noise-multiplier", "1", "--batch-size", "1",
                   timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("fewer than the 3 ranks") == 1
    assert "Traceback" not in result.stderr


def test_signal_checkpoints_and_resume_finishes(tmp_path):
    """SIGUSR1 to mpiexec -> every rank stops at a step boundary, checkpoint, exit 75;
    resume continues from that step to the end."""
    path = synthetic.write(tmp_path / "d.h5", rows=4000, features=8, test_rows=100)
    d = str(tmp_path / "ck")
    args = [sys.executable, "-m", "engine.cli", "train", "--data", path, "--epochs", "400",
            "--batch-size", "16", "--hidden", "8", "--noise-multiplier", "1", "--seed", "1",
            "--checkpoint-dir", d, "--checkpoint-every", "1000", "--metrics",
            str(tmp_path / "m.jsonl")]
    from launcher import clean_env

    env = clean_env(MPIEXEC_TIMEOUT="150")
    proc = subprocess.Popen([mpiexec_path(), "-n", "2", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:  # wait until training has started
            if (tmp_path / "m.jsonl").exists() and (tmp_path / "m.jsonl").read_text():
                break
            time.sleep(0.2)
        proc.send_signal(signal.SIGUSR1)
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, err
    assert "checkpoint written" in out
    step = ckpt.load(d)["step"]
    assert 0 < step < 400 * 250
    result = mpidp(2, *args[3:], "--resume", "--epochs", str(step // 250 + 1),
                   timeout=120)
    assert result.returncode == 0, result.stderr
    assert ckpt.load(d)["step"] == (step // 250 + 1) * 250


def test_eval_command_scores_a_checkpoint(tiny, tmp_path, capsys):
    """mpidp eval reproduces the trainer's test accuracy and refuses other encodings."""
    from collectives.runtime import MPI
    from engine.cli import build_parser

    d = str(tmp_path / "ck")
    trainer, code = _train(_cfg(tiny, checkpoint_dir=d), MPI.COMM_SELF)
    assert code == 0

    def run(*argv):
        args = build_parser().parse_args(["eval", *argv])
        return args._run(args)

    assert run("--checkpoint", d, "--data", tiny, "--json") == 0
    result = json.loads(capsys.readouterr().out)
    assert result["accuracy"] == pytest.approx(trainer.history[-1]["test_accuracy"], abs=1e-12)
    assert result["rows"] == 100
    other = synthetic.write(tmp_path / "other.h5", rows=50, features=6, seed=9,
                               attrs={"encoding_fingerprint": "something-else"})
    with pytest.raises(DataError, match="encoded differently"):
        run("--checkpoint", d, "--data", other)
    other_task = synthetic.write(tmp_path / "income.h5", rows=50, features=6, seed=9,
                                    attrs={"task": "income"})
    with pytest.raises(DataError, match="holds task 'income'"):
        run("--checkpoint", d, "--data", other_task)
    wider = synthetic.write(tmp_path / "wider.h5", rows=50, features=7)
    with pytest.raises(DataError, match="expects 6"):
        run("--checkpoint", d, "--data", wider)
