"""Any torch model through the trainer: the library's ``model=``, ``--model
MODULE:FACTORY``, and the refusals a user meets (issue #15)."""
import sys

import numpy as np
import pytest
import torch
from torch import nn

import engine
from engine.bench import synthetic
from engine.errors import CheckpointError, ConfigError
from launcher import mpidp

FEATURES = 10


@pytest.fixture
def data(shared_tmp, comm):
    path = shared_tmp / "models.h5"
    if comm.Get_rank() == 0:
        synthetic.write(path, rows=1500, features=FEATURES, seed=4)
    comm.Barrier()
    return str(path)


class Small(nn.Module):
    """Linear -> LayerNorm -> Tanh -> Linear: the Linear and the LayerNorm rule."""

    def __init__(self, n_features, n_classes):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(n_features, 16), nn.LayerNorm(16), nn.Tanh())
        self.head = nn.Linear(16, n_classes)

    def forward(self, x):
        return self.head(self.body(x))


@pytest.mark.mpi(min_size=1)
def test_a_factory_trains_in_place_with_the_mlps_accounting(data, comm, shared_tmp):
    common = dict(comm=comm, epochs=2, batch_size=100, target_epsilon=2.0, seed=3, quiet=True)
    run = engine.train(data, model=Small, **common)
    mlp = engine.train(data, **common)
    assert isinstance(run.model, Small) and run.exit_code == 0 and len(run.history) == 2
    assert run.epsilon == pytest.approx(mlp.epsilon) and run.epsilon <= 2.0
    assert run.history[-1]["test_accuracy"] > 0.6
    import h5py

    with h5py.File(data, "r") as f:
        X, y = torch.from_numpy(f["test/X"][:]), torch.from_numpy(f["test/y"][:])
    run.model.eval()
    with torch.no_grad():
        accuracy = (run.model(X).argmax(1) == y).float().mean().item()
    assert accuracy == pytest.approx(run.history[-1]["test_accuracy"], abs=1e-6)
    flat = np.concatenate([p.detach().numpy().ravel() for p in run.model.parameters()])
    assert len(set(comm.allgather(flat.tobytes()))) == 1


@pytest.mark.mpi(min_size=1)
def test_a_users_mlp_runs_the_fused_kernels_bit_for_bit(data, comm):
    from engine.nn.mlp import MLPSpec, init_params, to_module

    common = dict(comm=comm, epochs=2, batch_size=100, noise_multiplier=1.0, seed=9,
                  quiet=True, hidden=(12,), allreduce="ring")
    spec = MLPSpec.build(FEATURES, (12,), 2)
    mine = to_module(spec, init_params(spec, 9))
    run = engine.train(data, model=mine, **common)
    builtin = engine.train(data, model="mlp", **common)
    assert run.model is mine  # trained in place
    for a, b in zip(mine.parameters(), builtin.model.parameters()):
        assert torch.equal(a.detach(), b.detach())
    keys = ("train_loss", "test_accuracy", "epsilon", "clipped_fraction", "train_examples")
    assert [[h[k] for k in keys] for h in run.history] == \
        [[h[k] for k in keys] for h in builtin.history]


class ChainedMLP(nn.Module):
    """The fused MLP written as a class of its own: fc1, fc2 and F.relu between."""

    def __init__(self, sequential):
        super().__init__()
        self.fc1, self.fc2 = sequential[0], sequential[2]  # defined in call order ...

    def forward(self, x):
        return self.fc2(nn.functional.relu(self.fc1(x)))


