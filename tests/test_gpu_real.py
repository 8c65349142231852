"""On a real GPU only: the CUDA kernels, streams, the device selection and a training run.

Every test is marked ``gpu`` and skips without a CUDA GPU (here: always);
``make test-gpu`` runs them on a GPU machine with ``MPIDP_REQUIRE_GPU=1``,
which turns those skips into failures. They are the first thing to run on a
GPU machine: what the CPU-only suite cannot check is exactly the CUDA
launches (tests/test_gpu_kernels.py simulates and compiles them), torch's
CUDA ops and the CUDA-aware transfer.
"""
from __future__ import annotations

import io
import os

import numpy as np
import pytest
import torch

from kernel_inputs import random_layers
from kernels import registry
from kernels.common import philox

pytestmark = pytest.mark.gpu


def _no_gpu_reason() -> str | None:
    if not torch.cuda.is_available():
        return (f"needs a CUDA GPU: torch {torch.__version__} (CUDA {torch.version.cuda}) sees "
                "none; run `make test-gpu` on a GPU machine")
    return None


@pytest.fixture(autouse=True)
def _gpu():
    reason = _no_gpu_reason()
    if reason is not None:
        if os.environ.get("MPIDP_REQUIRE_GPU") == "1":
            pytest.fail(f"MPIDP_REQUIRE_GPU=1 but: {reason}")
        pytest.skip(reason)


def _backends() -> list:
    """numba and cupy, each skipped (or failed when required) when not installed."""
    out = []
    for name in ("cupy", "numba"):
        marks = []
        module = {"cupy": "kernels.cupy.clip_rows", "numba": "kernels.numba_cuda.clip_rows"}[name]
        try:
            __import__(module)
        except ImportError as exc:
            if os.environ.get("MPIDP_REQUIRE_GPU") != "1":
                marks.append(pytest.mark.skip(reason=f"{name} kernels not importable ({exc}); "
                                              "pip install 'mpidp[cuda12]' (or cuda13)"))
        out.append(pytest.param(name, marks=marks))
    return out


BACKENDS = _backends()
DTYPES = [torch.float32, torch.float64]


def tol(dtype):
    return dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,C", [(0, 1.0), (1, 1e6), (37, 0.5), (700, 0.3)])
def test_clip_rows_on_the_gpu_equals_the_cpu(backend, dtype, k, C):
    g = torch.Generator().manual_seed(k)
    dims = (30, 300, 2)  # a layer wider than a block, k above a block: strided loops
    acts = [torch.cat([torch.randn(k, d, generator=g, dtype=dtype),
                       torch.ones(k, 1, dtype=dtype)], 1) for d in dims[:-1]]
    grads = [torch.randn(k, d, generator=g, dtype=dtype) * 0.1 for d in dims[1:]]
    f_cpu = torch.empty(k, dtype=dtype)
    cpu = [x.clone() for x in grads]
    n_cpu = registry.get("clip_rows", "cpu", "numba")(acts, cpu, C, f_cpu)
    dev = [x.cuda() for x in grads]
    f = torch.empty(k, dtype=dtype, device="cuda")
    n = registry.get("clip_rows", "cuda", backend)([a.cuda() for a in acts], dev, C, f)
    assert n == n_cpu
    assert torch.allclose(f.cpu(), f_cpu, **tol(dtype))
    assert all(torch.allclose(a.cpu(), b, **tol(dtype)) for a, b in zip(dev, cpu))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layers", [1, 4, 6])
