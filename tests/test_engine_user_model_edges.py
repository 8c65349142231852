"""User models at the edges of what per-example clipping can serve: a forward
that mixes the examples of a batch (refused), one parameter in two layers
(tied weights: the whole-model torch.func path, never the fused MLP or the
per-layer rules), a parameter used outside its own layer's call (a
functional call on its weight, a direct read, another module's forward:
torch.func too), logits in half precision (refused), and buffers: recorded
by digest in checkpoints (mpidp eval refuses a rebuild with others), never
changed by the rows (refused by the probes, with gradients on or off, and
before publication). Every model that trains is checked against the naive
per-example loop (serial: no ranks)."""
import warnings

import pytest
import torch
from torch import nn

from engine.dp.clipping import LayerClipper
from engine.dp.module_engine import ModuleEngine, _missed_use, _refuse_mixing
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


# -- a parameter used outside its own layer's call -------------------------------------

class FunctionalReuse(nn.Module):
    """``l.weight`` in ``l``'s call and again in a functional call in forward."""

    def __init__(self, dropout=0.0):
        super().__init__()
        self.l, self.o = nn.Linear(F_IN, CLASSES), nn.Linear(CLASSES, CLASSES)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return self.o(self.drop(torch.tanh(self.l(x)) + nn.functional.linear(x, self.l.weight)))


class DirectRead(nn.Module):
    """A layer's bias read directly in forward, beside the layer's own call."""

    def __init__(self):
        super().__init__()
        self.l, self.o = nn.Linear(F_IN, 8), nn.Linear(8, CLASSES)

    def forward(self, x):
        return self.o(torch.tanh(self.l(x)) * self.l.bias)


