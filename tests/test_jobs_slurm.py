"""The jobs/ scripts under a real Slurm (a throw-away 2-node cluster on localhost).

Needs root and Debian's slurmctld, slurmd, slurm-client and munge (`.ci/run`
installs them). Without them these tests skip, saying why — unless
MPIDP_REQUIRE_SLURM=1 (set by .ci/run), which turns the skip into a failure.
"""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from slurm_cluster import started_cluster

#: Minutes of Slurm each: only in make test-long (MPIDP_LONG_TESTS=1).
LONG_TEST = pytest.mark.long

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


def test_the_slurm_example_runs_a_users_program_across_two_nodes(cluster, job_env, tmp_path):
    """examples/slurm_allreduce.sbatch as its comment says: sbatch from the root."""
    result = cluster.run(ROOT / "examples" / "slurm_allreduce.sbatch",
                         f"--output={tmp_path}/example-%j.out", cwd=ROOT,
                         env=dict(job_env, REPO_DIR=str(ROOT)))
    assert result.ok, result.output
    assert "1. 4 ranks summed 30000 floats" in result.output and "3. done" in result.output


def test_the_jobs_cpus_per_task_is_handed_to_srun(cluster, job_env, tmp_path):
    """Slurm 22.05's srun no longer inherits sbatch's --cpus-per-task: on a
    cluster that binds tasks, a job of two CPUs a task would start ranks of one
    CPU each (and mpidp would run one thread) unless jobs/common.sh hands it on
    as SRUN_CPUS_PER_TASK. This cluster binds nothing (task/none), so what is
    checked is the hand-over, and that srun takes it beside the job's own."""
    script = tmp_path / "cpus.sbatch"
    script.write_text(
        "#!/bin/bash\n"
        f". {JOBS / 'common.sh'} || exit 2\n"
        "mpi_run python -c \"import os; "
        "print('srun cpus-per-task', os.environ.get('SRUN_CPUS_PER_TASK'))\"\n")
    result = cluster.run(script, "--ntasks=1", "--cpus-per-task=2",
                         f"--output={tmp_path}/cpus-%j.out", cwd=ROOT, env=job_env)
    assert result.ok and "srun cpus-per-task 2" in result.output, result.output


def test_prep_job_resources_are_overridable(cluster, job_env, prepared, tmp_path):
    """The script's request is a default: --ntasks=1 replaces it; --ntasks-per-node
    alone cannot raise it, and the job says so instead of running short."""
    _, data = prepared
    csv = data.parent / "persons.csv"
    one = cluster.run(JOBS / "prep.sbatch", "--ntasks=1", f"--output={tmp_path}/one-%j.out",
                      cwd=ROOT, env=dict(job_env, INPUTS=str(csv), OUT=str(tmp_path / "p.h5")))
    assert one.ok and "on 1 rank" in one.output, one.output
    capped = cluster.run(JOBS / "prep.sbatch", "--nodes=2", "--ntasks-per-node=2",
                         f"--output={tmp_path}/capped-%j.out", cwd=ROOT,
                         env=dict(job_env, INPUTS=str(csv), OUT=str(tmp_path / "q.h5")))
    assert capped.exit_code == 2 and "pass --ntasks=4 as well" in capped.output, capped.output
    assert not (tmp_path / "q.h5").exists()


def test_a_wrong_venv_stops_the_job(cluster, job_env, prepared, tmp_path):
    _, data = prepared
    result = cluster.run(JOBS / "train.sbatch", "--ntasks=1", f"--output={tmp_path}/v-%j.out",
                         cwd=ROOT, env=dict(job_env, MPIDP_VENV=str(tmp_path / "no-venv"),
                                            DATA=str(data), OUT_DIR=str(tmp_path / "run")))
    assert result.state == "FAILED" and result.exit_code == 2, result.output
    assert f"MPIDP_VENV={tmp_path / 'no-venv'} is not a virtualenv" in result.output
    assert "mpidp train" not in result.output


