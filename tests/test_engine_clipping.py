"""Clipped gradient sums equal the naive per-example loop (float64, tight tolerance).

Every engine (the hand-written MLP with Numba and with torch kernels, the
per-layer clipper with its rules (engine.dp.rules; each rule alone:
test_engine_rules.py) and its torch.func fallback for a layer without one,
and the whole-model torch.func clipper), for
batches of 0, 1 and many examples, with clipping inactive (huge C) and
active (tiny C). Property tests with Hypothesis on small shapes.
"""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from engine.dp.clipping import FuncClipper, LayerClipper
from engine.dp.fast_mlp import FastMLP
from engine.dp.rules import has_fast_rule
from engine.nn.mlp import MLPSpec, flat_from_module, init_params, to_module
from engine.dp.naive import naive_clipped_sum

RTOL, ATOL = 1e-10, 1e-12
SETTINGS = settings(max_examples=12, deadline=None)
batch_sizes = st.sampled_from([0, 1, 2, 7, 33])
clip_bounds = st.sampled_from([None, 1e-3, 0.3, 1e9])  # None = no clipping (non-DP)


def _data(k, d, classes, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(k, d, generator=g, dtype=torch.float64),
            torch.randint(0, classes, (k,), generator=g))


def _assert_close(got, want):
    assert torch.allclose(got, want, rtol=RTOL, atol=ATOL), \
        f"max abs diff {(got - want).abs().max():.3e}"


@pytest.mark.parametrize("backend", ["numba", "torch"])
@SETTINGS
@given(k=batch_sizes, hidden=st.sampled_from([(), (5,), (6, 4)]), C=clip_bounds,
       classes=st.sampled_from([2, 3]), seed=st.integers(0, 10_000))
def test_fast_mlp_matches_naive(backend, k, hidden, C, classes, seed):
    spec = MLPSpec.build(4, hidden, classes)
    params = init_params(spec, seed, dtype=torch.float64)
    grad = torch.full_like(params, float("nan"))  # must be overwritten entirely
    engine = FastMLP(spec, params, grad, capacity=3, backend=backend)  # grows as needed
    x, y = _data(k, 4, classes, seed)
    X = torch.cat([x, torch.ones(k, 1, dtype=torch.float64)], 1)
    rows = torch.arange(k)
    n = engine.load(X, y, rows)
    loss, clipped = engine.clipped_sum(n, C)
    model = to_module(spec, params)
    want, want_loss, want_clipped = naive_clipped_sum(model, x, y, C)
    # the naive loop returns [W, b] per layer; compare in the flat [W | b] layout
    lin = [m for m in model if isinstance(m, nn.Linear)]
    for m, start in zip(lin, _offsets(lin)):
        m.weight.data = want[start:start + m.weight.numel()].view_as(m.weight)
        m.bias.data = want[start + m.weight.numel():start + m.weight.numel() + m.bias.numel()]
    _assert_close(grad, flat_from_module(spec, model))
    assert loss == pytest.approx(want_loss, rel=1e-12, abs=1e-12)
    assert clipped == want_clipped


def _offsets(linears):
    out, o = [], 0
    for m in linears:
        out.append(o)
        o += m.weight.numel() + m.bias.numel()
    return out


