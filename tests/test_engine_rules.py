"""Every per-layer rule equals a per-example loop (engine.dp.rules).

For each rule (Linear on [k, d] and on sequences, both ghost and materialised;
Embedding; LayerNorm, GroupNorm, RMSNorm; Conv1d, Conv2d), over shapes chosen
by Hypothesis, empty batches included: the per-example squared norms, the
clipped sums for random factors and the norms of random groups' summed
gradients against a loop of ``torch.autograd.grad`` on one example at a time
(in float64), within float32 rounding for a float32 layer and to 1e-9 for a
float64 one. Then a model mixing the layers through LayerClipper against the
naive loop of engine.dp.naive, the SlowPathWarning for the layers that take
the torch.func fallback (and its absence for the others), and the layers
DP-SGD refuses, with the reason. Serial.
"""
from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st
from torch import nn

from engine.dp import rules
from engine.dp.clipping import FuncClipper, LayerClipper
from engine.dp.naive import naive_clipped_sum
from engine.dp.rules import FuncRule, SlowPathWarning, has_fast_rule, rule_for
from engine.dp.rules.conv import Chooser
from engine.dp.rules.linear import OuterSums
from engine.errors import ConfigError
from engine.dp.module_engine import ModuleEngine

SETTINGS = settings(max_examples=20, deadline=None)
batch_sizes = st.sampled_from([0, 1, 2, 5])
dtypes = st.sampled_from([torch.float32, torch.float64])
ghosts = st.sampled_from([None, True, False])  # OuterSums: by size, forced on, forced off
#: conv ways: unfolded patches, the grouped weight-gradient kernel, or timed (Chooser)
conv_ways = st.sampled_from([None, "unfold", "grouped"])


