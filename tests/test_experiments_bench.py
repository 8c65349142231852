"""mpidp bench scaling end to end on tiny data (one launch per rank count; no timing asserted)."""
import json

import pytest

from engine.bench.scaling import BenchError
from engine.cli import build_parser
from engine.dp.accountant import epsilon_for


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
    assert two["speedup"] == pytest.approx(one["epoch_avg_s"] / two["epoch_avg_s"])
    assert two["efficiency"] == pytest.approx(two["speedup"] / 2)
    runs = {r["ranks"]: r for r in doc["runs"]}
    assert sorted(runs) == [1, 2]
    steps_per_epoch = round(1500 / 100)
    for s in (one, two):
        epochs = runs[s["ranks"]]["epochs"]
        first, last = epochs[0], epochs[-1]
        # --time-budget given: the runs went on past the target, read off the history.
        assert s["epochs_run"] == len(epochs) == 2 and s["steady_epochs"] == 1
        assert s["first_epoch_s"] == first["epoch_time_s"]
        assert s["epoch_avg_s"] == last["epoch_time_s"]
        assert s["train_time_s"] == pytest.approx(first["epoch_time_s"] + last["epoch_time_s"])
        assert s["tta_epochs"] == 1 and s["tta_s"] == pytest.approx(first["epoch_time_s"])
        assert s["cost"] == pytest.approx(s["train_time_s"] / 3600)  # 1 node at price 1
        # Epsilon is the accountant's for the steps taken, whatever the rank count.
        assert last["step"] == 2 * steps_per_epoch and last["ranks"] == s["ranks"]
        assert s["epsilon"] == last["epsilon"] == pytest.approx(epsilon_for(
            100 / 1500, last["noise_multiplier"], last["step"], 1e-5), rel=1e-9)
        for e in epochs:
            assert e["examples_per_s"] == pytest.approx(e["train_examples"] / e["epoch_time_s"])
            assert e["comm_s"] + e["compute_s"] == pytest.approx(e["epoch_time_s"])
            assert sum(e["step_breakdown_s"].values()) <= e["epoch_time_s"]
            assert e["step_breakdown_s"]["comm_s"] == pytest.approx(e["comm_s"])
        assert s["command"].startswith(f"mpiexec -n {s['ranks']} mpidp train --data ")
    assert one["epsilon"] == pytest.approx(two["epsilon"], rel=1e-12)
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
