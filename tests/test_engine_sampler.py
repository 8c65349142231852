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
    state = a.get_state()
    first = [a.sample(i) for i in range(5)]
    a.set_state(state)
    assert all(np.array_equal(x, a.sample(i)) for i, x in enumerate(first))


def test_shuffle_sampler_is_fixed_size_and_covers_an_epoch():
    s = ShuffleSampler(n_local=100, local_batch=10, steps_per_epoch=10, seed=0, rank=0)
    assert not s.assumption_met
    rows = np.concatenate([s.sample(i) for i in range(10)])
    assert sorted(rows.tolist()) == list(range(100))
    assert not np.array_equal(s.sample(0), s.sample(10))  # a new permutation next epoch


def test_rate_must_be_a_probability():
    with pytest.raises(ValueError):
        PoissonSampler(10, 0.0, 0, 0)


def test_dense_and_sparse_paths_give_distinct_uniform_rows():
    """Both the duplicate-redraw path (k << n) and choice() (k > n/4) are uniform."""
    for n, q in ((40, 0.5), (60, 0.05)):
        s = PoissonSampler(n, q, seed=4, rank=0)
        counts = np.zeros(n)
        for step in range(6000):
            rows = s.sample(step)
            assert np.all(np.diff(rows) > 0)
            counts[rows] += 1
        assert stats.chisquare(counts).pvalue > 1e-4
        assert abs(counts.sum() / 6000 - n * q) < 6 * np.sqrt(n * q / 6000)