def _reference(layer: nn.Module, a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-example gradients ``{name: [k, *shape]}`` of ``<layer(a_i), b_i>``,
    one ``autograd.grad`` per example."""
    named = list(layer.named_parameters(recurse=False))
    grads = {name: [] for name, _ in named}
    for i in range(a.shape[0]):
        out = layer(a[i:i + 1])
        got = torch.autograd.grad((out * b[i:i + 1]).sum(), [p for _, p in named],
                                  allow_unused=True)
        for (name, p), g in zip(named, got):
            grads[name].append(torch.zeros_like(p) if g is None else g)
    return {name: torch.stack(grads[name]) if grads[name] else p.new_zeros((0, *p.shape))
            for name, p in named}


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
    rtol, atol = (1e-4, 1e-5 * scale) if dtype == torch.float32 else (1e-9, 1e-12 * scale)
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.allclose(got.double(), want, rtol=rtol, atol=atol), \
        f"{what}: max abs diff {(got.double() - want).abs().max():.3e} (scale {scale:.3g})"


def _groups(k: int, seed: int) -> torch.Tensor:
    """Random non-empty groups over k rows: int64 ``[H+1]`` offsets."""
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(i for i in range(1, k) if torch.rand(1, generator=g) < 0.5)
    return torch.tensor([0, *cuts, k] if k else [0], dtype=torch.int64)


def _check_rule(layer: nn.Module, a: torch.Tensor, dtype: torch.dtype, seed: int,
                ghost: bool | None = None, way: str | None = None) -> None:
    """The layer's rule (run in ``dtype``) against the float64 loop."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():  # not the initial ones and zeros of norm layers
            p.copy_(torch.randn(p.shape, generator=g))
    ref_layer = copy.deepcopy(layer).double()
    a64 = a.double() if a.is_floating_point() else a
    with torch.no_grad():
        out_shape = ref_layer(a64).shape
    b64 = torch.randn(out_shape, generator=g, dtype=torch.float64)
    want = _reference(ref_layer, a64, b64)
    k = a.shape[0]

    layer = layer.to(dtype)
    OuterSums.ghost, Chooser.forced = ghost, way
    try:
        term = rule_for(layer)(layer, a.to(dtype) if a.is_floating_point() else a,
                               b64.to(dtype))
        assert has_fast_rule(layer) and not isinstance(term, FuncRule)
        want_sq = sum(w.flatten(1).square().sum(1) for w in want.values())
        _close(term.sq_norms, want_sq, dtype, "squared norms")

        factors = torch.rand(k, generator=g, dtype=torch.float64)
        sums = term.clipped_sum(factors.to(dtype))
        assert sums.keys() == want.keys()
        for name, w in want.items():
            _close(sums[name], torch.tensordot(factors, w, dims=([0], [0])), dtype, name)

        groups = _groups(k, seed)
        want_groups = torch.zeros(groups.shape[0] - 1, dtype=torch.float64)
        for h in range(groups.shape[0] - 1):
            rows = slice(int(groups[h]), int(groups[h + 1]))
            want_groups[h] = sum(float(w[rows].sum(0).square().sum()) for w in want.values())
        _close(term.group_sq_norms(groups), want_groups, dtype, "group norms")
    finally:
        OuterSums.ghost, Chooser.forced = None, None


@SETTINGS
@given(k=batch_sizes, positions=st.sampled_from([(), (3,), (2, 2), (1,)]),
       d_in=st.integers(1, 5), d_out=st.integers(1, 5), bias=st.booleans(), ghost=ghosts,
       dtype=dtypes, seed=st.integers(0, 10_000))
def test_linear_rule(k, positions, d_in, d_out, bias, ghost, dtype, seed):
    a = torch.randn(k, *positions, d_in, generator=torch.Generator().manual_seed(seed))
    _check_rule(nn.Linear(d_in, d_out, bias=bias), a, dtype, seed, ghost)


@SETTINGS
@given(k=batch_sizes, index_shape=st.sampled_from([(), (1,), (4,), (2, 3), (9,)]),
       rows=st.integers(1, 6), dim=st.integers(1, 4), padding=st.booleans(),
       dtype=dtypes, seed=st.integers(0, 10_000))
@example(k=2, index_shape=(6,), rows=2, dim=3, padding=True, dtype=torch.float64, seed=0)
def test_embedding_rule(k, index_shape, rows, dim, padding, dtype, seed):
    """Repeated rows within an example (few rows, many lookups) and padding_idx."""
    g = torch.Generator().manual_seed(seed)
    index = torch.randint(0, rows, (k, *index_shape), generator=g)
    layer = nn.Embedding(rows, dim, padding_idx=rows // 2 if padding else None)
    _check_rule(layer, index, dtype, seed)


@SETTINGS
@given(k=batch_sizes, lead=st.sampled_from([(), (3,), (2, 2)]),
       shape=st.sampled_from([(1,), (4,), (2, 3)]), bias=st.booleans(),
       kind=st.sampled_from(["layer", "rms"]), dtype=dtypes, seed=st.integers(0, 10_000))
def test_layer_norm_and_rms_norm_rules(k, lead, shape, bias, kind, dtype, seed):
    layer = (nn.LayerNorm(shape, eps=1e-3, bias=bias) if kind == "layer"
             else nn.RMSNorm(shape, eps=1e-3))
    a = torch.randn(k, *lead, *shape, generator=torch.Generator().manual_seed(seed))
    _check_rule(layer, a, dtype, seed)


@SETTINGS
@given(k=batch_sizes, groups=st.sampled_from([1, 2, 3]), per_group=st.integers(1, 2),
       spatial=st.sampled_from([(), (1,), (4,), (2, 3)]), dtype=dtypes,
       seed=st.integers(0, 10_000))
def test_group_norm_rule(k, groups, per_group, spatial, dtype, seed):
    assume(per_group * math.prod(spatial) > 1)  # torch refuses one value per group
    channels = groups * per_group
    a = torch.randn(k, channels, *spatial, generator=torch.Generator().manual_seed(seed))
    _check_rule(nn.GroupNorm(groups, channels, eps=1e-3), a, dtype, seed)


@st.composite
def _conv_case(draw, dims: int):
    """(layer, input shape): any stride, dilation, groups, padding and mode."""
    groups = draw(st.sampled_from([1, 2]))
    in_ch, out_ch = groups * draw(st.integers(1, 2)), groups * draw(st.integers(1, 3))
    kernel = tuple(draw(st.integers(1, 3)) for _ in range(dims))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(dims))
    padding = draw(st.sampled_from(["same", "valid", "ints"]))
    stride = (tuple(draw(st.integers(1, 2)) for _ in range(dims)) if padding != "same"
              else (1,) * dims)  # torch refuses 'same' with strides
    if padding == "ints":
        padding = tuple(draw(st.integers(0, 2)) for _ in range(dims))
    mode = draw(st.sampled_from(["zeros", "reflect", "replicate", "circular"]))
    size = tuple(d * (kk - 1) + 3 + draw(st.integers(0, 3))  # > the padding (reflect)
                 for d, kk in zip(dilation, kernel))
    conv = nn.Conv1d if dims == 1 else nn.Conv2d
    layer = conv(in_ch, out_ch, kernel, stride=stride, padding=padding, dilation=dilation,
                 groups=groups, bias=draw(st.booleans()), padding_mode=mode)
    return layer, (in_ch, *size)


CONV_SETTINGS = settings(max_examples=25, deadline=None)
conv_batch_sizes = st.sampled_from([0, 1, 2, 5, 9])  # 9: timed by the Chooser


@pytest.mark.filterwarnings("ignore:Using padding='same'")  # torch's, on its own copy
@CONV_SETTINGS
@given(k=conv_batch_sizes, case=_conv_case(1), ghost=ghosts, way=conv_ways, dtype=dtypes,
       seed=st.integers(0, 10_000))
@example(k=3, case=(nn.Conv1d(2, 4, 2, padding="same"), (2, 5)),  # odd padding: on the right
         ghost=None, way=None, dtype=torch.float64, seed=0)
@example(k=2, case=(nn.Conv1d(4, 6, 3, stride=2, dilation=2, groups=2, padding=2,
                              padding_mode="reflect"), (4, 9)),
         ghost=True, way="grouped", dtype=torch.float64, seed=1)
def test_conv1d_rule(k, case, ghost, way, dtype, seed):
    layer, shape = case
    a = torch.randn(k, *shape, generator=torch.Generator().manual_seed(seed))
    _check_rule(layer, a, dtype, seed, ghost, way)


@pytest.mark.filterwarnings("ignore:Using padding='same'")
@CONV_SETTINGS
@given(k=conv_batch_sizes, case=_conv_case(2), ghost=ghosts, way=conv_ways, dtype=dtypes,
       seed=st.integers(0, 10_000))
@example(k=3, case=(nn.Conv2d(2, 4, (2, 3), padding="same", dilation=(1, 2), groups=2,
                              padding_mode="circular"), (2, 4, 5)),
         ghost=False, way="grouped", dtype=torch.float64, seed=0)
def test_conv2d_rule(k, case, ghost, way, dtype, seed):
    layer, shape = case
    a = torch.randn(k, *shape, generator=torch.Generator().manual_seed(seed))
    _check_rule(layer, a, dtype, seed, ghost, way)


def test_conv_chooser_times_both_ways_once_per_shape(monkeypatch):
    """A batch of at least MIN_ROWS rows times both ways, keeps the faster for the
    layer's shape (exact either way), and later batches reuse the choice."""
    monkeypatch.setattr(Chooser, "chosen", {})
    calls = []
    import engine.dp.rules.conv as conv

    for name in ("_unfold_term", "_grouped_term"):
        way = getattr(conv, name)
        monkeypatch.setattr(conv, name, lambda *args, _w=way, _n=name: calls.append(_n) or _w(*args))
    layer = nn.Conv2d(3, 4, 3, padding=1).double()
    k = Chooser.MIN_ROWS + 1
    _check_rule(layer, torch.randn(k, 3, 6, 6), torch.float64, 3)
    assert sorted(set(calls)) == ["_grouped_term", "_unfold_term"] and len(calls) == 6
    (way,) = Chooser.chosen.values()
    calls.clear()
    _check_rule(layer, torch.randn(k, 3, 6, 6), torch.float64, 4)
    assert calls == ["_" + way + "_term"]


# --- whole models --------------------------------------------------------------

F_IN, CLASSES = 6, 3


class Mixed(nn.Module):
    """Embedding (codes from two features, one padding code) + Linear +
    LayerNorm, as a 2-channel sequence into Conv1d + GroupNorm, then Linear:
    every parameterised layer has a rule."""

    def __init__(self, n_features: int = F_IN, n_classes: int = CLASSES):
        super().__init__()
        self.emb = nn.Embedding(5, 4, padding_idx=0)
        self.proj = nn.Linear(n_features, 4)
        self.norm = nn.LayerNorm(4)
        self.conv = nn.Conv1d(2, 3, 3, padding=1)
        self.gn = nn.GroupNorm(3, 3)
        self.head = nn.Linear(12, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        codes = (x[:, :2].abs() * 2).long().clamp(max=4)  # [k, 2], some 0 (padding)
        seq = self.emb(codes) + self.norm(self.proj(x))[:, None, :]  # [k, 2, 4]
        h = torch.tanh(self.gn(self.conv(seq)))  # [k, 3, 4]
        return self.head(h.flatten(1))


def _data(k: int, seed: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(k, F_IN, generator=g, dtype=dtype),
            torch.randint(0, CLASSES, (k,), generator=g))


def _pair(factory, seed: int):
    torch.manual_seed(seed)
    model = factory().double()
    reference = copy.deepcopy(model)
    return model, reference


@settings(max_examples=10, deadline=None)
@given(k=batch_sizes, C=st.sampled_from([None, 1e-3, 0.3, 1e9]), seed=st.integers(0, 10_000))
def test_mixed_model_matches_the_naive_loop(k, C, seed):
    model, reference = _pair(Mixed, seed)
    for _, m in model.named_modules():
        assert not any(True for _ in m.parameters(recurse=False)) or has_fast_rule(m)
    x, y = _data(k, seed)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowPathWarning)  # every layer has its rule
        clipper = LayerClipper(model)
        loss, clipped = clipper.clipped_sum(x, y, C)
    want, want_loss, want_clipped = naive_clipped_sum(reference, x, y, C)
    assert torch.allclose(clipper.grad, want, rtol=1e-9, atol=1e-12)
    assert loss == pytest.approx(want_loss, rel=1e-12, abs=1e-12) and clipped == want_clipped


@settings(max_examples=10, deadline=None)
@given(sizes=st.lists(st.integers(1, 4), min_size=0, max_size=5),
       C=st.sampled_from([1e-3, 0.3, 1e9]), seed=st.integers(0, 10_000))
def test_mixed_model_clips_groups_like_the_loop(sizes, C, seed):
    """Households: each group's summed gradient clipped as one."""
    model, reference = _pair(Mixed, seed)
    x, y = _data(sum(sizes), seed)
    groups = torch.tensor([0, *torch.tensor(sizes, dtype=torch.int64).cumsum(0).tolist()])
    clipper = LayerClipper(model)
    _, clipped = clipper.clipped_sum(x, y, C, groups)
    want, want_clipped = torch.zeros_like(clipper.grad), 0
    for h in range(len(sizes)):
        rows = slice(int(groups[h]), int(groups[h + 1]))
        total, _, _ = naive_clipped_sum(reference, x[rows], y[rows], None)
        norm = float(total.norm())
        want += min(1.0, C / norm) * total if norm > 0 else total
        want_clipped += sizes[h] if norm > C else 0
    assert torch.allclose(clipper.grad, want, rtol=1e-9, atol=1e-12)
    assert clipped == want_clipped


def test_module_engine_trains_the_mixed_model_per_layer_in_float32():
    torch.manual_seed(1)
    model = Mixed()
    reference = copy.deepcopy(model)
    x, y = _data(20, 2, torch.float32)
    X = torch.cat([x, torch.ones(20, 1)], 1)
    grad = torch.zeros(sum(p.numel() for p in model.parameters()))
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowPathWarning)
        engine = ModuleEngine(model, grad, (X[:4], y[:4]), CLASSES)
        loss, clipped = engine.clipped_sum(engine.load(X, y, torch.arange(20)), 0.5)
    assert engine.rule == "per-layer rules"
    want, want_loss, want_clipped = naive_clipped_sum(reference, x, y, 0.5)
    assert torch.allclose(grad, want, rtol=1e-4, atol=1e-6)
    assert loss == pytest.approx(want_loss, rel=1e-5) and clipped == want_clipped


