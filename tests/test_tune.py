"""mpidp tune: the space, the privacy of the tuning, the search side by side, resuming.

Serial tests: parsing and its one-line errors, the Papernot & Steinke bounds
(against values computed by hand and against dp-accounting's own
implementation), the household score, the report. MPI tests (1, 2 and 4
ranks; two groups from 2 ranks up): a search on a small synthetic file with
a val split, a diverging trial, resuming, a private random search.
CLI tests: bad input exits 2 with one line and writes nothing.
"""
from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from engine.errors import ConfigError, OutputError
from engine.tune import privacy, report, space
from engine.tune import search as search_mod

# -- the space ----------------------------------------------------------------------------


def test_space_text_is_parsed_into_trainconfig_types():
    s = space.parse("lr=0.01,0.05; batch-size=256,1024;hidden=128,128|64|none;"
                    "optimizer=sgd,adam,sgd;epochs=2", None)
    assert s.values == {"lr": (0.01, 0.05), "batch_size": (256, 1024),
                        "hidden": ((128, 128), (64,), ()), "optimizer": ("sgd", "adam"),
                        "epochs": (2,)}
    assert s.size == 2 * 2 * 3 * 2 and s.varied == ["lr", "batch_size", "hidden", "optimizer"]
    assert s.points()[0] == {"lr": 0.01, "batch_size": 256, "hidden": (128, 128),
                             "optimizer": "sgd", "epochs": 2}
    assert space.parse(s.describe(), None) == s  # the description parses back


def test_space_file_and_text_combine(tmp_path):
    path = tmp_path / "space.toml"
    path.write_text('[space]\nlr = [0.1, 0.2]\nhidden = [[32, 32], []]\nmodel = "logreg"\n')
    s = space.parse("epochs=1,2", str(path))
    assert s.values == {"epochs": (1, 2), "lr": (0.1, 0.2), "hidden": ((32, 32), ()),
                        "model": ("logreg",)}
    top = tmp_path / "top.toml"
    top.write_text('batch_size = 64\nhidden = ["16,16", "8"]\n')
    assert space.parse(None, str(top)).values == {"batch_size": (64,),
                                                  "hidden": ((16, 16), (8,))}


@pytest.mark.parametrize("text, message", [
    ("lr=abc", r"--space: lr=abc: 'abc' is not a number"),
    ("lr=-1", r"lr=-1: --lr -1.0 must be a positive number"),
    ("learning_rate=0.1", r"unknown setting 'learning_rate'; did you mean lr\?"),
    ("seed=1,2", r"seed is not tuned by a search"),
    ("optimizer=rmsprop", r"optimizer=rmsprop: choose from sgd, adam"),
    ("batch_size=1.5", r"batch_size=1.5: '1.5' is not a whole number"),
    ("momentum=1", r"momentum=1: --momentum 1.0 must be in \[0, 1\)"),
    ("hidden=12,x", r"hidden=12,x: '12,x': expected comma-separated layer widths"),
    ("lr=0.1;lr=0.2", r"lr is given twice"),
    ("lr=", r"lr: no values"),
    ("lr", r"'lr' is not KEY=VALUES"),
    ("model=nomodule", r"model=nomodule: --model 'nomodule'"),
])
def test_bad_space_is_one_line_naming_the_key(text, message):
    with pytest.raises(ConfigError, match=message) as info:
        space.parse(text, None)
    assert "\n" not in str(info.value) and info.value.collective


