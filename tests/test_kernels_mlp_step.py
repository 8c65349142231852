"""The fused ``mlp_step`` (one Numba call per step) against the composed ops, and
the BLAS call it is built on."""
import numba
import numpy as np
import pytest
import torch

from engine.dp.fast_mlp import FastMLP
from engine.nn.mlp import MLPSpec, init_params
from kernels import registry
from kernels.numba_cpu import blas, mlp_step

DTYPES = [torch.float32, torch.float64]


@numba.njit
def _product(fn, trans_a, trans_b, m, n, k, a, lda, b, ldb, beta, c, ldc):
    scratch = np.zeros(8, dtype=np.int32)
    scalars = np.zeros(2, dtype=c.dtype)
    blas.gemm(fn, scratch, scalars, trans_a, trans_b, m, n, k, a, lda, b, ldb, beta, c, ldc)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (False, True), (True, False),
                                             (True, True)])
def test_gemm_is_the_row_major_product_and_writes_only_its_columns(dtype, trans_a, trans_b):
    fn = blas.gemm_address(dtype)
    assert fn is not None, "torch's CPU build exports no BLAS gemm here"
    rng = np.random.default_rng(0)
    m, n, k = 5, 7, 3
    a = rng.standard_normal((k, m) if trans_a else (m, k)).astype(dtype)
    b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(dtype)
    c = np.full((m, n + 2), 3.0, dtype=dtype)  # a row stride past its n columns
    _product(fn, trans_a, trans_b, m, n, k, a, a.shape[1], b, b.shape[1], 0.5, c, n + 2)
    want = 0.5 * 3.0 + (a.T if trans_a else a).astype(np.float64) @ (b.T if trans_b else b)
    np.testing.assert_allclose(c[:, :n], want, rtol=1e-5 if dtype == np.float32 else 1e-12)
    assert (c[:, n:] == 3.0).all()


def test_gemm_is_torchs_own_routine_bit_for_bit():
    """The routine called is the one torch.mm calls: equal to the last bit."""
    g = torch.Generator().manual_seed(1)
    a, w = torch.randn(256, 101, generator=g), torch.randn(128, 101, generator=g)
    c = np.empty((256, 128), dtype=np.float32)
    _product(blas.gemm_address(np.float32), False, True, 256, 128, 101, a.numpy(), 101,
             w.numpy(), 101, 0.0, c, 128)
    assert torch.equal(torch.from_numpy(c), a @ w.t())


@pytest.fixture
def one_part(monkeypatch):
    """The whole batch in one part (the step at one thread): only then is the
    fused step the composed one bit for bit."""
    monkeypatch.setattr(mlp_step, "row_split_parts", lambda threads=None: 1)


@pytest.fixture(params=[2, 3])
def parts(request, monkeypatch):
    """The batch's rows cut into this many parts (the threads run them, however
    many there are)."""
    monkeypatch.setattr(mlp_step, "row_split_parts", lambda threads=None: request.param)
    return request.param


def _close(dtype):
    """Tolerances of sums reordered by the parts (float32 or float64 rounding)."""
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else \
        {"rtol": 1e-12, "atol": 1e-12}


def _engines(spec, dtype, capacity):
    """The fused engine and the composed one (same Numba ops, composed in Python),
    on the same parameters."""
    params = init_params(spec, 3, dtype=dtype)
    fused = FastMLP(spec, params, torch.full_like(params, float("nan")), capacity=capacity)
    composed = FastMLP(spec, params, torch.full_like(params, float("nan")), capacity=capacity)
    composed.fused = None
    composed._views = {}
    assert fused.backends["mlp_step"] == "numba" and composed.backends["mlp_step"] == "composed"
    return fused, composed


def _batch(n_features, classes, n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    X = torch.cat([torch.randn(n, n_features, generator=g, dtype=dtype),
                   torch.ones(n, 1, dtype=dtype)], 1)
    return X, torch.randint(0, classes, (n,), generator=g)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [(), (9,), (16, 8)])
