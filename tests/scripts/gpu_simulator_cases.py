"""The Numba CUDA kernels under NUMBA_ENABLE_CUDASIM=1, against the CPU and by hand.

Run by tests/test_gpu_kernels.py in a subprocess with the simulator on (it
must never leak into other tests; compile checks need it off). Not collected
by the normal suite. Shapes are tiny: every simulated thread is a Python
thread. The kernels are called through the registry, exactly as the engine
calls them on a GPU, with CPU tensors standing in for device memory.
"""
import io
import os

import numba
import numpy as np
import pytest
import torch

from kernel_inputs import cpu_clip_rows, random_layers  # tests/, on PYTHONPATH
from kernels import registry
from kernels.common import philox

assert os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", "run with NUMBA_ENABLE_CUDASIM=1"
assert numba.config.ENABLE_CUDASIM

DTYPES = [torch.float32, torch.float64]


def tol(dtype):
    return dict(rtol=2e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-12, atol=0)


def cuda_kernel(op):
    fn = registry.get(op, "cuda", "numba")
    assert fn.__module__.startswith("kernels.numba_cuda."), fn.__module__
    return fn


def _naive_clip(acts, grads, C):
    """Per-example gradients materialised: g_i = sum over layers of outer products."""
    k = grads[0].shape[0]
    norms = torch.zeros(k, dtype=torch.float64)
    for i in range(k):
        norms[i] = sum(float(torch.outer(g[i], a[i]).double().square().sum())
                       for a, g in zip(acts, grads)) ** 0.5
    factors = torch.clamp(C / norms, max=1.0)
    return factors, [g.double() * factors[:, None] for g in grads]


def test_the_cuda_registry_under_the_simulator_is_numba():
    for op in registry.OPS:
        assert registry.backends(op, "cuda")[-1] == "torch"
        if op in registry.GENERIC_ON_GPU:
            assert registry.backends(op, "cuda") == ["torch"]
        else:
            assert "numba" in registry.backends(op, "cuda")


def test_the_numba_probe_kernel_compiles_and_runs():
    """What the engine checks before choosing the back-end on a GPU."""
    assert registry.check("numba_cuda") is None
    assert registry.choose("cuda") in ("cupy", "numba")  # CuPy first where it is installed
    assert registry.choose("cuda", "numba") == "numba"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,C", [(0, 1.0), (1, 1e6), (5, 0.3), (6, 1e-3)])
def test_clip_rows_matches_cpu_and_the_naive_loop(dtype, k, C):
    acts, grads = random_layers(k, (5, 7, 3), dtype, seed=k)
    cpu_grads = [g.clone() for g in grads]
    want_f, want_g = _naive_clip(acts, grads, C) if k else (None, None)
    factors = torch.full((k + 2,), -1.0, dtype=dtype)
    cpu_factors = factors.clone()
    n = cuda_kernel("clip_rows")(acts, grads, C, factors)
    n_cpu = cpu_clip_rows()(acts, cpu_grads, C, cpu_factors)
    assert n == n_cpu
    assert torch.equal(factors[k:], torch.full((2,), -1.0, dtype=dtype))  # untouched
    if k == 0:
        return
    assert n == int((want_f < 1).sum())
    assert torch.allclose(factors[:k], cpu_factors[:k], **tol(dtype))
    assert torch.allclose(factors[:k].double(), want_f, **tol(dtype))
    for g, c, w in zip(grads, cpu_grads, want_g):
        assert torch.allclose(g, c, **tol(dtype))
        assert torch.allclose(g.double(), w, **tol(dtype))