@pytest.mark.mpi(min_size=1)
def test_a_users_own_mlp_class_runs_the_fused_kernels_bit_for_bit(data, comm):
    """A class whose forward is the chain (traced by torch.fx) trains as the
    built-in MLP does, in place, and the checkpoint records the fused layout."""
    from engine.models import TorchModel
    from engine.nn.mlp import MLPSpec, init_params, to_module

    common = dict(comm=comm, epochs=2, batch_size=100, noise_multiplier=1.0, seed=9,
                  quiet=True, hidden=(12,), allreduce="ring")
    spec = MLPSpec.build(FEATURES, (12,), 2)
    mine = ChainedMLP(to_module(spec, init_params(spec, 9)))
    assert TorchModel(mine, "mine").mlp_spec == spec
    run = engine.train(data, model=mine, **common)
    builtin = engine.train(data, model="mlp", **common)
    assert run.model is mine
    for a, b in zip([mine.fc1.weight, mine.fc1.bias, mine.fc2.weight, mine.fc2.bias],
                    builtin.model.parameters()):
        assert torch.equal(a.detach(), b.detach())
    assert [h["train_loss"] for h in run.history] == [h["train_loss"] for h in builtin.history]


@pytest.mark.mpi(min_size=1)
def test_a_checkpoint_of_the_generic_path_resumes_on_it(data, comm, shared_tmp, monkeypatch):
    """A class's checkpoint written before its forward was traced (the generic
    path, the module's parameter order, no fused layout recorded) resumes on
    the generic path, bit for bit that path's uninterrupted run, instead of
    being refused as another model; another model still is refused."""
    import engine.models as models
    from engine.nn.mlp import MLPSpec, init_params, to_module

    def mine(widths=(12,)):
        other = MLPSpec.build(FEATURES, widths, 2)
        return ChainedMLP(to_module(other, init_params(other, 9)))

    common = dict(comm=comm, batch_size=100, noise_multiplier=1.0, seed=9, quiet=True,
                  epochs=2, allreduce="ring")  # one summation order in every run
    where = str(shared_tmp / "generic-run")
    with monkeypatch.context() as before:  # mpidp as it was: no class traced
        before.setattr(models, "mlp_linears_of", lambda module: None)
        whole = engine.train(data, model=mine(), **common)
        stopped = engine.train(data, model=mine(), checkpoint_dir=where, stop_after=7,
                               **common)
    assert whole.exit_code == 0 and stopped.exit_code == 75
    resumed = engine.train(data, model=mine(), checkpoint_dir=where, resume=True, **common)
    assert resumed.exit_code == 0
    for a, b in zip(resumed.model.parameters(), whole.model.parameters()):
        assert torch.equal(a.detach(), b.detach())
    with pytest.raises(CheckpointError, match="another model"):
        engine.train(data, model=mine((13,)), checkpoint_dir=where, resume=True, **common)


