"""The audit's statistics against hand-computed values and independent references."""
import math

import numpy as np
import pytest
from scipy.stats import mannwhitneyu

from engine.audit import calibrated, loss_threshold, stats
from engine.audit.membership import Observations


def test_roc_curve_by_hand():
    # Sorted: .9 m, .8 m, .7 n, .3 m, .2 n, .1 n
    roc = stats.roc_curve([0.9, 0.8, 0.3], [0.7, 0.2, 0.1])
    assert np.allclose(roc.fpr, [0, 0, 0, 1 / 3, 1 / 3, 2 / 3, 1])
    assert np.allclose(roc.tpr, [0, 1 / 3, 2 / 3, 2 / 3, 1, 1, 1])
    assert roc.thresholds[0] == np.inf and np.allclose(roc.thresholds[1:],
                                                       [.9, .8, .7, .3, .2, .1])
    assert stats.auc_of(roc) == pytest.approx(8 / 9)
    assert stats.advantage(roc) == pytest.approx(2 / 3)
    assert stats.tpr_at_fpr(roc, 0.01) == pytest.approx(2 / 3)
    assert stats.tpr_at_fpr(roc, 1 / 3) == pytest.approx(1.0)   # FPR exactly 1/3 counts


def test_ties_count_one_half():
    # members {1, 1}, non-members {1, 0}: pairs 1/2, 1/2, 1, 1 -> 3/4
    roc = stats.roc_curve([1.0, 1.0], [1.0, 0.0])
    assert np.allclose(roc.fpr, [0, 0.5, 1]) and np.allclose(roc.tpr, [0, 1, 1])
    assert stats.auc_of(roc) == pytest.approx(0.75)
    assert stats.advantage(roc) == pytest.approx(0.5)
    assert stats.tpr_at_fpr(roc, 0.01) == 0.0   # the tied non-member comes with them


def test_perfect_and_inverted_attacks():
    s = stats.summary([5, 6, 7], [1, 2])
    assert s["auc"] == 1 and s["advantage"] == 1 and s["balanced_accuracy"] == 1
    assert s["tpr_at_fpr"] == {0.01: 1.0, 0.001: 1.0}
    s = stats.summary([1, 2], [5, 6, 7])
    assert s["auc"] == 0 and s["advantage"] == 0 and s["balanced_accuracy"] == 0.5
    assert s["tpr_at_fpr"][0.01] == 0.0


def test_auc_equals_mann_whitney_u():
    rng = np.random.default_rng(3)
    for m, n in ((7, 11), (200, 150), (1, 9)):
        pos = np.round(rng.normal(0.4, 1, m), 1)   # rounding makes ties
        neg = np.round(rng.normal(0.0, 1, n), 1)
        u = mannwhitneyu(pos, neg, alternative="two-sided").statistic
        assert stats.auc(pos, neg) == pytest.approx(u / (m * n), abs=1e-12)


def test_tpr_at_fpr_against_a_brute_force_over_thresholds():
    rng = np.random.default_rng(4)
    pos, neg = rng.normal(1, 1, 300), rng.normal(0, 1, 1000)
    roc = stats.roc_curve(pos, neg)
    for alpha in (0.0, 0.001, 0.01, 0.1):
        best = max((np.mean(pos >= t) for t in np.r_[np.inf, pos, neg]
                    if np.mean(neg >= t) <= alpha), default=0.0)
        assert stats.tpr_at_fpr(roc, alpha) == pytest.approx(best)
    brute_adv = max(np.mean(pos >= t) - np.mean(neg >= t) for t in np.r_[pos, neg])
    assert stats.advantage(roc) == pytest.approx(brute_adv)


def test_bad_scores_are_refused():
    with pytest.raises(ValueError):
        stats.roc_curve([], [1.0])
    with pytest.raises(ValueError):
        stats.roc_curve([np.nan], [1.0])


