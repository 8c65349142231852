"""Training options beyond the DP step: the learning-rate schedules (alpha/sqrt(t),
warm-up and milestones), L2 weight decay, the stopping rules, and the dense
epsilon-like synthetic generator they are tried on."""
import math

import numpy as np
import pytest
import torch

from engine.bench import synthetic
from engine.config import TrainConfig
from engine.errors import ConfigError
from engine.nn.optim import SGD, Adam
from engine.nn.schedule import learning_rate
from engine.stopping import (TARGET_ACCURACY, TIME_BUDGET, accuracy_after_time,
                             stop_reason, time_to_accuracy)
from engine.trainer import Trainer


def test_inv_sqrt_schedule_by_hand():
    assert [learning_rate("inv-sqrt", 200.0, t) for t in (1, 4, 16, 100)] == \
        [200.0, 100.0, 50.0, 20.0]
    assert learning_rate("constant", 0.05, 7) == 0.05
    with pytest.raises(ValueError):
        learning_rate("inv-sqrt", 1.0, 0)
    with pytest.raises(ValueError):
        learning_rate("cosine", 1.0, 1)


def test_step_schedule_warms_up_then_decays_at_the_milestones():
    """mlbench 1a's shape: 10 updates per epoch, 2 warm-up epochs from 0.025 to
    0.1, then x0.1 from epoch 4 and again from epoch 6 (epochs counted from 0)."""
    def lr(t):
        return learning_rate("step", 0.1, t, steps_per_epoch=10, warmup_epochs=2,
                             warmup_from=0.025, milestones=(4, 6), decay=0.1)
    assert lr(1) == pytest.approx(0.025 + 0.075 / 20)
    assert lr(10) == pytest.approx(0.0625) and lr(20) == pytest.approx(0.1)
    assert [lr(t) for t in (21, 40)] == [pytest.approx(0.1)] * 2  # epochs 2, 3
    assert [lr(t) for t in (41, 60)] == [pytest.approx(0.01)] * 2  # epochs 4, 5
    assert lr(61) == pytest.approx(0.001) and lr(1000) == pytest.approx(0.001)
    assert learning_rate("step", 0.1, 5, steps_per_epoch=10) == 0.1  # no warm-up, no milestone


