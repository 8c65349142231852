"""jobs/sweep_scaling.sh: its dry run, and one tiny sweep under a real (throw-away) Slurm.

The Slurm part needs root and Debian's slurmctld, slurmd, slurm-client and
munge (as tests/test_jobs_slurm.py); without them it skips, saying why,
unless MPIDP_REQUIRE_SLURM=1.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine.bench import synthetic
from slurm_cluster import fake_slurm, started_cluster

ROOT = Path(__file__).resolve().parent.parent
SWEEP = ROOT / "jobs" / "sweep_scaling.sh"


def test_dry_run_prints_one_sbatch_per_layout(tmp_path):
    env = dict(os.environ, DATA="/data/pums.h5", TRAIN_ARGS="--epochs 3 --hidden 64,64")
    result = subprocess.run(["bash", str(SWEEP), "--dry-run", "--layouts", "4x1,2x2,1x4",
                             "--out", str(tmp_path / "sw"), "--", "--partition=gpu"],
                            env=env, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 3
    for i, (line, (nodes, tasks)) in enumerate(zip(lines, ((4, 1), (2, 2), (1, 4)))):
        assert f"--nodes={nodes} --ntasks-per-node={tasks} --ntasks={nodes * tasks}" in line
        # nodes nothing else uses: exclusive, and each layout after the previous one
        assert "--exclusive" in line and ("--dependency=afterany:" in line) == (i > 0)
        assert "--partition=gpu" in line and line.endswith("jobs/train.sbatch")
        assert f"OUT_DIR={tmp_path}/sw/{nodes}x{tasks}" in line
        assert "TRAIN_ARGS=--epochs\\ 3\\ --hidden\\ 64\\,64" in line
    assert not (tmp_path / "sw").exists()  # a dry run writes nothing
    bad = subprocess.run(["bash", str(SWEEP), "--layouts", "2by2"], env=env,
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "not NODESxTASKS" in bad.stderr
    no_data = subprocess.run(["bash", str(SWEEP)], capture_output=True, text=True,
                             env={k: v for k, v in env.items() if k != "DATA"}, timeout=30)
    assert no_data.returncode == 2 and "set DATA" in no_data.stderr


def _sweep(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess,
                                                             list[str]]:
    """The sweep against the fake sbatch of tests/slurm_cluster.py, which runs
    each job at once (jobs/train.sbatch with a fake mpidp); returns the run and
    the sbatch lines of the fake programs' log."""
    fake = fake_slurm(tmp_path / "fake")
    fake.update(DATA="d.h5", SWEEP_POLL_SECONDS="0.1", **env)
    done = subprocess.run(["bash", str(SWEEP), *args], env=fake, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    log = tmp_path / "fake" / "log"
    lines = log.read_text().splitlines() if log.exists() else []
    return done, [line for line in lines if line.startswith("sbatch ")]


@pytest.mark.parametrize("args, message", [
    (["--timeout", "10m"], "--timeout 10m is not a whole number of seconds >= 1"),
    (["--timeout", "abc"], "--timeout abc is not a whole number of seconds >= 1"),
    (["--layouts", "1x1", "--timeout"], "--timeout needs seconds"),
    (["--layouts"], "--layouts needs a list of NODESxTASKS"),
    (["--out"], "--out needs a directory"),
    (["--out", "--dry-run"], "--out needs a directory"),
    (["--layouts", "1x1,1x1"], "layout 1x1 is given twice"),
])
def test_bad_usage_is_one_line_and_exit_2_before_any_sbatch(tmp_path, args, message):
    """--timeout 10m submitted the jobs, then failed on bash's "value too great
    for base" (exit 1, the jobs left queued); an option without its value ended
    with bash's own message, exit 1."""
    done, submitted = _sweep(tmp_path, *args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith(f"sweep_scaling.sh: {message}"), done.stderr
    assert done.stderr.count("\n") == 1 and not submitted


def test_an_out_holding_a_sweep_is_refused_and_failed_jobs_are_not_tabulated(tmp_path):
    """A second sweep into one --out with other TRAIN_ARGS printed the first
    sweep's figures under the new header, exit 0: its jobs resumed the old
    runs and were refused (exit 2), and the sweep saw only the old metrics."""
    first, submitted = _sweep(tmp_path, "--layouts", "1x1,2x1", "--out", "sw")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "collected sw/1x1 sw/2x1 --json sw/scaling.json" in first.stdout
    assert (tmp_path / "sw" / "1x1" / "exit-code").read_text() == "0\n"
    again, resubmitted = _sweep(tmp_path, "--layouts", "1x1,2x1", "--out", "sw",
                                TRAIN_ARGS="--epochs 3")
    assert again.returncode == 2 and resubmitted == submitted, again.stdout + again.stderr
    assert again.stderr == ("sweep_scaling.sh: --out sw already holds a sweep "
                            "(sw/1x1/sweep-point.json): give a new --out, or --resume to finish "
                            "that sweep with the same TRAIN_ARGS\n")
    # --resume submits; jobs refused as those were are failures, not the old table
    resumed, resubmitted = _sweep(tmp_path, "--resume", "--layouts", "1x1,2x1", "--out", "sw",
                                  TRAIN_ARGS="--epochs 3", FAKE_MPIDP_EXIT="2")
    assert resumed.returncode == 1 and len(resubmitted) == 4, resumed.stdout + resumed.stderr
    assert "collected" not in resumed.stdout and not (tmp_path / "sw" / "scaling.txt").exists()
    jobs = re.findall(r"^layout (\S+): job (\d+) ", resumed.stdout, re.M)
    assert [layout for layout, _ in jobs] == ["1x1", "2x1"], resumed.stdout
    assert resumed.stderr.splitlines() == [
        f"sweep_scaling.sh: layout {layout}: job {job} failed (exit 2); left out of the "
        f"table; see sw/{layout}/job-{job}.out" for layout, job in jobs]


def test_a_job_that_failed_after_writing_metrics_is_left_out(tmp_path):
    """Metrics alone said nothing of how a job ended: the sweep reads the exit
    status the job wrote (MPIDP_EXIT_FILE), and tabulates the other layouts."""
    done, _ = _sweep(tmp_path, "--layouts", "1x1,2x1", "--out", "sw", FAKE_MPIDP_EXIT="3",
                     FAKE_MPIDP_EXIT_WHERE="sw/2x1/")
    assert done.returncode == 1, done.stdout + done.stderr
    assert (tmp_path / "sw" / "2x1" / "metrics.jsonl").is_file()
    assert re.fullmatch(r"sweep_scaling.sh: layout 2x1: job \d+ failed \(exit 3\); left out "
                        r"of the table; see sw/2x1/job-\d+\.out\n", done.stderr), done.stderr
    assert "collected sw/1x1 --json" in done.stdout


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from started_cluster(tmp_path_factory.mktemp("slurm"))


@pytest.mark.timeout(300)
@pytest.mark.long  # a whole sweep under Slurm: make test-long
def test_tiny_sweep_under_slurm_collects_one_table(cluster, tmp_path):
    data = synthetic.write(tmp_path / "d.h5", rows=1200, features=6, test_rows=200)
    env = cluster.env(
        DATA=data, MPIDP_VENV=sys.prefix, SWEEP_POLL_SECONDS="0.3",
        NUMBA_CACHE_DIR=os.environ.get("NUMBA_CACHE_DIR", str(ROOT / ".numba_cache")),
        MPI4PY_RC_THREAD_LEVEL="multiple", MPIR_CVAR_ENABLE_HEAVY_YIELD="1",
        TRAIN_ARGS="--epochs 2 --batch-size 100 --hidden 8 --noise-multiplier 1 --seed 1",
        BENCH_ARGS="--price-per-node-hour 2")
    out = tmp_path / "sweep"
    result = subprocess.run(["bash", str(SWEEP), "--layouts", "1x1,2x1", "--out", str(out),
                             "--timeout", "200"], env=env, cwd=ROOT, capture_output=True,
                            text=True, timeout=260)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "strong scaling (global batch 100), DP-SGD" in result.stdout
    assert "cost at 2 per node-hour" in result.stdout
    doc = json.loads((out / "scaling.json").read_text())
    by_layout = {s["layout"]: s for s in doc["summaries"]}
    assert by_layout["1x1"]["ranks"] == 1 and by_layout["2x1"]["ranks"] == 2
    assert by_layout["2x1"]["nodes"] == 2 and by_layout["1x1"]["speedup"] == 1.0
    assert (out / "scaling.png").stat().st_size > 0 and (out / "scaling.txt").is_file()
    point = json.loads((out / "2x1" / "sweep-point.json").read_text())
    assert point["nodes"] == 2 and point["job_id"]
    # measured one after the other: the second layout started after the first ended
    first = json.loads((out / "1x1" / "sweep-point.json").read_text())["job_id"]
    ended = cluster.job_fields(first)["EndTime"]
    started = cluster.job_fields(point["job_id"])["StartTime"]
    assert started >= ended, (ended, started)