def test_only_an_exact_linear_relu_chain_is_taken_for_the_fused_mlp():
    from torch.nn import functional as F

    from engine.models import mlp_spec_of
    from engine.nn.linear_chain import linear_chain

    class Three(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.fc3 = nn.Linear(5, 8), nn.Linear(8, 8), nn.Linear(8, 2)

        def forward(self, x):  # two spellings of a ReLU
            return self.fc3(self.fc2(F.relu(self.fc1(x), inplace=True)).relu_())

    class TorchRelu(Three):
        def forward(self, x):  # and a third
            return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))

    class Tanh(Three):
        def forward(self, x):
            return self.fc3(torch.tanh(self.fc2(F.relu(self.fc1(x)))))

    class Branch(Three):
        def forward(self, x):  # data-dependent: fx cannot trace it
            return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x))))) if x.sum() > 0 else x

    class Unused(Three):
        def __init__(self):
            super().__init__()
            self.spare = nn.Linear(2, 2)  # a parameter the chain would not train

    class Twice(Three):
        def forward(self, x):
            return self.fc3(F.relu(self.fc2(F.relu(self.fc2(F.relu(self.fc1(x)))))))

    class Residual(Three):
        def forward(self, x):
            h = F.relu(self.fc1(x))
            return self.fc3(F.relu(self.fc2(h)) + h)

    class Counts(Three):
        def forward(self, x):  # Python of its own: the kernels would skip it
            self.calls = getattr(self, "calls", 0) + 1
            return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))

    class Flag(Three):
        def forward(self, x):  # a test the trace would freeze
            if getattr(self, "wide", True):
                return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))
            return self.fc3(x)

    def counted_relu(x):
        counted_relu.calls = getattr(counted_relu, "calls", 0) + 1
        return F.relu(x)

    class OwnFunction(Three):
        def forward(self, x):  # a function of the user's: traced through, Python lost
            return self.fc3(counted_relu(self.fc2(counted_relu(self.fc1(x)))))

    class Steps(Three):
        """Assignments to local names are fine."""

        def forward(self, x):
            h = F.relu(self.fc1(x))
            h = F.relu(self.fc2(h))
            return self.fc3(h)

    class OtherSelf(Three):
        def forward(net, x):  # noqa: N805 - ``self`` by another name
            return net.fc3(F.relu(net.fc2(F.relu(net.fc1(x)))))

    class Inner(nn.Module):  # a submodule with a forward of its own
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(5, 8)

        def forward(self, x):
            return self.fc(x)

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.head = Inner(), nn.Linear(8, 2)

        def forward(self, x):
            return self.head(F.relu(self.inner(x)))

    class Nested(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(5, 8), nn.ReLU())
            self.head = nn.Linear(8, 2)

        def forward(self, x):
            return self.head(self.body(x))

    three = Three()
    assert linear_chain(three) == [three.fc1, three.fc2, three.fc3]
    assert mlp_spec_of(three).dims == (5, 8, 8, 2)
    assert mlp_spec_of(TorchRelu()).dims == (5, 8, 8, 2)
    assert mlp_spec_of(Nested()).dims == (5, 8, 2)
    assert mlp_spec_of(Steps()).dims == (5, 8, 8, 2)
    assert mlp_spec_of(OtherSelf()).dims == (5, 8, 8, 2)
    for module in (Tanh(), Branch(), Unused(), Twice(), Residual(), Counts(), Flag(), Outer(),
                   OwnFunction(),
                   nn.Sequential(nn.Linear(5, 8), nn.ReLU()),  # ends on a ReLU
                   nn.Sequential(nn.Linear(5, 8, bias=False), nn.ReLU(), nn.Linear(8, 2)),
                   nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 2)).double()):
        assert mlp_spec_of(module) is None, type(module).__name__
    hooked = Three()
    hooked.register_forward_hook(lambda *args: None)  # on the container itself
    assert mlp_spec_of(hooked) is None


def test_a_factory_that_cannot_take_the_sizes_is_one_clear_error():
    from engine.errors import ConfigError
    from engine.nn.model_names import build

    class NoSizes(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 2)

    with pytest.raises(ConfigError, match=r"^model mine: a model factory is called as "
                       r"NoSizes\(n_features, n_classes\), here NoSizes\(4, 2\), but "
                       r"NoSizes\(\) does not take them"):
        build(NoSizes, 4, 2, "mine")
    assert isinstance(build(nn.Linear, 4, 2, "mine"), nn.Linear)  # (in, out, bias=True)
    assert isinstance(build(lambda *sizes: nn.Linear(*sizes), 4, 2, "mine"), nn.Linear)


@pytest.mark.mpi(min_size=2)
def test_a_model_that_differs_between_ranks_is_refused_on_every_rank(data, comm):
    torch.manual_seed(comm.Get_rank())  # the user's mistake: a different draw per rank
    model = nn.Linear(FEATURES, 2)
    with pytest.raises(ConfigError, match="initial parameters differ between ranks") as info:
        engine.train(data, model=model, comm=comm, epochs=1, noise_multiplier=1.0,
                     quiet=True)
    assert info.value.collective


class FrozenBody(nn.Module):
    """A frozen feature extractor (its Linear) under a trained head."""

    def __init__(self, n_features, n_classes):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(n_features, 16), nn.Tanh())
        self.body.requires_grad_(False)
        self.head = nn.Linear(16, n_classes)

    def forward(self, x):
        return self.head(self.body(x))


