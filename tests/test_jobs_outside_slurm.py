"""The jobs/ scripts run with bash outside Slurm (docs/clusters.md): their
variables checked before any work, exit 2 as mpidp's own bad input, and no
output directory left behind by a run that was refused."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

JOBS = Path(__file__).resolve().parent.parent / "jobs"


def _script(name: str, tmp_path: Path, **env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("SLURM_", "PMI_", "DATA", "INPUTS", "TUNE_ARGS", "OUT"))}
    clean.update(MPIDP_VENV=sys.prefix, **env)
    return subprocess.run(["bash", str(JOBS / name)], env=clean, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("tasks", ["abc", "0", "-1", "00", "2x"])
def test_a_task_count_that_is_no_count_stops_the_job(tmp_path, tasks):
    """mpiexec -n abc quietly started one rank under a banner saying tasks=abc."""
    done = _script("train.sbatch", tmp_path, MPIDP_NTASKS=tasks, DATA="d.h5", OUT_DIR="out")
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr == (f"jobs/common.sh: MPIDP_NTASKS={tasks} must be a whole number >= 1 "
                           "(the ranks outside Slurm)\n")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("name, variable, env", [
    ("train.sbatch", "DATA", {}),
    ("prep.sbatch", "INPUTS", {}),
    ("tune.sbatch", "DATA", {}),
    ("tune.sbatch", "TUNE_ARGS", {"DATA": "d.h5"}),
])
def test_a_missing_variable_is_exit_2_and_says_what_to_set(tmp_path, name, variable, env):
    """bash's own ${DATA:?} exited 1, the code of a crash."""
    done = _script(name, tmp_path, **env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith(f"{name}: set {variable} to ")
    assert done.stderr.count("\n") == 1 and not list(tmp_path.iterdir())


def test_a_refused_run_leaves_no_empty_output_directory(tmp_path):
    """OUT_DIR was created before mpidp refused the run, and stayed, empty."""
    done = _script("train.sbatch", tmp_path, MPIDP_NTASKS="1", DATA="nope.h5", OUT_DIR="out")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "data file nope.h5 does not exist" in done.stderr
    assert not (tmp_path / "out").exists()
