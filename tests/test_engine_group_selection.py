"""Choosing on the worst group: mpidp train and mpidp tune --select-on
worst_group_val_accuracy, on the validation split only.

The reference scores each epoch's (or trial's) model on the whole val split
in one process and groups with pandas; the published file must hold no
exact score of any group.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import h5py
import numpy as np
import pandas as pd
import pytest
import torch

import engine
from engine.bench import synthetic, synthetic_images
from engine.errors import ConfigError, GroupError

GROUPS = {"SEX": {1: 0.5, 2: 0.5}, "RAC1P": {1: 0.6, 2: 0.25, 6: 0.15}}


@pytest.fixture
def data(comm, shared_tmp) -> str:
    path = str(shared_tmp / "groups.h5")
    if comm.Get_rank() == 0:
        synthetic.write(path, rows=1200, features=8, test_rows=300, val_rows=900, seed=6,
                        group_columns=GROUPS)
    comm.Barrier()
    return path


def _worst_on_val(payload: dict, path: str, attribute: str, min_size: int = 100) -> float:
    """The worst group's val accuracy of a checkpoint's model, by pandas."""
    from engine.models import checkpoint_logits

    with h5py.File(path, "r") as f:
        X, y = f["val/X"][:], f["val/y"][:]
        codes = f[f"val/groups/{attribute}"][:]
    logits = checkpoint_logits(payload["model"], payload["params"].float(), X.shape[1], 2, "")
    rows = torch.from_numpy(np.hstack([X, np.ones((len(X), 1), np.float32)]))
    with torch.no_grad():
        pred = logits(rows).argmax(1).numpy()
    frame = pd.DataFrame({"g": codes, "right": pred == y})
    by = frame.groupby("g")["right"].agg(["size", "mean"])
    return float(by[by["size"] >= min_size]["mean"].min())


def _holds(value, key: str) -> bool:
    """Whether a payload holds ``key`` anywhere in its dicts."""
    if isinstance(value, dict):
        return key in value or any(_holds(v, key) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds(v, key) for v in value)
    return False


@pytest.mark.mpi(min_size=1)
def test_train_keeps_the_epoch_whose_worst_group_is_best(comm, shared_tmp, data):
    from engine import checkpoint as ckpt

    run_dir = str(shared_tmp / "run")
    run = engine.train(data, comm=comm, quiet=True, epochs=4, batch_size=64, hidden=(8,),
                       noise_multiplier=1.0, lr=0.3, seed=3, checkpoint_dir=run_dir,
                       select_on="worst_group_val_accuracy", group_by="RAC1P")
    records = run.history
    scores = [r["val_worst_group_accuracy"] for r in records]
    best = int(np.argmax(scores))  # the first of equal ones
    assert records[-1]["selected_epoch"] == best + 1
    assert records[-1]["select_on"] == "worst_group_val_accuracy"
    assert all(r["val_worst_group"].startswith("RAC1P ") for r in records)
    assert "test_accuracy" in records[-1] and all("test_accuracy" not in r
                                                  for r in records[:-1])
    if comm.Get_rank() == 0:
        published = ckpt.load_model(run_dir)  # best.pt
        assert published["selected"] == {"epoch": best + 1, "step": records[best]["step"],
                                         "on": "worst_group_val_accuracy",
                                         "run_step": records[-1]["step"]}
        assert _worst_on_val(published, data, "RAC1P") == pytest.approx(scores[best],
                                                                        abs=1e-12)
        for key in ("val_worst_group_accuracy", "val_worst_group", "val_accuracy",
                    "history", "best"):
            assert not _holds(published, key), key
        private = ckpt.load_file(ckpt.path_in(run_dir))  # the resume file keeps them
        assert private["best"]["val_worst_group_accuracy"] == scores[best]
    # eval names the rule the model was chosen by (it said "selected on val_accuracy")
    from engine.cli import build_parser

    args = build_parser().parse_args(["eval", "--checkpoint", run_dir, "--data", data,
                                      "--json", str(shared_tmp / f"e{comm.Get_size()}.json")])
    assert args._run(args) == 0
    if comm.Get_rank() == 0:
        said = json.loads((shared_tmp / f"e{comm.Get_size()}.json").read_text())
        assert said["selected_on"] == "worst_group_val_accuracy"  # one model: its figures


@pytest.mark.mpi(min_size=1)
def test_train_refuses_what_it_cannot_group(comm, shared_tmp, data):
    plain = str(shared_tmp / "plain.h5")
    if comm.Get_rank() == 0:
        synthetic.write(plain, rows=400, features=5, val_rows=200, seed=1)
    comm.Barrier()
    common = dict(comm=comm, quiet=True, epochs=1, dp=False, hidden=(4,))
    with pytest.raises(ConfigError, match="--group-by SEX chooses the groups of --select-on "
                       "worst_group_val_accuracy"):
        engine.train(data, group_by="SEX", **common)
    with pytest.raises(GroupError, match="keeps no group columns"):
        engine.train(plain, select_on="worst_group_val_accuracy", **common)
    with pytest.raises(GroupError, match=r"--group-by ST: .* keeps the group columns SEX, "
                       "RAC1P"):
        engine.train(data, select_on="worst_group_val_accuracy", group_by="ST", **common)
    with pytest.raises(GroupError, match="no SEX group has --min-group-size 5000 validation"):
        engine.train(data, select_on="worst_group_val_accuracy", group_by="SEX",
                     min_group_size=5000, **common)
    with pytest.raises(ConfigError, match="--min-group-size 0: give at least 1"):
        engine.train(data, select_on="worst_group_val_accuracy", min_group_size=0, **common)
    for size in (5, 100):  # was accepted and ignored; the default given too
        with pytest.raises(ConfigError, match="--min-group-size sizes the groups of "
                           "--select-on worst_group_val_accuracy"):
            engine.train(data, min_group_size=size, **common)
    images = shared_tmp / "images.h5"
    if comm.Get_rank() == 0:
        synthetic_images.write_images(str(images), rows=64, test_rows=16, seed=1)
        with h5py.File(images, "a") as f:  # a val split, as prep's images have
            f.copy("test", "val")
    comm.Barrier()
    with pytest.raises(GroupError, match="is an image file, with no person attributes to "
                       "group by: select on val_accuracy"):  # no prep can add them
        engine.train(images, select_on="worst_group_val_accuracy", **common)


def _tune(*argv: str) -> int:
    from engine.cli import build_parser

    args = build_parser(only="tune").parse_args(["tune", *argv])
    return args._run(args)


@pytest.mark.mpi(min_size=1)
def test_tune_chooses_the_trial_whose_worst_group_is_best(comm, shared_tmp, data, capsys):
    from engine import checkpoint as ckpt

    out = shared_tmp / "tune"
    assert _tune("--data", data, "--no-dp", "--out", str(out), "--seed", "2",
                 "--select-on", "worst_group_val_accuracy", "--group-by", "sex",
                 "--space", "lr=0.05,0.5;batch_size=64;epochs=1;hidden=8") == 0
    doc = json.loads((out / "tune.json").read_text())
    ok = [r for r in doc["trials"] if r["status"] == "ok"]
    best = max(ok, key=lambda r: (r["val_worst_group_accuracy"], -r["trial"]))
    assert doc["chosen"]["trial"] == best["trial"] and len(ok) == 2
    assert doc["selection"].startswith("the accuracy of the worst SEX group")
    header = capsys.readouterr().out.splitlines()[0] if comm.Get_rank() == 0 else ""
    assert comm.Get_rank() or "chosen on the val accuracy of the worst SEX group of at " \
        "least 100 rows" in header, header  # it said "chosen on val accuracy"
    payload = ckpt.load_model(doc["chosen"]["checkpoint"])
    assert _worst_on_val(payload, data, "SEX") == pytest.approx(
        best["val_worst_group_accuracy"], abs=1e-12)
    assert not _holds(payload, "val_worst_group_accuracy")  # exact, not covered


@pytest.mark.mpi(min_size=1)
def test_private_tune_noises_every_group_count_and_states_its_cost(comm, shared_tmp, data):
    """A private random search releases each group's noisy counts of rows and
    correct predictions (L2 sensitivity sqrt 2), and only what it derives from them."""
    from engine import checkpoint as ckpt
    from engine.tune import privacy

    out = shared_tmp / "private"
    assert _tune("--data", data, "--target-epsilon", "2", "--out", str(out), "--seed", "5",
                 "--trials", "2", "--score-noise", "0.5", "--select-on",
                 "worst_group_val_accuracy", "--space",
                 "lr=0.2,0.5;batch_size=80;epochs=1;hidden=4") == 0
    doc = json.loads((out / "tune.json").read_text())
    stated = doc["privacy"]
    assert "L2 sensitivity 1.41" in stated["text"]
    records = [r for r in doc["trials"] if r["status"] == "ok"]
    for r in records:
        assert r["val_noise_std"] == 0.5 and r["val_loss"] is None and r["group_by"] == "RAC1P"
        assert 0 <= r["val_worst_group_accuracy"] <= 1
    curves = [privacy.trial_curve(80 / 1200, r["noise_multiplier"], r["steps"])
              for r in records[:1]]
    expected = privacy.random_search(curves, 1e-5, "negative-binomial", 2.0, 1.0, 0.5,
                                     math.sqrt(2))
    assert stated["epsilon"] == pytest.approx(expected.epsilon, rel=1e-9)
    assert stated["epsilon"] > privacy.random_search(curves, 1e-5, "negative-binomial", 2.0,
                                                     1.0, 0.5).epsilon
    if comm.Get_rank() == 0 and doc["chosen"]:
        tuning = ckpt.load_model(doc["chosen"]["checkpoint"])["selected"]["tuning"]
        assert tuning["val_worst_group_accuracy"] == doc["chosen"]["val_worst_group_accuracy"]
        assert tuning["val_split"] == "val, noised"


def test_tune_refuses_worst_group_households_in_a_private_search(tmp_path):
    from launcher import mpidp

    path = synthetic.write(tmp_path / "g.h5", rows=400, features=5, val_rows=200, seed=1,
                           group_columns=GROUPS)
    out = tmp_path / "out"
    result = mpidp(1, "tune", "--data", path, "--target-epsilon", "1", "--out", str(out),
                   "--select-on", "worst_group_val_accuracy", "--privacy-unit", "household",
                   "--space", "lr=0.1", timeout=120)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and "a household may span groups" in errors[0], result.stderr
    assert not Path(out).exists()