@pytest.mark.parametrize("k", [1, 7, 130])
@pytest.mark.parametrize("max_norm", [None, 1e-3, 0.5, 1e9])
def test_fused_step_equals_the_composed_ops_bit_for_bit(dtype, hidden, k, max_norm, one_part):
    spec = MLPSpec.build(12, hidden, 3)
    fused, composed = _engines(spec, dtype, capacity=4)  # both grow to k
    X, y = _batch(12, 3, 200, dtype, seed=k)
    rows = torch.randperm(200, generator=torch.Generator().manual_seed(k))[:k].sort().values
    got = [fused.load(X, y, rows), *fused.clipped_sum(k, max_norm)]
    want = [composed.load(X, y, rows), *composed.clipped_sum(k, max_norm)]
    assert got == want
    assert torch.equal(fused.grad, composed.grad)
    assert torch.equal(fused.factors[:k], composed.factors[:k]) or max_norm is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_step_clips_households_as_the_composed_ops_do(dtype, one_part):
    spec = MLPSpec.build(6, (8,), 2)
    fused, composed = _engines(spec, dtype, capacity=64)
    X, y = _batch(6, 2, 64, dtype, seed=2)
    groups = torch.tensor([0, 1, 4, 5, 12, 30, 64])
    for engine in (fused, composed):
        engine.load(X, y, torch.arange(64))
    assert fused.clipped_sum(64, 0.05, groups) == composed.clipped_sum(64, 0.05, groups)
    assert torch.equal(fused.grad, composed.grad)


@pytest.mark.parametrize("cut", [1, 2])
def test_a_nan_spreads_as_through_the_composed_ops(cut, monkeypatch):
    """A NaN input stays NaN through the fused ReLU (torch.clamp_min keeps it), so
    the trainer's divergence check sees it."""
    monkeypatch.setattr(mlp_step, "row_split_parts", lambda threads=None: cut)
    spec = MLPSpec.build(4, (5, 3), 2)
    fused, composed = _engines(spec, torch.float32, capacity=8)
    X, y = _batch(4, 2, 8, torch.float32, seed=0)
    X[3, 1] = float("nan")
    for engine in (fused, composed):
        engine.load(X, y, torch.arange(8))
        engine.clipped_sum(8, None)
    assert torch.isnan(fused.grad).any()
    assert torch.equal(torch.isnan(fused.grad), torch.isnan(composed.grad))


def test_without_a_blas_gemm_the_engine_composes_the_ops(monkeypatch):
    monkeypatch.setattr(mlp_step, "gemm_address", lambda dtype: None)
    spec = MLPSpec.build(5, (4,), 2)
    params = init_params(spec, 0)
    engine = FastMLP(spec, params, torch.zeros_like(params), capacity=8)
    assert engine.fused is None and engine.backends["mlp_step"] == "composed"
    X, y = _batch(5, 2, 8, torch.float32, seed=1)
    engine.load(X, y, torch.arange(8))
    loss, _ = engine.clipped_sum(8, 1.0)
    assert np.isfinite(loss) and engine.grad.abs().sum() > 0
    A, _, Z, G, labels, _ = engine._slices(8)
    with pytest.raises(ValueError, match="cannot run"):
        mlp_step.mlp_step(A, G, engine.W, engine.G_out, Z[-1], labels, engine.factors, 1.0)


def test_the_environment_switch_turns_the_fused_step_off(monkeypatch):
    monkeypatch.setenv("MPIDP_NO_FUSED_STEP", "1")
    spec = MLPSpec.build(5, (4,), 2)
    params = init_params(spec, 0)
    assert FastMLP(spec, params, torch.zeros_like(params)).backends["mlp_step"] == "composed"


def test_fused_lookup_by_device_and_back_end():
    assert registry.fused("mlp_step", "cpu").backend == "numba"
    assert registry.fused("mlp_step", torch.device("cpu"), backend="numba") is not None
    assert registry.fused("mlp_step", "cpu", backend="torch") is None  # --kernels torch
    assert registry.fused("mlp_step", "cuda") is None
    with pytest.raises(ValueError, match="unknown fused op"):
        registry.register_fused("no_such_step", backend="numba_cpu")
    with pytest.raises(ValueError, match="twice"):
        registry.register_fused("mlp_step", backend="numba_cpu")(lambda: None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [1, 7, 130])