def test_bad_space_file(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        space.parse(None, str(tmp_path / "none.toml"))
    (tmp_path / "flat.toml").write_text("hidden = [128, 128]\n")
    with pytest.raises(ConfigError, match="list of layer-width lists"):
        space.parse(None, str(tmp_path / "flat.toml"))
    (tmp_path / "both.toml").write_text("lr = [0.1]\n")
    with pytest.raises(ConfigError, match="lr is in both --space and --space-file"):
        space.parse("lr=0.2", str(tmp_path / "both.toml"))
    (tmp_path / "bad.toml").write_text("lr = [0.1\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        space.parse(None, str(tmp_path / "bad.toml"))
    with pytest.raises(ConfigError, match="give the search space"):
        space.parse(None, None)


def test_trial_keys_hash_number_and_settings():
    a = space.settings_key(1, {"lr": 0.1, "hidden": (8,)})
    assert a == space.settings_key(1, {"hidden": [8], "lr": 0.1})
    assert a != space.settings_key(2, {"lr": 0.1, "hidden": (8,)})
    assert a != space.settings_key(1, {"lr": 0.2, "hidden": (8,)})


# -- the privacy of the tuning --------------------------------------------------------------


def test_truncated_negative_binomial_by_hand():
    """Theorem 2 with eta = 1 (geometric), gamma = 0.1 (E[K] = 10) on the Gaussian
    mechanism eps(lambda) = lambda / (2 sigma^2), sigma^2 = 2, at orders 2, 4, 8:
    eps_hat term min over lambda_hat of (lambda_hat - 1)/4 + ln(10)/lambda_hat is
    0.75 + 0.575646 = 1.325646 (lambda_hat = 4), doubled (1 + eta): 2.651293; then
    eps'(lambda) = lambda/4 + ln(10)/(lambda - 1) + 2.651293 = 5.453878, 4.418821,
    4.980234, and RDP's monotonicity lowers order 2 to order 4's value."""
    orders = [2.0, 4.0, 8.0]
    curve = privacy.gaussian_curve(math.sqrt(2), orders=orders)
    assert curve == pytest.approx([0.5, 1.0, 2.0])
    out = privacy.tnb_curve(orders, curve, eta=1.0, gamma=0.1)
    assert out == pytest.approx([4.418821, 4.418821, 4.980234], abs=1e-6)
    assert privacy.tnb_mean(1.0, 0.1) == pytest.approx(10)
    assert privacy.tnb_mean(0.0, 0.1) == pytest.approx(9 / math.log(10))  # logarithmic
    assert privacy.tnb_mean(2.0, 0.5) == pytest.approx(2 * 0.5 / (0.5 * (1 - 0.25)))


@pytest.mark.parametrize("eta", [0.0, 0.5, 1.0, 2.0])
def test_negative_binomial_bound_is_dp_accountings(eta):
    """The same theorem as dp-accounting's RepeatAndSelectDpEvent, on a DP-SGD curve."""
    import dp_accounting
    from dp_accounting.dp_event import RepeatAndSelectDpEvent
    from dp_accounting.rdp import RdpAccountant

    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.0)), 100)
    theirs = RdpAccountant(orders=list(privacy.ORDERS))
    theirs.compose(RepeatAndSelectDpEvent(event, 10, eta))
    gamma = privacy.tnb_gamma(eta, 10)
    assert privacy.tnb_mean(eta, gamma) == pytest.approx(10, rel=1e-9)
    mine = privacy.tnb_curve(privacy.ORDERS, privacy.trial_curve(0.01, 1.0, 100), eta, gamma)
    assert mine == pytest.approx(theirs.rdp, rel=1e-8)


def test_poisson_bound_is_dp_accountings_then_monotone():
    """Theorem 6: eps + mu delta_hat + log(mu)/(lambda - 1) at eps_hat = log(1 + 1/(lambda-1));
    dp-accounting's, lowered where a higher order gives less."""
    import dp_accounting
    from dp_accounting.dp_event import RepeatAndSelectDpEvent
    from dp_accounting.rdp import RdpAccountant
    from dp_accounting.rdp.rdp_privacy_accountant import compute_delta

    curve = privacy.trial_curve(0.01, 1.0, 100)
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.0)), 100)
    theirs = RdpAccountant(orders=list(privacy.ORDERS))
    theirs.compose(RepeatAndSelectDpEvent(event, 10, math.inf))
    mine = privacy.poisson_curve(privacy.ORDERS, curve, 10)
    assert mine == pytest.approx(privacy._monotone(privacy.ORDERS, theirs.rdp), rel=1e-12)
    assert np.all(mine <= theirs.rdp + 1e-12)
    i = int(np.flatnonzero(privacy.ORDERS == 20)[0])
    delta_hat, _ = compute_delta(privacy.ORDERS, curve, math.log1p(1 / 19))
    raw = curve[i] + 10 * delta_hat + math.log(10) / 19
    assert mine[i] <= raw + 1e-12