@pytest.mark.parametrize("layers", [1, 2, 4, 5])
def test_clip_rows_fused_and_by_layer_match_the_cpu(layers):
    """Up to FUSED_LAYERS layers one fused kernel clips; beyond, one launch per layer."""
    acts, grads = random_layers(6, (4, 3, 5, 2, 3, 4)[:layers + 1], torch.float32, seed=layers)
    cpu = [g.clone() for g in grads]
    norms = sum(a.double().square().sum(1) * g.double().square().sum(1)
                for a, g in zip(acts, grads)).sqrt()
    s = norms.sort().values
    C = float(s[len(s) // 2 - 1] + s[len(s) // 2]) / 2  # between two rows' norms: half clipped
    factors, cpu_factors = torch.empty(6), torch.empty(6)
    count = torch.full((1,), -1, dtype=torch.int32)
    assert cuda_kernel("clip_rows")(acts, grads, C, factors, count=count) is None
    n = cpu_clip_rows()(acts, cpu, C, cpu_factors)
    assert int(count[0]) == n and 0 < n < 6
    assert torch.allclose(factors, cpu_factors, **tol(torch.float32))
    for g, c in zip(grads, cpu):
        assert torch.allclose(g, c, **tol(torch.float32))


def test_clip_kernels_stride_when_rows_outnumber_threads():
    """Launches smaller than the data (as for widths > 256 or grids past 65535 rows):
    every column, row and factor is still covered."""
    from kernels.numba_cuda.clip_rows import KERNELS

    kern = KERNELS[np.dtype(np.float32)]
    rng = np.random.default_rng(0)
    a = rng.standard_normal((11, 9)).astype(np.float32)
    g = rng.standard_normal((11, 5)).astype(np.float32)
    sq = np.zeros(11, np.float32)
    kern.row_sq_norms[11, 2](a, g, sq, False)  # 2 threads over 9 and 5 columns
    want = (a.astype(np.float64) ** 2).sum(1) * (g.astype(np.float64) ** 2).sum(1)
    assert np.allclose(sq, want, rtol=1e-6)
    factors, count = np.zeros(11, np.float32), np.zeros(1, np.int32)
    kern.clip_factors[1, 4](sq, np.float32(3.0), factors, count)  # 4 threads, 11 rows
    norms = np.sqrt(want)
    assert count[0] == int((norms > 3).sum()) and 0 < count[0] < 11
    assert np.allclose(factors, np.minimum(1, 3 / norms), rtol=1e-6)
    scaled = g.copy()
    kern.scale_rows[(2, 1), (4, 2)](scaled, factors)  # grid-stride over 11 rows
    assert np.allclose(scaled, g * factors[:, None], rtol=1e-6)
    fused_g, fused_sq, fused_f = g.copy(), np.zeros(11, np.float32), np.zeros(11, np.float32)
    unused = np.zeros((1, 1), np.float32)
    kern.fused_rows[11, 2](a, fused_g, unused, unused, unused, unused, unused, unused,
                           np.int32(1), np.float32(3.0), fused_sq, fused_f)  # 2 threads
    assert np.allclose(fused_sq, want, rtol=1e-6)
    assert np.allclose(fused_f, factors, rtol=1e-6)
    assert np.allclose(fused_g, scaled, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 1, 300])
def test_sgd_update_equals_the_cpu_and_torch_optim(dtype, n):
    g = torch.Generator().manual_seed(n)
    p0 = torch.randn(n, generator=g, dtype=dtype)
    grads = [torch.randn(n, generator=g, dtype=dtype) for _ in range(3)]
    p, v = p0.clone(), torch.zeros(n, dtype=dtype)
    p_cpu, v_cpu = p0.clone(), torch.zeros(n, dtype=dtype)
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.SGD([ref], lr=0.1, momentum=0.9)
    for grad in grads:
        cuda_kernel("sgd_update")(p, v, grad, 0.5, 0.1, 0.9)
        registry.get("sgd_update", "cpu", "numba")(p_cpu, v_cpu, grad, 0.5, 0.1, 0.9)
        ref.grad = grad * 0.5
        opt.step()
    assert torch.allclose(p, p_cpu, **tol(dtype)) and torch.allclose(v, v_cpu, **tol(dtype))
    assert torch.allclose(p, ref.detach(), **tol(dtype))


def test_sgd_update_strides_past_its_grid():
    from kernels.numba_cuda.sgd_update import KERNELS

    p, v, grad = np.zeros(37, np.float32), np.ones(37, np.float32), np.ones(37, np.float32)
    KERNELS[np.dtype(np.float32)].update[2, 4](p, v, grad, np.float32(2), np.float32(0.5),
                                               np.float32(0.5))  # 8 threads, 37 elements
    assert np.all(v == 2.5) and np.all(p == -1.25)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [0, 3, 9])
