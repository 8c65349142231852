"""The one-run epsilon lower bound (engine.audit.one_run) against closed forms and simulations."""
import math

import numpy as np
import pytest

from engine.audit import one_run


def test_pure_dp_with_all_guesses_right_has_a_closed_form():
    """delta = 0, v = r: the p-value is q^r, so the bound solves q^r = alpha."""
    for r in (5, 20, 100):
        q = 0.05 ** (1 / r)
        assert one_run.epsilon_lower_bound(1000, r, r, 0.0) == pytest.approx(
            math.log(q / (1 - q)), abs=1e-6)
        assert one_run.p_value(1000, r, r, 1.0, 0.0) == pytest.approx(
            (1 / (1 + math.exp(-1))) ** r)


def test_the_bound_grows_with_evidence_and_shrinks_with_delta():
    assert one_run.epsilon_lower_bound(1000, 100, 50, 1e-5) == 0.0  # chance level
    few = one_run.epsilon_lower_bound(1000, 100, 80, 1e-5)
    more = one_run.epsilon_lower_bound(1000, 100, 95, 1e-5)
    assert 0 < few < more
    assert one_run.epsilon_lower_bound(1000, 100, 95, 1e-3) < more
    assert one_run.ceiling(1000, 100, 1e-5) >= more


def test_the_bound_holds_for_randomised_response():
    """An eps-DP mechanism (randomised response per canary): over many audits
    the bound exceeds the true eps in at most 5% of them."""
    rng = np.random.default_rng(0)
    eps, m, over = 2.0, 200, 0
    q = 1 / (1 + math.exp(-eps))
    trials = 200
    for _ in range(trials):
        included = rng.random(m) < 0.5
        told = np.where(rng.random(m) < q, included, ~included)  # eps-DP output
        scores = told + rng.random(m) * 1e-3  # ties broken at random
        result = one_run.audit(scores, included, delta=0.0)
        over += result.epsilon > eps
    assert over <= 0.05 * trials


def test_a_leaky_mechanism_is_caught():
    """A mechanism that reveals membership almost exactly refutes epsilon = 1."""
    rng = np.random.default_rng(1)
    included = rng.random(1000) < 0.5
    scores = included + rng.normal(0, 0.05, 1000)
    result = one_run.audit(scores, included, delta=1e-5)
    assert result.epsilon > 1.0 and result.correct == result.guesses
    assert result.epsilon <= result.ceiling


def test_bad_input():
    with pytest.raises(ValueError, match="0 <= v <= r <= m"):
        one_run.p_value(10, 11, 3, 1.0, 0.0)
    with pytest.raises(ValueError, match="confidence"):
        one_run.epsilon_lower_bound(10, 5, 3, 0.0, confidence=1.0)
    with pytest.raises(ValueError, match="do not fit"):
        one_run.audit(np.zeros(4), np.zeros(4, bool), 0.0, ks=[(3, 3)])


# ---------------------------------------------------------------- the f-DP analysis
from engine.audit import one_run_fdp  # noqa: E402


def test_gdp_epsilon_is_dp_accountings():
    """mu-GDP's epsilon at delta against dp_accounting's Gaussian mechanism
    (sensitivity 1, noise sigma: mu = 1 / sigma), an independent implementation."""
    import dp_accounting

    for sigma in (0.5, 1.0, 2.0, 4.0):
        for delta in (1e-5, 1e-3):
            assert one_run_fdp.gdp_epsilon(1 / sigma, delta) == pytest.approx(
                dp_accounting.get_epsilon_gaussian(sigma, delta), rel=1e-6)
    assert one_run_fdp.gdp_epsilon(0.0, 1e-5) == 0.0


def _gdp_game(mu: float, m: int, seed: int):
    """The idealised audit of a mu-GDP mechanism: a canary's score is N(mu, 1)
    when included, N(0, 1) when not, so each canary's view is exactly mu-GDP."""
    rng = np.random.default_rng(seed)
    included = rng.random(m) < 0.5
    return rng.standard_normal(m) + mu * included, included