def test_clip_rows_fused_and_by_layer_on_the_gpu(backend, layers):
    """Up to four layers one fused launch; beyond, one launch per layer: both as the CPU."""
    dims = (7, 300, 5, 40, 3, 9, 2)[:layers + 1]
    acts, grads = random_layers(300, dims, torch.float32, seed=layers)
    norms = sum(a.double().square().sum(1) * g.double().square().sum(1)
                for a, g in zip(acts, grads)).sqrt().sort().values
    C = float(norms[149] + norms[150]) / 2  # between two rows' norms: half clipped
    cpu, f_cpu = [x.clone() for x in grads], torch.empty(300)
    n_cpu = registry.get("clip_rows", "cpu", "numba")(acts, cpu, C, f_cpu)
    dev, f = [x.cuda() for x in grads], torch.empty(300, device="cuda")
    count = torch.zeros(1, dtype=torch.int32, device="cuda")
    registry.get("clip_rows", "cuda", backend)([a.cuda() for a in acts], dev, C, f,
                                               count=count)
    assert int(count.item()) == n_cpu and 0 < n_cpu < 300
    assert torch.allclose(f.cpu(), f_cpu, **tol(torch.float32))
    assert all(torch.allclose(a.cpu(), b, **tol(torch.float32)) for a, b in zip(dev, cpu))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_sgd_update_on_the_gpu_equals_the_cpu(backend, dtype):
    g = torch.Generator().manual_seed(3)
    n = 1_100_000  # more than the launch's 4096 blocks of 256 threads: strided
    p, v, grad = (torch.randn(n, generator=g, dtype=dtype) for _ in range(3))
    p_dev, v_dev = p.cuda(), v.cuda()
    registry.get("sgd_update", "cuda", backend)(p_dev, v_dev, grad.cuda(), 0.25, 0.1, 0.9)
    registry.get("sgd_update", "cpu", "numba")(p, v, grad, 0.25, 0.1, 0.9)
    assert torch.allclose(v_dev.cpu(), v, **tol(dtype))
    assert torch.allclose(p_dev.cpu(), p, **tol(dtype))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_relu_backward_and_softmax_on_the_gpu(backend, dtype):
    g = torch.Generator().manual_seed(1)
    full = torch.randn(513, 65, generator=g, dtype=dtype).clamp_min(0)
    grad = torch.randn(513, 64, generator=g, dtype=dtype)
    dev = grad.cuda()
    registry.get("relu_backward", "cuda", backend)(dev, full.cuda()[:, :64])
    assert torch.equal(dev.cpu(), torch.where(full[:, :64] > 0, grad, 0.0))
    logits = torch.randn(300, 5, generator=g, dtype=dtype) * 3
    labels = torch.randint(0, 5, (300,), generator=g)
    cpu_grad, dev_grad = torch.empty_like(logits), torch.empty_like(logits).cuda()
    want = registry.get("softmax_xent", "cpu", "numba")(logits, labels, cpu_grad)
    got = registry.get("softmax_xent", "cuda", backend)(logits.cuda(), labels.cuda(), dev_grad)
    assert got == pytest.approx(want, rel=1e-5)
    assert torch.allclose(dev_grad.cpu(), cpu_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gaussian_stream_on_the_gpu_is_the_philox_reference(backend, dtype):
    stream = registry.get("gaussian_stream", "cuda", backend)(np.random.SeedSequence(9),
                                                               torch.device("cuda"))
    key = tuple(stream.get_state()[:2])
    buf = torch.zeros(100_003, dtype=dtype, device="cuda")
    stream.add_(buf, 2.0)
    stream.add_(buf[5:1000], 1.0)
    want = np.zeros(100_003, dtype=buf.cpu().numpy().dtype)
    counter = philox.add_reference(want, 2.0, 0, key)
    philox.add_reference(want[5:1000], 1.0, counter, key)
    assert np.allclose(buf.cpu().numpy(), want, **tol(dtype))


def test_numba_and_cupy_streams_agree():
    pytest.importorskip("cupy")
    a = registry.get("gaussian_stream", "cuda", "numba")(np.random.SeedSequence(4))
    b = registry.get("gaussian_stream", "cuda", "cupy")(np.random.SeedSequence(4))
    x, y = torch.zeros(4097, device="cuda"), torch.zeros(4097, device="cuda")
    a.add_(x, 1.0)
    b.add_(y, 1.0)
    assert torch.allclose(x, y, rtol=1e-6, atol=1e-6) and a.get_state() == b.get_state()


@pytest.mark.parametrize("backend", BACKENDS)
def test_kernels_run_on_torchs_current_stream(backend):
    """Inputs produced on a side stream by a long GEMM chain; the kernel must wait
    for them because it runs on that same (current) stream."""
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        a = torch.randn(2048, 2048, device="cuda")
        for _ in range(20):
            a = torch.tanh(a @ a * 1e-3)
        out = a[:, :1024] - 0.0  # ready only after the chain
        grad = torch.ones(2048, 1024, device="cuda")
        registry.get("relu_backward", "cuda", backend)(grad, out)
        want = (out > 0).float()
        same = bool(torch.equal(grad, want))
    side.synchronize()
    assert same


def test_numba_views_are_zero_copy():
    from kernels.numba_cuda.launch import array

    t = torch.zeros(10, 3, device="cuda")
    assert array(t).device_ctypes_pointer.value == t.data_ptr()


def test_one_mlp_step_on_the_gpu_equals_the_cpu():
    from engine.dp.fast_mlp import FastMLP
    from engine.nn.mlp import MLPSpec, init_params

    spec = MLPSpec((20, 64, 64, 3))
    g = torch.Generator().manual_seed(2)
    X = torch.cat([torch.randn(500, 20, generator=g), torch.ones(500, 1)], 1)
    y = torch.randint(0, 3, (500,), generator=g)
    rows = torch.randperm(500, generator=g)[:200]
    out = {}
    for device in ("cpu", "cuda"):
        params = init_params(spec, 3).to(device)
        grad = torch.zeros(spec.n_params, device=device)
        mlp = FastMLP(spec, params, grad, capacity=64)
        k = mlp.load(X.to(device), y.to(device), rows)
        out[device] = (*mlp.clipped_sum(k, 0.1), grad.cpu())
    assert out["cuda"][1] == out["cpu"][1]
    assert out["cuda"][0] == pytest.approx(out["cpu"][0], rel=1e-4)
    assert torch.allclose(out["cuda"][2], out["cpu"][2], rtol=1e-4, atol=1e-6)


@pytest.mark.mpi(min_size=1)
def test_each_rank_binds_its_own_gpu(comm):
    from engine.nn.device import select

    if torch.cuda.device_count() < comm.Get_size():
        pytest.skip(f"{comm.Get_size()} ranks but {torch.cuda.device_count()} GPU(s)")
    placement = select("cuda", comm)
    assert torch.cuda.current_device() == placement.device.index
    # str(): torch's UUID object does not pickle
    names = comm.allgather(str(torch.cuda.get_device_properties(placement.device).uuid))
    assert len(set(names)) == comm.Get_size()


@pytest.mark.mpi(min_size=1)
def test_training_on_gpus(comm, shared_tmp):
    """--device cuda end to end: --no-dp close to the CPU run; DP reproducible."""
    from engine.bench import synthetic
    from engine.config import TrainConfig
    from engine.trainer import Trainer

    if torch.cuda.device_count() < comm.Get_size():
        pytest.skip(f"{comm.Get_size()} ranks but {torch.cuda.device_count()} GPU(s)")
    path = str(shared_tmp / "d.h5")
    if comm.Get_rank() == 0:
        synthetic.write(path, rows=2000, features=8, test_rows=200, seed=5)
    comm.Barrier()

    def run(**kw):
        cfg = TrainConfig(data=path, epochs=2, batch_size=64, hidden=(16,), seed=3,
                          progress=False, **kw)
        cfg.validate()
        trainer = Trainer(cfg, comm, out=io.StringIO())
        assert trainer.run() == 0
        return trainer

    gpu, cpu = run(dp=False, device="cuda"), run(dp=False)
    assert gpu.params.is_cuda and torch.is_tensor(gpu.buffer) and gpu.buffer.is_cuda
    assert torch.allclose(gpu.params.cpu(), cpu.params, rtol=1e-3, atol=1e-5)
    first = run(noise_multiplier=1.0, device="cuda")
    second = run(noise_multiplier=1.0, device="cuda")
    assert torch.equal(first.params, second.params)
    assert first.history[-1]["epsilon"] == pytest.approx(
        run(noise_multiplier=1.0).history[-1]["epsilon"])


def test_a_gpu_back_end_is_chosen_by_its_probe_kernel(monkeypatch, tmp_path):
    """--kernels names a back-end whose first compile fails: one line, before
    any step; no --kernels: the first back-end whose probe kernel runs."""
    from engine.bench import synthetic
    from engine.config import TrainConfig
    from engine.errors import ConfigError
    from engine.trainer import Trainer
    from mpi4py import MPI

    path = synthetic.write(str(tmp_path / "d.h5"), rows=600, features=6, test_rows=60, seed=1)

    def trainer(**kw):
        cfg = TrainConfig(data=path, epochs=1, batch_size=64, hidden=(8,), seed=3,
                          progress=False, dp=False, device="cuda", **kw)
        cfg.validate()
        return Trainer(cfg, MPI.COMM_SELF, out=io.StringIO())

    assert registry.check("cupy") is None  # the real probe, on this GPU
    chosen = trainer()
    assert chosen.run() == 0 and chosen.engine.backends["clip_rows"] == registry.choose("cuda")
    broken = ("cannot compile or launch a kernel (AttributeError: module 'numpy' has no "
              "attribute 'row_stack')")
    monkeypatch.setitem(registry._CHECKED, "numba_cuda", broken)
    with pytest.raises(ConfigError, match=r"^--kernels numba: the numba back-end .*row_stack.*"
                                          r"usable here: cupy, torch$"):
        trainer(kernels="numba").run()
    assert trainer().run() == 0


@pytest.mark.parametrize("name, shape", [("mnist-small", (1, 28, 28)),
                                         ("mnist-large", (1, 28, 28)),
                                         ("resnet20", (3, 32, 32))])
def test_image_model_dp_step_on_the_gpu_equals_the_cpu(name, shape, monkeypatch):
    """The per-layer rules on CUDA (the conv chooser timing both ways with
    synchronisation) give the CPU's clipped sum, in full float32: cuDNN's
    convolutions run in TF32 by default (torch's setting, kept by mpidp), which
    moves gradients by ~1e-3 of their scale, through every layer."""
    from engine.nn.image_models import build
    from engine.dp.module_engine import ModuleEngine

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)

    g = torch.Generator().manual_seed(4)
    width = shape[0] * shape[1] * shape[2]
    X = torch.cat([torch.randn(64, width, generator=g), torch.ones(64, 1)], 1)
    y = torch.randint(0, 10, (64,), generator=g)
    out = {}
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        model = build(name, shape, 10).to(device)
        n = sum(p.numel() for p in model.parameters())
        engine = ModuleEngine(model, torch.zeros(n, device=device),
                              (X[:8].to(device), y[:8].to(device)), 10, capacity=64)
        k = engine.load(X.to(device), y.to(device), torch.arange(48))
        loss, clipped = engine.clipped_sum(k, 0.5)
        out[device] = (loss, clipped, engine.grad.cpu())
    assert out["cuda"][1] == out["cpu"][1]
    assert out["cuda"][0] == pytest.approx(out["cpu"][0], rel=1e-4)
    # float32 sums in other orders (cuDNN's algorithms, the conv way each
    # device chose) through up to 20 layers: compared as a whole vector
    error = float((out["cuda"][2] - out["cpu"][2]).norm() / out["cpu"][2].norm())
    print(f"{name}: relative error of the clipped sum {error:.2e}")
    assert error < 1e-4