def test_bound_is_the_single_run_plus_the_penalty():
    """Before monotonicity, eps'(lambda) - eps(lambda) = (1 + eta) min_hat(...) +
    log(E[K])/(lambda - 1): a constant and a term that falls with the order."""
    curve = privacy.trial_curve(0.02, 1.1, 200)
    orders = privacy.ORDERS
    for mean in (2, 10, 50):
        gamma = privacy.tnb_gamma(1.0, mean)
        constant = 2 * np.min((1 - 1 / orders) * curve + math.log(1 / gamma) / orders)
        raw = curve + constant + math.log(mean) / (orders - 1)
        out = privacy.tnb_curve(orders, curve, 1.0, gamma)
        assert out == pytest.approx(privacy._monotone(orders, raw))
        assert out[-1] == pytest.approx(raw[-1]) and np.all(out >= curve)


def test_cost_grows_with_the_expected_trials_and_the_score_noise():
    curve = privacy.trial_curve(0.02, 1.1, 200)
    single, _ = privacy.to_epsilon(privacy.ORDERS, curve, 1e-5)
    # a trial's curve is the engine's RDP accountant's
    from engine.dp.accountant import epsilon_for
    assert single == pytest.approx(epsilon_for(0.02, 1.1, 200, 1e-5, "rdp"), rel=1e-9)
    last = single
    for mean in (1.5, 4, 16, 64):
        for distribution in ("negative-binomial", "poisson"):
            s = privacy.random_search([curve], 1e-5, distribution, mean, 1.0, None)
            assert s.epsilon > single and s.trial_rdp_epsilon == pytest.approx(single)
        tnb = privacy.random_search([curve], 1e-5, "negative-binomial", mean, 1.0, None)
        assert tnb.epsilon > last
        last = tnb.epsilon
    quiet = privacy.random_search([curve], 1e-5, "negative-binomial", 10, 1.0, 100.0)
    loud = privacy.random_search([curve], 1e-5, "negative-binomial", 10, 1.0, 5.0)
    exact = privacy.random_search([curve], 1e-5, "negative-binomial", 10, 1.0, None)
    assert exact.epsilon < quiet.epsilon < loud.epsilon
    # the space's largest curve counts: adding a cheaper point changes nothing
    cheap = privacy.trial_curve(0.01, 2.0, 10)
    assert privacy.random_search([curve, cheap], 1e-5, "negative-binomial", 10, 1.0,
                                 None).epsilon == pytest.approx(exact.epsilon)
    assert privacy.gaussian_curve(5.0, orders=[2.0, 10.0]) == pytest.approx([0.04, 0.2])


def test_public_search_is_the_trials_composed():
    curve = privacy.trial_curve(0.02, 1.1, 200)
    s = privacy.public_search([curve] * 4, 1e-5, "val")
    assert s.epsilon == pytest.approx(privacy.to_epsilon(privacy.ORDERS, 4 * curve, 1e-5)[0])
    assert s.trials == 4 and "4 runs composed" in s.text


@pytest.mark.parametrize("distribution, eta, mean", [
    ("negative-binomial", 1.0, 8), ("negative-binomial", 0.0, 8),
    ("negative-binomial", 2.0, 8), ("poisson", None, 8)])
def test_the_number_of_trials_has_the_stated_mean(distribution, eta, mean):
    rng = np.random.default_rng(0)
    draws = np.array([privacy.draw_trials(rng, distribution, mean, eta or 1.0)
                      for _ in range(20000)])
    assert draws.mean() == pytest.approx(mean, rel=0.05)
    assert draws.min() >= (0 if distribution == "poisson" else 1)


# -- scoring and the report -----------------------------------------------------------------


def test_household_score_counts_each_household_once():
    """The noised score's sensitivity is one household: the sum of each household's
    share of correct predictions."""
    import torch
    from collectives import MPI
    from engine.shard import Shard

    class Fixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, x):  # predicts class 1 where the first feature is positive
            return torch.stack([-x[:, 0], x[:, 0]], dim=1)

    X = np.array([[1, 1], [1, 1], [-1, 1], [1, 1], [-1, 1]], dtype=np.float32)
    y = np.array([1, 1, 1, 0, 0])  # correct: 1, 1, 0, 0, 1
    groups = np.array([0, 3, 4, 5])  # households {0,1,2}, {3}, {4}
    result = search_mod.score(Fixed(), Shard(X=X, y=y, offset=0, n_total=5, groups=groups,
                                             units_total=3), MPI.COMM_SELF)
    assert result["rows"] == 5 and result["correct"] == 3
    assert result["units"] == 3 and result["unit_score"] == pytest.approx(2 / 3 + 0 + 1)
    plain = search_mod.score(Fixed(), Shard(X=X, y=y, offset=0, n_total=5), MPI.COMM_SELF)
    assert plain["units"] == 5 and plain["unit_score"] == 3