def _models(d, classes):
    """(name, factory, clipper class): Linear MLPs, layers with rules of their own,
    a layer without one (the torch.func fallback), a 3-D Linear."""
    return [
        ("linear-mlp", lambda: nn.Sequential(nn.Linear(d, 6), nn.ReLU(), nn.Linear(6, classes)),
         LayerClipper),
        ("layernorm-rule", lambda: nn.Sequential(
            nn.Linear(d, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, classes)), LayerClipper),
        ("conv-rule", lambda: nn.Sequential(
            nn.Unflatten(1, (1, d)), nn.Conv1d(1, 2, 3), nn.ReLU(), nn.Flatten(),
            nn.Linear(2 * (d - 2), classes)), LayerClipper),
        ("prelu-fallback", lambda: nn.Sequential(
            nn.Linear(d, 6), nn.PReLU(), nn.Linear(6, classes)), LayerClipper),
        ("linear-on-3d-input", lambda: nn.Sequential(
            nn.Unflatten(1, (2, d // 2)), nn.Linear(d // 2, 3), nn.Flatten(),
            nn.Linear(6, classes, bias=False)), LayerClipper),
        ("whole-model-func", lambda: nn.Sequential(
            nn.Linear(d, 5), nn.GELU(), nn.LayerNorm(5), nn.Linear(5, classes)), FuncClipper),
    ]


@pytest.mark.filterwarnings("ignore::engine.dp.rules.SlowPathWarning")
@pytest.mark.parametrize("case", range(len(_models(4, 2))), ids=[m[0] for m in _models(4, 2)])
@SETTINGS
@given(k=batch_sizes, C=clip_bounds, classes=st.sampled_from([2, 3]),
       seed=st.integers(0, 10_000))
def test_module_clippers_match_naive(case, k, C, classes, seed):
    name, factory, clipper_cls = _models(4, classes)[case]
    torch.manual_seed(seed)
    model = factory().double()
    reference = factory().double()
    reference.load_state_dict(model.state_dict())
    x, y = _data(k, 4, classes, seed)
    clipper = clipper_cls(model)
    loss, clipped = clipper.clipped_sum(x, y, C)
    want, want_loss, want_clipped = naive_clipped_sum(reference, x, y, C)
    _assert_close(clipper.grad, want)
    assert loss == pytest.approx(want_loss, rel=1e-12, abs=1e-12)
    assert clipped == want_clipped


@pytest.mark.parametrize("frozen", [(0,), (2,), (2, 4), (0, 6), (6,)])
def test_frozen_linears_of_a_plain_chain_are_skipped_not_shifted(frozen):
    """A frozen Linear in an nn.Sequential of Linear and ReLU layers (the chain
    the clipper differentiates by hand): the trainable layers after it were
    paired with other layers' inputs and gradients (a clipped sum off by as
    much as the sum itself, clipped by the wrong norms); a frozen first
    Linear crashed. Against the naive loop over the trainable parameters."""
    from engine.dp.module_engine import frozen_to_buffers

    def factory():
        return nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 7), nn.ReLU(),
                             nn.Linear(7, 6), nn.ReLU(), nn.Linear(6, 3)).double()

    torch.manual_seed(0)
    model, reference = factory(), factory()
    reference.load_state_dict(model.state_dict())
    for m in (model, reference):
        for at in frozen:
            m[at].requires_grad_(False)
    frozen_to_buffers(model)  # as the module engine trains it
    x, y = _data(33, 5, 3, 1)
    for C in (None, 1e-3, 0.3):
        clipper = LayerClipper(model)
        loss, clipped = clipper.clipped_sum(x, y, C)
        want, want_loss, want_clipped = naive_clipped_sum(reference, x, y, C)
        _assert_close(clipper.grad, want)
        assert loss == pytest.approx(want_loss, rel=1e-12) and clipped == want_clipped


def test_fallback_is_exercised():
    """The rule cases above use their rules, the fallback case torch.func."""
    assert all(has_fast_rule(m) for m in (nn.Linear(2, 2), nn.LayerNorm(2), nn.Conv1d(1, 1, 1)))
    assert not has_fast_rule(nn.PReLU())


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_clipped_norms_never_exceed_C(backend, dtype):
    """After clipping, each example's gradient norm is at most C (up to rounding)."""
    spec = MLPSpec.build(6, (8,), 2)
    params = init_params(spec, 3, dtype=dtype)
    grad = torch.empty_like(params)
    engine = FastMLP(spec, params, grad, capacity=64, backend=backend)
    x, y = _data(64, 6, 2, 1)
    X = torch.cat([x, torch.ones(64, 1, dtype=torch.float64)], 1).to(dtype)
    C = 0.002
    engine.load(X, y, torch.arange(64))
    _, clipped = engine.clipped_sum(64, C)
    assert clipped > 32
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    for i in range(64):  # each row alone: its clipped gradient
        engine.load(X, y, torch.tensor([i]))
        engine.clipped_sum(1, C)
        assert float(grad.double().norm()) <= C * (1 + tol)


def test_empty_batch_gives_zero_sum():
    spec = MLPSpec.build(3, (4,), 2)
    params = init_params(spec, 0)
    grad = torch.full_like(params, 7.0)
    engine = FastMLP(spec, params, grad)
    assert engine.clipped_sum(engine.load(torch.ones(5, 4), torch.zeros(5, dtype=torch.long),
                                          torch.empty(0, dtype=torch.long)), 1.0) == (0.0, 0)
    assert torch.count_nonzero(grad) == 0