@pytest.mark.mpi(min_size=1)
def test_frozen_layers_stay_as_built_and_the_rest_trains(data, comm, shared_tmp):
    """Frozen parameters are constants (as the factory built them, under the
    run's seed): the head trains, the checkpoint records what was frozen, a
    resume goes on; a rank whose frozen weights differ is refused."""
    from engine.models import seeded

    common = dict(comm=comm, epochs=2, batch_size=100, noise_multiplier=1.0, seed=3,
                  quiet=True, checkpoint_dir=str(shared_tmp / "frozen"))
    built = seeded(3, lambda: FrozenBody(FEATURES, 2))
    stopped = engine.train(data, model=FrozenBody, stop_after=4, **common)
    assert stopped.exit_code == 75
    run = engine.train(data, model=FrozenBody, resume=True, comm=comm, quiet=True,
                       checkpoint_dir=common["checkpoint_dir"])
    assert run.exit_code == 0 and run.history[-1]["test_accuracy"] > 0.6
    assert torch.equal(run.model.body[0].weight, built.body[0].weight)
    assert not torch.equal(run.model.head.weight, built.head.weight)
    assert [n for n, _ in run.model.named_parameters()] == ["head.weight", "head.bias"]
    payload = torch.load(shared_tmp / "frozen" / "checkpoint.pt",
                         weights_only=True)
    assert payload["model"]["frozen"]["names"] == ["body.0.weight", "body.0.bias"]
    if comm.Get_size() > 1:
        def differs(f, c):
            model = FrozenBody(f, c)
            if comm.Get_rank() == comm.Get_size() - 1:
                model.body[0].weight.data.add_(1.0)
            return model

        with pytest.raises(ConfigError, match="initial parameters differ between ranks"):
            engine.train(data, model=differs, comm=comm, epochs=1, noise_multiplier=1.0,
                         quiet=True)


def test_eval_rebuilds_frozen_layers_only_as_they_were():
    """mpidp eval calls the factory again: the same frozen constants, or one
    line saying they differ (never a model evaluated with other weights)."""
    from engine.models import TorchModel, checkpoint_logits, seeded

    recorded_model = seeded(3, lambda: FrozenBody(FEATURES, 2))
    model = TorchModel(recorded_model, "test_engine_models:FrozenBody")
    recorded = model.to_dict()
    params = torch.cat([p.detach().reshape(-1) for p in recorded_model.parameters()])
    rows = torch.randn(5, FEATURES + 1)
    torch.manual_seed(3)  # the factory draws its frozen layer: seeded as in training
    named = "test_engine_models:FrozenBody"  # as `mpidp eval --model` names it
    logits = checkpoint_logits(recorded, params, FEATURES, 2, "run", model=named)(rows)
    with torch.no_grad():
        assert torch.allclose(logits, recorded_model(rows[:, :-1]))
    torch.manual_seed(4)
    with pytest.raises(ConfigError, match=r"^run: test_engine_models:FrozenBody builds other "
                       r"frozen parameters than the run trained with"):
        checkpoint_logits(recorded, params, FEATURES, 2, "run", model=named)


class Resizable(nn.Module):
    """A model that is no fused MLP (Tanh), whose width a test may change."""

    WIDTH = 8

    def __init__(self, n_features, n_classes):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(n_features, self.WIDTH), nn.Tanh(),
                                 nn.Linear(self.WIDTH, n_classes))

    def forward(self, x):
        return self.net(x)


