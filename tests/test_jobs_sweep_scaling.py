"""jobs/sweep_scaling.sh: its dry run, and one tiny sweep under a real (throw-away) Slurm.

The Slurm part needs root and Debian's slurmctld, slurmd, slurm-client and
munge (as tests/test_jobs_slurm.py); without them it skips, saying why,
unless MPIDP_REQUIRE_SLURM=1.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.bench import synthetic
from slurm_cluster import started_cluster

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
