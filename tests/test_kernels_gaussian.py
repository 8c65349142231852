"""The Gaussian noise kernels: the right stream, the right distribution, reproducible."""
import numpy as np
import pytest
import torch

from kernels import registry
from kernels.numba_cpu.gaussian import ziggurat_tables, seed_state, sfc64_raw
from normality import assert_standard_normal


def test_sfc64_stream_is_numpys_bit_for_bit():
    for seed in (0, 1, 2**40 + 3):
        state = seed_state(np.random.SeedSequence(seed))
        out = np.empty(5000, dtype=np.uint64)
        sfc64_raw(state, out)
        want = np.random.SFC64(np.random.SeedSequence(seed)).random_raw(5000)
        assert np.array_equal(out, want)


def test_ziggurat_tables_close_the_recursion():
    k, w, f = ziggurat_tables()
    assert len(k) == len(w) == 256 and f[-1] == 1.0
    # every layer has the same area v; the top layer closes at x = 0
    x = w * 2.0 ** 23
    top = x[255] * (1.0 - np.exp(-0.5 * x[255] ** 2))
    assert top == pytest.approx(0.00492867323399, rel=1e-6)


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_samples_are_standard_normal(backend):
    """KS test, moments and the tail beyond the ziggurat's base (seeded: no flakes;
    a wrong table or a biased path fails by hundreds of standard errors)."""
    stream = registry.get("gaussian_stream", "cpu", backend)(np.random.SeedSequence(7))
    x = torch.zeros(2_000_000, dtype=torch.float64)
    stream.add_(x, 1.0)
    assert_standard_normal(x.numpy(), tail_at=3.6541528853610088)  # the ziggurat's tail


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_add_scales_adds_and_restores_state(backend):
    make = registry.get("gaussian_stream", "cpu", backend)
    a, b = make(np.random.SeedSequence(3)), make(np.random.SeedSequence(3))
    base = torch.arange(1001, dtype=torch.float32)
    x, y = base.clone(), torch.zeros(1001)
    a.add_(x, 2.0)
    b.add_(y, 1.0)
    assert torch.allclose(x - base, 2 * y, atol=1e-4)  # same stream: x = base + 2 z
    state = a.get_state()
    first, second = torch.zeros(10), torch.zeros(10)
    a.add_(first, 1.0)
    a.set_state(state)
    a.add_(second, 1.0)
    assert torch.equal(first, second)
    other = make(np.random.SeedSequence(4))
    z = torch.zeros(1001)
    other.add_(z, 1.0)
    assert not torch.equal(z, y)


def test_numba_noise_does_not_depend_on_the_thread_count():
    import numba

    make = registry.get("gaussian_stream", "cpu", "numba")
    before = numba.get_num_threads()
    out = []
    for threads in (1, numba.config.NUMBA_NUM_THREADS):
        numba.set_num_threads(threads)
        x = torch.zeros(10_001)
        make(np.random.SeedSequence(12)).add_(x, 1.0)
        out.append(x)
    numba.set_num_threads(before)
    assert torch.equal(out[0], out[1])
    with pytest.raises(ValueError):
        make(np.random.SeedSequence(1)).set_state([1, 2, 3, 4])