def test_households_are_counted_by_key_whatever_the_row_order(tmp_path):
    """N of the tuning's accounting is the trainer's: the distinct household keys,
    also when a household's rows are not consecutive (before: one per row)."""
    import h5py
    from collectives import MPI
    from engine.bench import synthetic
    from engine.shard import read_info
    from engine.tune.options import training_units

    path = synthetic.write(tmp_path / "h.h5", rows=400, features=3, seed=2, val_rows=50)
    with h5py.File(path, "r+") as f:
        perm = np.random.default_rng(0).permutation(f["train/y"].shape[0])
        for name in ("train/X", "train/y", "train/household"):
            f[name][...] = f[name][:][perm]
        distinct = len(np.unique(f["train/household"][:]))
    assert distinct < 300
    assert training_units(read_info(path), "household", MPI.COMM_SELF) == distinct


def test_choice_and_command():
    records = [{"trial": 1, "status": "ok", "val_accuracy": 0.8},
               {"trial": 2, "status": "failed", "val_accuracy": None},
               {"trial": 3, "status": "ok", "val_accuracy": 0.9},
               {"trial": 4, "status": "ok", "val_accuracy": 0.9}]
    assert report.choose(records)["trial"] == 3
    assert report.choose(records[1:2]) is None
    command = report.train_command("my data.h5", {"lr": 0.05, "hidden": (64, 64),
                                                  "optimizer": "adam"},
                                   {"dp": True, "target_epsilon": 1.0, "delta": 1e-6,
                                    "accountant": "pld", "privacy_unit": "household"}, 2)
    assert command == ("mpiexec -n 2 mpidp train --data 'my data.h5' --lr 0.05 --hidden 64,64 "
                       "--optimizer adam --target-epsilon 1 --delta 1e-06 "
                       "--privacy-unit household")
    assert report.train_command("d.h5", {"hidden": ()}, {"dp": False}, 1) == \
        "mpidp train --data d.h5 --hidden '' --no-dp"
    # the search's epoch choice too: without it the command picked on plain val accuracy
    worst = {"select_on": "worst_group_val_accuracy", "group_by": "RAC1P", "min_group_size": 100}
    assert report.train_command("d.h5", {}, {"dp": False}, 1, worst) == \
        "mpidp train --data d.h5 --no-dp --select-on worst_group_val_accuracy --group-by RAC1P"
    assert report.train_command("d.h5", {}, {"dp": False}, 1,
                                {**worst, "min_group_size": 50}).endswith(" --min-group-size 50")


def test_groups_are_balanced_by_cost():
    trials = [search_mod.Trial.make(i + 1, {"epochs": e}, None)
              for i, e in enumerate([8, 1, 1, 1, 1, 1, 1, 1, 1])]
    groups = search_mod.assign(trials, [1, 1], lambda t: t.settings["epochs"])
    assert [t.number for t in groups[0]] == [1] and len(groups[1]) == 8


# -- searches on a file with a val split (MPI) ------------------------------------------------


@pytest.fixture
def data(shared_tmp, comm):
    path = shared_tmp / "tune.h5"
    if comm.Get_rank() == 0:
        from engine.bench import synthetic
        synthetic.write(path, rows=600, features=12, seed=5, val_rows=150)
    comm.Barrier()
    return str(path)


def tune(*argv: str) -> int:
    """``mpidp tune argv...`` in this process (every rank)."""
    from engine.cli import build_parser

    args = build_parser(only="tune").parse_args(["tune", *argv])
    return args._run(args)


def _parallel(comm) -> list[str]:
    return ["--parallel", "2"] if comm.Get_size() >= 2 else []


def _val(path: str):
    import h5py
    import torch

    with h5py.File(path, "r") as f:
        return torch.from_numpy(f["val/X"][:]), torch.from_numpy(f["val/y"][:].astype(np.int64))


