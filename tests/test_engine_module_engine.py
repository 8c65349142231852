"""ModuleEngine: any torch model behind the fused MLP's interface, and the
model checks and factories a user meets first (serial: no ranks involved)."""
import warnings

import pytest
import torch
from torch import nn

from engine.dp.naive import naive_clipped_sum
from engine.dp.rules import SlowPathWarning
from engine.errors import ConfigError
from engine.nn import model_names
from engine.dp.module_engine import ModuleEngine, frozen_to_buffers, parameter_digest

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


class TiedWithDropout(Tied):
    """Tied (the whole-model torch.func path) with a Dropout, or a functional one."""

    def __init__(self, functional: bool = False):
        super().__init__()
        self.drop = None if functional else nn.Dropout(0.2)

    def forward(self, x):
        h = torch.tanh(self.inner(torch.tanh(self.inner(x))))
        h = nn.functional.dropout(h, 0.2, self.training) if self.drop is None else self.drop(h)
        return self.head(h)


@pytest.mark.parametrize("functional", [False, True], ids=["module", "functional"])
def test_random_draws_on_the_whole_model_path_are_refused_before_training(functional):
    """vmap cannot draw per example: refused at once, in one line naming the
    layer, why the model takes that path and what to do; in eval mode (no
    draws) and on the per-layer path the same Dropout trains."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowPathWarning)
        with pytest.raises(ConfigError) as caught:
            _engine(TiedWithDropout(functional))
        message = str(caught.value)
        assert "\n" not in message
        assert message.startswith("the model draws" if functional else
                                  "layer 'drop' (Dropout) draws random numbers in training")
        assert "layer 'inner' (Linear) runs 2 times" in message
        assert "or remove the random layer" in message
        engine = _engine(TiedWithDropout(functional).eval())
    X, y = _rows(8)
    engine.load(X, y, torch.arange(8))
    engine.clipped_sum(8, 1.0)
    per_layer = _engine(nn.Sequential(nn.Linear(F_IN, 8), nn.Dropout(0.5),
                                      nn.Linear(8, CLASSES)))
    per_layer.load(X, y, torch.arange(8))
    per_layer.clipped_sum(8, 1.0)
    assert per_layer.rule == "per-layer rules"


def test_frozen_parameters_reach_the_checks_only_as_buffers():
    """ModuleEngine turns frozen parameters into buffers first
    (tests/test_engine_rules.py); check_model still refuses one that was not."""
    from engine.dp.module_engine import check_model

    model = nn.Sequential(nn.Linear(F_IN, 4), nn.Linear(4, CLASSES))
    model[0].weight.requires_grad_(False)
    with pytest.raises(ConfigError, match="'0.weight' is frozen"):
        check_model(model, torch.device("cpu"), torch.float32)
    assert frozen_to_buffers(model) == ["0.weight"] and frozen_to_buffers(model) == []
    check_model(model, torch.device("cpu"), torch.float32)


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
    model = model_names.build(model_names.load_factory("my_models:good"), F_IN, CLASSES, "x")
    assert isinstance(model, nn.Linear) and model.out_features == CLASSES
    for name, message in [
        ("my_models", "choose mlp, logreg, embedding-mlp, mnist-small, mnist-large, resnet20 or MODULE:FACTORY"),
        ("broken_models:good", "cannot import 'broken_models': ModuleNotFoundError"),
        ("my_models:missing", "has no 'missing'"),
        ("my_models:value", "'value' is not callable"),
    ]:
        with pytest.raises(ConfigError, match=message):
            model_names.load_factory(name)
    for name, message in [("my_models:raises", "factory raised RuntimeError: out of ideas"),
                          ("my_models:not_a_module", "returned int, not a torch.nn.Module")]:
        with pytest.raises(ConfigError, match=message):
            model_names.build(model_names.load_factory(name), F_IN, CLASSES, name)
    # engine.train(model=42): it was called, and the TypeError quoted as the factory's
    with pytest.raises(ConfigError, match=r"model python:int: an object of type int is "
                       r"neither a torch.nn.Module nor a factory"):
        model_names.build(42, F_IN, CLASSES, "python:int")


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
    from engine.dp.clipping import LayerClipper
    from engine.dp.flat_model import plain_chain

    X, y = _rows(40)
    x, labels = X[:23, :-1], y[:23]
    assert plain_chain(_models()["mlp"]) is not None
    assert plain_chain(Wrapped(_models()["mlp"])) is None
    assert plain_chain(type("Sub", (nn.Sequential,), {})(nn.Linear(2, 2))) is None
    assert plain_chain(nn.Sequential(nn.Sequential(nn.Linear(2, 2)))) is None
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


def _chains(dtype):
    torch.manual_seed(1)
    kw = {"dtype": dtype}
    return {
        "mlp": nn.Sequential(nn.Linear(F_IN, 8, **kw), nn.ReLU(), nn.Linear(8, CLASSES, **kw)),
        "in-place relu, three linears": nn.Sequential(
            nn.Linear(F_IN, 8, **kw), nn.ReLU(inplace=True), nn.Linear(8, 8, **kw), nn.ReLU(),
            nn.Linear(8, CLASSES, **kw)),
        "relu first, twice in a row, last": nn.Sequential(
            nn.ReLU(), nn.Linear(F_IN, 8, **kw), nn.ReLU(), nn.ReLU(),
            nn.Linear(8, CLASSES, **kw), nn.ReLU()),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(_chains(torch.float32)))
@pytest.mark.parametrize("C", [None, 0.05, 1e6])
def test_an_mlp_chain_is_differentiated_by_hand_with_autograds_numbers(monkeypatch, dtype,
                                                                       name, C):
    """A plain Sequential of Linear and ReLU layers goes backward without
    autograd (g W through each Linear, the relu_backward kernel through each
    ReLU): the same sums, loss and clipped count as the autograd pass, bit for
    bit, and the naive loop's within rounding."""
    from engine.dp.clipping import LayerClipper

    X, y = _rows(40)
    x, labels = X[:29, :-1].to(dtype), y[:29]
    given = x.clone()
    results = {}
    for by_hand in (True, False):
        clipper = LayerClipper(_chains(dtype)[name])
        assert clipper._by_hand
        clipper._by_hand = by_hand
        with monkeypatch.context() as patch:
            if by_hand:  # no autograd at all on this path
                patch.setattr(torch.autograd, "grad", None)
            loss, clipped = clipper.clipped_sum(x, labels, C)
        results[by_hand] = (clipper.grad.clone(), loss, clipped)
        # ReLUs run in place only on what a Linear just made, never on the input
        assert torch.equal(x, given)
    assert torch.equal(results[True][0], results[False][0])
    assert results[True][1:] == results[False][1:]
    want, want_loss, want_clipped = naive_clipped_sum(_chains(dtype)[name], x, labels, C)
    tol = dict(rtol=1e-4, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-10, atol=0)
    assert torch.allclose(results[True][0], want, **tol)
    assert results[True][1] == pytest.approx(want_loss, rel=1e-5)
    assert results[True][2] == want_clipped


