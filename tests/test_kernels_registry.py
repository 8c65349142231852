"""The kernel registry, and every CPU kernel against the generic torch one."""
import importlib
import types
from pathlib import Path

import pytest
import torch

from kernel_inputs import random_layers
from kernels import registry


def test_every_op_has_a_generic_and_a_cpu_kernel():
    for op in registry.OPS:
        impls = registry.implementations(op)
        assert "any" in impls and impls["any"].backend == "torch"
        assert registry.get(op, "cpu").backend == "numba"
        assert registry.get(op, torch.device("cpu"), backend="torch") is impls["any"]


def test_unknown_device_falls_back_to_torch_and_unknown_backend_fails():
    assert registry.get("clip_rows", "xpu").backend == "torch"  # nothing device-specific
    assert registry.backends("clip_rows", "cuda")[-1] == "torch"  # after the CUDA kernels
    with pytest.raises(registry.UnknownKernel):
        registry.get("clip_rows", "cpu", backend="cupy")
    with pytest.raises(ValueError):
        registry.register("no_such_op", backend="numba_cpu")
    with pytest.raises(ValueError):
        registry.register("clip_rows", backend="no_such_backend")
    with pytest.raises(ValueError, match="twice"):
        registry.register("clip_rows", backend="numba_cpu")(lambda *args: 0)


def test_each_kernel_lives_in_its_back_ends_folder():
    """kernels/<back-end>/<module>.py holds that back-end's kernel and no other's."""
    for name, backend in registry.BACKENDS.items():
        for op, fn in registry.kernels_of(name).items():
            assert fn.__module__ == f"kernels.{name}.{registry.MODULES[op]}"
            assert fn.backend == backend.family


def test_ops_generic_on_gpu_have_no_cuda_kernel_module():
    """GENERIC_ON_GPU is what the folders say (checked without importing CuPy)."""
    root = Path(registry.__file__).parent
    for name, backend in registry.BACKENDS.items():
        for op, module in registry.MODULES.items():
            if backend.device == "cuda":
                has_kernel = (root / name / f"{module}.py").exists()
                assert has_kernel == (op not in registry.GENERIC_ON_GPU), (name, op)


@pytest.fixture
def probes(monkeypatch):
    """Each GPU back-end's probe kernel replaced: ``probes[name] = exception or None``."""
    outcome: dict[str, BaseException | None] = {}
    real = importlib.import_module

    def fake_import(name):
        backend = name.split(".")[1] if name.startswith("kernels.") else None
        if name.endswith(".launch") and backend in outcome:
            def self_check():
                if outcome[backend] is not None:
                    raise outcome[backend]
                return torch.ones(1)
            return types.SimpleNamespace(self_check=self_check)
        return real(name)

    monkeypatch.setattr(registry.importlib, "import_module", fake_import)
    monkeypatch.setattr(registry, "_CHECKED", {})
    monkeypatch.setattr(registry, "_load", lambda device_type="": None)
    return outcome


def test_a_gpu_back_end_that_cannot_compile_is_not_chosen(probes):
    """numba-cuda 0.30.4 under numpy 2.5 imports, sees the GPU, then fails in
    its first compile: the probe kernel finds that before any training step."""
    probes["cupy"] = ImportError("No module named 'cupy'")
    probes["numba_cuda"] = AttributeError("module 'numpy' has no attribute 'row_stack'")
    assert registry.choose("cuda") == "torch"  # the generic kernels still run
    assert registry.choose("cuda", "torch") == "torch"
    with pytest.raises(registry.BackendUnusable,
                       match=r"numba back-end .*cannot compile or launch a kernel "
                             r"\(AttributeError: module 'numpy' has no attribute 'row_stack'\); "
                             r"usable here: torch$"):
        registry.choose(torch.device("cuda"), "numba")
    with pytest.raises(registry.BackendUnusable, match=r"cupy back-end .*not importable"):
        registry.choose("cuda", "cupy")