def test_train_job_on_two_nodes_sees_all_ranks(cluster, job_env, prepared, tmp_path):
    """One rank a node (two a node: the Slurm example's user program, above); each
    rank of a training job costs seconds of start-up on this machine's two cores."""
    _, data = prepared
    result = cluster.run(JOBS / "train.sbatch", "--nodes=2", "--ntasks=2", "--time=2",
                         f"--output={tmp_path}/train-%j.out", cwd=ROOT,
                         env=dict(job_env, DATA=str(data), OUT_DIR=str(tmp_path / "run"),
                                  TRAIN_ARGS="--epochs 1 --batch-size 512 "
                                             "--noise-multiplier 1.0 --seed 1"))
    assert result.ok, result.output
    metrics = [json.loads(line) for line in
               (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["ranks"] == 2 and metrics[-1]["epoch"] == 1
    assert (tmp_path / "run" / "checkpoint" / "checkpoint.pt").is_file()
    # the warning's lead follows the time limit (2 minutes: a tenth, at least 10 s)
    left, lead = map(int, re.search(r"time limit in (\d+) s; SIGUSR1 to the ranks (\d+) s "
                                    "before it", result.output).groups())
    assert 100 <= left <= 120 and lead == max(10, left // 10)


@LONG_TEST  # the tune job's trials as job steps: a minute of Slurm in test-long
def test_tune_job_runs_its_trials_side_by_side_on_two_nodes(cluster, job_env, prepared,
                                                           tmp_path):
    _, data = prepared
    out = tmp_path / "tune"
    result = cluster.run(JOBS / "tune.sbatch", "--nodes=2", "--ntasks-per-node=1",
                         "--ntasks=2", f"--output={tmp_path}/tune-%j.out", cwd=ROOT,
                         env=dict(job_env, DATA=str(data), OUT_DIR=str(out),
                                  TUNE_ARGS="--no-dp --space lr=0.01,0.05;epochs=1 "
                                            "--parallel 2 --seed 1"))
    assert result.ok, result.output
    report = json.loads((out / "tune.json").read_text())
    assert report["ranks"] == 2 and report["parallel"] == 2
    assert sorted(t["group"] for t in report["trials"]) == [0, 1]
    best = max(report["trials"], key=lambda t: t["val_accuracy"])
    assert report["chosen"]["trial"] == best["trial"]
    assert "train it again with:" in result.output


@LONG_TEST  # DDP and Opacus steps under Slurm; the scaling bench has its own tests
def test_bench_scaling_job_runs_a_preset_and_its_peers_as_job_steps(cluster, job_env,
                                                                   tmp_path):
    """jobs/bench_scaling.sbatch: --preset dp-sweep on a tiny grid at 2 ranks
    across the two nodes, DP, the mpidp run and its Opacus-DDP peer each a step
    of the allocation (srun), tabulated side by side (the grid's other axes and
    the DDP peer: tests/test_engine_bench_scaling.py, under mpiexec)."""
    out = tmp_path / "bench"
    result = cluster.run(JOBS / "bench_scaling.sbatch", "--nodes=2", "--ntasks-per-node=1",
                         "--ntasks=2", f"--output={tmp_path}/scaling-%j.out", cwd=ROOT,
                         env=dict(job_env, OUT_DIR=str(out),
                                  BENCH_ARGS="--preset dp-sweep --models mnist-small "
                                             "--batch-sizes 40 --data-repeats 1 --ranks 2 "
                                             "--privacy dp "
                                             "--image-shape 1x8x8 --rows 240 --test-rows 80 "
                                             f"--threads 1 --cache {tmp_path / 'cache'}"))
    assert result.ok, result.output
    assert "launcher: srun" in result.output and "mpidp / Opacus-DDP" in result.output
    doc = json.loads((out / "scaling.json").read_text())
    assert {(s["impl"], s["ranks"]) for s in doc["summaries"]} == {("mpidp", 2),
                                                                  ("opacus-ddp", 2)}
    assert doc["notes"] == [] and (out / "scaling.png").stat().st_size > 0


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


# batch 4: about 0.6 s an epoch, long enough for a signal to land in training
ARGS = "--epochs 2 --batch-size 4 --lr 0.002 --noise-multiplier 1.0 --seed 11"


@pytest.fixture(scope="module")
def reference(job_env, prepared, tmp_path_factory):
    """The uninterrupted run of ARGS, through the same script without Slurm."""
    _, data = prepared
    out = tmp_path_factory.mktemp("reference")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMI_"))}
    env.update(job_env, MPIDP_NTASKS="2", DATA=str(data), OUT_DIR=str(out / "ref"),
               TRAIN_ARGS=ARGS)
    local = subprocess.run(["bash", str(JOBS / "train.sbatch")], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert local.returncode == 0, local.stdout + local.stderr
    return out / "ref"


def _submit_and_wait_for_training(cluster, job_env, data, out_dir, output, args=ARGS):
    job = cluster.submit(JOBS / "train.sbatch", "--nodes=1", "--ntasks=2",
                         f"--output={output}", cwd=ROOT,
                         env=dict(job_env, DATA=str(data), OUT_DIR=str(out_dir),
                                  TRAIN_ARGS=args))
    deadline = time.monotonic() + 120
    while "epoch  train_loss" not in (output.read_text() if output.exists() else ""):
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.1)
    return job


def _wait_requeued(cluster, job, limit=120):
    deadline = time.monotonic() + limit
    while True:  # requeued: counted as a restart, and pending (or running) again
        fields = cluster.job_fields(job)
        if fields.get("Restarts", "0") != "0":
            return
        assert time.monotonic() < deadline, f"the job was not requeued: {fields}"
        time.sleep(0.2)


def _one_record_per_epoch(run: Path, epochs: int) -> None:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == list(range(1, epochs + 1))




@pytest.mark.parametrize("how", [
    ("--signal=USR1", "--batch"),   # --signal=B:USR1@N: to the batch shell only
    # the other variants take as long each: with MPIDP_LONG_TESTS=1 (make test-long)
    pytest.param(("--signal=USR1",), marks=LONG_TEST),  # --signal=USR1@N: to every rank
    pytest.param(("--signal=TERM",), marks=LONG_TEST),  # SIGTERM to every rank
    pytest.param(("--signal=TERM", "--batch"), marks=LONG_TEST),  # to the batch shell
    # SIGTERM to srun too: it kills the ranks before they checkpoint; the job is
    # requeued all the same, and the run starts again (or resumes) on another step
    pytest.param(("--signal=TERM", "--full"), marks=LONG_TEST),
    pytest.param("scontrol requeue", marks=LONG_TEST),  # an administrator's requeue
])
def test_stopped_job_is_requeued_and_resumes_bit_identical(
        cluster, job_env, prepared, reference, tmp_path, how):
    _, data = prepared
    out = tmp_path / "train.out"
    job = _submit_and_wait_for_training(cluster, job_env, data, tmp_path / "run", out)
    command = ["scontrol", "requeue", job] if how == "scontrol requeue" \
        else ["scancel", *how, job]
    subprocess.run(command, env=cluster.env(), check=True)
    _wait_requeued(cluster, job)
    result = cluster.wait(job, timeout=300)
    assert result.ok, result.output
    assert "restart count: 1" in result.output
    # the requeued job's clean-up step: one task a node, without srun's warning
    assert "can't honor --ntasks-per-node" not in result.output, result.output
    if "--full" not in how:
        resumed = re.search(r"mpidp train: resumed the run in \S+ at step (\d+) .*epsilon "
                            r"[0-9.]+ spent", result.output)
        assert resumed and f"stopped at step {resumed.group(1)} " in result.output
    assert torch.equal(_final_params(tmp_path / "run" / "checkpoint"),
                       _final_params(reference / "checkpoint"))
    _one_record_per_epoch(tmp_path / "run", 2)
    assert "Traceback" not in result.output


#: A run that lasts: about 0.6 s an epoch on 2 ranks here (2,000 steps of batch
#: 4; the steps of batch 32 take 0.06 s an epoch, too quick to be stopped).
LONG = "--epochs EPOCHS --batch-size 4 --lr 0.002 --noise-multiplier 1.0 --seed 2"


@LONG_TEST
def test_short_time_limit_requeue_chain_finishes(cluster, job_env, prepared, tmp_path):
    """--time=1: each run is warned before the limit, checkpoints, requeues; the
    chain ends with the whole run and one record per epoch."""
    _, data = prepared
    result = cluster.run(JOBS / "train.sbatch", "--nodes=1", "--ntasks=2", "--time=1",
                         f"--output={tmp_path}/chain-%j.out", cwd=ROOT, timeout=500,
                         env=dict(job_env, DATA=str(data), OUT_DIR=str(tmp_path / "run"),
                                  MPIDP_SIGNAL_LEAD="42",  # warn ~18 s after the start
                                  TRAIN_ARGS=LONG.replace("EPOCHS", "80")))
    assert result.ok, result.output
    assert int(cluster.job_fields(result.job_id)["Restarts"]) >= 1, result.output
    assert "got SIGUSR1" in result.output and "mpidp train: resumed the run" in result.output
    _one_record_per_epoch(tmp_path / "run", 80)


def test_second_job_into_the_same_directory_is_refused(cluster, job_env, prepared, tmp_path):
    _, data = prepared
    out_a = tmp_path / "a.out"
    first = _submit_and_wait_for_training(cluster, job_env, data, tmp_path / "run", out_a,
                                          LONG.replace("EPOCHS", "100"))
    second = cluster.run(JOBS / "train.sbatch", "--nodes=1", "--ntasks=2",
                         f"--output={tmp_path}/b-%j.out", cwd=ROOT, timeout=200,
                         env=dict(job_env, DATA=str(data), OUT_DIR=str(tmp_path / "run"),
                                  TRAIN_ARGS=LONG.replace("EPOCHS", "100")))
    subprocess.run(["scancel", first], env=cluster.env(), check=True)  # a plain scancel
    ended = cluster.wait(first, timeout=200)
    assert second.exit_code == 73 and second.state == "FAILED", second.output
    assert re.search(rf"in use by another run: pid \d+ on host \S+ \(Slurm job {first}",
                     second.output), second.output
    assert ended.state == "CANCELLED", ended.output
    # A cancelled job stays cancelled, its checkpoint written for a resubmission.
    # What the batch shell and the ranks print on the way out may be lost: Slurm
    # signals them all at once and kills what is left after KillWait, so whether
    # the shell's last line ("the job was cancelled, so it is not requeued")
    # reaches the file depends on who wins that race. The facts do not: the job
    # was never requeued, the checkpoint is on disk, the lock is released.
    time.sleep(1.5)  # a requeue by the trap would have shown by now
    fields = cluster.job_fields(first)
    assert fields.get("JobState") == "CANCELLED" and fields.get("Restarts", "0") == "0", fields
    assert (tmp_path / "run" / "checkpoint" / "checkpoint.pt").is_file(), ended.output
    assert not (tmp_path / "run" / "checkpoint" / "lock").exists()