class TwoInputs(nn.Module):
    """A Bilinear (no rule, two inputs) after a Linear."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(F_IN, 4)
        self.bil = nn.Bilinear(4, F_IN, CLASSES)

    def forward(self, x):
        return self.bil(torch.tanh(self.lin(x)), x)


class Scale(nn.Module):
    """A custom layer with a parameter of its own."""

    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, x):
        return x * self.weight


def _slow_messages(caught) -> list[str]:
    return [str(w.message) for w in caught if w.category is SlowPathWarning]


@pytest.mark.parametrize("factory, layer", [
    (TwoInputs, r"layer 'bil' \(Bilinear\)"),
    (lambda: nn.Sequential(nn.Linear(F_IN, 4), Scale(4), nn.Linear(4, CLASSES)),
     r"layer '1' \(Scale\)"),
])
def test_a_layer_without_a_rule_is_named_once_and_still_exact(factory, layer):
    model, reference = _pair(factory, 0)
    with pytest.warns(SlowPathWarning, match=layer + " has no per-layer rule: .*torch.func"):
        clipper = LayerClipper(model)
    x, y = _data(7, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        clipper.clipped_sum(x, y, 0.2)
        clipper.clipped_sum(x, y, 0.2)
    assert not _slow_messages(caught)  # once per layer, when the clipper is built
    want, _, _ = naive_clipped_sum(reference, x, y, 0.2)
    assert torch.allclose(clipper.grad, want, rtol=1e-9, atol=1e-12)


def test_a_rule_that_declines_an_input_is_named_once():
    class Declining(nn.Linear):
        pass

    rules.register_rule(Declining)(lambda layer, a, b: FuncRule(layer, a, b))
    try:
        model, reference = _pair(lambda: nn.Sequential(Declining(F_IN, CLASSES)), 0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            clipper = LayerClipper(model)
            x, y = _data(5, 1)
            clipper.clipped_sum(x, y, None)
            clipper.clipped_sum(x, y, None)
        assert _slow_messages(caught) == [
            "layer '0' (Declining) has a rule, but not for inputs of shape [5, 6]: its "
            "per-example gradients go through torch.func (exact, slower); a rule goes in "
            "engine.dp.rules (register_rule)"]
        assert torch.allclose(clipper.grad, naive_clipped_sum(reference, x, y, None)[0])
    finally:
        rules._RULES.pop(Declining)


class Mixing(nn.Module):
    """A module with a parameter of its own and a child with parameters."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(F_IN))
        self.head = nn.Linear(F_IN, CLASSES)

    def forward(self, x):
        return self.head(x * self.scale)


