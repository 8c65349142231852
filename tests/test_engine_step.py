"""engine.step.DPStep: the one DP-SGD step is exactly load -> clipped sum -> noise ->
all-reduce -> update, times its phases, and reduces the whole buffer."""
import time

import numpy as np
import pytest
import torch

import collectives
from collectives import MPI
from engine.dp.noise import GaussianNoise
from engine.dp.fast_mlp import FastMLP
from engine.nn.mlp import MLPSpec, init_params
from engine.nn.optim import SGD
from engine.step import PHASES, DPStep

SPEC = MLPSpec.build(6, (8,), 3)
C, STD, LR, B = 0.5, 0.7, 0.1, 16


def _data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    X = np.ones((n, SPEC.dims[0] + 1), dtype=np.float32)
    X[:, :-1] = rng.standard_normal((n, SPEC.dims[0]), dtype=np.float32)
    y = rng.integers(0, SPEC.dims[-1], n).astype(np.int64)
    return torch.from_numpy(X), torch.from_numpy(y)


def _parts(dp: bool, comm):
    """Fresh, identical components: buffer (gradient + one control float), engine,
    noise, optimizer."""
    buffer = np.zeros(SPEC.n_params + 1, dtype=np.float32)
    grad = torch.from_numpy(buffer[:SPEC.n_params])
    params = init_params(SPEC, 3)
    engine = FastMLP(SPEC, params, grad, capacity=8)
    noise = (GaussianNoise(SPEC.n_params, STD, comm.Get_size(), comm.Get_rank(), 9)
             if dp else None)
    return buffer, grad, params, engine, noise, SGD(params, LR, 0.9)


def _batches(count=6, n=64, seed=1):
    rng = np.random.default_rng(seed)
    out = [np.sort(rng.choice(n, size=int(rng.binomial(n, B / n)), replace=False))
           for _ in range(count)]
    out.append(np.empty(0, dtype=np.int64))  # an empty local batch is a valid step
    return [torch.from_numpy(rows.astype(np.int64)) for rows in out]


@pytest.mark.parametrize("dp", [True, False])
def test_step_is_the_composition_of_its_components(dp):
    comm = MPI.COMM_SELF
    X, y = _data()
    buffer, grad, params, engine, noise, opt = _parts(dp, comm)
    step = DPStep(engine, X, y, buffer, grad, opt, 1.0 / B, comm,
                  max_norm=C if dp else None, noise=noise)
    buffer2, grad2, params2, engine2, noise2, opt2 = _parts(dp, comm)
    for rows in _batches():
        k, loss, clipped = step(rows)
        # The same phases, by hand, on the twin components.
        k2 = engine2.load(X, y, rows)
        loss2, clipped2 = engine2.clipped_sum(k2, C if dp else None)
        if noise2 is not None:
            noise2.add_(grad2)
        collectives.allreduce(buffer2, comm)
        opt2.step(grad2, 1.0 / B)
        assert (k, loss, clipped) == (k2, loss2, clipped2) and k == rows.shape[0]
        assert torch.equal(params, params2)
        if not dp:
            assert clipped == 0
    assert not torch.equal(params, init_params(SPEC, 3))  # it learned something


def test_times_add_up_per_phase_from_the_given_start():
    comm = MPI.COMM_SELF
    X, y = _data()
    buffer, grad, params, engine, noise, opt = _parts(True, comm)
    step = DPStep(engine, X, y, buffer, grad, opt, 1.0 / B, comm, max_norm=C, noise=noise)
    times = dict.fromkeys(PHASES, 0.0)
    before = time.perf_counter()
    step(_batches()[0], times, started=before - 5.0)  # sampling "took" 5 s
    elapsed = time.perf_counter() - before
    assert set(times) == set(PHASES)
    assert all(v >= 0 for v in times.values())
    assert 5.0 <= times["sample_s"] <= 5.0 + elapsed
    assert sum(times.values()) <= 5.0 + elapsed
    untimed = dict(times)
    step(_batches()[1])  # no times: nothing recorded anywhere
    assert times == untimed


def test_the_engine_must_write_into_the_reduced_gradient():
    comm = MPI.COMM_SELF
    X, y = _data()
    buffer, grad, params, engine, noise, opt = _parts(False, comm)
    with pytest.raises(ValueError, match="grad"):
        DPStep(engine, X, y, buffer, torch.zeros_like(grad), opt, 1.0 / B, comm,
               max_norm=None)


@pytest.mark.mpi(min_size=1)
def test_the_whole_buffer_is_reduced_and_every_rank_keeps_the_same_model(comm):
    X, y = _data(seed=comm.Get_rank())  # different rows on every rank
    buffer, grad, params, engine, noise, opt = _parts(True, comm)
    step = DPStep(engine, X, y, buffer, grad, opt, 1.0 / B, comm, max_norm=C, noise=noise)
    for rows in _batches(seed=10 + comm.Get_rank()):
        buffer[-1] = 1.0 if comm.Get_rank() == 0 else 0.0  # the trainer's control float
        step(rows)
        assert buffer[-1] == 1.0  # summed over the ranks with the gradient
    everyone = comm.allgather(params.numpy().copy())
    assert all(np.array_equal(everyone[0], p) for p in everyone)


def test_set_noise_changes_the_noise_of_the_next_calls():
    """The step binds its noise once; ``set_noise`` is how a changed deviation
    (the audit's faults) or no noise at all reaches the next call."""
    comm = MPI.COMM_SELF
    X, y = _data()
    rows = _batches()[0]
    outs = []
    for change in (None, "silence", "double"):
        buffer, grad, params, engine, noise, opt = _parts(True, comm)
        step = DPStep(engine, X, y, buffer, grad, opt, 1.0 / B, comm, max_norm=C, noise=noise)
        if change == "silence":
            step.set_noise(None)
        elif change == "double":
            noise.local_std *= 2
            step.set_noise(noise)
        step(rows)
        outs.append(grad.clone())
    buffer, grad, params, engine, _, opt = _parts(True, comm)
    engine.clipped_sum(engine.load(X, y, rows), C)
    clean = grad.clone()
    assert torch.equal(outs[1], clean)
    assert torch.allclose(outs[2] - clean, 2 * (outs[0] - clean), atol=1e-5)
    assert not torch.equal(outs[0], clean)