@pytest.mark.parametrize("settings, message", [
    (dict(nesterov=True, momentum=0.0), "--nesterov"),
    (dict(nesterov=True, optimizer="adam"), "--nesterov"),
    (dict(lr_milestones=(5,)), "--lr-schedule step"),
    (dict(lr_schedule="step", lr_milestones=(9, 5)), "increasing"),
    (dict(lr_schedule="step", lr_decay=0.0), "--lr-decay"),
    (dict(lr_schedule="step", lr_warmup_epochs=-1.0), "--lr-warmup-epochs"),
])
def test_step_schedule_and_nesterov_settings_are_checked(settings, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(data="x.h5", **settings).validate()


def test_weight_decay_sgd_by_hand():
    p = torch.tensor([1.0, 2.0], dtype=torch.float64)
    opt = SGD(p, lr=0.1, momentum=0.0, weight_decay=0.1)
    g = torch.tensor([0.5, -1.0], dtype=torch.float64)
    opt.step(g, scale=0.5)  # effective gradient 0.5 g + 0.1 p = [0.35, -0.3]
    assert p.tolist() == pytest.approx([1 - 0.035, 2 + 0.03])
    assert g.tolist() == [0.5, -1.0]  # the all-reduce buffer is left alone


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_weight_decay_matches_torch_optim(name):
    gen = torch.Generator().manual_seed(3)
    start = torch.randn(20, generator=gen, dtype=torch.float64)
    grads = [torch.randn(20, generator=gen, dtype=torch.float64) for _ in range(4)]
    ours = start.clone()
    theirs = start.clone().requires_grad_(True)
    if name == "sgd":
        opt = SGD(ours, lr=0.1, momentum=0.9, weight_decay=0.01)
        ref = torch.optim.SGD([theirs], lr=0.1, momentum=0.9, weight_decay=0.01)
    else:
        opt = Adam(ours, lr=0.01, weight_decay=0.01)
        ref = torch.optim.Adam([theirs], lr=0.01, weight_decay=0.01)
    for g in grads:
        opt.step(g, scale=0.5)
        theirs.grad = 0.5 * g
        ref.step()
    assert torch.allclose(ours, theirs.detach(), atol=1e-12)


def test_stopping_rules():
    record = {"epoch": 3, "train_time_s": 5.0, "test_accuracy": 0.9}
    assert stop_reason(record, 0.9, None) == TARGET_ACCURACY
    assert stop_reason(record, 0.91, None) is None
    assert stop_reason(record, 0.91, 5.0) == TIME_BUDGET
    assert stop_reason(record, 0.9, 1.0) == TARGET_ACCURACY  # reached: the target wins
    assert stop_reason({"train_time_s": 1.0}, 0.5, 2.0) is None  # not evaluated yet
    # with a validation split the target is on val (test is scored only at the end)
    assert stop_reason({"train_time_s": 1.0, "val_accuracy": 0.9}, 0.9, None) \
        == TARGET_ACCURACY
    assert stop_reason({"train_time_s": 1.0, "val_accuracy": 0.8, "test_accuracy": 0.95},
                       0.9, None) is None
    history = [{"epoch": 1, "train_time_s": 2.0, "test_accuracy": 0.6},
               {"epoch": 2, "train_time_s": 3.0},
               {"epoch": 3, "train_time_s": 4.5, "test_accuracy": 0.8}]
    assert time_to_accuracy(history, 0.7) == (4.5, 3)
    assert time_to_accuracy(history, 0.9) is None
    assert accuracy_after_time(history, 4.0) == (0.6, 2.0)
    assert accuracy_after_time(history, 1.0) is None


@pytest.mark.parametrize("sigma", [0.0, -1.0, float("inf"), float("nan")])
def test_a_noise_multiplier_must_be_finite_and_positive(sigma):
    # inf passed here once and failed later inside dp-accounting's PLD
    with pytest.raises(ConfigError, match=rf"--noise-multiplier {sigma} must be a finite "
                       r"positive number \(use --no-dp"):
        TrainConfig(data="x.h5", noise_multiplier=sigma).validate()


def test_bad_stopping_and_l2_options_are_user_errors():
    for kw, match in ((dict(target_accuracy=1.5), "target-accuracy"),
                      (dict(time_budget=0.0), "time-budget"),
                      (dict(weight_decay=-1.0), "weight-decay")):
        with pytest.raises(ConfigError, match=match):
            TrainConfig(data="x.h5", dp=False, **kw).validate()


def test_dense_generator_rows_and_labels(tmp_path):
    import h5py

    path = synthetic.write_dense(tmp_path / "d.h5", rows=3000, features=50, seed=2)
    with h5py.File(path) as f:
        X, y = f["train/X"][:], f["train/y"][:]
        assert f["test/X"].shape == (750, 50) and f.attrs["n_classes"] == 2
    assert np.allclose(np.linalg.norm(X, axis=1), 1.0, atol=1e-5)
    assert 0.4 < y.mean() < 0.6
    # Feature scales decay as (1 + j)^-0.5 before normalisation.
    # (Columns far from the first few barely move the row norm, so their ratio
    # survives the normalisation.)
    scale2 = (1.0 + np.arange(50)) ** -1.0
    ratio = X[:, 20:25].std() / X[:, 45:].std()
    assert ratio == pytest.approx(math.sqrt(scale2[20:25].mean() / scale2[45:].mean()),
                                  rel=0.08)
    assert X[:, :5].std() > X[:, 20:25].std()


class _Null:
    def write(self, text):
        pass

    def flush(self):
        pass


@pytest.mark.mpi(min_size=1)
def test_trainer_stops_every_rank_at_the_same_step(comm, shared_tmp):
    """A reachable target stops after the first epoch that reaches it, on every rank
    at the same step; a tiny budget stops after one epoch; inv-sqrt reaches lr/sqrt(t)."""
    path = str(shared_tmp / "d.h5")
    if comm.Get_rank() == 0:
        synthetic.write(path, rows=400, features=4, test_rows=80, seed=4)
    comm.Barrier()
    base = dict(data=path, epochs=6, batch_size=20, hidden=(), dp=False, seed=3,
                progress=False, momentum=0.0, lr=0.5, lr_schedule="inv-sqrt",
                weight_decay=1e-3)
    runs = {}
    for name, extra in (("target", dict(target_accuracy=0.01)),
                        ("budget", dict(time_budget=1e-9)), ("full", {})):
        cfg = TrainConfig(**base, **extra)
        cfg.validate()
        trainer = Trainer(cfg, comm, out=_Null())
        assert trainer.run() == 0
        runs[name] = trainer
        assert len(set(comm.allgather(trainer.step))) == 1
    assert len(runs["target"].history) == 1
    assert runs["target"].history[-1]["stop_reason"] == TARGET_ACCURACY
    assert len(runs["budget"].history) == 1
    assert runs["budget"].history[-1]["stop_reason"] == TIME_BUDGET
    full = runs["full"]
    assert len(full.history) == 6 and "stop_reason" not in full.history[-1]
    assert full.optimizer.lr == pytest.approx(0.5 / math.sqrt(full.step))
    assert full.optimizer.weight_decay == 1e-3
    times = [r["train_time_s"] for r in full.history]
    assert times == sorted(times)
    assert times[-1] == pytest.approx(sum(r["epoch_time_s"] for r in full.history))