class SequenceFirst(nn.Module):
    """A Linear applied to [positions, k, d]: not batch first."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.head = nn.Linear(4, CLASSES)

    def forward(self, x):
        seq = x.reshape(-1, 2, 3).transpose(0, 1)  # [2, k, 3]
        return self.head(self.lin(seq).transpose(0, 1).flatten(1))


class Recurrent(nn.Module):
    """An LSTM over a sequence of one step: it returns a tuple, not a tensor."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(F_IN, 3, batch_first=True)
        self.head = nn.Linear(3, CLASSES)

    def forward(self, x):
        return self.head(self.rnn(x.unsqueeze(1))[0][:, -1])


@pytest.mark.parametrize("factory, why", [
    (Mixing, r"the model itself \(Mixing\) has parameters of its own and in its children"),
    (SequenceFirst, r"layer 'lin' \(Linear\) takes inputs that are not batch first"),
    (Recurrent, r"layer 'rnn' \(LSTM\) returns a tuple, not one tensor"),
])
def test_module_engine_says_why_it_clips_the_whole_model(factory, why):
    torch.manual_seed(0)
    model = factory()
    reference = copy.deepcopy(model)
    x, y = _data(9, 4, torch.float32)
    X = torch.cat([x, torch.ones(9, 1)], 1)
    grad = torch.zeros(sum(p.numel() for p in model.parameters()))
    with pytest.warns(SlowPathWarning, match="whole model through torch.func.*: " + why):
        engine = ModuleEngine(model, grad, (X[:2], y[:2]), CLASSES)
    assert engine.rule == "torch.func" and isinstance(engine.clipper, FuncClipper)
    engine.clipped_sum(engine.load(X, y, torch.arange(9)), 0.3)
    assert torch.allclose(grad, naive_clipped_sum(reference, x, y, 0.3)[0], rtol=1e-4,
                          atol=1e-6)