def test_other_chains_and_hooked_layers_keep_autograd(monkeypatch):
    """By hand only for exact Linear and ReLU types used once, with no hook:
    any other layer, a subclass, a reused layer or a layer's own hook (which
    could change an output or must see the backward) keeps the autograd pass."""
    from engine.dp.clipping import LayerClipper

    class MyLinear(nn.Linear):
        pass

    shared = nn.Linear(8, 8)
    assert not LayerClipper(nn.Sequential(nn.Linear(F_IN, 8), nn.Tanh(),
                                          nn.Linear(8, CLASSES)))._by_hand
    with pytest.warns(SlowPathWarning, match="MyLinear"):  # a subclass: no rule either
        assert not LayerClipper(nn.Sequential(MyLinear(F_IN, CLASSES)))._by_hand
    assert not LayerClipper(nn.Sequential(nn.Linear(F_IN, 8), shared, nn.ReLU(),
                                          shared))._by_hand
    X, y = _rows(20)
    with pytest.raises(ValueError, match="ran 2 times"):  # as the hooks' path says
        LayerClipper(nn.Sequential(nn.Linear(F_IN, 8), shared, nn.ReLU(),
                                   shared)).clipped_sum(X[:, :-1], y, 1.0)
    for hook in ("forward", "full backward"):
        seq = _chains(torch.float32)["mlp"]
        seen = []
        if hook == "forward":
            seq[1].register_forward_hook(lambda m, i, o: seen.append(hook))
        else:
            seq[1].register_full_backward_hook(lambda m, gi, go: seen.append(hook))
        clipper = LayerClipper(seq)
        assert clipper._by_hand  # the chain qualifies; the hook decides at each call
        with monkeypatch.context() as patch:
            patch.setattr(type(clipper), "_chain_pass", None)
            clipper.clipped_sum(X[:, :-1], y, 0.05)
        assert seen == [hook]


def test_an_output_changed_in_place_gets_the_gradient_at_the_layers_output():
    """nn.ReLU(inplace=True) after a Linear changes the Linear's output in
    place: the autograd pass (a wrapped model's global hook, or a chain with a
    hook) must still take the gradient at the Linear's output, not at the
    ReLU's. Against the naive loop on the same model without in-place."""
    from engine.dp.clipping import LayerClipper

    def model(inplace):
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(F_IN, 8), nn.ReLU(inplace=inplace), nn.Linear(8, 8),
                             nn.ReLU(inplace=inplace), nn.Linear(8, CLASSES))

    X, y = _rows(30)
    x, labels = X[:, :-1], y
    want, want_loss, want_clipped = naive_clipped_sum(model(False), x, labels, 0.05)
    hooked = model(True)
    hooked[4].register_forward_hook(lambda m, i, o: None)  # the chain's autograd pass
    for clipper in (LayerClipper(Wrapped(model(True))), LayerClipper(hooked)):
        for _ in range(2):  # the first call finds the change, the second copies at once
            loss, clipped = clipper.clipped_sum(x, labels, 0.05)
            assert torch.allclose(clipper.grad, want, rtol=1e-4, atol=1e-6)
            assert loss == pytest.approx(want_loss, rel=1e-5) and clipped == want_clipped
        assert clipper._copy_outputs