@pytest.mark.mpi(min_size=1)
def test_image_models_train_on_gpus(comm, shared_tmp):
    """A short DP run of each image model with --device cuda."""
    import engine
    from image_files import mnist_dir, prepare

    if torch.cuda.device_count() < comm.Get_size():
        pytest.skip(f"{comm.Get_size()} ranks but {torch.cuda.device_count()} GPU(s)")
    if comm.Get_rank() == 0:
        mnist_dir(shared_tmp / "mnist", n_train=256, n_test=64)
    comm.Barrier()
    data = prepare(comm, "mnist", shared_tmp / "mnist", shared_tmp / "mnist.h5")
    for name in ("mnist-small", "mnist-large", "resnet20"):
        run = engine.train(data, model=name, comm=comm, epochs=1, batch_size=32,
                           target_epsilon=8.0, device="cuda", quiet=True, seed=1)
        assert run.epsilon == pytest.approx(8.0, rel=1e-3)
        assert all(np.isfinite(r["train_loss"]) for r in run.history)


# ------------------------------------------------ the fixed-shape step as one CUDA graph
def _graph_steps(name: str, backend: str | None, dp: bool = True, graph: bool = True):
    """An eager DPStep and the same model's step chosen by --cuda-graph (twins)."""
    from collectives import MPI
    from engine import fixed_step
    from engine.bench.dpsgd_models import model_data
    from engine.dp.noise import GaussianNoise
    from engine import models
    from engine.nn.optim import SGD
    from engine.step import DPStep

    X, y, classes, codes, shape = data = model_data(name, 2000, 0)
    device = torch.device("cuda")
    out = []
    for mode in ("off", "on" if graph else "off"):
        model = models.resolve(name, (16, 16), X.shape[1] - 1, classes, 0, device,
                               code_columns=codes, image_shape=shape)
        buffer = torch.zeros(model.n_params + 1, device=device)
        grad = buffer[:model.n_params]
        engine = model.build_engine(grad, 0, (torch.from_numpy(X[:4]), torch.from_numpy(y[:4])),
                                    classes, 64, backend)
        noise = GaussianNoise(model.n_params, 0.5, 1, 0, 3, device=device, backend=backend) \
            if dp else None
        step = DPStep(engine, torch.from_numpy(X).cuda(), torch.from_numpy(y).cuda(), buffer,
                      grad, SGD(engine.params, 0.05, 0.9, backend=backend), 1 / 32,
                      MPI.COMM_SELF, max_norm=1.0 if dp else None, noise=noise)
        chosen, line = fixed_step.choose(step, mode, MPI.COMM_SELF, n_local=len(y),
                                         q=32 / len(y))
        out.append((chosen, line))
    del data
    return out


