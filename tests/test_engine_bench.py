"""mpidp bench dpsgd runs every method on tiny data and writes its JSON (no timing asserted)."""
import json

import pytest

from engine.cli import build_parser
from engine.errors import ConfigError


def _run(*argv):
    args = build_parser().parse_args(["bench", "dpsgd", *argv])
    return args._run(args)


def test_bench_dpsgd_runs_and_reports_ratios(tmp_path, capsys):
    out = tmp_path / "b.json"
    assert _run("--rows", "3000", "--features", "12", "--hidden", "16", "--batch-size", "64",
                "--steps", "3", "--repeats", "1", "--naive-steps", "1", "--threads", "1",
                "--methods", "mpidp-dp,mpidp-nondp,naive", "--json", str(out)) == 0
    data = json.loads(out.read_text())
    rates = data["examples_per_s"]
    for method in ("mpidp-dp", "mpidp-nondp", "naive"):  # torch.optim/Opacus import slowly
        assert rates[method] > 0
    assert data["dp_over_nondp"] > 0
    assert data["speedup"]["mpidp-dp"] == 1.0
    assert "DP / non-DP time per example" in capsys.readouterr().out


def test_bench_refuses_unknown_methods():
    with pytest.raises(ConfigError, match="unknown --methods nope"):
        _run("--methods", "mpidp-dp,nope")


@pytest.mark.parametrize("argv, message", [
    (["--rows", "0"], "--rows 0 must be at least 1"),
    (["--batch-size", "0"], "--batch-size 0 must be at least 1"),
    (["--steps", "0"], "--steps 0 must be at least 1"),
    (["--rows", "100", "--features", "4", "--batch-size", "200"],
     "--batch-size 200 is more than the 100 training rows"),
])
def test_bench_refuses_impossible_sizes(argv, message):
    with pytest.raises(ConfigError, match=message):
        _run(*argv)
