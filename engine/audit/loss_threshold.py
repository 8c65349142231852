"""Membership inference by thresholding the loss (Yeom et al. 2018).

Yeom, Giacomelli, Fredrikson & Jha, "Privacy risk in machine learning:
analyzing the connection to overfitting" (CSF 2018), Sec. 3.2: a model fits
its training records better than unseen ones, so a record whose loss is low
is guessed to be a member. The score is the negative loss, ``log p(y | x)``.

Yeom et al.'s attacker predicts "member" when the loss is at most the
model's average training loss, which it is assumed to know; we take that
threshold as the mean loss of the audited members and report its TPR, FPR
and balanced accuracy (``yeom_*``), besides the threshold-free statistics of
:func:`engine.audit.stats.summary` (AUC, best advantage, TPR at low FPR).

Example::

    >>> import numpy as np
    >>> from engine.audit import loss_threshold
    >>> members, non = np.log([0.9, 0.8, 0.6]), np.log([0.8, 0.5, 0.4])  # log p(y|x)
    >>> s = loss_threshold.statistic(members, non)     # threshold: p >= 0.756
    >>> [round(s[k], 4) for k in ("auc", "yeom_tpr", "yeom_fpr")]   # AUC: 7.5 of 9 pairs
    [0.8333, 0.6667, 0.3333]
"""
from __future__ import annotations

import numpy as np

from engine.audit import stats

NAME = "loss"
TITLE = "loss threshold (Yeom et al. 2018)"
NEEDS_REFERENCE = False


def scores(observed) -> tuple[np.ndarray, np.ndarray]:
    """(member scores, non-member scores): the target's ``log p(y | x)``."""
    return observed.member_logp, observed.nonmember_logp


def statistic(members: np.ndarray, nonmembers: np.ndarray) -> dict[str, float]:
    """Threshold-free statistics plus Yeom's threshold (mean member loss)."""
    result = stats.flatten(stats.summary(members, nonmembers))
    threshold = float(np.mean(members))   # -(mean training loss)
    tpr, fpr = stats.threshold_rates(members, nonmembers, threshold)
    result.update(yeom_threshold_loss=-threshold, yeom_tpr=tpr, yeom_fpr=fpr,
                  yeom_balanced_accuracy=(1.0 + tpr - fpr) / 2.0)
    return result