@pytest.mark.parametrize("max_norm", [None, 1e-3, 0.5])
def test_rows_cut_into_parts_give_the_composed_sums(dtype, k, max_norm, parts):
    """Each part (a thread's rows) runs the whole step on its rows; the sums are
    the composed step's up to the order of the additions; the losses, the
    clip factors and the count of clipped rows are the rows' own. Batches
    smaller than the parts leave parts empty."""
    spec = MLPSpec.build(12, (16, 8), 3)
    fused, composed = _engines(spec, dtype, capacity=4)
    X, y = _batch(12, 3, 200, dtype, seed=k)
    rows = torch.randperm(200, generator=torch.Generator().manual_seed(k))[:k].sort().values
    fused.load(X, y, rows)
    composed.load(X, y, rows)
    loss, clipped = fused.clipped_sum(k, max_norm)
    want_loss, want_clipped = composed.clipped_sum(k, max_norm)
    assert fused._slices(k)[5][4].parts == parts
    assert clipped == want_clipped
    assert loss == pytest.approx(want_loss, rel=1e-6 if dtype == torch.float32 else 1e-13)
    torch.testing.assert_close(fused.grad, composed.grad, **_close(dtype))
    if max_norm is not None:
        torch.testing.assert_close(fused.factors[:k], composed.factors[:k], **_close(dtype))
    again = fused.grad.clone()
    fused.load(X, y, rows)
    assert fused.clipped_sum(k, max_norm) == (loss, clipped)
    assert torch.equal(fused.grad, again)  # the parts' sums are added in a fixed order


@pytest.mark.parametrize("dtype", DTYPES)
def test_parts_keep_households_whole(dtype, parts):
    spec = MLPSpec.build(6, (8, 4), 2)
    fused, composed = _engines(spec, dtype, capacity=64)
    X, y = _batch(6, 2, 64, dtype, seed=2)
    groups = torch.tensor([0, 1, 4, 5, 12, 30, 64])  # one household crosses every cut
    for engine in (fused, composed):
        engine.load(X, y, torch.arange(64))
    got, want = fused.clipped_sum(64, 0.05, groups), composed.clipped_sum(64, 0.05, groups)
    assert got[1] == want[1] and got[0] == pytest.approx(want[0], rel=1e-6)
    torch.testing.assert_close(fused.grad, composed.grad, **_close(dtype))
    factors = fused.factors[:64]
    for lo, hi in zip(groups[:-1].tolist(), groups[1:].tolist()):
        assert torch.equal(factors[lo:hi], factors[lo].expand(hi - lo))  # one factor each


@pytest.mark.parametrize("k,parts_,groups,bounds,firsts", [
    (10, 2, None, [0, 5, 10], [0, 0, 0]),
    (10, 3, None, [0, 3, 6, 10], [0, 0, 0, 0]),
    (1, 3, None, [0, 0, 0, 1], [0, 0, 0, 0]),
    (0, 2, None, [0, 0, 0], [0, 0, 0]),
    (64, 2, [0, 1, 4, 5, 12, 30, 64], [0, 64, 64], [0, 6, 6]),     # cut inside the last
    (64, 3, [0, 1, 4, 5, 12, 30, 64], [0, 30, 64, 64], [0, 5, 6, 6]),
    (6, 3, [0, 2, 4, 6], [0, 2, 4, 6], [0, 1, 2, 3]),
    (6, 2, [0, 3, 6], [0, 3, 6], [0, 1, 2]),
])
def test_split_bounds_cut_rows_evenly_and_only_between_groups(k, parts_, groups, bounds,
                                                               firsts):
    mode = mlp_step.ROWS if groups is None else mlp_step.GROUPS
    starts = mlp_step._NO_GROUPS if groups is None else np.array(groups, dtype=np.int64)
    got_bounds = np.empty(parts_ + 1, dtype=np.int64)
    got_firsts = np.empty(parts_ + 1, dtype=np.int64)
    mlp_step._split_bounds(k, mode, starts, got_bounds, got_firsts)
    assert got_bounds.tolist() == bounds and got_firsts.tolist() == firsts


