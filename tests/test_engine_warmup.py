"""engine.warmup: a machine's one-time costs paid before the runs that count, and said."""
import io
import json
import os
import subprocess
import sys

import pytest

from collectives import MPI
from engine import warmup
from engine.bench import synthetic
from engine.config import TrainConfig
from engine.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def marker(tmp_path, monkeypatch):
    path = tmp_path / "warm.json"
    monkeypatch.setenv("MPIDP_WARM_FILE", str(path))
    return path


def test_a_machine_is_warm_once_marked_for_its_numba_cache(marker, monkeypatch):
    assert not warmup.is_warm()
    warmup.mark_warm()
    assert warmup.is_warm()
    warmup.mark_warm()  # the same state once
    assert len(json.loads(marker.read_text())["states"]) == 1
    monkeypatch.setenv("NUMBA_CACHE_DIR", "/elsewhere")
    assert not warmup.is_warm()  # another cache: compiled nothing yet
    monkeypatch.setenv("MPIDP_WARM_FILE", "none")
    assert warmup.is_warm()


def test_a_first_run_says_it_pays_one_time_costs_and_marks_the_machine(marker, tmp_path):
    data = synthetic.write(tmp_path / "d.h5", rows=600, features=6, val_rows=100, seed=1)
    lines = []
    for _ in range(2):
        out = io.StringIO()
        cfg = TrainConfig(data=str(data), epochs=1, batch_size=64, noise_multiplier=1.0,
                          delta=1e-4, seed=0, progress=False)
        assert Trainer(cfg, MPI.COMM_SELF, out=out).run() == 0
        lines.append(out.getvalue())
    assert "epoch 1 compiles the kernels" in lines[0] and "mpidp warmup" in lines[0]
    assert "compiles the kernels" not in lines[1] and warmup.is_warm()


def test_the_command_at_two_ranks_runs_its_steps_and_marks_the_machine(marker, tmp_path):
    data = synthetic.write(tmp_path / "d.h5", rows=2000, features=8, val_rows=200, seed=2)
    env = dict(os.environ, MPIDP_WARM_FILE=str(marker))
    done = subprocess.run([os.path.join(os.path.dirname(sys.executable), "mpiexec"), "-n", "2",
                           sys.executable, "-m", "engine.cli", "warmup", "--data", str(data),
                           "--steps", "12"], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    # whole epochs of the file: 2,000 rows at a batch of 256 are 8 steps an epoch
    first, *_, last = done.stdout.splitlines()
    # said first, before any measurement or compilation; the result last
    assert first.startswith("mpidp warmup: filling this machine's caches on 2 rank(s)")
    assert last.startswith("mpidp warmup: 16 steps in ") and "on 2 rank(s)" in last
    assert "measurements not kept" in done.stdout  # the suite keeps no tuning file
    assert warmup.is_warm()
    bad = subprocess.run([sys.executable, "-m", "engine.cli", "warmup", "--steps", "0"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert bad.returncode == 2 and "--steps 0 must be at least 1" in bad.stderr


def test_a_warm_up_a_signal_stopped_is_no_success(marker, tmp_path, monkeypatch):
    """A stop at a step ended the trainer with 130, which warm_up ignored: the
    command said "N steps in S s", exited 0 and marked the machine warm."""
    from engine.stopping import Interrupted

    data = synthetic.write(tmp_path / "d.h5", rows=600, features=6, seed=1)
    monkeypatch.setattr(Trainer, "run", lambda self: 130)  # as after SIGINT at a step
    with pytest.raises(Interrupted) as stopped:
        warmup.warm_up(str(data), 4, "cpu", MPI.COMM_SELF)
    assert stopped.value.signum == 2 and not marker.exists() and not warmup.is_warm()


def test_warm_up_on_a_scoring_file_or_a_file_of_codes(marker, tmp_path):
    """A scoring-only file (no training rows) was a ZeroDivisionError on every
    rank; a file of category codes was refused with advice to pass --model,
    which warmup does not take. Now a one-line DataError, and the embedding
    MLP that such a file's runs train."""
    from engine.errors import DataError

    scoring = synthetic.write(tmp_path / "s.h5", rows=0, features=8, test_rows=100, seed=2)
    with pytest.raises(DataError, match="has no training rows .* warm up on the data of "):
        warmup.warm_up(scoring, 4, "cpu", MPI.COMM_WORLD)
    codes = synthetic.write(tmp_path / "c.h5", rows=600, features=8, codes=True, seed=2)
    steps, _ = warmup.warm_up(codes, 4, "cpu", MPI.COMM_WORLD)
    assert steps >= 4
