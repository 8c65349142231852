"""ModuleEngine: any torch model behind the fused MLP's interface, and the
model checks and factories a user meets first (serial: no ranks involved)."""
import warnings

import pytest
import torch
from torch import nn

from engine.dp.naive import naive_clipped_sum
from engine.dp.rules import SlowPathWarning
from engine.errors import ConfigError
from engine.nn import factories
from engine.nn.module_engine import ModuleEngine, parameter_digest

F_IN, CLASSES = 6, 3


def _rows(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.cat([torch.randn(n, F_IN, generator=g), torch.ones(n, 1)], 1)
    return X, torch.randint(0, CLASSES, (n,), generator=g)


class Tied(nn.Module):
    """One Linear applied twice: the per-layer rules cannot serve it."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(F_IN, F_IN)
        self.head = nn.Linear(F_IN, CLASSES)

    def forward(self, x):
        return self.head(torch.tanh(self.inner(torch.tanh(self.inner(x)))))


def _models():
    torch.manual_seed(0)
    return {
        "mlp": nn.Sequential(nn.Linear(F_IN, 8), nn.ReLU(), nn.Linear(8, CLASSES)),
        "layernorm": nn.Sequential(nn.Linear(F_IN, 8), nn.LayerNorm(8), nn.Tanh(),
                                   nn.Linear(8, CLASSES)),
        "tied": Tied(),
    }


@pytest.mark.parametrize("name", ["mlp", "layernorm", "tied"])
@pytest.mark.parametrize("C", [None, 0.05, 1e6])
def test_clipped_sums_match_the_naive_loop(name, C):
    model = _models()[name]
    reference = _models()[name]
    X, y = _rows(40)
    grad = torch.zeros(sum(p.numel() for p in model.parameters()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = ModuleEngine(model, grad, (X[:4], y[:4]), CLASSES)
    assert engine.rule == ("torch.func" if name == "tied" else "per-layer rules")
    slow = [str(w.message) for w in caught if w.category is SlowPathWarning]
    if name == "tied":  # the whole model through torch.func, and why
        assert len(slow) == 1 and "layer 'inner' (Linear) runs 2 times" in slow[0]
    else:
        assert not slow
    rows = torch.tensor([0, 3, 4, 9, 17, 31, 39])
    k = engine.load(X, y, rows)
    loss, clipped = engine.clipped_sum(k, C)
    want, want_loss, want_clipped = naive_clipped_sum(reference, X[rows, :-1], y[rows], C)
    assert torch.allclose(grad, want, rtol=1e-4, atol=1e-6)
    assert loss == pytest.approx(want_loss, rel=1e-5) and clipped == want_clipped
    assert engine.load(X, y, rows[:0]) == 0 and engine.clipped_sum(0, C) == (0.0, 0)
    assert not grad.any()


def test_parameters_are_views_of_one_flat_vector():
    model = _models()["mlp"]
    X, y = _rows(10)
    engine = ModuleEngine(model, torch.zeros(sum(p.numel() for p in model.parameters())),
                          (X[:2], y[:2]), CLASSES)
    before = engine.logits(X)
    digest = parameter_digest(engine.params)
    engine.params.mul_(0.0)  # what an optimizer step does, in place
    assert not engine.logits(X).equal(before) and not model[0].weight.any()
    assert parameter_digest(engine.params) != digest


def test_logits_are_computed_in_eval_mode_and_training_mode_is_restored():
    model = nn.Sequential(nn.Linear(F_IN, 8), nn.Dropout(0.9), nn.Linear(8, CLASSES))
    X, y = _rows(50)
    engine = ModuleEngine(model, torch.zeros(sum(p.numel() for p in model.parameters())),
                          (X[:2], y[:2]), CLASSES)
    assert engine.logits(X).equal(engine.logits(X)) and model.training


def _engine(model, X=None):
    X, y = _rows(4) if X is None else X
    return ModuleEngine(model, torch.zeros(sum(p.numel() for p in model.parameters())),
                        (X, y), CLASSES)


@pytest.mark.parametrize("model, message", [
    (nn.Linear(F_IN, CLASSES + 1), r"returns \(4, 4\).*\[rows, 3\]"),
    (nn.Linear(F_IN + 1, CLASSES), "forward pass fails on 4 rows of 6 features"),
    (nn.Sequential(nn.Linear(F_IN, 4), nn.BatchNorm1d(4), nn.Linear(4, CLASSES)),
     "BatchNorm1d.*mixes the examples"),
    (nn.Linear(F_IN, CLASSES).double(), "float64.*model.float"),
    (nn.ReLU(), "no parameters"),
])
def test_models_dp_sgd_cannot_train_are_refused_with_the_reason(model, message):
    with pytest.raises(ConfigError, match=message):
        _engine(model)


def test_frozen_parameters_are_refused():
    model = nn.Sequential(nn.Linear(F_IN, 4), nn.Linear(4, CLASSES))
    model[0].weight.requires_grad_(False)
    with pytest.raises(ConfigError, match="'0.weight' is frozen"):
        _engine(model)


def test_factory_names_and_failures_are_one_line_errors(tmp_path, monkeypatch):
    (tmp_path / "my_models.py").write_text(
        "import torch\n"
        "def good(n_features, n_classes):\n"
        "    return torch.nn.Linear(n_features, n_classes)\n"
        "def raises(n_features, n_classes):\n"
        "    raise RuntimeError('out of ideas')\n"
        "def not_a_module(n_features, n_classes):\n"
        "    return 42\n"
        "value = 3\n")
    (tmp_path / "broken_models.py").write_text("import no_such_package_xyz\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    model = factories.build(factories.load_factory("my_models:good"), F_IN, CLASSES, "x")
    assert isinstance(model, nn.Linear) and model.out_features == CLASSES
    for name, message in [
        ("my_models", "choose mlp, logreg, embedding-mlp, mnist-small, mnist-large, resnet20 or MODULE:FACTORY"),
        ("broken_models:good", "cannot import 'broken_models': ModuleNotFoundError"),
        ("my_models:missing", "has no 'missing'"),
        ("my_models:value", "'value' is not callable"),
    ]:
        with pytest.raises(ConfigError, match=message):
            factories.load_factory(name)
    for name, message in [("my_models:raises", "factory raised RuntimeError: out of ideas"),
                          ("my_models:not_a_module", "returned int, not a torch.nn.Module")]:
        with pytest.raises(ConfigError, match=message):
            factories.build(factories.load_factory(name), F_IN, CLASSES, name)


class Wrapped(nn.Module):
    """The same layers as a Sequential, behind a forward of its own: the hooks' path."""

    def __init__(self, seq):
        super().__init__()
        self.seq = seq

    def forward(self, x):
        return self.seq(x)


def test_a_plain_sequential_is_run_layer_by_layer_with_the_same_sums_and_hooks(monkeypatch):
    """A plain nn.Sequential of leaf layers is called layer by layer (no global
    forward hook, torch's slow path); a subclass, a wrapper or a hook on the
    Sequential itself takes the hooks' path. Both give the naive loop's sums
    bit for bit alike, and a user's hooks run in either."""
    from engine.dp.clipping import LayerClipper, _plain_chain

    X, y = _rows(40)
    x, labels = X[:23, :-1], y[:23]
    assert _plain_chain(_models()["mlp"]) is not None
    assert _plain_chain(Wrapped(_models()["mlp"])) is None
    assert _plain_chain(type("Sub", (nn.Sequential,), {})(nn.Linear(2, 2))) is None
    assert _plain_chain(nn.Sequential(nn.Sequential(nn.Linear(2, 2)))) is None
    sums = {}
    for how in ("chain", "wrapped", "own hook"):
        seq = _models()["mlp"]
        seen = []
        seq[0].register_forward_hook(lambda m, i, o: seen.append("child"))
        if how == "own hook":
            seq.register_forward_hook(lambda m, i, o: seen.append("own"))
        clipper = LayerClipper(Wrapped(seq) if how == "wrapped" else seq)
        with monkeypatch.context() as patch:
            if how == "chain":  # no global hook on this path
                patch.setattr(nn.modules.module, "register_module_forward_hook", None)
            loss, clipped = clipper.clipped_sum(x, labels, 0.05)
        sums[how] = (clipper.grad.clone(), loss, clipped)
        assert seen == (["child", "own"] if how == "own hook" else ["child"]), how
    want, want_loss, want_clipped = naive_clipped_sum(_models()["mlp"], x, labels, 0.05)
    for grad, loss, clipped in sums.values():
        assert torch.equal(grad, sums["chain"][0])
        assert torch.allclose(grad, want, rtol=1e-4, atol=1e-6)
        assert loss == pytest.approx(want_loss, rel=1e-5) and clipped == want_clipped