def test_fdp_bound_never_exceeds_a_gaussian_mechanisms_epsilon_and_beats_steinke():
    """Over 20 seeded audits of a 1-GDP mechanism (epsilon 4.38 at delta 1e-5):
    never above the truth; above the binomial theorem's bound of the same
    guesses (the f-DP analysis uses the curve, not only (epsilon, delta))."""
    truth = one_run_fdp.gdp_epsilon(1.0, 1e-5)
    ks = [(250, 250)]
    bounds = []
    for seed in range(20):
        scores, included = _gdp_game(1.0, 20_000, seed)
        fdp = one_run.audit(scores, included, 1e-5, ks=ks, bound=one_run_fdp.epsilon_lower_bound)
        binomial = one_run.audit(scores, included, 1e-5, ks=ks)
        assert fdp.epsilon <= truth
        assert fdp.epsilon > binomial.epsilon
        bounds.append(fdp.epsilon)
    assert min(bounds) > 0.5 * truth  # measured 0.65-0.84 of it (binomial: 0.51-0.65)


def test_fdp_rejection_follows_the_evidence():
    tau = 0.05
    weak, strong = one_run_fdp.gdp_fbar_inverse(3.0), one_run_fdp.gdp_fbar_inverse(0.3)
    assert one_run_fdp.rejects(1000, 100, 100, strong, tau)      # all right: not 0.3-GDP
    assert not one_run_fdp.rejects(1000, 100, 55, strong, tau)   # near chance: no evidence
    assert not one_run_fdp.rejects(1000, 100, 0, strong, tau)
    assert not one_run_fdp.rejects(1000, 100, 100, weak, tau)    # 100 guesses cannot refute 3
    low = one_run_fdp.epsilon_lower_bound(1000, 100, 80, 1e-5)
    high = one_run_fdp.epsilon_lower_bound(1000, 100, 95, 1e-5)
    assert 0 < low < high <= one_run_fdp.epsilon_lower_bound(1000, 100, 100, 1e-5)
    assert one_run_fdp.epsilon_lower_bound(1000, 100, 50, 1e-5) == 0.0
    with pytest.raises(ValueError, match="0 <= v <= r <= m"):
        one_run_fdp.rejects(10, 11, 3, strong, tau)
    with pytest.raises(ValueError, match="confidence"):
        one_run_fdp.mu_lower_bound(10, 5, 3, confidence=1.0)


def test_dpsgd_curve_at_full_batch_is_gaussian_dp_and_errs_towards_the_weaker_claim():
    """At q = 1, T steps of noise sigma are exactly sqrt(T)/sigma-GDP: the
    curve from the accountant's PLD matches it, never stronger."""
    exact = one_run_fdp.gdp_fbar_inverse(1.0)
    ours = one_run_fdp.dpsgd_fbar_inverse(1.0, 5.0, 25, 1e-5)
    for y in (1e-6, 1e-4, 1e-2, 0.1, 0.5, 0.9):
        assert 0.97 * exact(y) <= ours(y) <= exact(y)
    assert ours(0.0) == 0.0 and ours(1.0) == 1.0
    # subsampling makes a run more private: the inverse grows towards y
    sub = one_run_fdp.dpsgd_fbar_inverse(0.1, 5.0, 25, 1e-5)
    assert all(ours(y) < sub(y) <= y for y in (1e-4, 1e-2, 0.1, 0.5))


def test_dpsgd_curve_at_a_delta_past_the_plds_tails_is_drawn():
    """At delta 1e-15 (dp-accounting's tail truncation) the PLD has no finite
    epsilon: the curve is drawn up to a larger delta's, not refused after the
    canaries' training (a ValueError traceback once)."""
    tiny = one_run_fdp.dpsgd_fbar_inverse(0.14, 1.0, 7, 1e-15)
    usual = one_run_fdp.dpsgd_fbar_inverse(0.14, 1.0, 7, 1e-5)
    for y in (1e-4, 1e-2, 0.1, 0.5):
        assert tiny(y) == pytest.approx(usual(y), rel=1e-2) and tiny(y) <= y


def test_curve_from_epsilon_delta_pairs_is_the_pure_dp_curve():
    """One pair (eps, 0): f(a) = max(0, 1 - e^eps a, e^-eps (1 - a))."""
    inverse = one_run_fdp.curve_fbar_inverse(np.array([1.0]), np.array([0.0]), points=20000)
    for a in (1e-3, 0.05, 0.2, 0.6):
        fbar = 1 - max(0.0, 1 - math.e * a, (1 - a) / math.e)
        assert inverse(fbar) == pytest.approx(a, rel=2e-3) and inverse(fbar) <= a