def test_the_first_gpu_back_end_whose_probe_runs_is_chosen_once(probes):
    probes["cupy"] = RuntimeError("nvrtc: error: invalid value for --gpu-architecture\nmore")
    probes["numba_cuda"] = None
    assert registry.choose("cuda") == "numba"
    assert registry.check("cupy") == ("cannot compile or launch a kernel (RuntimeError: nvrtc: "
                                      "error: invalid value for --gpu-architecture)")
    probes["numba_cuda"] = RuntimeError("not probed again")
    assert registry.check("numba_cuda") is None  # cached per process
    probes.clear()  # any probe now would import the real modules, which fail here
    assert registry.choose("cpu", "numba") == "numba"  # the CPU is never probed
    assert registry.choose("cpu") is None
    with pytest.raises(ValueError, match="not a GPU back-end"):
        registry.check("numba_cpu")


def test_no_back_end_after_the_first_that_runs_is_compiled(probes):
    probes["cupy"] = None
    probes["numba_cuda"] = AssertionError("numba-cuda compiled although CuPy runs")
    assert registry.choose("cuda") == "cupy"
    assert "numba_cuda" not in registry._CHECKED


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("k", [0, 1, 50])
@pytest.mark.parametrize("C", [1e-3, 2.0, 1e6])
def test_clip_rows_numba_equals_torch(dtype, k, C):
    outs = {}
    for backend in ("numba", "torch"):
        acts, grads = random_layers(k, (5, 7, 3), dtype, seed=k)
        factors = torch.full((k + 2,), -1.0, dtype=dtype)
        n = registry.get("clip_rows", "cpu", backend)(acts, grads, C, factors)
        outs[backend] = (n, factors[:k], grads)
    (n1, f1, g1), (n2, f2, g2) = outs["numba"], outs["torch"]
    assert n1 == n2
    tol = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-12, atol=0)
    assert torch.allclose(f1, f2, **tol)
    assert all(torch.allclose(a, b, **tol) for a, b in zip(g1, g2))
    assert bool((f1 <= 1).all()) and bool((f1 > 0).all())


def test_clip_rows_reference_values():
    """One example, one layer, by hand: |g| = |a| |b| = sqrt(2) * 5."""
    acts = [torch.tensor([[1.0, 1.0]], dtype=torch.float64)]  # ones column included
    grads = [torch.tensor([[3.0, 4.0]], dtype=torch.float64)]
    factors = torch.empty(1, dtype=torch.float64)
    for backend in ("numba", "torch"):
        g = [grads[0].clone()]
        assert registry.get("clip_rows", "cpu", backend)(acts, g, 1.0, factors) == 1
        assert factors[0].item() == pytest.approx(1 / (5 * 2 ** 0.5), rel=1e-14)


@pytest.mark.parametrize("k", [0, 3, 40])
def test_relu_backward_numba_equals_torch(k):
    g = torch.Generator().manual_seed(k)
    out_full = torch.randn(k, 9, generator=g).clamp_min(0)
    grad = torch.randn(k, 8, generator=g)
    a, b = grad.clone(), grad.clone()
    registry.get("relu_backward", "cpu", "numba")(a, out_full[:, :8])
    registry.get("relu_backward", "cpu", "torch")(b, out_full[:, :8])
    assert torch.equal(a, b)
    assert torch.equal(a, grad * (out_full[:, :8] > 0))


