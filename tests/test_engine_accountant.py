"""The accountant against published values, calibration, and mpidp privacy."""
import json
import subprocess
import sys

import pytest

from engine.dp.accountant import Accountant, calibrate_sigma, epsilon_for
from engine.errors import PrivacyError

# Abadi et al. MNIST setting; values from dp-accounting as recorded in the notes.
Q, SIGMA, STEPS, DELTA = 256 / 60000, 1.1, 14062, 1e-5


def test_published_cross_check_values():
    assert epsilon_for(Q, SIGMA, STEPS, DELTA, "rdp") == pytest.approx(2.597, abs=5e-4)
    assert epsilon_for(Q, SIGMA, STEPS, DELTA, "pld") == pytest.approx(2.382, abs=5e-4)


def test_calibration_round_trip_and_monotonicity():
    sigma = calibrate_sigma(0.01, 500, 1.0, 1e-5)
    assert epsilon_for(0.01, sigma, 500, 1e-5) == pytest.approx(1.0, rel=2e-3)
    assert epsilon_for(0.01, sigma, 500, 1e-5) <= 1.0 + 1e-9 or sigma > 0
    assert calibrate_sigma(0.01, 500, 2.0, 1e-5) < sigma


def test_impossible_targets_are_errors():
    with pytest.raises(PrivacyError, match="out of reach"):
        calibrate_sigma(1.0, 10_000, 1e-6, 1e-5)
    with pytest.raises(PrivacyError):
        calibrate_sigma(0.01, 10, -1.0, 1e-5)
    with pytest.raises(PrivacyError):
        calibrate_sigma(0.01, 10, 1.0, 1.5)


def test_accountant_state_round_trip():
    a = Accountant(q=Q, sigma=SIGMA, delta=DELTA)
    a.step(STEPS)
    b = Accountant.from_state(a.state_dict())
    assert b.steps == STEPS and b.epsilon() == a.epsilon()
    assert a.epsilon(0) == 0.0


def test_budget_arithmetic_counts_the_epochs_that_fit():
    steps_per_epoch, epochs = 100, 10
    a = Accountant(q=0.01, sigma=1.0, delta=1e-5)
    budget = epsilon_for(0.01, 1.0, 4 * steps_per_epoch, 1e-5)  # exactly 4 epochs' worth
    assert a.fits(budget, 4 * steps_per_epoch) and not a.fits(budget, 5 * steps_per_epoch)
    assert a.fits(budget * (1 + 1e-7), 4 * steps_per_epoch)  # within the slack
    assert a.epochs_within(budget, steps_per_epoch, epochs) == 4
    assert a.epochs_within(budget, steps_per_epoch, 3) == 3  # never more than asked
    assert a.epochs_within(10 * budget, steps_per_epoch, epochs) == epochs
    a.step(6 * steps_per_epoch)  # epochs already spent count whatever the budget says
    assert a.epochs_within(budget, steps_per_epoch, epochs) == 6
    a.check_plan(budget, 4, steps_per_epoch)  # within: no error
    with pytest.raises(PrivacyError, match=r"5 epochs would spend epsilon=[\d.]+, more than "
                       r"this run's budget epsilon=[\d.]+ \(delta=1e-05\); at most 6 "
                       "epochs fit"):
        a.check_plan(budget, 5, steps_per_epoch)
    fresh = Accountant(q=0.01, sigma=1.0, delta=1e-5)
    with pytest.raises(PrivacyError, match="at most 4 epochs fit"):
        fresh.check_plan(budget, epochs, steps_per_epoch)


def test_privacy_command():
    out = subprocess.run(
        [sys.executable, "-m", "engine.cli", "privacy", "--sample-rate", str(Q),
         "--noise-multiplier", "1.1", "--steps", str(STEPS), "--json"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["epsilon_rdp"] == pytest.approx(2.597, abs=5e-4)
    assert result["epsilon_pld"] == pytest.approx(2.382, abs=5e-4)
    bad = subprocess.run(
        [sys.executable, "-m", "engine.cli", "privacy", "--sample-rate", "1.0",
         "--target-epsilon", "0.000001", "--steps", "10000", "--accountant", "rdp"],
        capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "out of reach" in bad.stderr
