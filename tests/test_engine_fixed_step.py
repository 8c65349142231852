"""engine.fixed_step: the step on a batch of fixed shape (the CUDA graph's step), on the CPU.

What runs inside a CUDA graph on a GPU is checked here without one: the
fixed-shape step (the rows of a fixed-capacity batch and a 0/1 mask) trains
the model the eager step trains, for the fused MLP and for models on the
per-layer rules and on torch.func; padding rows contribute exactly nothing
(whatever rows they point at); a batch above the capacity runs eagerly and
whole; the noise staged as counters is the eager step's noise; the loss and
clipped count come back through ``settle``; the capacity rule keeps its
overflow probability.
"""
import numpy as np
import pytest
import torch
from scipy.stats import binom
from torch import nn

from collectives import MPI
from engine.dp.noise import GaussianNoise
from engine.fixed_step import FixedShapeStep, capacity_for, overflow_probability
from engine.dp.fast_mlp import FastMLP
from engine.nn.mlp import MLPSpec, init_params
from engine.dp.module_engine import ModuleEngine
from engine.nn.optim import SGD
from engine.step import DPStep
from kernels.common import philox
from kernels.common.philox_stream import PhiloxDeviceStream

SPEC = MLPSpec.build(6, (8, 5), 3)
C, STD, LR, B, N = 0.5, 0.7, 0.1, 16, 64


def _data(n=N, seed=0, features=SPEC.dims[0]):
    rng = np.random.default_rng(seed)
    X = np.ones((n, features + 1), dtype=np.float32)
    X[:, :-1] = rng.standard_normal((n, features), dtype=np.float32) * 2
    y = rng.integers(0, SPEC.dims[-1], n).astype(np.int64)
    return torch.from_numpy(X), torch.from_numpy(y)


def _batches(count=8, n=N, seed=1, big=False):
    rng = np.random.default_rng(seed)
    out = [np.sort(rng.choice(n, size=int(rng.binomial(n, B / n)), replace=False))
           for _ in range(count)]
    out.append(np.empty(0, dtype=np.int64))  # an empty local batch
    if big:
        out.append(np.arange(0, n, 2))  # 32 rows: above the capacity below
    return [torch.from_numpy(rows.astype(np.int64)) for rows in out]


def _mlp_engine(grad, backend):
    params = init_params(SPEC, 3)
    return FastMLP(SPEC, params, grad, capacity=4, backend=backend)


def _module():
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _func_module():
    class Shared(nn.Module):  # one weight used twice: the torch.func path
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(6, 6) * 0.3)
            self.out = nn.Linear(6, 3)

        def forward(self, x):
            return self.out(torch.tanh(torch.tanh(x @ self.w) @ self.w))

    torch.manual_seed(6)
    return Shared()


def _generic_engine(grad, make):
    X, y = _data()
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ModuleEngine(make(), grad, (X[:4], y[:4]), SPEC.dims[-1], capacity=4)


ENGINES = {
    "mlp-numba": lambda grad: _mlp_engine(grad, None),
    "mlp-torch": lambda grad: _mlp_engine(grad, "torch"),
    "rules": lambda grad: _generic_engine(grad, _module),
    "torch.func": lambda grad: _generic_engine(grad, _func_module),
}


def _step(kind, dp, noise_seed=9):
    n_params = {"rules": 83, "torch.func": 36 + 21}.get(kind, SPEC.n_params)
    buffer = np.zeros(n_params + 1, dtype=np.float32)
    grad = torch.from_numpy(buffer[:n_params])
    engine = ENGINES[kind](grad)
    assert engine.params.shape == (n_params,)
    noise = GaussianNoise(n_params, STD, 1, 0, noise_seed) if dp else None
    opt = SGD(engine.params, LR, 0.9)
    X, y = _data()
    return DPStep(engine, X, y, buffer, grad, opt, 1.0 / B, MPI.COMM_SELF,
                  max_norm=C if dp else None, noise=noise)


@pytest.mark.parametrize("kind", list(ENGINES))
@pytest.mark.parametrize("dp", [True, False])
def test_the_fixed_shape_step_trains_the_eager_steps_model(kind, dp):
    eager, fixed = _step(kind, dp), FixedShapeStep(_step(kind, dp), capacity=24)
    losses, clipped = [0.0, 0.0], [0, 0]
    for rows in _batches(big=True):
        k1, l1, c1 = eager(rows)
        k2, l2, c2 = fixed(rows)
        assert k1 == k2 == rows.shape[0]
        losses[0] += l1
        clipped[0] += c1
        losses[1] += l2
        clipped[1] += c2
        # float rounding only: the sums over rows also run over the padding's zeros
        assert torch.allclose(eager.engine.params, fixed.engine.params, rtol=1e-5, atol=1e-6)
    assert fixed.overflows == 1  # the 32-row batch ran eagerly, whole
    loss, count = fixed.settle()
    assert losses[1] + loss == pytest.approx(losses[0], rel=1e-5)
    assert clipped[1] + count == clipped[0] and (not dp or clipped[0] > 0)
    assert fixed.settle() == (0.0, 0)  # read once