def _poisson(n: int, q: float, count: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(np.flatnonzero(rng.random(n) < q)) for _ in range(count)]


@pytest.mark.parametrize("backend", [pytest.param(None, id="default")] + BACKENDS
                         + [pytest.param("torch", id="torch")])
def test_the_mlp_step_as_a_cuda_graph_trains_the_eager_steps_model(backend):
    (eager, _), (graph, line) = _graph_steps("mlp", backend)
    assert "one CUDA graph" in line, line
    losses = [0.0, 0.0]
    for rows in _poisson(2000, 32 / 2000, 30) + [torch.arange(0, 2000, 10)]:  # 200: overflow
        losses[0] += eager(rows)[1]
        losses[1] += graph(rows)[1]
    assert graph.overflows == 1
    losses[1] += graph.settle()[0]
    torch.cuda.synchronize()
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)
    # the same noise stream (staged counters), the same batches: rounding apart
    assert torch.allclose(graph.engine.params, eager.engine.params, rtol=1e-4, atol=1e-5)
    assert graph.step.noise.get_state() == eager.noise.get_state()


@pytest.mark.parametrize("name", ["mnist-small", "resnet20", "embedding-mlp"])
def test_built_in_models_as_cuda_graphs(name):
    """The per-layer rules captured (or the reason they cannot be, in one line)."""
    (eager, _), (graph, line) = _graph_steps(name, None)
    if "one CUDA graph" not in line:
        pytest.xfail(f"{name}: {line}")
    for rows in _poisson(2000, 32 / 2000, 5):
        eager(rows)
        graph(rows)
    torch.cuda.synchronize()
    scale = float(eager.engine.params.abs().max())
    assert float((graph.engine.params - eager.engine.params).abs().max()) < 1e-3 * scale


def test_cuda_graph_on_refuses_a_model_it_cannot_capture():
    from collectives import MPI
    from engine import fixed_step
    from engine.errors import ConfigError

    (eager, _), _ = _graph_steps("mlp", None, graph=False)

    def sync_in_the_step(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    eager.engine.masked_sum = sync_in_the_step
    with pytest.raises(ConfigError, match="--cuda-graph on: the step cannot be captured"):
        fixed_step.choose(eager, "on", MPI.COMM_SELF, n_local=2000, q=32 / 2000)
    chosen, line = fixed_step.choose(eager, "auto", MPI.COMM_SELF, n_local=2000, q=32 / 2000)
    assert chosen is eager and line.startswith("no CUDA graph, the eager step runs")