def _relu_outputs(k: int, d: int, layout: str, seed: int) -> torch.Tensor:
    """A ReLU output ``[k, d]`` laid out as ``layout`` says: ``contiguous``; ``ones``
    (the engine's: the leading columns of a buffer with a column of ones);
    ``inner`` (columns 1..d of a wider buffer: the rows' buffer would reach
    past the storage); ``transposed`` (columns not adjacent)."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(k, d + 1, generator=g).clamp_min(0)
    return {"contiguous": full[:, :d].contiguous(), "ones": full[:, :d],
            "inner": full[:, 1:], "transposed": full[:, :d].t().contiguous().t()}[layout]


@pytest.mark.parametrize("layout", ["contiguous", "ones", "inner", "transposed"])
@pytest.mark.parametrize("k", [0, 1, 40])
def test_relu_backward_numba_reads_rows_in_their_buffer_only_where_it_can(layout, k):
    from kernels.numba_cpu.relu_backward import rows_in_their_buffer

    out = _relu_outputs(k, 8, layout, seed=k)
    grad = torch.randn(k, 8, generator=torch.Generator().manual_seed(k + 1))
    want = grad * (out > 0)
    got = grad.clone()
    registry.get("relu_backward", "cpu", "numba")(got, out)
    assert torch.equal(got, want)
    rows = rows_in_their_buffer(out)
    assert rows[:, :8].tolist() == out.tolist()
    if k > 1:  # (an array of one row or none is contiguous whatever its strides)
        assert rows.flags.c_contiguous == (layout in ("contiguous", "ones"))


@pytest.mark.parametrize("classes", [2, 5])
@pytest.mark.parametrize("k", [0, 1, 30])
def test_softmax_xent_numba_equals_torch_and_autograd(classes, k):
    g = torch.Generator().manual_seed(classes * 100 + k)
    logits = torch.randn(k, classes, generator=g, dtype=torch.float64) * 5
    labels = torch.randint(0, classes, (k,), generator=g)
    z = logits.clone().requires_grad_()
    want_loss = torch.nn.functional.cross_entropy(z, labels, reduction="sum")
    want_grad = torch.autograd.grad(want_loss, z)[0] if k else torch.zeros(0, classes)
    for backend in ("numba", "torch"):
        grad = torch.empty(k, classes, dtype=torch.float64)
        loss = registry.get("softmax_xent", "cpu", backend)(logits, labels, grad)
        assert loss == pytest.approx(float(want_loss.detach()), rel=1e-12, abs=1e-12)
        assert torch.allclose(grad, want_grad.to(grad.dtype), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_softmax_xent_refuses_a_label_out_of_range(backend):
    grad = torch.empty(2, 3)
    with pytest.raises((IndexError, RuntimeError)):
        registry.get("softmax_xent", "cpu", backend)(torch.zeros(2, 3), torch.tensor([0, 3]),
                                                     grad)


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("k", [0, 1, 37])
@pytest.mark.parametrize("with_extra", [False, True])
def test_clip_linear_rows_is_the_per_example_loop(backend, k, with_extra):
    """Three Linear layers (one without bias, the first one's input a strided
    view), rows clipped to C = 1: norms, factors and scaled rows as the
    per-example gradients give them."""
    g = torch.Generator().manual_seed(k + 7 * with_extra)
    full = torch.randn(k, 6, generator=g)
    acts = [full[:, :5], torch.randn(k, 4, generator=g), torch.randn(k, 3, generator=g)]
    grads = [torch.randn(k, 4, generator=g), torch.randn(k, 3, generator=g) * 0.01,
             torch.randn(k, 2, generator=g)]
    bias = [True, False, True]
    extra = torch.rand(k, generator=g) if with_extra else None
    want_sq = torch.zeros(k, dtype=torch.float64) if extra is None else extra.double().clone()
    for a, b, has_bias in zip(acts, grads, bias):
        for i in range(k):
            w = torch.outer(b[i], a[i]).double()
            want_sq[i] += w.square().sum() + (b[i].double().square().sum() if has_bias else 0)
    want_f = torch.clamp(1.0 / want_sq.sqrt(), max=1.0)
    scaled = [b.clone() for b in grads]
    factors = torch.empty(k)
    clipped = registry.get("clip_linear_rows", "cpu", backend)(acts, scaled, bias, extra, 1.0,
                                                               factors)
    assert clipped == int((want_sq.sqrt() > 1.0).sum())
    assert torch.allclose(factors.double(), want_f, rtol=1e-5)
    for b, s in zip(grads, scaled):
        assert torch.allclose(s, b * want_f[:, None].float(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sgd_update_numba_equals_torch(dtype):
    g = torch.Generator().manual_seed(3)
    p0, v0 = torch.randn(1001, generator=g, dtype=dtype), torch.randn(1001, generator=g, dtype=dtype)
    grad = torch.randn(1001, generator=g, dtype=dtype)
    out = {}
    for backend in ("numba", "torch"):
        p, v = p0.clone(), v0.clone()
        registry.get("sgd_update", "cpu", backend)(p, v, grad, 0.25, 0.1, 0.9)
        out[backend] = (p, v)
    want_v = 0.9 * v0.double() + 0.25 * grad.double()
    want_p = p0.double() - 0.1 * want_v
    tol = 1e-6 if dtype == torch.float32 else 1e-14
    for p, v in out.values():
        assert torch.allclose(v.double(), want_v, rtol=tol, atol=tol)
        assert torch.allclose(p.double(), want_p, rtol=tol, atol=tol)
    assert torch.allclose(out["numba"][0], out["torch"][0], rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("k", [0, 7])
def test_bound_kernels_equal_direct_calls(backend, k):
    """registry.bind fixes the buffers once; calls then match the plain kernel on
    the same inputs, and see the buffers' new contents every call."""
    assert hasattr(registry.get("clip_rows", "cpu", "numba"), "bind")  # views made once
    acts, grads = random_layers(k, (6, 5, 3), torch.float64, seed=k)
    for op, buffers, rest in (
            ("clip_rows", {"acts": acts, "grads": grads, "factors": torch.zeros(k + 2,
                                                                              dtype=torch.float64)},
             {"max_norm": 0.5}),
            ("relu_backward", {"grad": grads[0], "out": acts[1][:, :-1]}, {}),
            ("softmax_xent", {"logits": grads[-1], "labels": torch.arange(k) % 3,
                              "grad": torch.empty(k, 3, dtype=torch.float64)}, {}),
            ("sgd_update", {"params": torch.linspace(-1, 1, 3, dtype=torch.float64),
                            "velocity": torch.ones(3, dtype=torch.float64),
                            "grad": torch.full((3,), 2.0, dtype=torch.float64)},
             {"scale": 0.5, "lr": 0.1, "momentum": 0.9})):
        kernel = registry.get(op, "cpu", backend)
        twin = {name: ([t.clone() for t in b] if isinstance(b, (list, tuple)) else b.clone())
                for name, b in buffers.items()}
        bound = registry.bind(kernel, **buffers)
        for _ in range(2):  # the second call sees what the first one wrote
            got, want = bound(**rest), kernel(**twin, **rest)
            assert got == want
            for name, b in buffers.items():
                for x, y in zip(b if isinstance(b, (list, tuple)) else [b],
                                twin[name] if isinstance(b, (list, tuple)) else [twin[name]]):
                    assert torch.equal(x, y), (op, name)


