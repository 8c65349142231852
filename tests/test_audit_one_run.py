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
