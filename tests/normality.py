"""One check that samples are N(0, 1), shared by the Gaussian kernels' tests."""
import numpy as np
from scipy import stats


def assert_standard_normal(x: np.ndarray, tail_at: float) -> None:
    """Mean, variance, kurtosis, a KS test and the share beyond ``tail_at``, each
    within 5 standard errors: for seeded streams (no flakes) a wrong transform,
    table or branch fails by hundreds of them."""
    n = x.size
    assert abs(x.mean()) < 5 / np.sqrt(n)
    assert abs(x.var() - 1) < 5 * np.sqrt(2 / n)
    assert abs(stats.kurtosis(x)) < 5 * np.sqrt(24 / n)
    assert stats.kstest(x, "norm").pvalue > 1e-4
    tail = 2 * stats.norm.sf(tail_at)
    assert abs((np.abs(x) > tail_at).mean() - tail) < 5 * np.sqrt(tail / n)