def test_clip_rows_bound_on_one_thread_or_many_gives_the_same_numbers():
    """Bound with one Numba thread, clip_rows runs its serial twin (no parallel
    region to start); with more, the parallel kernel: the same factors, rows
    and count either way, and the torch kernel's."""
    import numba

    acts, grads = random_layers(37, (6, 5, 3), torch.float32, seed=4)
    before = numba.get_num_threads()
    out = []
    try:
        for threads in (1, numba.config.NUMBA_NUM_THREADS):
            numba.set_num_threads(threads)
            g = [t.clone() for t in grads]
            f = torch.zeros(37)
            n = registry.bind(registry.get("clip_rows", "cpu", "numba"), acts=acts, grads=g,
                              factors=f)(max_norm=2.0)
            out.append((n, f, g))
    finally:
        numba.set_num_threads(before)
    g = [t.clone() for t in grads]
    f = torch.zeros(37)
    out.append((registry.get("clip_rows", "cpu", "torch")(acts, g, 2.0, f), f, g))
    assert 0 < out[0][0] < 37
    (n1, f1, g1), (n2, f2, g2), (n3, f3, g3) = out
    assert n1 == n2 and torch.equal(f1, f2)  # Numba, serial and parallel: bit for bit
    assert all(torch.equal(x, y) for x, y in zip(g1, g2))
    assert n3 == n1 and torch.allclose(f3, f1, rtol=1e-5)  # torch's, within rounding
    assert all(torch.allclose(x, y, rtol=1e-5, atol=1e-7) for x, y in zip(g3, g1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("k", [0, 1, 37])
def test_gather_rows_numba_equals_torch_and_indexing(dtype, k):
    g = torch.Generator().manual_seed(k)
    X = torch.randn(200, 11, generator=g, dtype=dtype)
    y = torch.randint(0, 5, (200,), generator=g)
    rows = torch.randint(0, 200, (k,), generator=g).sort().values
    for backend in ("numba", "torch"):
        kernel = registry.get("gather_rows", "cpu", backend)
        out = torch.full((k, 11), float("nan"), dtype=dtype)
        labels = torch.full((k,), -1, dtype=torch.int64)
        kernel(X, y, rows, out, labels)
        assert torch.equal(out, X[rows]) and torch.equal(labels, y[rows])
        bound = registry.bind(kernel, X=X, y=y, out=out, out_labels=labels)
        out.zero_()
        bound(rows=rows)
        assert torch.equal(out, X[rows])
        narrow = torch.full((k, 10), float("nan"), dtype=dtype)  # all but the last column
        kernel(X, y, rows, narrow, labels)
        assert torch.equal(narrow, X[rows, :10])


def test_gather_rows_refuses_an_output_wider_than_the_rows():
    kernel = registry.get("gather_rows", "cpu", "numba")
    X, y = torch.zeros(10, 3), torch.zeros(10, dtype=torch.int64)
    with pytest.raises(ValueError, match="wider"):
        kernel(X, y, torch.tensor([2]), torch.empty(1, 4), torch.empty(1, dtype=torch.int64))


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_gather_rows_refuses_a_row_out_of_range(backend):
    kernel = registry.get("gather_rows", "cpu", backend)
    X, y = torch.zeros(10, 3), torch.zeros(10, dtype=torch.int64)
    with pytest.raises(IndexError):
        kernel(X, y, torch.tensor([2, 10]), torch.empty(2, 3), torch.empty(2, dtype=torch.int64))


@pytest.mark.parametrize("parts", [2, 3, 5])
@pytest.mark.parametrize("k", [0, 1, 2, 5, 37])
def test_gather_rows_in_parts_equals_indexing_and_refuses_bad_rows(parts, k):
    """At several threads each copies one part of the rows (the parted kernel;
    here more parts than the machine may have cores); a bad index is refused
    wherever it lies, not lost in a parallel loop."""
    from kernels.numba_cpu.gather_rows import _gather_parts

    g = torch.Generator().manual_seed(k)
    X = torch.randn(300, 9, generator=g)
    y = torch.randint(0, 5, (300,), generator=g)
    rows = torch.randint(0, 300, (k,), generator=g)
    out = torch.full((k, 8), float("nan"))
    labels = torch.full((k,), -1, dtype=torch.int64)
    arrays = (X.numpy(), y.numpy(), rows.numpy(), out.numpy(), labels.numpy())
    _gather_parts(*arrays, parts)
    assert torch.equal(out, X[rows, :8]) and torch.equal(labels, y[rows])
    for i, bad in ((k - 1, 300), (0, -1)):
        if k:
            wrong = rows.clone()
            wrong[i] = bad
            with pytest.raises(IndexError, match="out of range"):
                _gather_parts(X.numpy(), y.numpy(), wrong.numpy(), out.numpy(),
                              labels.numpy(), parts)


def test_gather_rows_binds_the_parted_kernel_at_several_threads():
    import numba

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one core")
    kernel = registry.get("gather_rows", "cpu", "numba")
    X, y = torch.randn(50, 4), torch.arange(50)
    rows = torch.tensor([49, 3, 3, 0, 17])
    before = numba.get_num_threads()
    try:
        for threads in (1, 2):
            numba.set_num_threads(threads)
            out, labels = torch.empty(5, 4), torch.empty(5, dtype=torch.int64)
            registry.bind(kernel, X=X, y=y, out=out, out_labels=labels)(rows=rows)
            assert torch.equal(out, X[rows]) and torch.equal(labels, y[rows])
    finally:
        numba.set_num_threads(before)


def test_a_forced_gpu_back_end_without_an_op_gets_the_generic_kernel():
    """--kernels cupy (or numba_cuda) on a GPU: the ops generic on GPUs (the
    batch gather, the SGD update, per-group clipping) come from torch instead
    of failing; get() itself still refuses the pair."""
    for op in registry.GENERIC_ON_GPU:
        for backend in ("cupy", "numba"):
            assert registry.get_or_best(op, "cuda", backend).backend == "torch"
            with pytest.raises(registry.UnknownKernel):
                registry.get(op, "cuda", backend)
    assert registry.get_or_best("clip_rows", "cpu", "numba").backend == "numba"
