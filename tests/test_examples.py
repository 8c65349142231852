"""The examples/ programs run as their docstrings say, so they never rot."""
import sys
from pathlib import Path

import pytest

from engine.bench import synthetic
from launcher import run_mpi

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("n", [2, 3])
def test_allreduce_user_program(n):
    result = run_mpi(n, [sys.executable, "-m", "mpi4py",
                         str(EXAMPLES / "allreduce_user_program.py")], timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert f"1. {n} ranks summed 30000 floats" in out
    assert "2. caught on every rank: allreduce called with different arguments" in out
    assert f"the next call on the same communicator gives {n}" in out and "3. done" in out


def test_allreduce_user_program_ends_promptly_when_a_rank_fails():
    result = run_mpi(3, [sys.executable, "-m", "mpi4py", str(EXAMPLES / "allreduce_user_program.py"),
                         "--fail-on-rank", "1"], timeout=60)
    assert result.returncode != 0
    assert "RuntimeError: an ordinary bug on rank 1" in result.stderr
    assert "3. done" not in result.stdout


def test_train_api(tmp_path):
    data = synthetic.write(tmp_path / "pums.h5", rows=3000, features=12, seed=0)
    result = run_mpi(2, [sys.executable, str(EXAMPLES / "train_api.py"), data], timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "epsilon 1.000 (delta 1e-05), test accuracy" in result.stdout
    assert "Linear(in_features=12, out_features=128" in result.stdout
