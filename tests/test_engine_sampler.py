"""Poisson sampling per rank: the right batch-size law, uniform rows, empty batches, resumable."""
import numpy as np
import pytest
from scipy import stats

from engine.dp.sampler import PoissonSampler, ShuffleSampler


def test_batch_sizes_are_binomial_and_rows_valid():
    n, q, steps = 1000, 0.03, 4000
    s = PoissonSampler(n, q, seed=1, rank=0)
    sizes, counts = [], np.zeros(n)
    for step in range(steps):
        rows = s.sample(step)
        assert rows.dtype == np.int64
        assert np.all(np.diff(rows) > 0)  # sorted and distinct
        assert rows.size == 0 or (rows[0] >= 0 and rows[-1] < n)
        sizes.append(rows.size)
        counts[rows] += 1
    sizes = np.array(sizes)
    assert abs(sizes.mean() - n * q) < 6 * np.sqrt(n * q * (1 - q) / steps)
    assert abs(sizes.var() / (n * q * (1 - q)) - 1) < 0.15
    # every row equally likely: chi-square on the inclusion counts
    assert stats.chisquare(counts).pvalue > 1e-4


def test_empty_batches_happen_and_are_valid():
    s = PoissonSampler(50, 0.01, seed=2, rank=0)
    sizes = [s.sample(i).size for i in range(200)]
    assert 0 in sizes and max(sizes) >= 1


def test_ranks_and_seeds_give_different_streams_and_state_restores():
    a, b = PoissonSampler(500, 0.1, 3, 0), PoissonSampler(500, 0.1, 3, 1)
    assert not np.array_equal(a.sample(0), b.sample(0))
    assert not np.array_equal(a.sample(0), PoissonSampler(500, 0.1, 4, 0).sample(0))
    state = a.get_state()
    first = [a.sample(i).copy() for i in range(5)]
    a.set_state(state)
    assert all(np.array_equal(x, a.sample(i)) for i, x in enumerate(first))


def test_a_steps_rows_depend_on_the_step_alone():
    """Counter-based: any order of calls (a resume, the trainer's look-ahead at
    the next step, a jump across blocks) gives each step the same rows."""
    forward = PoissonSampler(5000, 0.01, 7, 2)
    rows = [forward.sample(i).copy() for i in range(700)]
    jumping = PoissonSampler(5000, 0.01, 7, 2)
    for i in [699, 0, 128, 127, 1, 300, 699, 5]:
        np.testing.assert_array_equal(jumping.sample(i), rows[i])
    assert forward.block_steps < 700  # the steps above span several blocks


def test_coins_are_independent_across_steps_and_rows():
    """Each (step, row) is kept with probability q independently: a row kept at a
    step is kept at the next with probability q, and two neighbouring rows
    together with probability q^2 (the geometric skips cross steps and rows)."""
    n, q, steps = 200, 0.2, 6000
    s = PoissonSampler(n, q, seed=5, rank=0)
    kept = np.zeros((steps, n), dtype=bool)
    for i in range(steps):
        kept[i, s.sample(i)] = True
    both_steps = (kept[1:] & kept[:-1]).mean()
    both_rows = (kept[:, 1:] & kept[:, :-1]).mean()
    last_first = (kept[:-1, -1] & kept[1:, 0]).mean()  # across the step boundary
    sd = np.sqrt(q * q * (1 - q * q) / (steps * n))
    assert abs(both_steps - q * q) < 6 * sd and abs(both_rows - q * q) < 6 * sd
    assert abs(last_first - q * q) < 6 * np.sqrt(q * q / steps)
    assert abs(kept.mean() - q) < 6 * np.sqrt(q * (1 - q) / (steps * n))


def test_the_extreme_rates():
    assert np.array_equal(PoissonSampler(1000, 1.0, 0, 0).sample(3), np.arange(1000))
    tiny = PoissonSampler(10, 1e-12, 0, 0)  # skips far past the block: no loop over them
    assert sum(tiny.sample(i).size for i in range(1000)) == 0
    assert PoissonSampler(0, 0.5, 0, 0).sample(0).size == 0


def test_shuffle_sampler_is_fixed_size_and_covers_an_epoch():
    s = ShuffleSampler(n_local=100, local_batch=10, steps_per_epoch=10, seed=0, rank=0)
    assert not s.assumption_met
    rows = np.concatenate([s.sample(i) for i in range(10)])
    assert sorted(rows.tolist()) == list(range(100))
    assert not np.array_equal(s.sample(0), s.sample(10))  # a new permutation next epoch


def test_rate_must_be_a_probability():
    with pytest.raises(ValueError):
        PoissonSampler(10, 0.0, 0, 0)


def test_dense_and_sparse_rates_give_distinct_uniform_rows():
    for n, q in ((40, 0.5), (60, 0.05)):
        s = PoissonSampler(n, q, seed=4, rank=0)
        counts = np.zeros(n)
        for step in range(6000):
            rows = s.sample(step)
            assert np.all(np.diff(rows) > 0)
            counts[rows] += 1
        assert stats.chisquare(counts).pvalue > 1e-4
        assert abs(counts.sum() / 6000 - n * q) < 6 * np.sqrt(n * q / 6000)


def test_the_skip_kernel_against_a_python_loop():
    """bernoulli_rows turns exponentials into positions exactly as the geometric
    skip definition says, across steps, in chunks of any size."""
    from kernels.numba_cpu.bernoulli_rows import bernoulli_rows
    rng = np.random.default_rng(0)
    for n, q, steps in ((50, 0.1, 7), (3, 0.9, 20), (1000, 1e-3, 5), (10, 1.0, 4)):
        scale = 0.0 if q == 1.0 else 1 / -np.log1p(-q)
        e = rng.standard_exponential(4000)
        expect, pos, step, i = [[] for _ in range(steps)], -1, 0, 0
        while step < steps:
            pos += int(e[i] * scale) + 1
            i += 1
            step, pos = step + pos // n, pos % n
            if step < steps:
                expect[step].append(pos)
        for chunk in (1, 7, 4000):
            state = np.array([-1, 0, 0], dtype=np.int64)
            rows, offsets = np.empty(8000, dtype=np.int64), np.zeros(steps + 1, dtype=np.int64)
            used = 0
            while state[1] < steps:
                used += bernoulli_rows(e[used:used + chunk], scale, n, steps, state, rows,
                                       offsets)
            assert used == i
            got = [rows[offsets[j]:offsets[j + 1]].tolist() for j in range(steps)]
            assert got == expect