class Transposed(nn.Module):
    """No parameter of its own: applies another layer's weight, transposed."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, h):
        return nn.functional.linear(h, self.layer.weight.t())


class TiedDecoder(nn.Module):
    """``l``'s weight used by another module's forward (an autoencoder's tied decoder)."""

    def __init__(self):
        super().__init__()
        self.l, self.o = nn.Linear(F_IN, 8), nn.Linear(F_IN, CLASSES)
        self.dec = Transposed(self.l)

    def forward(self, x):
        return self.o(torch.tanh(self.dec(torch.tanh(self.l(x)))))


class OwnParameter(nn.Module):
    """An ``nn.Parameter`` of the model itself, used in forward outside any layer."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8))
        self.l, self.o = nn.Linear(F_IN, 8), nn.Linear(8, CLASSES)

    def forward(self, x):
        return self.o(torch.tanh(self.l(x)) * self.scale)


_MISSED = {"functional": (FunctionalReuse, "miss a use of parameter 'l.weight'"),
           "direct-read": (DirectRead, "miss a use of parameter 'l.bias'"),
           "other-module": (TiedDecoder, "miss a use of parameter 'l.weight'"),
           "own-parameter": (OwnParameter, "the model itself (OwnParameter) has parameters "
                                           "of its own and in its children")}


@pytest.mark.parametrize("name", list(_MISSED))
@pytest.mark.parametrize("C", [None, 0.05, 1e6])
def test_a_parameter_used_outside_its_layer_is_clipped_through_torch_func(name, C):
    """The per-layer rules see a parameter only in its own layer's call: a
    model that uses it elsewhere too is found on the probe rows (the rules'
    per-example gradients against autograd's) and clipped through torch.func,
    as the naive loop; the warning names the parameter."""
    build, why = _MISSED[name]
    torch.manual_seed(0)
    model = build()
    torch.manual_seed(0)
    reference = build()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = _engine(model)
    assert engine.rule == "torch.func"
    slow = [str(w.message) for w in caught if w.category is SlowPathWarning]
    assert len(slow) == 1 and why in slow[0], slow
    assert "\n" not in slow[0]
    _check_against_naive_loop(engine, reference, C)
    # torch.func left the model's own parameters in place (views of the flat vector)
    assert all(type(p) is nn.Parameter for p in model.parameters())
    assert [p.data_ptr() for p in model.parameters()][0] == engine.params.data_ptr()
    _check_against_naive_loop(engine, reference, C)  # and again: the same numbers


@pytest.mark.parametrize("name", ["functional", "direct-read", "other-module"])
def test_the_per_layer_rules_alone_get_such_a_model_wrong(name):
    """Why it is checked: the rules' clipped sum of such a model is far from
    the naive loop's, with no error (what the probe now catches)."""
    torch.manual_seed(0)
    model = _MISSED[name][0]()
    torch.manual_seed(0)
    reference = _MISSED[name][0]()
    X, y = _rows(24, seed=1)
    clipper = LayerClipper(model)
    clipper.clipped_sum(X[:, :-1], y, 0.05)
    want, _, _ = naive_clipped_sum(reference, X[:, :-1], y, 0.05)
    assert float((clipper.grad - want).norm()) > 0.05 * float(want.norm())


def test_a_missed_use_with_dropout_is_refused_naming_both():
    """The torch.func path cannot draw per example: refused in one line that
    says why the model takes that path."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowPathWarning)
        with pytest.raises(ConfigError) as caught:
            _engine(FunctionalReuse(dropout=0.2))
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("layer 'drop' (Dropout) draws random numbers in training")
    assert "the per-layer rules miss a use of parameter 'l.weight'" in message


class InPlaceDropout(nn.Module):
    """A Linear's output changed in place (the rules' first pass runs the
    forward again, drawing other numbers), then Dropout."""

    def __init__(self):
        super().__init__()
        self.l, self.o = nn.Linear(F_IN, 16), nn.Linear(16, CLASSES)
        self.act, self.drop = nn.ReLU(inplace=True), nn.Dropout(0.5)

    def forward(self, x):
        return self.o(self.drop(self.act(self.l(x))))


_PLAIN = {
    "relu-chain": lambda: nn.Sequential(nn.Linear(F_IN, 8), nn.ReLU(), nn.Linear(8, CLASSES)),
    "tanh-chain": lambda: nn.Sequential(nn.Linear(F_IN, 8), nn.Tanh(), nn.Linear(8, CLASSES)),
    "dropout": lambda: nn.Sequential(nn.Linear(F_IN, 16), nn.Dropout(0.5), nn.Tanh(),
                                     nn.Linear(16, CLASSES)),
    "in-place-then-dropout": InPlaceDropout,
    "noise": Noisy,
    "centre-in-training-given-in-eval": lambda: Centre(training_only=True).eval(),
    "layernorm": lambda: nn.Sequential(nn.Linear(F_IN, 8), nn.LayerNorm(8),
                                                 nn.Tanh(), nn.Linear(8, CLASSES)),
}


@pytest.mark.parametrize("name", list(_PLAIN))
def test_a_model_that_uses_each_parameter_in_its_layer_keeps_the_per_layer_rules(name):
    """No false alarm: the rules and autograd agree within rounding (random
    layers draw alike in both passes), so no warning and no slow path."""
    torch.manual_seed(0)
    model = _PLAIN[name]()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = _engine(model, n_probe=4)
    assert engine.rule == "per-layer rules"
    assert isinstance(engine.clipper, LayerClipper)
    assert not [w for w in caught if w.category is SlowPathWarning]


def test_the_probe_leaves_the_generators_and_the_gradient_buffer_as_they_were():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(F_IN, 16), nn.Dropout(0.5), nn.Linear(16, CLASSES))
    X, y = _rows(4)
    grad = torch.full((sum(p.numel() for p in model.parameters()),), 7.0)
    rng = torch.get_rng_state()
    clipper = LayerClipper(model, grad)
    assert _missed_use(clipper, X[:, :-1], y) is None
    assert torch.equal(torch.get_rng_state(), rng)
    assert bool((grad == 7.0).all())


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


def test_float64_logits_of_a_float32_model_are_not_taken_for_mixing():
    """A float32 model that casts its logits to float64 was refused as mixing
    the batch: the tolerance came from the logits' dtype, while the GEMMs of
    3 and 4 rows round apart in float32 (a regression hunt's find)."""
    from engine.dp.module_engine import _refuse_mixing

    class Wide(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.o = nn.Linear(200, 32), nn.Linear(32, 2)

        def forward(self, x):
            return self.o(torch.relu(self.a(x))).double()

    for seed in range(8):
        torch.manual_seed(seed)
        _refuse_mixing(Wide(), torch.randn(4, 200) * 3)  # no error: per-row arithmetic


def test_a_model_with_an_expanded_buffer_is_probed_without_a_traceback():
    """register_buffer("ex", torch.ones(1).expand(F)): the probe's byte view of
    the buffers raised "stride(-1) must be 1 to view Float as Byte"."""
    from engine.dp.module_engine import _state

    class Expanded(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(F_IN, CLASSES)
            self.register_buffer("ex", torch.ones(1).expand(F_IN))

        def forward(self, x):
            return self.l(x * self.ex)

    state = _state(Expanded())
    assert state["ex"] == torch.ones(F_IN).numpy().tobytes()


# -- buffers: recorded in checkpoints, never changed by the rows ----------------------

class RandProj(nn.Module):
    """A random projection in a buffer (drawn from torch's generator), then an MLP."""

    def __init__(self, n_features, n_classes):
        super().__init__()
        self.register_buffer("proj", torch.randn(n_features, 16))
        self.l1, self.l2 = nn.Linear(16, 8), nn.Linear(8, n_classes)

    def forward(self, x):
        return self.l2(torch.relu(self.l1(x @ self.proj)))


def randproj(n_features, n_classes):
    """RandProj as the hunter's factory builds it: drawn without a seed of its own."""
    return RandProj(n_features, n_classes)


def fixed_randproj(n_features, n_classes):
    """RandProj with its projection drawn from a generator of its own: the same
    buffer on every call."""
    model = RandProj(n_features, n_classes)
    model.proj.copy_(torch.randn(n_features, 16, generator=torch.Generator().manual_seed(5)))
    return model


def _recorded_randproj(seed=3):
    """A RandProj as a run built it (under its seed), its checkpoint entry and params."""
    from engine.models import seeded

    built = seeded(seed, lambda: RandProj(F_IN, CLASSES))
    entry = TorchModel(built, "test_engine_user_model_edges:randproj").to_dict()
    return built, entry, torch.cat([p.detach().reshape(-1) for p in built.parameters()])


def test_eval_refuses_a_rebuilt_model_whose_random_buffer_differs():
    """mpidp eval rebuilt RandProj with another projection and scored that
    model (0.55, then 0.46, against the run's 0.70), exit 0: the checkpoint
    recorded no buffer. Now each buffer's digest is recorded and a rebuild
    with other buffers is refused in one line; the same buffers give the
    run's logits."""
    from engine.models import checkpoint_logits

    built, entry, params = _recorded_randproj()
    named = "test_engine_user_model_edges:randproj"
    assert list(entry["buffers"]) == ["proj"] and "frozen" not in entry
    rows = torch.randn(5, F_IN + 1)
    torch.manual_seed(3)  # as the run drew it
    logits = checkpoint_logits(entry, params, F_IN, CLASSES, "run", model=named)(rows)
    with torch.no_grad():
        assert torch.equal(logits, built(rows[:, :-1]))
    torch.manual_seed(4)
    with pytest.raises(ConfigError) as caught:
        checkpoint_logits(entry, params, F_IN, CLASSES, "run", model=named)
    assert str(caught.value) == (
        "run: test_engine_user_model_edges:randproj builds other buffers than the run "
        "trained with (first: 'proj'): build them the same way on every call (seed torch in "
        "the factory, or load them from a file)")
    assert caught.value.collective


def test_a_checkpoint_without_the_buffers_record_loads_with_a_note_and_resumes():
    """Files written before mpidp recorded buffers: mpidp eval uses the rebuilt
    buffers with an UncheckedBuffersWarning, and a resume is not taken for a
    run of another model; a record that differs is."""
    from engine.models import UncheckedBuffersWarning, check_resume, checkpoint_logits
    from engine.errors import CheckpointError

    _, entry, params = _recorded_randproj()
    old = {k: v for k, v in entry.items() if k != "buffers"}
    with pytest.warns(UncheckedBuffersWarning, match=r"^run was written before mpidp "
                      r"recorded a model's buffers: .*\('proj'\) are used as it builds them"):
        checkpoint_logits(old, params, F_IN, CLASSES, "run",
                          model="test_engine_user_model_edges:randproj")
    torch.manual_seed(4)  # another draw than the run's
    model = TorchModel(RandProj(F_IN, CLASSES), "test_engine_user_model_edges:randproj")
    check_resume(old, model, "run")
    with pytest.raises(CheckpointError, match="holds a checkpoint of another model"):
        check_resume(entry, model, "run")


@pytest.fixture
def small_file(tmp_path):
    from engine.bench import synthetic

    return synthetic.write(tmp_path / "d.h5", rows=600, features=F_IN, n_classes=CLASSES,
                           seed=3)


def _eval(*argv: str) -> tuple[int, str]:
    """``mpidp eval ARGV`` in this process: (exit code, its output)."""
    import io
    from contextlib import redirect_stderr, redirect_stdout

    from engine.cli import main

    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(out):
        try:
            code = main(["eval", *argv])
        except SystemExit as stop:
            code = stop.code
    return code, out.getvalue()


def test_mpidp_eval_scores_the_trained_model_or_refuses(small_file, tmp_path):
    """The hunter's run: train a factory with a random buffer, then `mpidp eval
    --model` it. Drawn without a seed: refused (exit 2); drawn from a
    generator of its own: the run's test accuracy, exactly."""
    import engine

    for factory, code in (("randproj", 2), ("fixed_randproj", 0)):
        name = f"test_engine_user_model_edges:{factory}"
        where = tmp_path / factory
        run = engine.train(small_file, model=name, epochs=1, batch_size=100,
                           noise_multiplier=1.0, seed=3, quiet=True, checkpoint_dir=str(where))
        got, text = _eval("--checkpoint", str(where), "--data", small_file, "--model", name)
        assert got == code, text
        if code == 2:
            assert "builds other buffers than the run trained with (first: 'proj')" in text
        else:
            assert f"{run.history[-1]['test_accuracy']:.4f}" in text, text


class Stats(nn.Module):
    """Sums the rows it sees into buffers, only where gradients are enabled
    (``rows_over``: only in batches of more rows than that)."""

    def __init__(self, n_features=F_IN, n_classes=CLASSES, rows_over=0):
        super().__init__()
        self.rows_over = rows_over
        self.l = nn.Linear(n_features, n_classes)
        self.register_buffer("sum_x", torch.zeros(n_features))
        self.register_buffer("rows", torch.zeros(()))

    def forward(self, x):
        if torch.is_grad_enabled() and x.shape[0] > self.rows_over:
            with torch.no_grad():
                self.sum_x += x.sum(0)
                self.rows += x.shape[0]
        return self.l(x)


def test_a_buffer_changed_only_with_gradients_enabled_is_refused():
    """The state was checked around the output's probe alone, run under
    no_grad: the later probes, with gradients, changed the buffers unseen,
    and the run published exact sums of its training rows."""
    with pytest.raises(ConfigError, match=r"^buffer 'sum_x' of the model changes in its "
                                          r"forward pass: .* without clipping or noise"):
        _engine(Stats())


def test_engine_train_refuses_such_a_model_before_training(small_file):
    import engine

    with pytest.raises(ConfigError, match=r"^buffer 'sum_x' of the model changes"):
        engine.train(small_file, model=lambda f, c: Stats(f, c), epochs=1, batch_size=100,
                     noise_multiplier=1.0, seed=0, quiet=True)


def test_a_buffer_changed_in_training_only_is_never_published(small_file, tmp_path):
    """A model that changes its buffers only in batches larger than the probe's
    passes the probe; its run is refused before it writes a checkpoint or
    returns the model, on the buffer's name."""
    import engine

    changed = r"^buffer 'sum_x' of the model changed during training: .* not published"
    where = tmp_path / "ck"
    with pytest.raises(ConfigError, match=changed):
        engine.train(small_file, model=lambda f, c: Stats(f, c, rows_over=20), epochs=1,
                     batch_size=100, noise_multiplier=1.0, seed=0, quiet=True,
                     checkpoint_dir=str(where))
    assert not (where / "checkpoint.pt").exists() and not (where / "best.pt").exists()
    with pytest.raises(ConfigError, match=changed):
        engine.train(small_file, model=lambda f, c: Stats(f, c, rows_over=20), epochs=1,
                     batch_size=100, noise_multiplier=1.0, seed=0, quiet=True)
    _engine(Stats(rows_over=20))  # the probe alone does not see it