@pytest.mark.mpi(min_size=1)
def test_search_chooses_the_best_val_trial_and_survives_divergence(data, comm, shared_tmp):
    out = shared_tmp / "grid"
    code = tune("--data", data, "--no-dp", "--out", str(out), "--seed", "1",
                "--space", "lr=0.3,1e30;batch_size=32,64;epochs=1;hidden=8", *_parallel(comm))
    assert code == 0
    doc = json.loads((out / "tune.json").read_text())
    records = doc["trials"]
    assert [r["trial"] for r in records] == [1, 2, 3, 4]
    failed = [r for r in records if r["status"] == "failed"]
    assert [r["settings"]["lr"] for r in failed] == [1e30, 1e30]  # lr=1e30 diverges
    assert all("NaN or infinite" in r["message"] for r in failed)
    ok = [r for r in records if r["status"] == "ok"]
    best = max(ok, key=lambda r: (r["val_accuracy"], -r["trial"]))
    assert doc["chosen"]["trial"] == best["trial"] and len(ok) == 2
    assert doc["chosen"]["train_command"].endswith(
        f"--lr 0.3 --batch-size {best['settings']['batch_size']} --epochs 1 --hidden 8 --no-dp")
    lines = (out / "trials.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["trial"] for line in lines) == [1, 2, 3, 4]
    # only the chosen trial's model is kept, and its val accuracy is the recorded one
    assert sorted(os.listdir(out / "trials")) == [f"trial-{best['trial']:04d}"]
    from engine import checkpoint
    from engine.models import checkpoint_logits

    # one file, the model to publish: non-private trials state no epsilon and
    # their exact scores (neither noised nor declared public) stay out of it
    assert os.listdir(doc["chosen"]["checkpoint"]) == ["best.pt"]
    payload = checkpoint.load_model(doc["chosen"]["checkpoint"])
    assert payload["epsilon"] is None and "val_accuracy" not in payload["selected"]["tuning"]
    X, y = _val(data)
    logits = checkpoint_logits(payload["model"], payload["params"], X.shape[1], 2, "x")
    ones = np.ones((X.shape[0], 1), dtype=np.float32)
    import torch
    correct = int((logits(torch.cat([X, torch.from_numpy(ones)], 1)).argmax(1) == y).sum())
    assert correct / len(y) == pytest.approx(best["val_accuracy"], abs=1e-12)
    assert not (out / "lock").exists()


@pytest.mark.mpi(min_size=1)
def test_a_rerun_skips_finished_trials_and_another_space_is_refused(data, comm, shared_tmp,
                                                                     capsys):
    out = shared_tmp / "resume"
    argv = ["--data", data, "--no-dp", "--out", str(out), "--search", "random",
            "--trials", "3", "--seed", "4", "--space",
            "lr=0.1,0.2,0.4;batch_size=50,100;epochs=1;hidden=4", *_parallel(comm)]
    assert tune(*argv) == 0
    results = out / "trials.jsonl"
    first = {}
    if comm.Get_rank() == 0:
        first = {json.loads(line)["trial"]: json.loads(line)
                 for line in results.read_text().splitlines()}
        # a killed search: trial 2 never finished, and the last line was cut short
        kept = [json.dumps(first[n]) for n in (1, 3)]
        results.write_text("\n".join(kept) + "\n" + '{"trial": 2, "key": "x", "sta')
        (out / "tune.json").unlink()
    comm.Barrier()
    capsys.readouterr()
    assert tune(*argv) == 0
    said = capsys.readouterr().out
    if comm.Get_rank() == 0:
        assert "2 trial(s) already done" in said
        assert "trial 2/3" in said and "trial 1/3" not in said and "trial 3/3" not in said
        again = {json.loads(line)["trial"]: json.loads(line)
                 for line in results.read_text().splitlines()}
        assert sorted(again) == [1, 2, 3]
        assert again[1] == first[1] and again[3] == first[3]  # not run again
        assert again[2]["settings"] == first[2]["settings"]  # the same plan
        assert json.loads((out / "tune.json").read_text())["trials_planned"] == 3
    comm.Barrier()
    with pytest.raises(OutputError, match="holds a search of another space"):
        tune(*[a if not a.startswith("lr=") else "lr=0.5;epochs=1" for a in argv])
    with pytest.raises(OutputError, match="it differs in trials"):
        tune(*[a if a != "3" else "2" for a in argv])


def _check_published(doc: dict, stated: dict, comm) -> None:
    """The chosen trial's directory holds best.pt alone, stating the epsilon incl.
    tuning and the noisy score that chose it, never the exact val or test figures
    nor the seed (before 2026-11-27: the trial's 0.999-style epsilon, the exact
    val_accuracy and val_loss, the seed; checkpoint.pt beside it); `mpidp eval`
    prints that epsilon, saying it includes the tuning."""
    import io
    from contextlib import redirect_stdout

    import torch
    from engine import checkpoint
    from engine.cli import build_parser
    from engine.models import checkpoint_logits

    chosen, where = doc["chosen"], doc["chosen"]["checkpoint"]
    out = os.path.dirname(os.path.dirname(where))  # OUT/trials/trial-NNNN
    for name in ("tune.json", "trials.jsonl", "search.json"):  # every trial's exact scores
        assert os.stat(os.path.join(out, name)).st_mode & 0o777 == 0o600, name  # was 0644
    assert os.listdir(where) == ["best.pt"] and chosen["model"] == os.path.join(where,
                                                                                 "best.pt")
    payload = checkpoint.load_model(where)
    assert set(payload) <= checkpoint.PUBLISHED_KEYS | {"format", "version"}
    assert "seed" not in payload["config"]
    assert payload["epsilon"] == stated["epsilon"] > chosen["epsilon"]
    assert payload["privacy"]["includes_tuning"] is True
    assert payload["privacy"]["trial_epsilon"] == chosen["epsilon"]
    tuning = payload["selected"]["tuning"]
    assert tuning["trial"] == chosen["trial"] and tuning["val_noise_std"] == 0.5
    assert tuning["val_accuracy"] == chosen["val_accuracy"]  # the noisy score
    X, y = _val(doc["data"])
    logits = checkpoint_logits(payload["model"], payload["params"], X.shape[1], 2, "x")
    ones = torch.ones((X.shape[0], 1), dtype=torch.float32)
    exact = float((logits(torch.cat([X, ones], 1)).argmax(1) == y).float().mean())
    assert exact != tuning["val_accuracy"]  # the noisy score, not the exact one
    assert "val_loss" not in tuning and "val_accuracy" not in payload["selected"]
    args = build_parser().parse_args(["eval", "--checkpoint", where, "--data", doc["data"]])
    said = io.StringIO()
    with redirect_stdout(said):
        assert args._run(args) == 0
    if comm.Get_rank() == 0:
        # with its unit and delta, as train's done line (before: `epsilon E incl. tuning`)
        assert f"epsilon {stated['epsilon']:.3f} per person (delta 1e-05) incl. tuning)" \
            in said.getvalue()
    # the search has ended: no longer marked as one trial of it (engine.checkpoint.tune_trial)
    assert payload["privacy"]["guarantee"] is True
    assert "trial_of_search" not in payload["privacy"]


@pytest.mark.mpi(min_size=1)
def test_private_random_search_states_its_cost(data, comm, shared_tmp):
    from engine.tune.options import Options, privacy_plans

    out = shared_tmp / "private"
    code = tune("--data", data, "--target-epsilon", "2", "--out", str(out), "--seed", "11",
                "--trials", "3", "--score-noise", "0.5",
                "--space", "lr=0.2,0.5;batch_size=40,80;epochs=1;hidden=4", *_parallel(comm))
    assert code == 0
    doc = json.loads((out / "tune.json").read_text())
    stated = doc["privacy"]
    assert stated["mode"] == "random-search" and stated["eta"] == 1.0
    assert stated["gamma"] == pytest.approx(1 / 3) and stated["score_std"] == 0.5
    records = doc["trials"]
    assert len(records) == doc["trials_planned"] >= 1
    assert all(r["status"] == "ok" and r["epsilon"] <= 2.0 + 1e-6 for r in records)
    assert all(r["epsilon_incl_tuning"] == stated["epsilon"] > 2.0 for r in records)
    assert all(r["val_loss"] is None and r["val_noise_std"] == 0.5 for r in records)
    _check_published(doc, stated, comm)
    # the tuning's curves use the sigma each trial calibrated
    from engine.cli import build_parser
    args = build_parser(only="tune").parse_args(
        ["tune", "--data", data, "--target-epsilon", "2", "--space", "lr=1"])
    opts = Options(args, comm.Get_size())
    for r in records:
        key = (r["settings"]["batch_size"], 1, None)
        plan = privacy_plans([key], 600, opts, comm)[key]
        assert plan[1] == pytest.approx(r["noise_multiplier"], rel=1e-12)
        assert plan[2] == r["steps"]
    # the public mode: exact scores, the trials composed
    out = shared_tmp / "public"
    assert tune("--data", data, "--target-epsilon", "2", "--out", str(out), "--tuning-privacy",
                "public", "--public-split", "val", "--space",
                "lr=0.2,0.5;batch_size=80;epochs=1;hidden=4", *_parallel(comm)) == 0
    doc = json.loads((out / "tune.json").read_text())
    assert doc["privacy"]["mode"] == "public" and doc["privacy"]["trials"] == 2
    assert all(r["val_loss"] is not None for r in doc["trials"])
    curve = privacy.trial_curve(80 / 600, doc["trials"][0]["noise_multiplier"], 8)
    assert doc["privacy"]["epsilon"] == pytest.approx(
        privacy.to_epsilon(privacy.ORDERS, 2 * curve, 1e-5)[0], rel=1e-9)


@pytest.mark.mpi(min_size=1)
def test_a_private_score_noisier_than_the_val_split_says_so_and_stays_an_accuracy(
        data, comm, shared_tmp, capsys):
    """Noise of std 20 predictions on 150 val rows: the scores were printed
    below 0 or above 1 (-0.2183) without a word; now said at the start and
    clipped to [0, 1] (post-processing of the noisy count)."""
    out = shared_tmp / "noisy"
    assert tune("--data", data, "--target-epsilon", "2", "--out", str(out), "--seed", "3",
                "--trials", "4", "--space", "lr=0.2,0.5;batch_size=80;epochs=1;hidden=4",
                *_parallel(comm)) == 0
    text = capsys.readouterr().out
    doc = json.loads((out / "tune.json").read_text())
    assert all(0 <= r["val_accuracy"] <= 1 for r in doc["trials"] if r["status"] == "ok")
    assert comm.Get_rank() or "note: the score noise (std 20 correct predictions) is 0.13 " \
        "in accuracy on 150 val rows" in text, text


def test_a_search_stopped_before_any_trial_finished_says_so(data, shared_tmp, capsys,
                                                             monkeypatch):
    """It pointed to the trials file for "the finished ones", which did not exist."""
    from engine.errors import EXIT_CHECKPOINTED

    monkeypatch.setattr(search_mod, "run_search", lambda *a, **k: ([], True))
    out = shared_tmp / "stopped"
    assert tune("--data", data, "--no-dp", "--out", str(out), "--space",
                "lr=0.2,0.5;batch_size=80;epochs=1") == EXIT_CHECKPOINTED
    assert "stopped by a signal with 2 trial(s) not finished; none had finished: run the " \
        "same command again" in capsys.readouterr().out
    assert not (out / search_mod.TRIALS_FILE).exists()


# -- the command line -----------------------------------------------------------------------

def test_cli_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, capsys):
    """Each bad request: exit 2, one line, nothing written. The first through
    the console script in its own process (as a user runs it), the others
    through the same entry point in this process (no start-up to pay)."""
    from launcher import mpidp
    from engine.bench import synthetic
    from engine.cli import main

    path = synthetic.write(tmp_path / "d.h5", rows=200, features=6, seed=1, val_rows=50)
    out = tmp_path / "out"
    cases = [
        (["--no-dp", "--space", "lr=0.1,-2"], "--space: lr=-2: --lr -2.0 must be a positive"),
        (["--target-epsilon", "1e-4", "--space", "epochs=50;batch_size=50"], "out of reach"),
        (["--no-dp", "--space", "lr=0.1"], "batch_size 256 (the default) exceeds the 200"),
        (["--no-dp", "--space", "batch_size=10,500"], "batch_size=500: exceeds the 200"),
        (["--target-epsilon", "1", "--space", "lr=0.1", "--search", "grid"],
         "draws its trials at random"),
        (["--no-dp", "--space", "lr=0.1", "--public-split", "val"], "--public-split is about DP"),
        # accepted and ignored before, while their siblings were refused
        (["--no-dp", "--space", "lr=0.1", "--accountant", "rdp"], "--accountant is about DP"),
        (["--no-dp", "--space", "lr=0.1", "--delta", "1e-6"], "--delta is about DP"),
        (["--no-dp", "--space", "lr=0.1", "--min-group-size", "100"],  # the default, given
         "--min-group-size 100 sizes the groups of --select-on worst_group_val_accuracy"),
        # the message named --allow-large-delta, which tune does not have
        (["--target-epsilon", "1", "--delta", "0.5", "--space", "lr=0.1;batch_size=50"],
         "Use --delta 0.001 or smaller"),
    ]
    no_val = synthetic.write(tmp_path / "noval.h5", rows=200, features=6, seed=1)
    cases = [(path, *case) for case in cases]
    cases.append((no_val, ["--no-dp", "--space", "lr=0.1"], "has no val split"))
    # no group can be scored: every trial trained (privacy spent), then "no trial
    # finished (1 failed)"; refused before any, with mpidp train's words
    grouped = synthetic.write(tmp_path / "g.h5", rows=200, features=6, seed=1, val_rows=50,
                              group_columns={"RAC1P": {1: 0.5, 2: 0.5}})
    cases.append((grouped, ["--target-epsilon", "1", "--space", "lr=0.1;batch_size=50",
                            "--select-on", "worst_group_val_accuracy", "--group-by", "RAC1P",
                            "--min-group-size", "40"],
                  "no RAC1P group has --min-group-size 40 validation rows; lower it"))
    for number, (data, extra, message) in enumerate(cases):
        argv = ["tune", "--data", str(data), "--out", str(out), *extra]
        if number == 0:
            result = mpidp(1, *argv, timeout=60)
            code, stderr = result.returncode, result.stderr
        else:
            capsys.readouterr()
            with pytest.raises(SystemExit) as stopped:
                main(argv)
            code, stderr = stopped.value.code, capsys.readouterr().err
        assert code == 2, stderr
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], stderr
        assert "--allow-large-delta" not in stderr
        assert not out.exists()