def _frozen(module: nn.Module, *names: str) -> nn.Module:
    for name in names or [n for n, _ in module.named_parameters()]:
        module.get_parameter(name).requires_grad_(False)
    return module


@pytest.mark.parametrize("partly", [False, True])
def test_frozen_parameters_are_constants_and_the_rest_clips_exactly(partly):
    """A frozen layer (a pretrained feature extractor) is a constant: no
    gradient, no clipping, no noise, unchanged, its state_dict key kept; the
    trainable parameters' clipped sum equals the loop's over them alone. A
    layer frozen in part (its weight, not its bias) goes through torch.func."""
    torch.manual_seed(2)
    body = nn.Linear(F_IN, 8)
    model = nn.Sequential(_frozen(body, "weight") if partly else _frozen(body), nn.Tanh(),
                          nn.Linear(8, CLASSES))
    reference, keys = copy.deepcopy(model), set(model.state_dict())
    x, y = _data(11, 5, torch.float32)
    X = torch.cat([x, torch.ones(11, 1)], 1)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    grad = torch.zeros(trainable)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SlowPathWarning)
        engine = ModuleEngine(model, grad, (X[:4], y[:4]), CLASSES)
    slow = [str(w.message) for w in caught if issubclass(w.category, SlowPathWarning)]
    if partly:
        assert engine.rule == "torch.func" and len(slow) == 1
        assert "layer '0' (Linear) has frozen and trainable parameters" in slow[0]
    else:
        assert engine.rule == "per-layer rules" and not slow
    assert engine.params.numel() == trainable and set(model.state_dict()) == keys
    engine.clipped_sum(engine.load(X, y, torch.arange(11)), 0.2)
    want = naive_clipped_sum(reference, x, y, 0.2)[0]
    assert torch.allclose(grad, want, rtol=1e-4, atol=1e-6)
    assert torch.equal(model[0].weight, reference[0].weight)


