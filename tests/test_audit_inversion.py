"""Model inversion (Fredrikson et al.) on tiny hand-made models whose answer is known."""
import numpy as np
import pytest
import torch

from engine.audit import inversion
from engine.audit.scoring import label_log_probs, score_rows
from engine.nn.mlp import MLPSpec

NAMES = ["AGEP", "SEX=1", "SEX=2", "MAR=1", "MAR=2", "MAR=3", "DIS=1", "DIS=2"]


def _rows(features: list[list[float]]) -> np.ndarray:
    X = np.array(features, dtype=np.float32)
    return np.hstack([X, np.ones((X.shape[0], 1), dtype=np.float32)])


def test_attribute_columns_come_from_the_feature_names():
    cols, values = inversion.attribute_columns(NAMES, "MAR")
    assert cols.tolist() == [3, 4, 5] and values == ["1", "2", "3"]
    assert inversion.attribute_columns(NAMES, "SEX")[1] == ["1", "2"]
    for missing in ("AGEP", "RAC1P", "SE"):
        with pytest.raises(inversion.AttributeNotFound, match="DIS, MAR, SEX") as info:
            inversion.attribute_columns(NAMES, missing, "f.h5")
        assert info.value.exit_code == 2 and "f.h5" in str(info.value)


def test_a_file_without_one_hot_attributes_points_to_the_membership_attack():
    """Before: "--attribute SEX: mnist.h5 has no one-hot encoded attribute of
    that name; it has: none", for the default attacks on an image file."""
    pixels = [f"px{i}" for i in range(784)]
    with pytest.raises(inversion.AttributeNotFound) as info:
        inversion.attribute_columns(pixels, "SEX", "mnist.h5")
    said = str(info.value)
    assert "census file" in said and "mnist.h5" in said and said.endswith(
        "audit it with --attack membership")
    assert info.value.exit_code == 2 and info.value.collective and "\n" not in said


def test_attribute_values_require_one_hot_rows():
    X = _rows([[0.3, 0, 1, 0, 0, 1, 1, 0], [1.2, 1, 0, 1, 0, 0, 0, 1]])
    assert inversion.attribute_values(X, np.array([1, 2])).tolist() == [1, 0]
    assert inversion.attribute_values(X, np.array([3, 4, 5])).tolist() == [2, 0]
    bad = X.copy()
    bad[1, 2] = 1.0                 # both SEX columns set
    with pytest.raises(ValueError, match="row 1"):
        inversion.attribute_values(bad, np.array([1, 2]))


def _sex_predicts_label(strength: float) -> tuple:
    """Logistic model on [SEX=1, SEX=2, Z]: class-1 logit = strength * SEX=2
    (class-0 logit 0), so a known label points at the sex."""
    spec = MLPSpec.build(3, (), 2)
    params = torch.zeros(spec.n_params, dtype=torch.float64)
    params[4 + 1] = strength         # row 1 (class 1), column 1 (SEX=2)
    return spec, params


def test_candidate_likelihoods_by_hand():
    spec, params = _sex_predicts_label(2.0)
    X = _rows([[1, 0, 0.5], [0, 1, -1.0]])
    ll = inversion.candidate_log_likelihoods(spec, params, X, np.array([1, 0]), [0, 1])
    # label 1: p = 1/2 with SEX=1, sigmoid(2) with SEX=2; label 0: 1/2, sigmoid(-2)
    s = 1 / (1 + np.exp(-2.0))
    assert np.allclose(np.exp(ll), [[0.5, s], [0.5, 1 - s]])
    # the rows themselves are left untouched
    assert np.array_equal(X[:, :2], [[1, 0], [0, 1]])


def test_the_attack_recovers_the_attribute_where_the_model_reveals_it():
    spec, params = _sex_predicts_label(4.0)
    # label == [SEX=2] on 15 rows (the attack is right), != on 3 rows (wrong)
    rows = [[1, 0, 0.1]] * 10 + [[0, 1, 0.2]] * 5 + [[1, 0, 0.3]] * 3
    y = np.array([0] * 10 + [1] * 5 + [1] * 3)
    X = _rows(rows)
    truth = inversion.attribute_values(X, np.array([0, 1]))
    guess = inversion.predict(inversion.candidate_log_likelihoods(spec, params, X, y, [0, 1]),
                              inversion.log_prior(np.array([50, 50])))
    assert guess.tolist() == y.tolist()
    assert int(np.sum(guess == truth)) == 15


def test_a_model_blind_to_the_attribute_gives_the_baseline():
    from collectives.runtime import MPI

    spec, params = _sex_predicts_label(0.0)
    params[4 + 2] = 1.5            # the label depends on Z only
    rng = np.random.default_rng(0)
    sex = rng.integers(0, 2, 40)
    X = _rows([[1 - s, s, z] for s, z in zip(sex, rng.normal(size=40))])
    y = rng.integers(0, 2, 40)
    population = np.array([0] * 30 + [1] * 70)          # prior: SEX=2 is the mode
    result = inversion.attack(spec, params, np.array([0, 1]), ["1", "2"],
                              {"members": (X, y, sex)}, population, MPI.COMM_SELF)
    members = result["members"]
    assert result["baseline_guess"] == "2" and result["prior_rows"] == 100
    assert result["prior"] == pytest.approx([31 / 102, 71 / 102])
    assert members["rows"] == 40 and members["correct"] == int(np.sum(sex == 1))
    assert members["accuracy"] == members["baseline_accuracy"]
    assert members["advantage"] == 0.0
    lo, hi = members["accuracy_ci"]
    assert lo < members["accuracy"] < hi


def test_the_prior_decides_when_the_model_is_weak():
    # log-likelihoods favour value 0 by log(0.6/0.4); a 9:1 prior favours value 1
    ll = np.log([[0.6, 0.4]])
    assert inversion.predict(ll, inversion.log_prior(np.array([10, 90]))).tolist() == [1]
    assert inversion.predict(ll, inversion.log_prior(np.array([50, 50]))).tolist() == [0]


def test_scores_are_exact_for_confident_predictions():
    """The loss of a confident prediction keeps its precision (log_softmax would
    round it to 0 and tie every well-fit record)."""
    spec = MLPSpec.build(1, (), 2)
    params = torch.tensor([0.0, 0.0, 1.0, 0.0], dtype=torch.float64)   # logits (0, x)
    X = _rows([[40.0], [60.0], [0.0], [-3.0]])
    logp, correct = score_rows(spec, params, X, np.array([1, 1, 1, 0]))
    expected = -np.log1p(np.exp(-np.array([40.0, 60.0, 0.0, 3.0])))
    assert np.allclose(logp, expected, rtol=1e-12, atol=0)
    assert logp[0] < logp[1] < 0
    assert correct.tolist() == [True, True, False, True]   # a tie goes to class 0
    assert np.array_equal(label_log_probs(spec, params, X, np.array([1, 1, 1, 0])), logp)