def test_eval_says_why_a_users_model_cannot_be_built_again(monkeypatch):
    """A factory that does not import where eval runs, or that builds another
    model since the run: one line naming the cause (it blamed the data file)."""
    from engine.models import TorchModel, checkpoint_logits

    trained = Resizable(FEATURES, 2)
    recorded = TorchModel(trained, "test_engine_models:Resizable").to_dict()
    params = torch.cat([p.detach().reshape(-1) for p in trained.parameters()])
    named = "test_engine_models:Resizable"  # as `mpidp eval --model` names it
    assert checkpoint_logits(recorded, params, FEATURES, 2, "run", model=named)(
        torch.randn(3, FEATURES + 1)).shape == (3, 2)
    elsewhere = dict(recorded, name="not_importable_here:Resizable")
    with pytest.raises(ConfigError, match=r"^run: the run's model not_importable_here:"
                       r"Resizable cannot be built again: cannot import 'not_importable_here'"
                       r".*: run it where the module imports"):
        checkpoint_logits(elsewhere, params, FEATURES, 2, "run",
                          model="not_importable_here:Resizable")
    monkeypatch.setattr(Resizable, "WIDTH", 9)  # the factory changed since the run
    with pytest.raises(ConfigError, match=r"first difference: net.0.weight \[8, \d+\] in the "
                       r"checkpoint, net.0.weight \[9, \d+\] now\): either test_engine_models:"
                       r"Resizable builds another model than the run trained \(changed "
                       r"since\?\), or this file is prepared unlike"):
        checkpoint_logits(recorded, params, FEATURES, 2, "run", model=named)


class FailsOnTheLastRank(nn.Module):
    """A forward pass that fails on one rank's rows only (here: by its rank)."""

    def __init__(self, n_features, n_classes):
        super().__init__()
        self.fc = nn.Linear(n_features, n_classes)

    def forward(self, x):
        from collectives import MPI
        world = MPI.COMM_WORLD
        if world.Get_rank() == world.Get_size() - 1:
            raise ValueError("no rows like these")
        return self.fc(x)


@pytest.mark.mpi(min_size=1)
def test_a_model_refused_on_one_rank_is_refused_on_every_rank_once(data, comm):
    """Each rank probes the model with its own rows: a refusal on one rank is
    raised on all (collective: printed once by rank 0, no rank aborts)."""
    last = comm.Get_size() - 1
    where = f" \\(on rank {last}\\)$" if last else "$"
    with pytest.raises(ConfigError, match=r"forward pass fails .*ValueError: no rows "
                       r"like these" + where) as info:
        engine.train(data, model=FailsOnTheLastRank, comm=comm, epochs=1,
                     noise_multiplier=1.0, quiet=True)
    assert info.value.collective


@pytest.mark.mpi(min_size=1)
def test_resuming_with_another_model_is_refused(data, comm, shared_tmp):
    run_dir = str(shared_tmp / "run")
    common = dict(comm=comm, epochs=2, batch_size=100, noise_multiplier=1.0, seed=3,
                  quiet=True, checkpoint_dir=run_dir)
    assert engine.train(data, model=Small, stop_after=3, **common).exit_code == 75
    with pytest.raises((CheckpointError, ConfigError), match="model"):
        engine.train(data, resume=True, **common)  # the MLP, not the checkpoint's Small
    with pytest.raises(CheckpointError, match="another model.*python:Small"):
        engine.train(data, model=lambda f, c: Small(f, c + 0), resume=True, **common)
    done = engine.train(data, model=Small, resume=True, **common)
    assert done.exit_code == 0 and len(done.history) == 2


def test_model_output_of_the_wrong_shape_is_one_error(tmp_path):
    path = synthetic.write(tmp_path / "d.h5", rows=300, features=FEATURES, seed=1)
    with pytest.raises(ConfigError, match=r"returns \(4, 5\).*\[rows, 2\]"):
        engine.train(path, model=lambda f, c: nn.Linear(f, 5), epochs=1,
                     noise_multiplier=1.0, quiet=True)


FACTORY = """
import torch

def small(n_features, n_classes):
    return torch.nn.Sequential(torch.nn.Linear(n_features, 8), torch.nn.ReLU(),
                               torch.nn.Linear(8, n_classes))

def broken(n_features, n_classes):
    raise ValueError("no model today")
"""


