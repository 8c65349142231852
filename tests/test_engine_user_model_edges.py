"""User models at the edges of what per-example clipping can serve: a forward
that mixes the examples of a batch (refused), one parameter in two layers
(tied weights: the whole-model torch.func path, never the fused MLP or the
per-layer rules), and logits in half precision (refused). Every model that
trains is checked against the naive per-example loop (serial: no ranks)."""
import warnings

import pytest
import torch
from torch import nn

from engine.dp.clipping import LayerClipper
from engine.dp.module_engine import ModuleEngine, _refuse_mixing
from engine.dp.naive import naive_clipped_sum
from engine.dp.rules import SlowPathWarning
from engine.errors import ConfigError
from engine.models import TorchModel, mlp_linears_of

F_IN, CLASSES = 6, 3


def _rows(n, seed=0):
    """``n`` rows with the trailing ones column (as the engine loads them), labels."""
    g = torch.Generator().manual_seed(seed)
    X = torch.cat([torch.randn(n, F_IN, generator=g), torch.ones(n, 1)], 1)
    return X, torch.randint(0, CLASSES, (n,), generator=g)


def _engine(model, n_probe=4):
    X, y = _rows(n_probe)
    grad = torch.zeros(sum(p.numel() for p in model.parameters()))
    return ModuleEngine(model, grad, (X, y), CLASSES)


def _check_against_naive_loop(engine, reference, C, n=24):
    """The engine's clipped sum of ``n`` rows against the per-example loop on
    ``reference`` (a copy of the model as built)."""
    X, y = _rows(n, seed=1)
    engine.load(X, y, torch.arange(n))
    loss, clipped = engine.clipped_sum(n, C)
    want, want_loss, want_clipped = naive_clipped_sum(reference, X[:, :-1], y, C)
    assert torch.allclose(engine.grad, want, rtol=1e-5, atol=1e-6), \
        float((engine.grad - want).abs().max())
    assert loss == pytest.approx(want_loss, rel=1e-5)
    assert clipped == want_clipped


# -- a forward that mixes the examples of a batch -------------------------------------

class Centre(nn.Module):
    """Centres each batch (``x - x.mean(0)``): one row's logits depend on every row."""

    def __init__(self, training_only=False, dropout=0.0):
        super().__init__()
        self.training_only = training_only
        self.drop = nn.Dropout(dropout)
        self.l, self.o = nn.Linear(F_IN, 16), nn.Linear(16, CLASSES)

    def forward(self, x):
        if self.training or not self.training_only:
            x = x - x.mean(0, keepdim=True)
        return self.o(self.drop(torch.tanh(self.l(x))))


class BySize(nn.Module):
    """Scales by the batch's size: no row's values mix, its size does."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(F_IN, CLASSES)

    def forward(self, x):
        return self.l(x) / x.shape[0]


class Noisy(nn.Module):
    """Adds noise of its own in every mode: random, but per example."""

    def __init__(self):
        super().__init__()
        self.l, self.o = nn.Linear(F_IN, 16), nn.Linear(16, CLASSES)

    def forward(self, x):
        return self.o(torch.tanh(self.l(x) + 0.1 * torch.randn(x.shape[0], 16)))


@pytest.mark.parametrize("model, mode, cause", [
    (Centre(), "training", "another row of the batch changes"),
    (Centre().eval(), "eval", "another row of the batch changes"),
    (Centre(training_only=True), "training", "another row of the batch changes"),
    (Centre(dropout=0.5), "training", "another row of the batch changes"),
    (BySize(), "training", "the batch has one row fewer"),
], ids=["centre", "centre-eval", "centre-in-training", "centre-after-dropout", "by-size"])
def test_a_forward_that_mixes_the_examples_is_refused_in_one_line(model, mode, cause):
    """Per-example clipping bounds nothing there: refused before training,
    naming the cause as BatchNorm's refusal does; the probe leaves torch's
    generators and the modules' modes as they were."""
    modes = [m.training for m in model.modules()]
    with pytest.raises(ConfigError) as caught:
        _engine(model)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"the model mixes the examples of a batch: in {mode} mode one "
                              f"row's logits change when {cause}")
    rng = torch.get_rng_state()
    with pytest.raises(ConfigError, match="mixes the examples"):
        _refuse_mixing(model, _rows(4)[0][:, :-1])
    assert torch.equal(torch.get_rng_state(), rng)
    assert [m.training for m in model.modules()] == modes


def test_the_refused_mixing_moves_the_clipped_sum_by_more_than_the_bound():
    """Why it is refused: on the per-layer rules, one outlying row moves the
    clipped sum of a centred model by several C (adding or removing one row
    moves a per-example loop's sum by C at most)."""
    torch.manual_seed(0)
    model = Centre()
    clipper = LayerClipper(model)
    X, y = _rows(50)
    x = X[:, :-1].clone()
    x[0] = 1000.0
    clipper.clipped_sum(x, y, 1.0)
    with_row = clipper.grad.clone()
    clipper.clipped_sum(x[1:], y[1:], 1.0)
    assert float((with_row - clipper.grad).norm()) > 2.0


