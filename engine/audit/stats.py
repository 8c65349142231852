"""Statistics of an attack: ROC, AUC, advantage, TPR at low FPR, confidence intervals.

Host-side NumPy/SciPy only; no MPI. One convention throughout: an attack
gives every candidate record a **score, higher meaning "more likely a
member"**, and predicts "member" when the score is at least a threshold.

* **ROC** (:func:`roc_curve`): the (FPR, TPR) of every distinct threshold,
  from (0, 0) to (1, 1).
* **AUC** (:func:`auc`): the area under it, which equals the Mann-Whitney
  probability P(member score > non-member score) + P(tie)/2.
* **Advantage** (Yeom et al. 2018, Def. 4): max over thresholds of TPR - FPR;
  the balanced accuracy of that threshold is (1 + advantage) / 2. Chosen on
  the scored data, so it is an optimistic (in-sample) figure: without any
  leakage it is about the two-sample Kolmogorov-Smirnov noise level
  ``sqrt((m + n) / (m n))``, not 0 (:func:`no_leak_tests` gives p-values).
* **TPR at FPR alpha** (Carlini et al. 2022, "Membership inference attacks
  from first principles"): the largest TPR among thresholds whose FPR <= alpha.
  An attack that learns nothing has TPR = alpha. With n non-members the FPR
  moves in steps of 1/n: at alpha = 0.1% it rests on about n/1000 false
  positives.
* **Confidence intervals**: the percentile bootstrap (Efron & Tibshirani
  1993), stratified (members and non-members resampled separately, each
  with replacement, at their own sizes) and re-choosing every threshold in
  every resample (:func:`bootstrap_replicates`, :func:`percentile_interval`),
  each widened to contain the estimate, on at least :func:`min_resamples`;
  for a proportion k/n, the exact Clopper-Pearson interval
  (:func:`clopper_pearson`, via SciPy's ``binomtest``).

Example::

    >>> import numpy as np
    >>> from engine.audit import stats
    >>> members, non = np.array([0.9, 0.8, 0.3]), np.array([0.7, 0.2, 0.1])
    >>> round(stats.auc(members, non), 4)   # 8 of 9 pairs ordered correctly
    0.8889
    >>> round(stats.advantage(stats.roc_curve(members, non)), 4)   # TPR 2/3 at FPR 0
    0.6667
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

#: FPRs at which the TPR is reported by default.
LOW_FPRS = (0.01, 0.001)
#: Bootstrap resamples that must lie beyond each end of a percentile interval
#: (:func:`min_resamples`): fewer, and an end is the extreme of a handful of
#: replicates (with 1 resample the interval has width 0).
TAIL_RESAMPLES = 5


@dataclass(frozen=True)
class Roc:
    """An ROC curve: ``fpr[i]``, ``tpr[i]`` of predicting "member" when the
    score >= ``thresholds[i]``; starts at (0, 0) (threshold +inf), ends at (1, 1)."""

    fpr: np.ndarray
    tpr: np.ndarray
    thresholds: np.ndarray


def _scores(values, name: str) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64).ravel()
    if array.size == 0:
        raise ValueError(f"{name}: no scores")
    if not np.isfinite(array).all():
        raise ValueError(f"{name}: scores must be finite")
    return array


def roc_curve(members, nonmembers) -> Roc:
    """The ROC curve of scores ``members`` (positives) vs ``nonmembers``.

    Args:
        members, nonmembers: 1-D finite scores (any lengths >= 1).

    Returns:
        :class:`Roc` with one point per distinct score value plus (0, 0).
    """
    pos, neg = _scores(members, "members"), _scores(nonmembers, "nonmembers")
    scores = np.concatenate([pos, neg])
    is_member = np.concatenate([np.ones(pos.size), np.zeros(neg.size)])
    order = np.argsort(-scores, kind="stable")
    scores, is_member = scores[order], is_member[order]
    true_pos = np.cumsum(is_member)
    false_pos = np.arange(1, scores.size + 1) - true_pos
    last_of_value = np.r_[np.flatnonzero(np.diff(scores) != 0), scores.size - 1]
    return Roc(fpr=np.r_[0.0, false_pos[last_of_value] / neg.size],
               tpr=np.r_[0.0, true_pos[last_of_value] / pos.size],
               thresholds=np.r_[np.inf, scores[last_of_value]])


def auc_of(roc: Roc) -> float:
    """Area under an ROC curve (trapezoids: ties count one half)."""
    return float(np.sum(np.diff(roc.fpr) * (roc.tpr[1:] + roc.tpr[:-1]) / 2.0))


def auc(members, nonmembers) -> float:
    """ROC AUC = P(member score > non-member score) + P(equal) / 2."""
    return auc_of(roc_curve(members, nonmembers))


def advantage(roc: Roc) -> float:
    """Membership advantage max(TPR - FPR) over thresholds (>= 0: the +inf
    threshold gives 0)."""
    return float(np.max(roc.tpr - roc.fpr))


def tpr_at_fpr(roc: Roc, alpha: float) -> float:
    """The largest TPR among thresholds with FPR <= ``alpha``."""
    ok = roc.fpr <= alpha + 1e-12
    return float(np.max(roc.tpr[ok]))


def threshold_rates(members, nonmembers, threshold: float) -> tuple[float, float]:
    """(TPR, FPR) of predicting "member" when the score >= ``threshold``."""
    pos, neg = _scores(members, "members"), _scores(nonmembers, "nonmembers")
    return float(np.mean(pos >= threshold)), float(np.mean(neg >= threshold))


def summary(members, nonmembers, fprs: Sequence[float] = LOW_FPRS) -> dict:
    """Threshold-free statistics of one attack.

    Returns:
        ``{"auc", "advantage", "balanced_accuracy", "tpr_at_fpr": {alpha: tpr}}``
        (``balanced_accuracy`` = (1 + advantage) / 2, at the best threshold).
    """
    roc = roc_curve(members, nonmembers)
    adv = advantage(roc)
    return {"auc": auc_of(roc), "advantage": adv, "balanced_accuracy": (1.0 + adv) / 2.0,
            "tpr_at_fpr": {float(a): tpr_at_fpr(roc, a) for a in fprs}}


def no_leak_tests(members, nonmembers) -> dict[str, float]:
    """One-sided p-values of "the members' scores are not larger than the
    non-members'" (no membership signal), via SciPy:

    * ``auc_p_value``: Mann-Whitney U test (its U is ``AUC * m * n``);
    * ``advantage_p_value``: Kolmogorov-Smirnov two-sample test of the
      one-sided statistic ``D+ = max_t (F_non(t) - F_mem(t))``, which is the
      advantage (max TPR - FPR). Under no leakage the advantage is not 0 but
      about ``sqrt((m + n) / (m n))`` (the KS noise level); this p-value says
      whether it exceeds that.
    """
    # deferred: scipy loads slowly; keeps `mpidp audit --help` fast
    from scipy.stats import ks_2samp, mannwhitneyu

    pos, neg = _scores(members, "members"), _scores(nonmembers, "nonmembers")
    return {"auc_p_value": float(mannwhitneyu(pos, neg, alternative="greater").pvalue),
            "advantage_p_value": float(ks_2samp(neg, pos, alternative="greater").pvalue)}


def flatten(stats: dict) -> dict[str, float]:
    """``summary()`` output as flat ``name -> value`` (``tpr_at_fpr_0.01``...)."""
    flat = {k: v for k, v in stats.items() if not isinstance(v, dict)}
    for alpha, value in stats.get("tpr_at_fpr", {}).items():
        flat[f"tpr_at_fpr_{alpha:g}"] = value
    return flat


def bootstrap_replicates(members, nonmembers, statistic: Callable[[np.ndarray, np.ndarray],
                                                                   Sequence[float]],
                         replicate_ids: Sequence[int], seed: int) -> np.ndarray:
    """Stratified bootstrap replicates of ``statistic(members, nonmembers)``.

    Replicate ``i`` resamples members and non-members with replacement from a
    generator seeded by ``(seed, i)`` alone, so any subset of replicate ids
    can be computed anywhere (ranks split them) and the union is the same.

    Returns:
        float64 ``[len(replicate_ids), len(statistic(...))]`` (``[0, 0]`` for no ids).
    """
    pos, neg = _scores(members, "members"), _scores(nonmembers, "nonmembers")
    rows = []
    for i in replicate_ids:
        rng = np.random.default_rng(np.random.SeedSequence(int(seed), spawn_key=(int(i),)))
        rows.append(np.asarray(statistic(pos[rng.integers(0, pos.size, pos.size)],
                                         neg[rng.integers(0, neg.size, neg.size)]),
                               dtype=np.float64))
    if not rows:
        return np.empty((0, 0), dtype=np.float64)
    return np.array(rows, dtype=np.float64)


def min_resamples(confidence: float = 0.95) -> int:
    """The fewest bootstrap resamples a ``confidence`` interval may rest on:
    :data:`TAIL_RESAMPLES` beyond each end (200 at 95%, 1000 at 99%).

    Raises:
        ValueError: ``confidence`` outside (0, 1).
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence {confidence} must be in (0, 1)")
    tail = (1.0 - confidence) / 2.0
    return max(1, math.ceil(TAIL_RESAMPLES / tail - 1e-9))  # 5 / 0.025 is 200.000...03


