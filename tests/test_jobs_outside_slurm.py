"""The jobs/ scripts run with bash outside Slurm (docs/clusters.md): their
variables checked before any work, exit 2 as mpidp's own bad input, and no
output directory left behind by a run that was refused; and their logic for
Slurm (where common.sh is found, the warning before the time limit, signals,
requeue) against the fake sbatch, srun, squeue, scontrol and mpidp of
tests/slurm_cluster.py, in a second each (tests/test_jobs_slurm.py submits
them to a real Slurm)."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_cluster import fake_slurm

ROOT = Path(__file__).resolve().parent.parent
JOBS = ROOT / "jobs"


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


@pytest.mark.parametrize("lead", ["5m", "1.5", "0", "abc"])
def test_a_signal_lead_that_is_no_whole_number_of_seconds_stops_the_job(tmp_path, lead):
    """5m printed "SIGUSR1 to the ranks 5m s before it", then bash's "value too
    great for base", and the ranks were never warned."""
    done = _script("train.sbatch", tmp_path, MPIDP_SIGNAL_LEAD=lead, DATA="d.h5",
                   OUT_DIR="out")
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr == (f"jobs/common.sh: MPIDP_SIGNAL_LEAD={lead} must be a whole number "
                           "of seconds >= 1 (e.g. 300 for 5 minutes)\n")
    assert not list(tmp_path.iterdir())


# -- where jobs/common.sh is found -----------------------------------------------

NOT_FOUND = ("train.sbatch: cannot find jobs/common.sh: submit from the repository root or "
             "set JOBS_DIR to its jobs/ directory\n")


def test_a_job_submitted_away_from_the_repository_says_what_to_do(tmp_path):
    """sbatch runs a copy of the script (its $0 in Slurm's spool): from another
    directory, without JOBS_DIR, bash's own "common.sh: No such file or
    directory" ended the job. Then JOBS_DIR, or the submission directory's jobs/."""
    spool = tmp_path / "spool"
    spool.mkdir()
    shutil.copy(JOBS / "train.sbatch", spool / "slurm_script")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "PMI_", "DATA", "OUT", "JOBS_DIR"))}
    env.update(MPIDP_VENV=sys.prefix, SLURM_JOB_ID="7", SLURM_SUBMIT_DIR=str(tmp_path))

    def job(**extra):
        return subprocess.run(["bash", str(spool / "slurm_script")], env=dict(env, **extra),
                              cwd=tmp_path, capture_output=True, text=True, timeout=60)

    lost = job()
    assert lost.returncode == 2 and lost.stderr == NOT_FOUND, lost.stdout + lost.stderr
    for found in (job(JOBS_DIR=str(JOBS)), job(SLURM_SUBMIT_DIR=str(ROOT))):
        assert found.returncode == 2, found.stdout + found.stderr
        assert found.stderr.startswith("train.sbatch: set DATA to "), found.stderr


def test_a_script_run_by_its_path_finds_common_sh_beside_it(tmp_path):
    """Under salloc, `bash /path/jobs/prep.sbatch` from another directory: $0 is
    the real script, and common.sh is beside it."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "PMI_", "INPUTS", "JOBS_DIR"))}
    env.update(MPIDP_VENV=sys.prefix, SLURM_JOB_ID="7", SLURM_SUBMIT_DIR=str(tmp_path))
    done = subprocess.run(["bash", str(JOBS / "prep.sbatch")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith("prep.sbatch: set INPUTS to "), done.stderr


# -- against a fake Slurm ----------------------------------------------------------

def _fake_job(tmp_path: Path, slurm: bool = True, **env) -> tuple[subprocess.CompletedProcess,
                                                                   str]:
    """jobs/train.sbatch with the fake programs (in a Slurm job 7 unless not
    slurm); returns the run and the programs' log."""
    fake = fake_slurm(tmp_path / "fake")
    if slurm:
        fake.update(SLURM_JOB_ID="7", SLURM_NTASKS="2", SLURM_SUBMIT_DIR=str(tmp_path))
    fake.update(DATA="d.h5", **env)
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    done = subprocess.run(["bash", str(JOBS / "train.sbatch")], env=fake, cwd=work,
                          capture_output=True, text=True, timeout=60)
    log = tmp_path / "fake" / "log"
    return done, log.read_text() if log.exists() else ""