@pytest.mark.parametrize("kind", list(ENGINES))
def test_padding_rows_contribute_exactly_nothing(kind):
    """The same sampled rows with other padding (other row indices, another
    capacity) give the same clipped sum, loss and count."""
    X, y = _data()
    rows = torch.tensor([3, 7, 8, 20, 41])
    sums = []
    for capacity, pad in [(8, 0), (8, 63), (16, 5)]:
        step = _step(kind, dp=True)
        fixed = FixedShapeStep(step, capacity=capacity)
        cap_rows = torch.full((capacity,), pad, dtype=torch.int64)
        cap_rows[:5] = rows
        mask = torch.zeros(capacity)
        mask[:5] = 1
        loss = torch.zeros((), dtype=torch.float64)
        count = torch.zeros(1, dtype=torch.int32)
        step.engine.masked_sum(X, y, cap_rows, mask, C, loss, count)
        sums.append((step.grad.clone(), float(loss), int(count)))
        assert fixed.capacity == capacity
    ref = _step(kind, dp=True)
    k = ref.engine.load(X, y, rows)
    want_loss, want_count = ref.engine.clipped_sum(k, C)
    for grad, loss, count in sums:
        assert torch.allclose(grad, ref.grad, rtol=1e-5, atol=1e-7)
        assert loss == pytest.approx(want_loss, rel=1e-5) and count == want_count


def test_an_mlp_step_in_float64_is_the_eager_step_to_rounding():
    spec = MLPSpec.build(4, (6,), 2)
    X = torch.cat([torch.randn(40, 4, dtype=torch.float64), torch.ones(40, 1,
                                                                      dtype=torch.float64)], 1)
    y = torch.randint(0, 2, (40,))
    grads = []
    for fixed in (False, True):
        grad = torch.zeros(spec.n_params, dtype=torch.float64)
        engine = FastMLP(spec, init_params(spec, 1).double(), grad, capacity=4)
        rows = torch.arange(0, 40, 3)
        if fixed:
            cap_rows = torch.cat([rows, torch.zeros(30 - rows.shape[0], dtype=torch.int64)])
            mask = (torch.arange(30) < rows.shape[0]).double()
            engine.masked_sum(X, y, cap_rows, mask, 0.3, torch.zeros((), dtype=torch.float64),
                              torch.zeros(1, dtype=torch.int32))
        else:
            engine.clipped_sum(engine.load(X, y, rows), 0.3)
        grads.append(grad)
    assert torch.allclose(grads[0], grads[1], rtol=1e-13, atol=1e-15)


class HostPhilox(PhiloxDeviceStream):
    """The CUDA streams' Philox, run on the host (the reference's own code)."""

    backend = "test"

    def _launch(self, buf, std, counter, blocks, threads):
        philox.add_reference(buf.numpy(), std, counter, self._state.key)

    def _launch_at(self, buf, std, counter, offset, blocks, threads):
        words = counter.numpy().astype(np.uint64)
        start = (int(words[0]) | (int(words[1]) << 64)) + offset
        philox.add_reference(buf.numpy(), std, start, self._state.key)


@pytest.mark.parametrize("secure", [False, True])
def test_noise_staged_as_counters_is_the_eager_steps_noise(secure):
    """The graph's noise: the host advances the stream and stages each draw's
    counter with the rows; the kernel reads it there. Same noise, same state."""
    steps = []
    for staged in (False, True):
        step = _step("mlp-torch", dp=True)
        noise = GaussianNoise(SPEC.n_params, STD, 1, 0, 9, secure=secure)
        noise.stream = HostPhilox(np.random.SeedSequence(11))
        step.set_noise(noise)
        steps.append(FixedShapeStep(step, capacity=24, staged_noise=staged))
    assert steps[0]._staged is None and steps[1]._staged.draws == (4 if secure else 1)
    for rows in _batches():
        steps[0](rows)
        steps[1](rows)
        assert torch.equal(steps[0].engine.params, steps[1].engine.params)
    assert steps[0].step.noise.get_state() == steps[1].step.noise.get_state()


def test_households_and_the_canary_hook_run_the_eager_step():
    step = _step("mlp-numba", dp=True)
    fixed = FixedShapeStep(step, capacity=24)
    rows = torch.arange(6)
    assert fixed(rows, groups=torch.tensor([0, 2, 6]))[1] > 0  # eager: its loss returned
    step.extra = lambda grad: None
    assert fixed(rows)[1] > 0
    assert fixed.overflows == 0 and fixed.settle() == (0.0, 0)


def test_a_graph_needs_a_gpu_and_an_engine_with_a_fixed_shape_step():
    with pytest.raises(ValueError, match="CUDA device"):
        FixedShapeStep(_step("mlp-numba", dp=True), capacity=8, graph=True)

    class Plain:
        params = torch.zeros(1)

    step = _step("mlp-numba", dp=False)
    step.engine = Plain()
    with pytest.raises(ValueError, match="no fixed-shape step"):
        FixedShapeStep(step, capacity=8)


