"""Learning-rate schedules, as a function of the update's index.

``--lr-schedule constant`` keeps ``--lr``; ``inv-sqrt`` is the schedule of
mlbench's closed-division task 2a (logistic regression on epsilon), the
classic rate for convex SGD: ``lr_t = alpha / sqrt(t)``, ``t = 1, 2, ...``
the index of the update (mlbench's ``SQRTTimeDecayLR`` uses
``1 / sqrt(max(1, t))`` over its iteration counter, the same sequence). The
schedule depends only on the step, which every rank and every resume knows,
so it needs no state of its own in checkpoints.
"""
from __future__ import annotations

import math

SCHEDULES = ("constant", "inv-sqrt")


def learning_rate(schedule: str, base: float, update: int) -> float:
    """The learning rate of update number ``update`` (1-based).

    Raises:
        ValueError: unknown ``schedule`` or ``update < 1``.
    """
    if update < 1:
        raise ValueError(f"updates are counted from 1, got {update}")
    if schedule == "constant":
        return float(base)
    if schedule == "inv-sqrt":
        return float(base) / math.sqrt(update)
    raise ValueError(f"learning-rate schedule {schedule!r} not in {SCHEDULES}")