def test_local_runs_without_out_dir_get_a_directory_each(tmp_path):
    """Every local run shared results/train-local: a second run with other
    settings said "resuming the run in results/train-local/checkpoint" and was
    refused; with the same settings, "nothing to do"."""
    first, _ = _fake_job(tmp_path, slurm=False)
    second, log = _fake_job(tmp_path, slurm=False, TRAIN_ARGS="--epochs 3")
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    dirs = re.findall(r"^mpidp train .*--checkpoint-dir (\S+)", log, re.M)
    assert len(dirs) == 2 and dirs[0] != dirs[1], log
    for run, directory in zip((first, second), dirs):
        assert re.fullmatch(r"results/train-local-\d{8}-\d{6}-\d+/checkpoint", directory)
        assert f"a new run in {directory}" in run.stdout
        assert (tmp_path / "work" / directory).parent.joinpath("metrics.jsonl").is_file()


def test_a_lead_not_shorter_than_the_time_left_stops_the_job(tmp_path):
    """A lead of 120 s in a 1-minute job warned the ranks at once, before they
    had their handlers, and every requeued job again."""
    done, log = _fake_job(tmp_path, FAKE_TIME_LEFT="0:58", MPIDP_SIGNAL_LEAD="120",
                          OUT_DIR="run")
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr == ("jobs/common.sh: MPIDP_SIGNAL_LEAD=120 s is not shorter than the "
                           "job's time left (58 s): the ranks would be warned at once; lower "
                           "it or raise --time\n")
    assert "mpidp train" not in log and not (tmp_path / "work" / "run").exists()


def test_a_signal_before_the_ranks_start_stops_the_run_there(tmp_path):
    """A TERM during a requeued job's clean-up step came before the ranks
    existed: "passing SIGUSR1 to the ranks" went to no one, and the ranks then
    started and trained on, unwarned. Now they are not started, and the job
    requeues as after any stop. The clean-up step asks for one task on each
    node (-N and -n: else srun warned that it cannot honour --ntasks-per-node)."""
    exit_file = tmp_path / "exit-code"
    done, log = _fake_job(tmp_path, SLURM_RESTART_COUNT="1", SLURM_JOB_NUM_NODES="2",
                          FAKE_STEP_SIGNAL="TERM", OUT_DIR="run",
                          MPIDP_EXIT_FILE=str(exit_file))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "got SIGTERM before the ranks started" in done.stdout
    assert "stopped by SIGTERM before the ranks started; not starting them" in done.stdout
    assert "passing" not in done.stdout and "mpidp train" not in log, done.stdout + log
    assert "stopped (exit 143, SIGTERM); requeueing job 7" in done.stdout
    assert "scontrol requeue 7" in log and exit_file.read_text() == "requeued\n"
    clean_up = [line for line in log.splitlines() if line.startswith("srun") and "bash" in line]
    assert clean_up and "--nodes=2 --ntasks=2 --ntasks-per-node=1 " in clean_up[0], log


@pytest.mark.parametrize("resume", ["auto", "0"])
def test_the_warning_stops_the_run_and_mpidp_resume_0_is_not_requeued(tmp_path, resume):
    """With MPIDP_RESUME=0 the job requeued itself after the checkpoint, and the
    requeued job was refused ("holds a run ...; pass --resume", FAILED)."""
    exit_file = tmp_path / "exit-code"
    done, log = _fake_job(tmp_path, FAKE_TIME_LEFT="0:11", MPIDP_SIGNAL_LEAD="10",
                          FAKE_MPIDP_WAIT="1", MPIDP_RESUME=resume, OUT_DIR="run",
                          MPIDP_EXIT_FILE=str(exit_file))
    assert "got SIGUSR1; passing SIGUSR1 to the ranks" in done.stdout, done.stdout
    assert "mpidp: got SIGUSR1" in log
    if resume == "auto":
        assert done.returncode == 0 and "scontrol requeue 7" in log, done.stdout + done.stderr
        assert exit_file.read_text() == "requeued\n"
    else:
        assert done.returncode == 75 and "requeue" not in log, done.stdout + done.stderr
        assert done.stderr == ("mpidp job: stopped (exit 75, SIGUSR1); not requeued, as "
                               "MPIDP_RESUME=0 starts new runs only; to continue, submit "
                               "again with OUT_DIR=run and MPIDP_RESUME=1\n")
        assert exit_file.read_text() == "75\n"
