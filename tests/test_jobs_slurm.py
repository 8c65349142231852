"""The jobs/ scripts under a real Slurm (a throw-away 2-node cluster on localhost).

Needs root and Debian's slurmctld, slurmd, slurm-client and munge (`.ci/run`
installs them). Without them these tests skip, saying why — unless
MPIDP_REQUIRE_SLURM=1 (set by .ci/run), which turns the skip into a failure.
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from slurm_cluster import started_cluster

ROOT = Path(__file__).resolve().parent.parent
JOBS = ROOT / "jobs"
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from started_cluster(tmp_path_factory.mktemp("slurm"))


@pytest.fixture(scope="module")
def job_env():
    """Environment of every job: this Python's venv, and the oversubscription
    settings (the two emulated nodes share this machine's cores, which the
    ranks cannot see from Slurm's per-node task counts)."""
    return {"MPIDP_VENV": sys.prefix,
            "NUMBA_CACHE_DIR": os.environ.get("NUMBA_CACHE_DIR", str(ROOT / ".numba_cache")),
            "MPI4PY_RC_THREAD_LEVEL": "multiple", "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"}


@pytest.fixture(scope="module")
def prepared(cluster, job_env, tmp_path_factory):
    """A small PUMS-format file, prepared by the prep job on 2 ranks."""
    work = tmp_path_factory.mktemp("prepjob")
    csv = work / "persons.csv"
    subprocess.run([sys.executable, "-m", "engine.cli", "synth", "--rows", "12000",
                    "--seed", "3", "--out", str(csv), "--quiet"], check=True, timeout=120)
    out = work / "pums.h5"
    result = cluster.run(JOBS / "prep.sbatch", "--nodes=1", "--ntasks=2",
                         f"--output={work}/prep-%j.out", cwd=ROOT,
                         env=dict(job_env, INPUTS=str(csv), OUT=str(out)))
    return result, out


def test_prep_job_writes_the_file(prepared):
    result, out = prepared
    assert result.ok, result.output
    assert out.is_file()
    assert "on 2 ranks" in result.output


def test_bench_allreduce_job_across_two_nodes(cluster, job_env, tmp_path):
    result = cluster.run(JOBS / "bench_allreduce.sbatch", "--nodes=2",
                         "--ntasks-per-node=1", f"--output={tmp_path}/bench-%j.out",
                         cwd=ROOT, env=dict(job_env, OUT_DIR=str(tmp_path / "out"),
                                            BENCH_ARGS="-b 8 -e 64K -f 64 -i 20 -w 2 -c"))
    assert result.ok, result.output
    records = json.loads((tmp_path / "out" / "allreduce.json").read_text())
    assert records and all(r["ranks"] == 2 and r["wrong"] == 0 for r in records)
    assert (tmp_path / "out" / "allreduce.png").stat().st_size > 0
    assert "nodes=2" in result.output


def test_train_job_on_two_nodes_sees_all_ranks(cluster, job_env, prepared, tmp_path):
    _, data = prepared
    result = cluster.run(JOBS / "train.sbatch", "--nodes=2", "--ntasks=4",
                         f"--output={tmp_path}/train-%j.out", cwd=ROOT,
                         env=dict(job_env, DATA=str(data), OUT_DIR=str(tmp_path / "run"),
                                  TRAIN_ARGS="--epochs 1 --batch-size 512 "
                                             "--noise-multiplier 1.0 --seed 1"))
    assert result.ok, result.output
    metrics = [json.loads(line) for line in
               (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["ranks"] == 4 and metrics[-1]["epoch"] == 1
    assert (tmp_path / "run" / "checkpoint" / "checkpoint.pt").is_file()


def test_plain_srun_singletons_are_refused(cluster, job_env, tmp_path):
    # srun --mpi=none: every rank is a singleton of size 1. mpidp must refuse.
    result = cluster.run(JOBS / "bench_allreduce.sbatch", "--nodes=1", "--ntasks-per-node=2",
                         f"--output={tmp_path}/single-%j.out", cwd=ROOT,
                         env=dict(job_env, MPIDP_SRUN_MPI="none",
                                  OUT_DIR=str(tmp_path / "out"), BENCH_ARGS="-e 64"))
    assert result.state == "FAILED" and result.exit_code != 0, result.output
    assert "communicator of size 1" in result.output
    assert not (tmp_path / "out" / "allreduce.json").exists()


def test_failing_rank_fails_the_job_promptly(cluster, job_env, tmp_path):
    start = time.monotonic()
    result = cluster.run(ROOT / "tests" / "scripts" / "fail_rank.sbatch", "--ntasks=3",
                         f"--output={tmp_path}/fail-%j.out", cwd=ROOT, env=job_env,
                         timeout=120)
    assert result.state == "FAILED" and result.exit_code != 0, result.output
    assert "[rank 1] ZeroDivisionError" in result.output
    assert time.monotonic() - start < 60


def _final_params(checkpoint_dir: Path) -> torch.Tensor:
    payload = torch.load(checkpoint_dir / "checkpoint.pt", map_location="cpu",
                         weights_only=True)
    return payload["params"]


def test_signal_checkpoint_requeue_resume_matches_uninterrupted_run(
        cluster, job_env, prepared, tmp_path):
    _, data = prepared
    args = "--epochs 2 --batch-size 32 --noise-multiplier 1.0 --seed 11"
    # The uninterrupted reference, through the same script without Slurm.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMI_"))}
    env.update(job_env, MPIDP_NTASKS="2", DATA=str(data), OUT_DIR=str(tmp_path / "ref"),
               TRAIN_ARGS=args)
    local = subprocess.run(["bash", str(JOBS / "train.sbatch")], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert local.returncode == 0, local.stdout + local.stderr

    out = tmp_path / "train.out"
    job = cluster.submit(JOBS / "train.sbatch", "--nodes=1", "--ntasks=2",
                         f"--output={out}", cwd=ROOT,
                         env=dict(job_env, DATA=str(data), OUT_DIR=str(tmp_path / "run"),
                                  TRAIN_ARGS=args))
    deadline = time.monotonic() + 120
    while "epoch  train_loss" not in (out.read_text() if out.exists() else ""):
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.1)
    # What --signal=USR1@120 does before the time limit: USR1 to every rank.
    subprocess.run(["scancel", "--signal=USR1", job], env=cluster.env(), check=True)
    while True:  # requeued: counted as a restart, and pending again
        fields = cluster.job_fields(job)
        if fields.get("Restarts", "0") != "0" and fields.get("JobState") == "PENDING":
            break
        assert time.monotonic() < deadline, f"the job was not requeued: {fields}"
        time.sleep(0.2)
    result = cluster.wait(job, timeout=300)
    assert result.ok, result.output
    assert "stopped at step" in result.output and "restart count: 1" in result.output
    assert torch.equal(_final_params(tmp_path / "run" / "checkpoint"),
                       _final_params(tmp_path / "ref" / "checkpoint"))
