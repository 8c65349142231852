"""mpidp bench scaling end to end on tiny data (one launch per rank count; no timing asserted)."""
import json

import pytest

from engine.bench.scaling import BenchError
from engine.cli import build_parser


def _run(*argv):
    args = build_parser().parse_args(["bench", "scaling", *argv])
    return args._run(args)


def test_bench_scaling_runs_one_launch_per_rank_count(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert _run("--rows", "1500", "--test-rows", "300", "--features", "6", "--hidden", "8",
                "--batch-size", "100", "--ranks", "1,2", "--epochs", "2", "--privacy", "dp",
                "--target-accuracy", "0.01", "--time-budget", "60",
                "--cache", str(tmp_path / "cache"), "--keep", str(tmp_path / "runs"),
                "--json", str(out), "--price-per-node-hour", "1") == 0
    text = capsys.readouterr().out
    assert "strong scaling (global batch 100), DP-SGD, all-reduce auto" in text
    assert "cost at 1 per node-hour" in text and "load average before" in text
    doc = json.loads(out.read_text())
    one, two = sorted(doc["summaries"], key=lambda s: s["ranks"])
    assert (one["ranks"], two["ranks"]) == (1, 2) and one["speedup"] == 1.0
    assert two["efficiency"] == pytest.approx(two["speedup"] / 2)
    for s in (one, two):
        # --time-budget given: the runs went on past the target, read off the history.
        assert s["epochs_run"] == 2 and s["tta_epochs"] == 1 and s["epsilon"] > 0
        assert s["first_epoch_s"] > 0 and s["steady_epochs"] == 1
        assert s["command"].startswith(f"mpiexec -n {s['ranks']} mpidp train --data ")
    assert [len(r["epochs"]) for r in doc["runs"]] == [2, 2]
    assert doc["runs"][1]["epochs"][-1]["ranks"] == 2
    assert len(list((tmp_path / "runs").glob("*.jsonl"))) == 2


def test_dry_run_prints_the_commands(tmp_path, capsys):
    data = tmp_path / "d.h5"
    data.write_bytes(b"")  # never opened by a dry run
    assert _run("--preset", "mlbench-2a", "--data", str(data), "--ranks", "1,2,4",
                "--dry-run") == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3
    assert "--batch-size 400" in lines[2] and "--lr 600.0" in lines[2]
    for flags in ("--no-dp", "--lr-schedule inv-sqrt", "--weight-decay 2.5e-06",
                  "--sampling shuffle", "--momentum 0.0", "--target-accuracy 0.89",
                  "--hidden ''"):
        assert flags in lines[0]


def test_bench_scaling_user_errors(tmp_path):
    with pytest.raises(BenchError, match="no such file"):
        _run("--data", str(tmp_path / "missing.h5"), "--dry-run")
    with pytest.raises(BenchError, match="--scaling"):
        _run("--scaling", "diagonal", "--dry-run")
    with pytest.raises(BenchError, match="--allreduce 'ring,rings': choose from"):
        _run("--allreduce", "ring,rings", "--dry-run")
    with pytest.raises(BenchError, match="--hidden '128,x'"):
        _run("--hidden", "128,x", "--dry-run")
    with pytest.raises(BenchError, match="weak scaling needs --local-batch"):
        _run("--scaling", "weak", "--dry-run", "--data", __file__)