@pytest.mark.parametrize("build", [
    lambda: nn.Sequential(nn.Linear(F_IN, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(),
                          nn.Linear(512, CLASSES)),
    lambda: Centre(training_only=True).eval(),
], ids=["wide", "centre-in-training-given-in-eval"])
@pytest.mark.parametrize("C", [None, 0.05])
def test_per_example_models_pass_the_probe_and_match_the_naive_loop(build, C):
    """Float rounding (a GEMM blocked for another row count) is no mixing,
    and a model given in eval mode is probed (and trained) in eval mode."""
    torch.manual_seed(0)
    model = build()
    torch.manual_seed(0)
    reference = build()
    engine = _engine(model, n_probe=64)
    _check_against_naive_loop(engine, reference, C)


@pytest.mark.parametrize("build", [
    lambda: nn.Sequential(nn.Linear(F_IN, 16), nn.Dropout(0.5), nn.Tanh(),
                          nn.Linear(16, CLASSES)),
    Noisy,
], ids=["dropout", "noise"])
def test_random_draws_are_not_taken_for_mixing(build):
    """A random layer draws other numbers for another batch: the probe draws
    alike for the same shape, and compares other shapes in eval mode only."""
    torch.manual_seed(0)
    model = build()
    rng = torch.get_rng_state()
    _refuse_mixing(model, _rows(8)[0][:, :-1])
    assert torch.equal(torch.get_rng_state(), rng) and model.training
    assert _engine(model, n_probe=8).rule == "per-layer rules"


# -- one parameter in two layers --------------------------------------------------------

class TiedWeight(nn.Module):
    """``c.weight`` is ``b.weight``: one parameter, two layers."""

    def __init__(self, bias_too=False):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(F_IN, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.c.weight = self.b.weight
        if bias_too:
            self.c.bias = self.b.bias
        self.o = nn.Linear(8, CLASSES)

    def forward(self, x):
        return self.o(torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))))


def _tied_chain():
    """An MLP in form (Linear, ReLU, ...) but with a tied weight: not the fused MLP."""
    a, b, c, o = nn.Linear(F_IN, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, CLASSES)
    c.weight = b.weight
    return nn.Sequential(a, nn.ReLU(), b, nn.ReLU(), c, nn.ReLU(), o)


_TIED = {"class": TiedWeight, "class-bias-too": lambda: TiedWeight(bias_too=True),
         "relu-chain": _tied_chain}


@pytest.mark.parametrize("name", list(_TIED))
@pytest.mark.parametrize("C", [None, 0.05, 1e6])
def test_tied_weights_are_clipped_through_torch_func_as_the_naive_loop(name, C):
    torch.manual_seed(0)
    model = _TIED[name]()
    torch.manual_seed(0)
    reference = _TIED[name]()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = _engine(model)
    assert engine.rule == "torch.func"
    slow = [str(w.message) for w in caught if w.category is SlowPathWarning]
    tied = "'4.weight' is parameter '2.weight'" if name == "relu-chain" else \
        "'c.weight' is parameter 'b.weight'"
    assert len(slow) == 1 and f"parameter {tied} (one parameter in two layers: tied weights)" \
        in slow[0]
    _check_against_naive_loop(engine, reference, C)


def test_a_tied_relu_chain_is_not_taken_for_the_fused_mlp():
    """The fused kernels lay out one slot per layer's parameter: a tied
    chain trains through the generic path, as the naive loop."""
    torch.manual_seed(0)
    model = _tied_chain()
    torch.manual_seed(0)
    reference = _tied_chain()
    assert mlp_linears_of(model) is None
    wrapped = TorchModel(model, "tied")
    assert wrapped.mlp_spec is None
    X, y = _rows(4)
    grad = torch.zeros(wrapped.n_params)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowPathWarning)
        engine = wrapped.build_engine(grad, 0, (X, y), CLASSES, 64, None)
    assert isinstance(engine, ModuleEngine) and engine.rule == "torch.func"
    _check_against_naive_loop(engine, reference, 0.05)


def test_the_per_layer_clipper_refuses_tied_weights_by_name():
    with pytest.raises(ValueError, match=r"parameter 'c.weight' is parameter 'b.weight'.*"
                                         r"use FuncClipper"):
        LayerClipper(TiedWeight())


# -- logits in half precision -----------------------------------------------------------

class Cast(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype
        self.l = nn.Linear(F_IN, CLASSES)

    def forward(self, x):
        return self.l(x).to(self.dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int64])
def test_logits_that_are_not_float32_or_float64_are_refused_in_one_line(dtype):
    with pytest.raises(ConfigError) as caught:
        _engine(Cast(dtype))
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"the model returns logits of dtype {dtype}; they must be "
                              "float32 or float64")


@pytest.mark.parametrize("C", [None, 0.05])
def test_float64_logits_of_a_float32_model_train_as_the_naive_loop(C):
    torch.manual_seed(0)
    model = Cast(torch.float64)
    torch.manual_seed(0)
    reference = Cast(torch.float64)
    _check_against_naive_loop(_engine(model), reference, C)