class HalfUnderNoGrad(nn.Module):
    """A layer run under torch.no_grad (its parameters get no gradient)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(F_IN, 8), nn.Linear(8, CLASSES)

    def forward(self, x):
        with torch.no_grad():
            h = torch.tanh(self.a(x))
        return self.b(h)


def test_parameters_without_gradient_are_zero_in_the_sum_and_named():
    """The per-layer rules took a layer run under no_grad for a bug of
    autograd's (a RuntimeError at the first step); its gradient is zero, as
    in the loop, and the model is named in a warning: noise alone moves it."""
    from engine.dp.module_engine import UntrainedParameterWarning

    torch.manual_seed(3)
    model = HalfUnderNoGrad()
    reference = copy.deepcopy(model)
    x, y = _data(7, 6, torch.float32)
    X = torch.cat([x, torch.ones(7, 1)], 1)
    grad = torch.zeros(sum(p.numel() for p in model.parameters()))
    with pytest.warns(UntrainedParameterWarning, match=r"parameters 'a.weight', 'a.bias' of "
                      r"the model get no gradient .*freeze them"):
        engine = ModuleEngine(model, grad, (X[:4], y[:4]), CLASSES)
    assert engine.rule == "per-layer rules"
    engine.clipped_sum(engine.load(X, y, torch.arange(7)), 0.3)
    assert torch.allclose(grad, naive_clipped_sum(reference, x, y, 0.3)[0], rtol=1e-4,
                          atol=1e-6)
    assert not grad[:F_IN * 8 + 8].any()


def test_layer_clipper_refuses_inputs_that_are_not_batch_first():
    x, y = _data(5, 0)
    with pytest.raises(ValueError, match=r"'lin' \(Linear\) takes an input of shape "
                                         r"\[2, 5, 3\] for a batch of 5 rows"):
        LayerClipper(SequenceFirst().double()).clipped_sum(x, y, 1.0)


@pytest.mark.parametrize("layer, message", [
    (nn.BatchNorm1d(4), r"'1' \(BatchNorm1d\) mixes the examples of a batch .*per-example "
                        "gradients do not exist; use GroupNorm or LayerNorm"),
    (nn.Sequential(nn.Unflatten(1, (1, 2, 2)), nn.BatchNorm2d(1), nn.Flatten()),
     r"'1.1' \(BatchNorm2d\) mixes the examples"),
    (nn.InstanceNorm1d(4, track_running_stats=True),
     r"keeps running statistics of the training rows.*track_running_stats=False"),
])
def test_layers_that_mix_examples_are_refused_with_the_reason(layer, message):
    model = nn.Sequential(nn.Linear(F_IN, 4), layer, nn.Linear(4, CLASSES))
    X, y = torch.randn(4, F_IN + 1), torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ConfigError, match=message):
        ModuleEngine(model, torch.zeros(sum(p.numel() for p in model.parameters())),
                     (X, y), CLASSES)
    with pytest.raises(ValueError, match=message):
        LayerClipper(model)


class RunningMean(nn.Module):
    """Keeps a running mean of its inputs in a buffer (in training mode)."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(F_IN, CLASSES)
        self.register_buffer("mean", torch.zeros(F_IN))
        self.register_buffer("missing", torch.full((2,), float("nan")))  # fixed: allowed

    def forward(self, x):
        if self.training:
            self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        return self.head(x - self.mean)


