"""Which epsilon a run states as its guarantee: the done line, best.pt, mpidp eval.

- A run that ``--target-accuracy`` stopped read the data to stop: the
  mechanism was the planned run, so it states its budget (what the steps
  spent beside it); a ``--time-budget`` stop keeps the steps run's.
- ``--sampling shuffle`` states no guarantee, wherever the epsilon is stated.
- A ``mpidp tune`` trial's files say they are one trial of an unfinished
  search until the search's end rewrites the chosen one.
- ``mpidp eval`` states the unit and delta, as the done line does.
"""
from __future__ import annotations

import io
import json
import os
from contextlib import redirect_stdout
from types import SimpleNamespace

import pytest

from collectives.runtime import MPI
from engine import checkpoint as ckpt
from engine.bench import synthetic
from engine.config import TrainConfig
from engine.trainer import Trainer

RUN = dict(epochs=4, batch_size=64, hidden=(8,), noise_multiplier=1.0, lr=0.3, seed=5,
           progress=False, allreduce="ring")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "v.h5"
    return synthetic.write(path, rows=600, features=6, test_rows=100, val_rows=150, seed=3)


def _train(path, directory, **kw):
    cfg = TrainConfig(data=str(path), checkpoint_dir=str(directory), **{**RUN, **kw})
    cfg.validate()
    out = io.StringIO()
    trainer = Trainer(cfg, MPI.COMM_SELF, out=out)
    assert trainer.run() == 0
    return trainer, out.getvalue()


def _eval(checkpoint, data, *extra) -> str:
    from engine.cli import build_parser

    args = build_parser().parse_args(["eval", "--checkpoint", str(checkpoint), "--data",
                                      str(data), *extra])
    said = io.StringIO()
    with redirect_stdout(said):
        assert args._run(args) == 0
    return said.getvalue()


def test_a_target_accuracy_stop_states_the_budget(data, tmp_path):
    """Stopped after 1 of 4 epochs by the validation accuracy: before, the done
    line, best.pt and eval stated the one epoch's epsilon (an ex-post loss, not
    a guarantee of a run whose stop read the data); now the budget, the epoch's
    spend beside it. A resume that goes on keeps stating it."""
    run = tmp_path / "run"
    trainer, said = _train(data, run, target_accuracy=0.01)
    assert len(trainer.history) == 1 and trainer.history[-1]["stop_reason"] == "target_accuracy"
    budget, spent = trainer.budget, trainer.history[-1]["epsilon"]
    assert spent < 0.8 * budget
    done = next(line for line in said.splitlines() if line.startswith("done:"))
    assert f"epsilon {budget:.3f} per person (delta 1e-05), the budget of the planned run, " \
        "which --target-accuracy stopped on the data" in done, done
    assert f"({spent:.3f} spent by the steps run)" in done
    best = ckpt.load_file(ckpt.best_path_in(run))
    assert best["epsilon"] == best["privacy"]["epsilon"] == pytest.approx(budget)
    assert best["privacy"]["spent_epsilon"] == pytest.approx(spent)
    assert best["privacy"]["epsilon_of"] == "budget" and best["privacy"]["guarantee"] is True
    assert ckpt.load(run)["epsilon"] == pytest.approx(spent)  # the resume file: the odometer
    text = _eval(run, data)
    assert f"epsilon {budget:.3f} per person (delta 1e-05), the budget of the planned run" \
        in text and f"({spent:.3f} spent by the steps run)" in text, text
    for where in (run, ckpt.path_in(run)):  # the checkpoint states what best.pt does
        doc = json.loads(_eval(where, data, "--json"))
        assert doc["epsilon"] == pytest.approx(budget) and doc["epsilon_of"] == "budget"
        assert doc["spent_epsilon"] == pytest.approx(spent) and doc["epsilon_is_guarantee"]
    more, said = _train(data, run, resume=True, target_accuracy=1.0, epochs=3)
    assert len(more.history) == 3
    best = ckpt.load_file(ckpt.best_path_in(run))
    assert best["epsilon"] == pytest.approx(budget) and best["privacy"]["epsilon_of"] == "budget"
    assert f"epsilon {budget:.3f} per person" in said