def test_model_from_the_command_line(tmp_path, capsys, monkeypatch):
    from engine.cli import main

    data = synthetic.write(tmp_path / "d.h5", rows=1200, features=FEATURES, seed=2)
    (tmp_path / "my_models.py").write_text(FACTORY)
    args = ("train", "--data", data, "--epochs", "1", "--batch-size", "100",
            "--noise-multiplier", "1", "--seed", "0", "--no-progress")
    good = mpidp(2, *args, "--model", "my_models:small", "--metrics",
                 str(tmp_path / "m.jsonl"), "--checkpoint-dir", str(tmp_path / "run"),
                 cwd=str(tmp_path), timeout=240)
    assert good.returncode == 0, good.stderr[-2000:]
    assert "Sequential (my_models:small, 106 parameters, clipping by the fused MLP kernels)" \
        in good.stdout
    # eval rebuilds the model from its factory; the audit says it attacks MLPs only
    import json

    last = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[-1])
    scored = mpidp(2, "eval", "--checkpoint", str(tmp_path / "run"), "--data", data,
                   "--model", "my_models:small", "--json", cwd=str(tmp_path), timeout=240)
    assert scored.returncode == 0, scored.stderr[-2000:]
    assert json.loads(scored.stdout)["accuracy"] == pytest.approx(last["test_accuracy"])
    monkeypatch.chdir(tmp_path)  # where a user's factory module is found, as above
    monkeypatch.setitem(sys.modules, "my_models", None)  # restored (removed) at the end
    del sys.modules["my_models"]  # imported afresh from tmp_path below
    capsys.readouterr()  # the audit refuses before any work: in this process
    with pytest.raises(SystemExit) as stopped:
        main(["audit", "--checkpoint", str(tmp_path / "run"), "--data", data])
    stderr = capsys.readouterr().err
    assert stopped.value.code == 2 and "`mpidp audit` attacks mpidp's MLPs only" in stderr
    for model, message in [("my_models:broken", "the factory raised ValueError: no model today"),
                           ("nope_models:small", "cannot import 'nope_models'"),
                           ("mlp2", "choose mlp, logreg, embedding-mlp, mnist-small, mnist-large, resnet20 or MODULE:FACTORY")]:
        # a refused model is refused before any rank trains: one rank shows it,
        # through the console's entry point in this process (no start-up to pay)
        capsys.readouterr()
        with pytest.raises(SystemExit) as stopped:
            main([*args, "--model", model])
        stderr = capsys.readouterr().err
        assert stopped.value.code == 2, stderr[-2000:]
        assert message in stderr and "Traceback" not in stderr


class Scaling(nn.Module):
    """Changes its input in place (as ``x /= 255`` does), with an in-place ReLU
    after a Linear: the per-layer path's forward runs again once it sees that."""

    def __init__(self, n_features, n_classes):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(n_features, 8), nn.ReLU(inplace=True),
                                 nn.Linear(8, n_classes))

    def forward(self, x):
        x.mul_(2.0)
        return self.net(x)


class ScalingCopy(Scaling):
    def forward(self, x):
        return self.net(x * 2.0)


@pytest.mark.mpi(min_size=1)
def test_a_model_changing_its_input_in_place_trains_as_one_that_copies(data, comm):
    """Neither the training rows (the probe's among them), nor the validation
    and test rows, nor a step's forward pass run again see the change."""
    common = dict(comm=comm, epochs=3, batch_size=100, noise_multiplier=1.0, seed=5,
                  quiet=True, allreduce="ring")  # auto may pick another sum order
    changing = engine.train(data, model=Scaling, **common)
    copying = engine.train(data, model=ScalingCopy, **common)
    def figures(run):
        return [{k: v for k, v in h.items() if k.endswith(("loss", "accuracy", "fraction"))}
                for h in run.history]

    assert figures(changing) == figures(copying) and "test_accuracy" in figures(changing)[0]
    for a, b in zip(changing.model.parameters(), copying.model.parameters()):
        assert torch.equal(a, b)