def test_a_signal_the_trainer_forgot_is_still_counted():
    """A group stops after a trial when a signal came during it, although the
    trainer forgets the signals it handled (engine.stopping.signal_count)."""
    import signal

    from engine import stopping

    before = stopping.signal_count()
    stopping._record(signal.SIGTERM, None)
    stopping.forget_signals()
    assert stopping.received() == [] and stopping.signal_count() == before + 1


def test_points_invalid_only_together_are_left_out(monkeypatch):
    """A combination TrainConfig refuses is dropped and counted; none left is exit 2."""
    from engine.cli import build_parser
    from engine.config import TrainConfig
    from engine.tune import options

    real = TrainConfig.validate

    def validate(self):
        if self.optimizer == "adam" and self.lr > 0.1:
            raise ConfigError("adam with a large lr (a rule for this test)", collective=True)
        real(self)

    monkeypatch.setattr(TrainConfig, "validate", validate)
    args = build_parser(only="tune").parse_args(["tune", "--data", "x.h5", "--no-dp"])
    opts = options.Options(args, 1)
    points, dropped, reason = options.valid_points(
        space.parse("lr=0.1,0.5;optimizer=sgd,adam", None), opts)
    assert len(points) == 3 and dropped == 1 and "lr=0.5 optimizer=adam" in reason
    _, dropped, _ = options.valid_points(space.parse("lr=0.5;optimizer=adam", None), opts)
    assert dropped == 1