def test_clopper_pearson_by_hand():
    # k = 0: upper = 1 - (alpha/2)^(1/n); k = n: lower = (alpha/2)^(1/n)
    lo, hi = stats.clopper_pearson(0, 10)
    assert lo == 0 and hi == pytest.approx(1 - 0.025 ** 0.1, rel=1e-9)
    lo, hi = stats.clopper_pearson(10, 10)
    assert lo == pytest.approx(0.025 ** 0.1, rel=1e-9) and hi == 1
    lo, hi = stats.clopper_pearson(5, 10)                  # published: 0.1871, 0.8129
    assert (round(lo, 4), round(hi, 4)) == (0.1871, 0.8129)
    assert all(math.isnan(v) for v in stats.clopper_pearson(0, 0))


def test_bootstrap_is_the_same_however_the_replicates_are_split():
    rng = np.random.default_rng(5)
    pos, neg = rng.normal(0.5, 1, 60), rng.normal(0, 1, 80)

    def stat(p, n):
        return [stats.auc(p, n), float(np.mean(p))]

    whole = stats.bootstrap_replicates(pos, neg, stat, range(10), seed=9)
    parts = [stats.bootstrap_replicates(pos, neg, stat, range(r, 10, 3), seed=9)
             for r in range(3)]
    merged = np.empty_like(whole)
    for r, part in enumerate(parts):
        merged[list(range(r, 10, 3))] = part
    assert np.array_equal(whole, merged)
    assert stats.bootstrap_replicates(pos, neg, stat, [], seed=9).shape == (0, 0)
    # stratified: every replicate keeps the group sizes (mean of 60 resampled members)
    assert not np.array_equal(whole[0], whole[1])


def test_bootstrap_interval_matches_hanley_mcneil():
    """The bootstrap standard error of the AUC agrees with Hanley & McNeil's (1982)
    closed form, and a separated sample gives the point interval [1, 1]."""
    rng = np.random.default_rng(6)
    m = n = 300
    pos, neg = rng.normal(1, 1, m), rng.normal(0, 1, n)
    a = stats.auc(pos, neg)
    reps = stats.bootstrap_replicates(pos, neg, lambda p, q: [stats.auc(p, q)],
                                      range(400), seed=1)[:, 0]
    q1, q2 = a / (2 - a), 2 * a * a / (1 + a)
    se = math.sqrt((a * (1 - a) + (m - 1) * (q1 - a * a) + (n - 1) * (q2 - a * a)) / (m * n))
    assert reps.std() == pytest.approx(se, rel=0.2)
    lo, hi = stats.percentile_interval(reps[:, None], 0.95)[:, 0]
    assert lo < a < hi and hi - lo == pytest.approx(2 * 1.96 * se, rel=0.25)
    sep = stats.bootstrap_replicates([3, 4, 5], [0, 1], lambda p, q: [stats.auc(p, q)],
                                     range(50), seed=0)
    assert np.array_equal(stats.percentile_interval(sep), [[1.0], [1.0]])


def test_min_resamples_put_five_beyond_each_end_of_the_interval():
    assert [stats.min_resamples(c) for c in (0.5, 0.8, 0.9, 0.95, 0.99)] == [20, 50, 100,
                                                                             200, 1000]
    for bad in (0.0, 1.0, float("nan")):
        with pytest.raises(ValueError):
            stats.min_resamples(bad)


def test_intervals_contain_the_estimate_even_where_the_percentiles_do_not():
    """Before, the advantage of an in-sample threshold could lie below its own
    50% percentile interval (0.100 [0.110, 0.152] here): the resamples'
    duplicates make its maximum larger. Now each interval is widened to the
    estimate, and intervals that already held it are untouched."""
    from collectives import MPI
    from engine.audit import membership

    rng = np.random.default_rng(0)
    observed = Observations(rng.standard_normal(100), rng.standard_normal(100))
    found = membership.evaluate(loss_threshold, observed, MPI.COMM_SELF, resamples=400,
                                confidence=0.5, seed=0)
    est, ci, keys = found["estimate"], found["ci"], list(found["estimate"])
    reps = stats.bootstrap_replicates(
        observed.member_logp, observed.nonmember_logp,
        lambda p, n: [loss_threshold.statistic(p, n)[k] for k in keys], range(400), 0)
    raw = stats.percentile_interval(reps, 0.5)
    assert raw[0, keys.index("advantage")] > est["advantage"]  # the case this is about
    for j, key in enumerate(keys):
        assert ci[key][0] <= est[key] <= ci[key][1], key
        assert ci[key] == [min(raw[0, j], est[key]), max(raw[1, j], est[key])], key
    nan = stats.percentile_interval(np.array([[1.0], [2.0]]), 0.5, estimate=[float("nan")])
    assert np.array_equal(nan, stats.percentile_interval(np.array([[1.0], [2.0]]), 0.5))


