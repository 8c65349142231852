"""The Gaussian noise kernels: the right stream, the right distribution, reproducible."""
import numpy as np
import pytest
import torch

from kernels import registry
from kernels.numba_cpu.gaussian import (BLOCK, CHUNKS, DRAWS, LANES, seed_lanes, sfc64_raw,
                                        transform)
from normality import assert_standard_normal


def test_each_lane_is_numpys_sfc64_bit_for_bit():
    """Lane 0 is seeded exactly as numpy seeds one SFC64; every lane then steps
    as numpy's SFC64 from the same state."""
    for seed in (0, 1, 2**40 + 3):
        state = seed_lanes(np.random.SeedSequence(seed))
        numpy_state = np.random.SFC64(np.random.SeedSequence(seed)).state["state"]["state"]
        assert np.array_equal(state[:, 0], numpy_state)
        start = state.copy()
        out = np.empty((500, LANES), dtype=np.uint64)
        sfc64_raw(state, out)
        for lane in (0, 17, LANES - 1):
            bitgen = np.random.SFC64()
            bitgen.state = {"bit_generator": "SFC64", "state": {"state": start[:, lane].copy()},
                            "has_uint32": 0, "uinteger": 0}
            assert np.array_equal(out[:, lane], bitgen.random_raw(500))
        assert len({int(x) for x in out[0]}) == LANES  # the lanes are distinct streams


def _box_muller_float64(first: np.ndarray, angles: np.ndarray):
    """The kernel's mapping from raw draws to a normal pair, in float64 with numpy
    (``first``: the radius's uint64 draw; ``angles``: 32 bits, uint32)."""
    u = ((first >> np.uint64(12)).astype(np.float64) + 0.5) * 2.0 ** -52
    radius = np.sqrt(-2.0 * np.log(u))
    top = angles.astype(np.uint64)
    quadrant = (top >> np.uint64(30)).astype(np.float64)
    phi = ((top & np.uint64(0x3FFFFFFF)).astype(np.float64) / 2.0 ** 30 - 0.5) * np.pi / 2
    theta = quadrant * np.pi / 2 + phi
    return radius * np.cos(theta), radius * np.sin(theta)


def test_transform_is_box_muller_within_float32_rounding():
    """Every value within 4 float32 ulps of float64 Box-Muller on the same bits
    (absolute below 1, where the radius near 0 is quantised by u's float32
    rounding), including the extreme draws: u at its smallest (the 8.57 sigma
    tail), u at its largest (radius ~0), each quadrant's edges."""
    rng = np.random.default_rng(5)
    first = rng.integers(0, 2**64, 200_000, dtype=np.uint64, endpoint=False)
    second = rng.integers(0, 2**32, 200_000, dtype=np.uint32, endpoint=False)
    edges = np.array([0, 1, 4095, 4096, 2**63, 2**64 - 4097, 2**64 - 1], dtype=np.uint64)
    quadrants = np.array([q << 30 | e for q in range(4) for e in (0, 2**29, 2**30 - 1)],
                         dtype=np.uint32)
    first = np.concatenate([first, np.repeat(edges, len(quadrants))])
    second = np.concatenate([second, np.tile(quadrants, len(edges))])
    z0, z1 = transform(first, second)
    r0, r1 = _box_muller_float64(first, second)
    ulp = 2.0 ** -23
    for got, want in ((z0, r0), (z1, r1)):
        err = np.abs(got.astype(np.float64) - want) / np.maximum(np.abs(want), 1.0)
        assert err.max() < 4 * ulp, err.max() / ulp
    assert np.abs(z0).max() <= np.sqrt(-2 * np.log(2.0 ** -53)) + 1e-5
    assert np.hypot(z0[-len(quadrants) * len(edges):][:len(quadrants)],
                    z1[-len(quadrants) * len(edges):][:len(quadrants)]).min() > 8.5


def test_every_coordinate_of_an_odd_length_buffer_gets_noise():
    stream = registry.get("gaussian_stream", "cpu", "numba")(np.random.SeedSequence(2))
    for n in (1, BLOCK - 1, BLOCK + 1, 8 * BLOCK + 7):
        x = np.zeros(n, dtype=np.float32)
        stream.add_(x, 1.0)
        assert np.all(x != 0)


def block_of_draws(draws: np.ndarray) -> np.ndarray:
    """One block's values (float32[BLOCK], std 1) from each lane's three raw
    draws ``draws`` (uint64[DRAWS, LANES]), in the kernel module's documented
    layout: the first pairs' cosines, their sines, the second pairs' cosines
    and sines (angles: the third draw's high, then low, 32 bits)."""
    first, second, angles = draws
    xa, ya = transform(first, (angles >> np.uint64(32)).astype(np.uint32))
    xb, yb = transform(second, (angles & np.uint64(0xFFFFFFFF)).astype(np.uint32))
    return np.concatenate([xa, ya, xb, yb])


def test_a_buffer_is_the_documented_blocks_of_each_slices_draws():
    """The kernel's output, rebuilt in numpy from each slice's raw draws
    (numpy's SFC64, stepped from the slice's lanes): slice t of CHUNKS, block j
    made by block_of_draws from each lane's draws 3j, 3j + 1 and 3j + 2, the
    last block cut. Exact, bit for bit."""
    n = CHUNKS * (2 * BLOCK + 5) + 3
    stream = registry.get("gaussian_stream", "cpu", "numba")(np.random.SeedSequence(9))
    start = stream._state.copy()
    x = np.zeros(n, dtype=np.float32)
    stream.add_(x, 1.0)
    for t in range(CHUNKS):
        lo, hi = t * n // CHUNKS, (t + 1) * n // CHUNKS
        blocks = -(-(hi - lo) // BLOCK)
        raw = np.empty((DRAWS * blocks, LANES), dtype=np.uint64)
        sfc64_raw(start[t].copy(), raw)
        want = np.concatenate([block_of_draws(raw[DRAWS * j:DRAWS * (j + 1)])
                               for j in range(blocks)])[:hi - lo]
        assert np.array_equal(x[lo:hi], want), t


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_samples_are_standard_normal(backend):
    """KS test, moments and the tail mass beyond 3.5 (seeded: no flakes; a wrong
    transform or a biased path fails by hundreds of standard errors)."""
    stream = registry.get("gaussian_stream", "cpu", backend)(np.random.SeedSequence(7))
    x = torch.zeros(2_000_000, dtype=torch.float64)
    stream.add_(x, 1.0)
    assert_standard_normal(x.numpy(), tail_at=3.5)


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


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_a_bound_call_draws_what_add_draws_and_follows_set_state(backend):
    """``bind(buf, std)()`` is ``add_(buf, std)``: the same stream, advanced alike,
    and a state restored after binding is the one the bound call draws from."""
    make = registry.get("gaussian_stream", "cpu", backend)
    a, b = make(np.random.SeedSequence(8)), make(np.random.SeedSequence(8))
    x, y = torch.zeros(3001), torch.zeros(3001)
    bound = getattr(a, "bind", lambda buf, std: (lambda: a.add_(buf, std)))(x, 0.5)
    start = a.get_state()
    for _ in range(3):
        bound()
        b.add_(y, 0.5)
    assert torch.equal(x, y) and torch.count_nonzero(x) == x.numel()
    a.set_state(start)
    x.zero_()
    bound()
    y.zero_()
    make(np.random.SeedSequence(8)).add_(y, 0.5)
    assert torch.equal(x, y)


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