def test_a_time_budget_stop_states_the_steps_run(data, tmp_path):
    """The wall clock is not the data: the steps run are the mechanism."""
    run = tmp_path / "run"
    trainer, said = _train(data, run, time_budget=1e-9)
    assert trainer.history[-1]["stop_reason"] == "time_budget" and len(trainer.history) == 1
    spent = trainer.history[-1]["epsilon"]
    best = ckpt.load_file(ckpt.best_path_in(run))
    assert best["epsilon"] == pytest.approx(spent) and spent < trainer.budget
    assert best["privacy"]["epsilon_of"] == "steps_run"
    assert f"epsilon {spent:.3f} per person (delta 1e-05), " in said
    assert "budget of the planned run" not in said + _eval(run, data)


def test_shuffled_batches_state_no_guarantee(data, tmp_path):
    """The run's start said "epsilon is NOT a guarantee", the done line, best.pt
    and eval stated it as one."""
    run = tmp_path / "run"
    trainer, said = _train(data, run, sampling="shuffle", epochs=2)
    eps = trainer.history[-1]["epsilon"]
    done = next(line for line in said.splitlines() if line.startswith("done:"))
    assert f"epsilon {eps:.3f} per person (delta 1e-05), NOT a guarantee: --sampling " \
        "shuffle" in done, done
    privacy = ckpt.load_file(ckpt.best_path_in(run))["privacy"]
    assert privacy["guarantee"] is False and "--sampling shuffle" in privacy["not_a_guarantee"]
    assert "NOT a guarantee: --sampling shuffle" in _eval(run, data)
    doc = json.loads(_eval(run, data, "--json"))
    assert doc["epsilon_is_guarantee"] is False and "shuffle" in doc["not_a_guarantee"]
    # a best.pt written before the statement had its flag: told by its sampling
    old = ckpt.load_file(ckpt.best_path_in(run))
    for key in ("guarantee", "not_a_guarantee", "epsilon_of", "spent_epsilon"):
        old["privacy"].pop(key)
    ckpt.save(tmp_path, old, "old.pt")
    assert "NOT a guarantee: --sampling shuffle" in _eval(tmp_path / "old.pt", data)


def test_eval_states_the_unit_and_delta(data, tmp_path):
    """eval printed `epsilon 2.000` without the unit or delta."""
    run = tmp_path / "run"
    trainer, _ = _train(data, run, epochs=1)
    eps = trainer.history[-1]["epsilon"]
    assert f"epsilon {eps:.3f} per person (delta 1e-05))" in _eval(run, data)
    payload = ckpt.load_file(ckpt.best_path_in(run))
    payload["privacy"]["unit"] = "household"
    ckpt.save(tmp_path, payload, "household.pt")
    assert f"epsilon {eps:.3f} per household (delta 1e-05))" \
        in _eval(tmp_path / "household.pt", data)
    doc = json.loads(_eval(tmp_path / "household.pt", data, "--json"))
    assert doc["privacy_unit"] == "household" and doc["delta"] == 1e-5


def test_a_tune_trial_is_marked_until_the_search_publishes_it(data, tmp_path):
    """A trial of an unfinished search stated its own epsilon (0.999 where the
    search costs 3 or more), in best.pt and in eval; now both files say it is
    one trial's, not a guarantee, until tune's end rewrites the chosen one."""
    from engine.tune.report import publish

    trial = tmp_path / "out" / "trials" / "trial-0003"
    trial.parent.mkdir(parents=True)
    with ckpt.tune_trial(tmp_path / "out", 3):
        trainer, _ = _train(data, trial, epochs=1)
    assert ckpt.current_trial() is None  # only inside the trial
    eps = trainer.history[-1]["epsilon"]
    best = ckpt.load_file(ckpt.best_path_in(trial))
    assert best["privacy"]["guarantee"] is False
    assert best["privacy"]["trial_of_search"] == {"search": "out", "trial": 3}
    for where in (trial, ckpt.path_in(trial)):
        text = _eval(where, data)
        assert f"epsilon {eps:.3f} per person (delta 1e-05), NOT a guarantee: the epsilon " \
            "of trial 3 alone, in the unfinished mpidp tune search out" in text, text
        doc = json.loads(_eval(where, data, "--json"))
        assert doc["epsilon_is_guarantee"] is False and doc["trial_of_search"]["trial"] == 3
    statement = SimpleNamespace(epsilon=4.5, delta=1e-5, text="a search", mode="random-search")
    chosen = {"trial": 3, "settings": {"lr": 0.3}, "epsilon": eps, "val_accuracy": 0.7,
              "val_noise_std": 20.0}
    assert publish(str(trial), chosen, statement, SimpleNamespace(public_split=None))
    privacy = ckpt.load_file(ckpt.best_path_in(trial))["privacy"]
    assert "trial_of_search" not in privacy and privacy["guarantee"] is True
    assert privacy["epsilon"] == 4.5 and privacy["includes_tuning"]
    text = _eval(trial, data)
    assert "epsilon 4.500 per person (delta 1e-05) incl. tuning)" in text, text