def test_a_buffer_the_forward_pass_changes_is_refused():
    """A statistic of the training rows in a buffer would leave the run without
    noise; a fixed buffer (NaN included) is no problem."""
    X, y = torch.randn(4, F_IN + 1), torch.zeros(4, dtype=torch.int64)
    model = RunningMean()
    grad = torch.zeros(sum(p.numel() for p in model.parameters()))
    with pytest.raises(ConfigError, match=r"^buffer 'mean' of the model changes in its "
                                          r"forward pass: .* without clipping or noise"):
        ModuleEngine(model, grad, (X, y), CLASSES)
    model = RunningMean().eval()  # the same module, its buffer left alone
    ModuleEngine(model, grad, (X, y), CLASSES)


class Drifting(nn.Module):
    """Moves its bias by the data in forward, outside autograd."""

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(F_IN, CLASSES)

    def forward(self, x):
        with torch.no_grad():
            self.head.bias.add_(x.mean())
        return self.head(x)


def test_a_parameter_the_forward_pass_changes_is_refused():
    X, y = torch.randn(4, F_IN + 1), torch.zeros(4, dtype=torch.int64)
    model = Drifting()
    grad = torch.zeros(sum(p.numel() for p in model.parameters()))
    with pytest.raises(ConfigError, match=r"^parameter 'head.bias' of the model changes"):
        ModuleEngine(model, grad, (X, y), CLASSES)


class Branching(nn.Module):
    """One layer used twice (so only torch.func can clip it) and a branch on a
    value (.item(), which vmap cannot do)."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(F_IN, F_IN)
        self.head = nn.Linear(F_IN, CLASSES)

    def forward(self, x):
        if x.sum().item() > 1e9:
            x = x * 0
        return self.head(self.inner(self.inner(x)))


def test_a_model_torch_func_cannot_clip_is_one_config_error():
    X, y = torch.randn(4, F_IN + 1), torch.zeros(4, dtype=torch.int64)
    model = Branching()
    grad = torch.zeros(sum(p.numel() for p in model.parameters()))
    with pytest.warns(SlowPathWarning), pytest.raises(
            ConfigError, match=r"^the model cannot be clipped per example: the per-layer rules "
                               r"cannot serve it because layer 'inner' \(Linear\) runs 2 "
                               r"times .*, and torch.func's per-example gradients fail on it "
                               r"\(RuntimeError: "):
        ModuleEngine(model, grad, (X, y), CLASSES)


class Codes(nn.Module):
    def __init__(self, **options):
        super().__init__()
        self.emb = nn.Embedding(5, 3, **options)
        self.head = nn.Linear(3 * F_IN, CLASSES)

    def forward(self, x):
        return self.head(self.emb(x.abs().long().clamp(max=4)).flatten(1))


@pytest.mark.parametrize("options, message", [
    (dict(max_norm=1.0), r"'emb' \(Embedding\) has max_norm set: it renormalises the rows "
                         r"a batch looks up in place .*; use max_norm=None"),
    (dict(scale_grad_by_freq=True), r"'emb' \(Embedding\) has scale_grad_by_freq=True: .*"
                                    "one example's gradient depends on the others; use "
                                    "scale_grad_by_freq=False"),
])
def test_embeddings_that_depend_on_the_batch_are_refused_with_the_reason(options, message):
    model = Codes(**options)
    X, y = torch.randn(4, F_IN + 1), torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ConfigError, match=message):
        ModuleEngine(model, torch.zeros(sum(p.numel() for p in model.parameters())),
                     (X, y), CLASSES)
    assert Codes()(X[:, :-1]).shape == (4, CLASSES)  # the same model without the option runs


def test_every_built_in_rule_is_registered_on_import():
    for layer in (nn.Linear(2, 2), nn.Embedding(3, 2), nn.LayerNorm(2), nn.GroupNorm(1, 2),
                  nn.RMSNorm(2), nn.Conv1d(1, 1, 1), nn.Conv2d(1, 1, 1)):
        assert has_fast_rule(layer), type(layer).__name__
    for layer in (nn.Bilinear(2, 2, 2), nn.PReLU(), nn.Conv3d(1, 1, 1), Scale(2)):
        assert not has_fast_rule(layer) and rule_for(layer) is FuncRule