@pytest.mark.parametrize("n,q", [(790_000, 256 / 790_000), (395_000, 128 / 790_000),
                                 (50_000, 32 / 50_000), (64, 0.25), (10, 1.0)])
def test_capacity_is_the_smallest_with_the_overflow_bound(n, q):
    cap = capacity_for(n, q, 1e-4)
    assert overflow_probability(n, q, cap) <= 1e-4
    if cap > 1 and q < 1:
        assert binom.sf(cap - 1, n, q) > 1e-4  # one row less would overflow more often
    assert cap <= n
    expected = n * q
    assert cap <= expected + 5 * expected ** 0.5 + 5  # a few standard deviations


# ------------------------------------------------- --cuda-graph's choice (fixed_step.choose)
@pytest.fixture
def pretend_gpu(monkeypatch):
    """The choice's logic on the CPU: every device counts as graph-capable and
    the capture is replaced (``outcome["error"]``, per rank, makes it fail)."""
    from engine import fixed_step

    outcome = {"error": {}}
    monkeypatch.setattr(fixed_step, "graph_capable", lambda device: True)

    def prepare(self):
        error = outcome["error"].get(MPI.COMM_WORLD.Get_rank())
        if error:
            raise fixed_step.GraphUnusable(error)

    monkeypatch.setattr(fixed_step.FixedShapeStep, "prepare", prepare)
    return outcome


def test_choice_on_the_cpu_is_the_eager_step_without_a_line():
    from engine import fixed_step

    step = _step("mlp-numba", dp=True)
    assert fixed_step.choose(step, "auto", MPI.COMM_SELF, n_local=N, q=B / N) == (step, None)


def test_choice_captures_and_says_the_capacity_and_overflow(pretend_gpu):
    from engine import fixed_step

    step = _step("mlp-numba", dp=True)
    chosen, line = fixed_step.choose(step, "auto", MPI.COMM_SELF, n_local=N, q=B / N)
    assert isinstance(chosen, FixedShapeStep) and chosen.step is step
    assert f"batch of {capacity_for(N, B / N)} rows" in line and "probability" in line
    chosen, line = fixed_step.choose(step, "on", MPI.COMM_SELF, n_local=N, q=B / N,
                                     fixed_batch=16)
    assert chosen.capacity == 16 and "probability" not in line
    assert fixed_step.choose(step, "off", MPI.COMM_SELF, n_local=N, q=B / N) == \
        (step, "the eager step runs (--cuda-graph off)")


def test_choice_falls_back_with_the_reason_or_refuses_under_on(pretend_gpu):
    from engine import fixed_step
    from engine.errors import ConfigError

    step = _step("mlp-numba", dp=True)
    chosen, line = fixed_step.choose(step, "auto", MPI.COMM_SELF, n_local=N, q=B / N,
                                     households=True)
    assert chosen is step and "household batches have no fixed shape" in line
    pretend_gpu["error"][MPI.COMM_WORLD.Get_rank()] = "RuntimeError: a host sync"
    chosen, line = fixed_step.choose(step, "auto", MPI.COMM_SELF, n_local=N, q=B / N)
    assert chosen is step and line == ("no CUDA graph, the eager step runs: the step cannot "
                                       "be captured (RuntimeError: a host sync)")
    with pytest.raises(ConfigError, match="--cuda-graph on: the step cannot be captured"):
        fixed_step.choose(step, "on", MPI.COMM_SELF, n_local=N, q=B / N)


@pytest.mark.mpi(min_size=2)
def test_one_rank_that_cannot_capture_sends_every_rank_to_the_eager_step(pretend_gpu):
    from engine import fixed_step
    from engine.errors import ConfigError

    comm = MPI.COMM_WORLD
    pretend_gpu["error"][comm.Get_size() - 1] = "RuntimeError: no"
    step = _step("mlp-numba", dp=True)
    chosen, line = fixed_step.choose(step, "auto", comm, n_local=N, q=B / N)
    assert chosen is step
    assert line.startswith(f"no CUDA graph, the eager step runs: rank {comm.Get_size() - 1}: ")
    with pytest.raises(ConfigError) as caught:
        fixed_step.choose(step, "on", comm, n_local=N, q=B / N)
    assert caught.value.collective


def test_cuda_graph_on_without_a_gpu_is_refused_before_anything_runs():
    from engine.config import TrainConfig
    from engine.errors import ConfigError

    with pytest.raises(ConfigError, match="--cuda-graph on needs --device cuda"):
        TrainConfig(data="x.h5", target_epsilon=1, cuda_graph="on").validate()
    with pytest.raises(ConfigError, match="--cuda-graph 'sometimes'"):
        TrainConfig(data="x.h5", target_epsilon=1, cuda_graph="sometimes").validate()
    TrainConfig(data="x.h5", target_epsilon=1, cuda_graph="off").validate()