def test_blas_threads_are_restored_after_a_cut_step(parts):
    """Each part asks MKL for sequential products on its thread and gives the
    thread's setting back: torch's own products on the calling thread keep
    their threads."""
    import ctypes

    library = blas._torch_library()
    max_threads = library.mkl_get_max_threads
    max_threads.restype = ctypes.c_int
    before = max_threads()
    spec = MLPSpec.build(12, (16, 8), 3)
    fused, _ = _engines(spec, torch.float32, capacity=64)
    X, y = _batch(12, 3, 64, torch.float32, seed=1)
    fused.load(X, y, torch.arange(64))
    fused.clipped_sum(64, 1.0)
    assert max_threads() == before


def test_a_bad_label_in_a_part_is_an_error(parts):
    spec = MLPSpec.build(4, (5, 3), 2)
    fused, _ = _engines(spec, torch.float32, capacity=8)
    X, y = _batch(4, 2, 8, torch.float32, seed=0)
    y[7] = 5
    fused.load(X, y, torch.arange(8))
    with pytest.raises(IndexError, match="outside 0 .. classes - 1"):
        fused.clipped_sum(8, 1.0)


def test_parts_follow_the_threads_unless_switched_off(monkeypatch):
    assert mlp_step.row_split_parts(1) == 1
    assert mlp_step.row_split_parts(4) == 4
    monkeypatch.setenv(mlp_step.SPLIT_SWITCH, "1")
    assert mlp_step.row_split_parts(4) == 1
    monkeypatch.delenv(mlp_step.SPLIT_SWITCH)
    monkeypatch.setattr(mlp_step, "threads_address", lambda: None)  # no per-thread setter
    assert mlp_step.row_split_parts(4) == 1


def test_the_step_at_the_machines_threads_cuts_its_rows():
    """Unpatched: at Numba's thread count (2 or more here), a real cut."""
    threads = numba.config.NUMBA_NUM_THREADS
    if threads < 2:
        pytest.skip("one core: nothing to cut")
    before = numba.get_num_threads()
    numba.set_num_threads(2)
    try:
        spec = MLPSpec.build(12, (16, 8), 3)
        fused, composed = _engines(spec, torch.float32, capacity=300)
        X, y = _batch(12, 3, 300, torch.float32, seed=3)
        for engine in (fused, composed):
            engine.load(X, y, torch.arange(300))
        assert fused._slices(300)[5][4].parts == 2
        assert fused.clipped_sum(300, 0.5)[1] == composed.clipped_sum(300, 0.5)[1]
        torch.testing.assert_close(fused.grad, composed.grad, **_close(torch.float32))
    finally:
        numba.set_num_threads(before)


def test_bindings_for_many_batch_sizes_share_one_scratch(parts):
    """Poisson batches come in many sizes, each bound once: the parts' sums
    buffer is allocated once per model shape, not per size."""
    spec = MLPSpec.build(12, (16, 8), 3)
    fused, _ = _engines(spec, torch.float32, capacity=64)
    before = len(mlp_step._WORKSPACES)
    X, y = _batch(12, 3, 64, torch.float32, seed=1)
    for k in (5, 17, 40, 64):
        fused.load(X, y, torch.arange(k))
        fused.clipped_sum(k, 1.0)
    bound = [fused._slices(k)[5][4] for k in (5, 17, 40, 64)]
    assert all(b.partial is bound[0].partial for b in bound)
    assert bound[0].partial.shape == (parts, spec.n_params)
    assert len(mlp_step._WORKSPACES) <= before + 1


def test_the_step_mode_line_says_when_rows_are_cut(monkeypatch):
    from kernels.probe import mlp_step_mode

    assert mlp_step_mode(1) == "the MLP step in one call (torch's BLAS sgemm_)"
    assert mlp_step_mode(4).endswith(", its rows cut over 4 threads")
    assert mlp_step_mode(runs=True).endswith("cut over a rank's threads when it has several")
    monkeypatch.setenv(mlp_step.SPLIT_SWITCH, "1")
    assert mlp_step_mode(4) == mlp_step_mode(runs=True) == mlp_step_mode(1)
    monkeypatch.setenv(mlp_step.SWITCH, "1")
    assert mlp_step_mode(4).startswith("the MLP step composed op by op")