@pytest.mark.mpi(min_size=1)
def test_an_unfinished_search_leaves_marked_trials(comm, shared_tmp, monkeypatch):
    """The search stops (as on SIGTERM) after its trials: every trial's best.pt
    says it is one trial of it; the same command again ends the search and the
    chosen trial's file states the epsilon incl. tuning, unmarked."""
    from engine.cli import build_parser
    from engine.tune import search

    path = str(shared_tmp / "t.h5")
    if comm.Get_rank() == 0:
        synthetic.write(path, rows=600, features=12, seed=5, val_rows=150)
    comm.Barrier()
    out = shared_tmp / "tn"
    argv = ["tune", "--data", path, "--target-epsilon", "2", "--out", str(out), "--seed", "3",
            "--trials", "2", "--space", "lr=0.2,0.5;batch_size=80;epochs=1;hidden=4"]
    real = search.run_search

    def stopped(*args, **kwargs):
        records, _ = real(*args, **kwargs)
        return records, True

    monkeypatch.setattr(search, "run_search", stopped)
    args = build_parser(only="tune").parse_args(argv)
    assert args._run(args) == 75
    monkeypatch.setattr(search, "run_search", real)
    if comm.Get_rank() == 0:
        trials = sorted((out / "trials").iterdir())
        assert trials
        for trial in trials:
            privacy = ckpt.load_file(ckpt.best_path_in(trial))["privacy"]
            assert privacy["guarantee"] is False, trial
            assert privacy["trial_of_search"]["search"] == "tn"
            assert ckpt.load(trial)["trial_of_search"] == privacy["trial_of_search"]
    comm.Barrier()
    args = build_parser(only="tune").parse_args(argv)
    assert args._run(args) == 0
    doc = json.loads((out / "tune.json").read_text())
    privacy = ckpt.load_model(doc["chosen"]["checkpoint"])["privacy"]
    assert "trial_of_search" not in privacy and privacy["guarantee"] is True
    assert privacy["includes_tuning"] and privacy["epsilon"] == doc["privacy"]["epsilon"]
    assert os.listdir(out / "trials") == [os.path.basename(doc["chosen"]["checkpoint"])]


def test_the_library_states_what_the_command_states(data, tmp_path):
    """engine.train's Run.epsilon said what the steps spent after a
    target-accuracy stop, while the command and best.pt state the budget."""
    import engine

    settings = {k: v for k, v in RUN.items() if k != "progress"}
    run = engine.train(str(data), comm=MPI.COMM_SELF, quiet=True, target_accuracy=0.01,
                       checkpoint_dir=str(tmp_path / "run"), **settings)
    best = ckpt.load_file(ckpt.best_path_in(tmp_path / "run"))
    assert run.epsilon == pytest.approx(best["privacy"]["epsilon"])
    assert run.spent_epsilon == pytest.approx(run.history[-1]["epsilon"])
    assert run.spent_epsilon < run.epsilon
    assert run.guarantee is True
    shuffled = engine.train(str(data), comm=MPI.COMM_SELF, quiet=True, sampling="shuffle",
                            **settings)
    assert shuffled.guarantee is False and shuffled.epsilon == shuffled.spent_epsilon
