"""mpidp bench dpsgd runs every method on tiny data and writes its JSON (no timing asserted).

The bench's clock is replaced by one that advances by exactly one per reading,
so a block of steps lasts one "second" and a round's "examples/s" is the
number of examples it timed over its number of blocks: the test can then
check the numbers against the batches that were actually stepped, and the
order in which the methods took turns.
"""
import json
import re
import statistics
import types

import pytest

import engine.step
from engine.bench import dpsgd, synthetic
from engine.cli import build_parser
from engine.errors import ConfigError

ROWS, STEPS, REPEATS, WARM_UP = 3000, 3, 2, 3
#: Timed steps per block (STEPS = 3 makes blocks of 2 and 1) and the untimed
#: steps before each block.
BLOCK, SETTLE = 2, dpsgd.SETTLE_STEPS


def _run(*argv):
    args = build_parser().parse_args(["bench", "dpsgd", *argv])
    return args._run(args)


@pytest.fixture
def stepped(monkeypatch):
    """Every DPStep call the bench makes: (the step object, rows given, k returned)."""
    calls = []
    original = engine.step.DPStep.__call__

    def counted(self, rows, times=None, started=None):
        k, loss, clipped = original(self, rows, times, started)
        calls.append((self, int(rows.shape[0]), k))
        return k, loss, clipped

    monkeypatch.setattr(engine.step.DPStep, "__call__", counted)
    ticks = iter(range(10 ** 6))
    monkeypatch.setattr(dpsgd, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    return calls


def test_bench_dpsgd_runs_the_trainers_step_and_reports_what_it_counted(tmp_path, capsys,
                                                                          stepped):
    out = tmp_path / "b.json"
    assert _run("--rows", str(ROWS), "--features", "12", "--hidden", "16", "--batch-size",
                "64", "--steps", str(STEPS), "--repeats", str(REPEATS), "--naive-steps", "1",
                "--block", str(BLOCK), "--threads", "1", "--methods",
                "mpidp-dp,mpidp-nondp,naive", "--json", str(out)) == 0
    data = json.loads(out.read_text())
    assert data["mlp_step"] == "the MLP step in one call (torch's BLAS sgemm_)"
    assert data["provenance"]["machine"] == data["machine"] and data["provenance"]["date"]
    rates, rounds = data["examples_per_s"], data["all_rounds"]
    # Both mpidp methods ran engine.step.DPStep: warm-up, then STEPS per round.
    steps = {}
    for step, n_rows, k in stepped:
        assert k == n_rows  # every sampled row was stepped
        steps.setdefault(step, []).append(k)
    by_kind = {("dp" if s.max_norm is not None else "nondp"): (s, ks) for s, ks in steps.items()}
    assert set(by_kind) == {"dp", "nondp"}
    dp_step, nondp_step = by_kind["dp"][0], by_kind["nondp"][0]
    assert dp_step.max_norm == 1.0 and dp_step.noise is not None
    assert nondp_step.noise is None
    # After the warm-up (each method's STEPS in a row) the two take turns, block
    # by block: SETTLE untimed steps, then BLOCK timed ones (the last block: the rest).
    sizes = [min(BLOCK, STEPS - first) for first in range(0, STEPS, BLOCK)]
    order = [s for s, _, _ in stepped if s in (dp_step, nondp_step)]
    assert order[:2 * WARM_UP] == [dp_step] * WARM_UP + [nondp_step] * WARM_UP
    turn = [s for size in sizes for s in [dp_step] * (SETTLE + size)
            + [nondp_step] * (SETTLE + size)]
    assert order[2 * WARM_UP:] == turn * REPEATS
    for kind, method in (("dp", "mpidp-dp"), ("nondp", "mpidp-nondp")):
        ks = by_kind[kind][1]
        assert len(ks) == WARM_UP + (STEPS + SETTLE * len(sizes)) * REPEATS
        length = STEPS + SETTLE * len(sizes)  # a round's steps of this method
        rounds_ks = [ks[WARM_UP + r * length:WARM_UP + (r + 1) * length]
                     for r in range(REPEATS)]
        for ks_round, rate in zip(rounds_ks, rounds[method]):
            timed, at = [], 0
            for size in sizes:  # drop each block's settling steps
                timed += ks_round[at + SETTLE:at + SETTLE + size]
                at += SETTLE + size
            # one tick per block: the rate is the examples timed over the blocks
            assert rate == sum(timed) / len(sizes)
        assert all(r > 0 for r in rounds[method])
    for method in ("mpidp-dp", "mpidp-nondp", "naive"):  # torch.optim/Opacus import slowly
        assert len(rounds[method]) == REPEATS
        assert rates[method] == statistics.median(rounds[method])
        assert data["speedup"][method] == pytest.approx(rates["mpidp-dp"] / rates[method])
    assert data["speedup"]["mpidp-dp"] == 1.0
    assert data["dp_over_nondp"] == pytest.approx(statistics.median(
        nd / dp for nd, dp in zip(rounds["mpidp-nondp"], rounds["mpidp-dp"])))
    assert data["rows"] == ROWS and data["steps"] == STEPS and data["repeats"] == REPEATS
    text = capsys.readouterr().out
    assert data["mlp_step"] in text  # the header says how the step ran
    assert f"DP / non-DP time per example: {data['dp_over_nondp']:.3f}" in text
    # The table's s/epoch and ratio columns follow from examples/s.
    for method, rate in rates.items():
        line = re.search(rf"^{re.escape(method)}\s+([\d,]+)\s+([\d.]+)\s+([\d.]+)x$", text,
                         re.MULTILINE)
        assert line, f"no table row for {method}"
        assert line.group(1) == f"{rate:,.0f}"
        assert line.group(2) == f"{ROWS / rate:.2f}"
        assert line.group(3) == f"{rates['mpidp-dp'] / rate:.2f}"


def test_bench_refuses_unknown_methods():
    with pytest.raises(ConfigError, match="unknown --methods nope"):
        _run("--methods", "mpidp-dp,nope")


def test_bench_refuses_a_scoring_only_file(tmp_path):
    scoring = synthetic.write(tmp_path / "s.h5", rows=0, features=8, test_rows=100, seed=2)
    with pytest.raises(ConfigError, match="s.h5 has no training rows .*benchmark on a file"):
        _run("--data", str(scoring))


@pytest.mark.parametrize("argv, message", [
    (["--rows", "0"], "--rows 0 must be at least 1"),
    (["--batch-size", "0"], "--batch-size 0 must be at least 1"),
    (["--steps", "0"], "--steps 0 must be at least 1"),
    # 0 passed, and the naive loop's rate divided by zero after the whole run
    (["--naive-steps", "0"], "--naive-steps 0 must be at least 1"),
    # a loop left out of --methods ran no naive steps: the option did nothing
    (["--methods", "mpidp-dp", "--naive-steps", "5"], "^--naive-steps 5 would be ignored: "
     "--methods mpidp-dp leaves the naive loop out; add naive"),
    (["--rows", "100", "--features", "4", "--batch-size", "200"],
     "--batch-size 200 is more than the 100 training rows"),
])
def test_bench_refuses_impossible_sizes(argv, message):
    with pytest.raises(ConfigError, match=message):
        _run(*argv)


def test_bench_generic_path_steps_the_same_model_as_the_fused_one(tmp_path, stepped):
    """mpidp-generic runs the MLP as an nn.Module through ModuleEngine: the same
    batches and noise as mpidp-dp, so the two end on the same parameters."""
    import torch

    from torch.nn.utils import parameters_to_vector

    from engine.dp.fast_mlp import FastMLP
    from engine.nn.mlp import to_module
    from engine.dp.module_engine import ModuleEngine

    out = tmp_path / "g.json"
    assert _run("--rows", str(ROWS), "--features", "12", "--hidden", "16", "--batch-size",
                "64", "--steps", str(STEPS), "--repeats", str(REPEATS), "--threads", "1",
                "--methods", "mpidp-dp,mpidp-generic", "--json", str(out)) == 0
    data = json.loads(out.read_text())
    assert data["generic_over_fused"] > 0 and set(data["examples_per_s"]) == \
        {"mpidp-dp", "mpidp-generic"}
    engines = {type(step.engine): step for step, _, _ in stepped}
    fused, generic = engines[FastMLP], engines[ModuleEngine]
    assert len([s for s, _, _ in stepped if s is generic]) == \
        WARM_UP + (STEPS + SETTLE) * REPEATS  # one block a round (--block 20)
    # The same parameters and rows give the same clipped sum through either engine
    # (the fused layout is [W | b] per layer, the module's W then b: converted).
    spec = fused.engine.spec

    def module_layout(flat):
        return parameters_to_vector(to_module(spec, flat).parameters())

    with torch.no_grad():
        generic.engine.params.copy_(module_layout(fused.engine.params))
    rows = torch.arange(0, 200, 3)
    for step in (fused, generic):
        k = step.engine.load(step.X, step.y, rows)
        step.engine.clipped_sum(k, step.max_norm)
    want = module_layout(fused.grad)
    assert torch.allclose(generic.grad, want, rtol=1e-4, atol=1e-6) and want.any()


@pytest.mark.parametrize("argv, message", [
    # each was run without a word: the models' own data, widths and features
    (["--models", "mlp", "--hidden", "7"],
     "--hidden would be ignored with --models: each model has its own data, widths and "
     "features, no naive loop or blocks; drop it"),
    (["--models", "mlp", "--features", "5", "--naive-steps", "3", "--block", "1", "--data",
      "X.h5"], "--data, --features, --naive-steps, --block would be ignored with --models"),
    (["--device", "cuda", "--hidden", "7"],
     r"--hidden would be ignored with --device cuda \(the built-in models\)"),
    # the file's rows and features silently replaced these
    (["--data", "X.h5", "--rows", "600"],
     "--rows would be ignored with --data X.h5: the file's rows and features are used; "
     "drop it"),
    (["--data", "X.h5", "--rows", "600", "--features", "5"],
     "--rows, --features would be ignored with --data X.h5"),
])
def test_bench_refuses_options_it_would_ignore(argv, message, monkeypatch):
    from engine.bench import dpsgd_models

    monkeypatch.setattr(dpsgd_models, "run", lambda args: pytest.fail("ran the models"))
    monkeypatch.setattr(dpsgd, "_load", lambda args: pytest.fail("read the data"))
    with pytest.raises(ConfigError, match=message):
        _run("--steps", "1", "--repeats", "1", *argv)


def test_bench_labels_the_threads_it_runs_and_says_they_oversubscribe(tmp_path, capsys,
                                                                       monkeypatch,
                                                                       threads_restored):
    """--threads above Numba's pool printed "8 thread(s)" beside "its rows cut over
    2 threads", and nothing on the oversubscribed cores."""
    import os

    import numba

    pool = numba.config.NUMBA_NUM_THREADS
    many = 2 * max(pool, os.cpu_count() or 1)
    monkeypatch.setattr(dpsgd, "_steppers",
                        lambda *a, **k: ({"mpidp-dp": lambda rows: rows.shape[0]}, True))
    out = tmp_path / "t.json"
    assert _run("--rows", "500", "--features", "4", "--steps", "2", "--repeats", "1",
                "--methods", "mpidp-dp", "--threads", str(many), "--json", str(out)) == 0
    data = json.loads(out.read_text())
    assert (data["threads"], data["numba_threads"], data["numba_pool"]) == (many, pool, pool)
    assert data["threads_note"].startswith(f"note: --threads {many} with 1 rank(s)")
    head, note = capsys.readouterr().out.splitlines()[:2]
    assert (f", {many} torch thread(s), {pool} Numba thread(s) (its pool, "
            f"NUMBA_NUM_THREADS={pool}), ") in head
    assert note == data["threads_note"]