def percentile_interval(replicates: np.ndarray, confidence: float = 0.95,
                        estimate=None) -> np.ndarray:
    """Percentile bootstrap interval of each column: float64 ``[2, columns]``.

    With ``estimate`` (one value per column), each interval is widened to
    contain it where it does not: the percentile interval of a statistic
    chosen in-sample (the advantage and TPR at low FPR re-choose their
    threshold in every resample) can lie wholly above the estimate. Widening
    keeps every interval that covered the true value covering it (the
    coverage does not drop); a NaN estimate leaves its interval as it is.
    """
    tail = (1.0 - confidence) / 2.0
    interval = np.quantile(np.asarray(replicates, dtype=np.float64), [tail, 1.0 - tail],
                           axis=0)
    if estimate is not None:
        point = np.asarray(estimate, dtype=np.float64)
        interval = np.array([np.fmin(interval[0], point), np.fmax(interval[1], point)])
    return interval


def clopper_pearson(successes: int, trials: int, confidence: float = 0.95) -> tuple[float,
                                                                                     float]:
    """Exact (Clopper-Pearson) confidence interval of a binomial proportion.

    ``(nan, nan)`` when ``trials`` is 0.
    """
    if trials <= 0:
        return float("nan"), float("nan")
    from scipy.stats import binomtest  # deferred: scipy loads slowly

    ci = binomtest(int(successes), int(trials)).proportion_ci(confidence_level=confidence,
                                                             method="exact")
    return float(ci.low), float(ci.high)