def test_the_noisy_choice_note_weighs_the_worst_groups_size(tmp_path, capsys):
    """The worst group's score is a ratio of noisy counts over a group that may
    be as small as --min-group-size: the note compared the noise with every
    val row (20 / 2,000 = 0.01) and stayed silent at 20 / 100 = 0.2."""
    from engine.bench import synthetic
    from engine.cli import main

    data = synthetic.write(tmp_path / "g.h5", rows=300, features=6, seed=1, val_rows=2000,
                           group_columns={"RAC1P": {1: 0.5, 2: 0.5}})
    base = ["tune", "--data", str(data), "--target-epsilon", "1", "--trials", "1",
            "--seed", "2", "--space", "lr=0.1;batch_size=50;epochs=1"]
    said = {}
    for name, extra in (("overall", []), ("worst", ["--select-on", "worst_group_val_accuracy",
                                                    "--group-by", "RAC1P"])):
        capsys.readouterr()
        main([*base, *extra, "--out", str(tmp_path / name)])
        said[name] = capsys.readouterr().out
    assert "choice is mostly noise" not in said["overall"]
    assert ("note: the score noise (std 20 correct predictions) is 0.20 in accuracy on a "
            "RAC1P group of --min-group-size 100 val rows") in said["worst"], said["worst"]