def test_relu_backward_equals_cpu_and_the_mask(dtype, k):
    g = torch.Generator().manual_seed(k)
    full = torch.randn(k, 10, generator=g, dtype=dtype).clamp_min(0)
    grad = torch.randn(k, 9, generator=g, dtype=dtype)
    a, b = grad.clone(), grad.clone()
    cuda_kernel("relu_backward")(a, full[:, :9])  # a strided view, as in the engine
    registry.get("relu_backward", "cpu", "numba")(b, full[:, :9])
    assert torch.equal(a, b)
    assert torch.equal(a, torch.where(full[:, :9] > 0, grad, 0.0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,classes", [(0, 2), (1, 2), (7, 5)])
def test_softmax_xent_matches_cpu_and_autograd(dtype, k, classes):
    g = torch.Generator().manual_seed(10 * k + classes)
    logits = torch.randn(k, classes, generator=g, dtype=dtype) * 4
    labels = torch.randint(0, classes, (k,), generator=g)
    z = logits.double().clone().requires_grad_()
    want_loss = torch.nn.functional.cross_entropy(z, labels, reduction="sum")
    want_grad = (torch.autograd.grad(want_loss, z)[0] if k
                 else torch.zeros(0, classes, dtype=torch.float64))
    want_loss = float(want_loss.detach())
    grad, cpu_grad = torch.empty(k, classes, dtype=dtype), torch.empty(k, classes, dtype=dtype)
    loss = cuda_kernel("softmax_xent")(logits, labels, grad)
    cpu_loss = registry.get("softmax_xent", "cpu", "numba")(logits, labels, cpu_grad)
    rel = 1e-5 if dtype == torch.float32 else 1e-12
    assert loss == pytest.approx(cpu_loss, rel=rel, abs=rel)
    assert loss == pytest.approx(want_loss, rel=rel, abs=rel)
    assert torch.allclose(grad, cpu_grad, **tol(dtype))
    assert torch.allclose(grad.double(), want_grad, rtol=rel, atol=rel)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gaussian_stream_is_the_philox_reference(dtype):
    make = cuda_kernel("gaussian_stream")
    stream = make(np.random.SeedSequence(11), torch.device("cpu"))
    key = tuple(stream.get_state()[:2])
    buf = torch.arange(10, dtype=dtype)
    want = buf.numpy().copy()
    stream.add_(buf, 0.5)           # 10 elements: blocks 0..2 (last one partly used)
    stream.add_(buf[3:8], 2.0)      # a slice, as the partition noise scheme passes
    counter = philox.add_reference(want, 0.5, 0, key)
    philox.add_reference(want[3:8], 2.0, counter, key)
    assert stream.get_state()[2:] == [5, 0]
    if dtype == torch.float64:
        assert np.allclose(buf.numpy(), want, rtol=1e-14, atol=1e-14)
    else:
        assert np.allclose(buf.numpy(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gaussian_stream_from_a_counter_in_device_memory(dtype):
    """take + add_at_ (the CUDA graph's split draw) add what add_ adds."""
    make = cuda_kernel("gaussian_stream")
    eager, split = make(np.random.SeedSequence(4)), make(np.random.SeedSequence(4))
    a, b = torch.zeros(21, dtype=dtype), torch.zeros(21, dtype=dtype)
    counter = torch.zeros(2, dtype=torch.int64)
    for _ in range(2):
        eager.add_(a, 0.5)
        first = split.take(21)
        counter[0], counter[1] = first & philox.MASK64, first >> 64
        split.add_at_(b, 0.5, counter)
    assert torch.equal(a, b) and eager.get_state() == split.get_state()
    counter.zero_()
    c = torch.zeros(6, dtype=dtype)
    split.add_at_(c, 1.0, counter, offset=5)
    want = np.zeros(6, dtype=c.numpy().dtype)
    philox.add_reference(want, 1.0, 5, tuple(split.get_state()[:2]))
    assert np.array_equal(c.numpy(), want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_device_outputs_equal_the_returned_values(dtype):
    """softmax_xent(losses=) and clip_rows(count=): what a CUDA graph's step reads."""
    acts, grads = random_layers(6, (5, 7, 3), dtype, seed=3)
    other = [g.clone() for g in grads]
    f1, f2 = torch.empty(6, dtype=dtype), torch.empty(6, dtype=dtype)
    count = torch.full((1,), -1, dtype=torch.int32)
    n = cuda_kernel("clip_rows")(acts, grads, 0.3, f1)
    assert cuda_kernel("clip_rows")(acts, other, 0.3, f2, count=count) is None
    assert int(count) == n and torch.equal(f1, f2)
    assert all(torch.equal(x, y) for x, y in zip(grads, other))
    logits = torch.randn(5, 3, dtype=dtype, generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([0, 2, 1, 1, 0])
    g1, g2 = torch.empty(5, 3, dtype=dtype), torch.empty(5, 3, dtype=dtype)
    losses = torch.full((7,), -1.0, dtype=dtype)
    total = cuda_kernel("softmax_xent")(logits, labels, g1)
    assert cuda_kernel("softmax_xent")(logits, labels, g2, losses=losses) is None
    assert torch.equal(g1, g2) and torch.equal(losses[5:], torch.full((2,), -1.0, dtype=dtype))
    assert float(losses[:5].double().sum()) == pytest.approx(total, rel=1e-12)


def test_gaussian_stream_state_round_trip_and_other_layouts():
    make = cuda_kernel("gaussian_stream")
    a = make(np.random.SeedSequence(2))
    state = a.get_state()
    first, second = torch.zeros(7), torch.zeros(7)
    a.add_(first, 1.0)
    a.set_state(state)
    a.add_(second, 1.0)
    assert torch.equal(first, second) and bool((first != 0).all())
    other = make(np.random.SeedSequence(3))
    third = torch.zeros(7)
    other.add_(third, 1.0)
    assert not torch.equal(first, third)
    cpu_state = registry.get("gaussian_stream", "cpu", "numba")(np.random.SeedSequence(2))
    with pytest.raises(ValueError):
        a.set_state(cpu_state.get_state())  # a checkpoint of the CPU stream


def test_one_mlp_step_through_the_cuda_kernels_equals_the_cpu_step():
    """FastMLP's whole clipped step with every kernel taken from the 'cuda' registry."""
    from engine.dp.fast_mlp import FastMLP
    from engine.nn.mlp import MLPSpec, init_params

    spec = MLPSpec((4, 5, 3))
    g = torch.Generator().manual_seed(1)
    X = torch.cat([torch.randn(12, 4, generator=g), torch.ones(12, 1)], 1)
    y = torch.randint(0, 3, (12,), generator=g)
    rows = torch.tensor([0, 3, 4, 7, 11])
    out = {}
    for name in ("cpu", "cuda"):
        params = init_params(spec, 3)
        grad = torch.zeros(spec.n_params)
        mlp = FastMLP(spec, params, grad, capacity=8)
        if name == "cuda":
            for op in ("clip_rows", "relu_backward", "softmax_xent"):
                setattr(mlp, op, cuda_kernel(op))
        k = mlp.load(X, y, rows)
        loss, clipped = mlp.clipped_sum(k, 0.05)
        out[name] = (loss, clipped, grad)
    assert out["cuda"][1] == out["cpu"][1] > 0
    assert out["cuda"][0] == pytest.approx(out["cpu"][0], rel=1e-5)
    assert torch.allclose(out["cuda"][2], out["cpu"][2], rtol=1e-5, atol=1e-7)


def test_training_on_the_device_path_with_every_kernel_simulated(tmp_path, monkeypatch):
    """mpidp train's GPU code path (tensor all-reduce buffer, device transfers,
    Philox noise) with every kernel a simulated CUDA kernel, against the same
    path with the CPU clipping/ReLU/softmax kernels: the same model."""
    from collectives.runtime import MPI
    from engine.bench import synthetic
    from engine.config import TrainConfig
    from engine.nn.device import Placement
    from engine.trainer import Trainer

    path = synthetic.write(tmp_path / "d.h5", rows=60, features=3, test_rows=10, seed=1)
    monkeypatch.setattr("engine.trainer.select_device",
                        lambda kind, comm: Placement(torch.device("cpu"), host_buffer=False))
    original = registry.get
    runs = {}
    for mode in ("simulated", "cpu kernels"):
        def get(op, device="cpu", backend=None, mode=mode):
            if op in registry.GENERIC_ON_GPU:
                return original(op, device, backend)
            if op == "gaussian_stream" or mode == "simulated":
                return original(op, "cuda", "numba")
            return original(op, device, backend)

        monkeypatch.setattr(registry, "get", get)
        cfg = TrainConfig(data=str(path), epochs=1, batch_size=12, hidden=(4,),
                          noise_multiplier=0.5, max_grad_norm=0.1, seed=3, progress=False)
        cfg.validate()
        trainer = Trainer(cfg, MPI.COMM_SELF, out=io.StringIO())
        assert trainer.run() == 0
        runs[mode] = trainer
    sim, cpu = runs["simulated"], runs["cpu kernels"]
    assert sim.engine.clip_rows.__module__ == "kernels.numba_cuda.clip_rows"
    assert cpu.engine.clip_rows.__module__ == "kernels.numba_cpu.clip_rows"
    assert sim.noise.stream.get_state() == cpu.noise.stream.get_state()
    assert sim.noise.stream.get_state()[2] > 0  # the Philox counter moved
    assert sim.history[0]["clipped_fraction"] == cpu.history[0]["clipped_fraction"] > 0
    assert torch.allclose(sim.params, cpu.params, rtol=1e-5, atol=1e-6)
    assert sim.history[0]["train_loss"] == pytest.approx(cpu.history[0]["train_loss"], rel=1e-5)
