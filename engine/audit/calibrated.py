"""Difficulty-calibrated loss attack (Watson et al. 2022).

Watson, Guo, Cormode & Sablayrolles, "On the importance of difficulty
calibration in membership inference attacks" (ICLR 2022), Sec. 3: a low loss
says little when the record is easy for *any* model of its population. The
calibrated score subtracts the loss of a reference model that never saw the
record, ``s(x) = loss_ref(x) - loss_target(x)`` (higher: the target fits x
better than a model that did not train on it, so x is more likely a member).
The reference model is trained on the population sample, disjoint from
members and non-members (:mod:`engine.audit.reference`).

Example::

    >>> import numpy as np
    >>> from engine.audit import calibrated
    >>> from engine.audit.membership import Observations
    >>> obs = Observations(np.log([.9, .5]), np.log([.9, .4]),
    ...                    np.log([.6, .4]), np.log([.9, .5]))
    >>> calibrated.statistic(*calibrated.scores(obs))["auc"]   # raw losses tie at 0.9
    1.0
"""
from __future__ import annotations

import numpy as np

from engine.audit import stats

NAME = "calibrated"
TITLE = "difficulty-calibrated loss (Watson et al. 2022)"
NEEDS_REFERENCE = True


def scores(observed) -> tuple[np.ndarray, np.ndarray]:
    """(member, non-member) scores ``log p_target(y|x) - log p_ref(y|x)``."""
    if observed.member_ref_logp is None:
        raise ValueError("the calibrated attack needs the reference model's scores")
    return (observed.member_logp - observed.member_ref_logp,
            observed.nonmember_logp - observed.nonmember_ref_logp)


def statistic(members: np.ndarray, nonmembers: np.ndarray) -> dict[str, float]:
    """AUC, best advantage and TPR at low FPR of the calibrated scores."""
    return stats.flatten(stats.summary(members, nonmembers))