def test_yeom_threshold_is_the_mean_member_loss():
    members, non = np.log([0.9, 0.8, 0.6]), np.log([0.8, 0.5, 0.4])
    s = loss_threshold.statistic(members, non)
    # mean member loss = -log(0.432)/3 -> predict member when p >= 0.432^(1/3) = 0.756
    assert s["yeom_threshold_loss"] == pytest.approx(-np.log(0.432) / 3)
    assert s["yeom_tpr"] == pytest.approx(2 / 3) and s["yeom_fpr"] == pytest.approx(1 / 3)
    assert s["yeom_balanced_accuracy"] == pytest.approx(2 / 3)
    assert s["auc"] == pytest.approx(7.5 / 9)


def test_calibration_removes_the_difficulty_of_each_record():
    # Target = reference + 0.1 on members: raw scores are useless (records of
    # very different difficulty), calibrated ones separate perfectly.
    difficulty = np.array([-3.0, -0.1, -2.0, -0.5])
    obs = Observations(member_logp=difficulty[:2] + 0.1, nonmember_logp=difficulty[2:],
                       member_ref_logp=difficulty[:2], nonmember_ref_logp=difficulty[2:])
    assert loss_threshold.statistic(*loss_threshold.scores(obs))["auc"] == 0.5
    assert calibrated.statistic(*calibrated.scores(obs))["auc"] == 1.0
    with pytest.raises(ValueError):
        calibrated.scores(Observations(difficulty, difficulty))


def test_no_leak_tests_use_the_advantage_and_auc():
    """The KS statistic D+ of (non-members, members) is the advantage, and the
    Mann-Whitney U is AUC * m * n; shifted scores give small p-values, equal
    ones large."""
    from scipy.stats import ks_2samp

    rng = np.random.default_rng(8)
    same = stats.no_leak_tests(rng.normal(0, 1, 400), rng.normal(0, 1, 500))
    assert same["auc_p_value"] > 0.01 and same["advantage_p_value"] > 0.01
    pos, neg = rng.normal(0.5, 1, 400), rng.normal(0, 1, 500)
    shifted = stats.no_leak_tests(pos, neg)
    assert shifted["auc_p_value"] < 1e-6 and shifted["advantage_p_value"] < 1e-6
    d_plus = ks_2samp(neg, pos, alternative="greater").statistic
    assert d_plus == pytest.approx(stats.advantage(stats.roc_curve(pos, neg)))


def test_row_plan_halves_each_split_by_parity():
    from engine.audit.inputs import MIN_ROWS, SplitTooSmall, plan_rows, reference_rows, spread

    assert spread(10, 4).tolist() == [0, 2, 5, 7] and spread(5, 5).tolist() == [0, 1, 2, 3, 4]
    plan = plan_rows(n_train=1000, n_test=101)
    assert plan.m == 51 and plan.nonmembers.tolist() == list(range(0, 101, 2))
    assert np.all(plan.members % 2 == 0) and len(set(plan.members)) == 51
    assert plan.population_train.tolist() == list(range(1, 1000, 2))
    assert plan.population_test.tolist() == list(range(1, 101, 2)) and plan.population == 550
    assert plan_rows(1000, 101, max_rows=30).m == 30
    a, b = reference_rows(plan, 110)                # a fifth of each part
    assert (a.size, b.size) == (100, 10) and set(a) <= set(plan.population_train)
    a, b = reference_rows(plan, 10 ** 6)            # all of it
    assert (a.size, b.size) == (500, 50)
    with pytest.raises(SplitTooSmall, match="at least"):
        plan_rows(1000, 2 * MIN_ROWS - 3)
    with pytest.raises(SplitTooSmall, match="--max-rows"):
        plan_rows(1000, 1000, max_rows=MIN_ROWS - 1)
