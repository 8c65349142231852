"""Learning-rate schedules, as a function of the update's index.

``--lr-schedule constant`` keeps ``--lr``; ``inv-sqrt`` is the schedule of
mlbench's closed-division task 2a (logistic regression on epsilon), the
classic rate for convex SGD: ``lr_t = alpha / sqrt(t)``, ``t = 1, 2, ...``
the index of the update (mlbench's ``SQRTTimeDecayLR`` uses
``1 / sqrt(max(1, t))`` over its iteration counter, the same sequence).
``step`` is the schedule of mlbench's task 1a (ResNet-20 on CIFAR-10, after
Goyal et al. 2017): a linear warm-up over the first ``warmup_epochs`` from
``warmup_from`` (the one-worker rate, ``lr / ranks``, when the rate was
scaled with the workers) to ``lr``, then ``lr`` times ``decay`` for each
milestone epoch passed. A schedule depends only on the step, which every
rank and every resume knows, so it needs no state of its own in checkpoints.
"""
from __future__ import annotations

import math

SCHEDULES = ("constant", "inv-sqrt", "step")


def learning_rate(schedule: str, base: float, update: int, steps_per_epoch: int = 1,
                  warmup_epochs: float = 0.0, warmup_from: float = 0.0,
                  milestones: tuple[int, ...] = (), decay: float = 0.1) -> float:
    """The learning rate of update number ``update`` (1-based).

    ``steps_per_epoch``, ``warmup_epochs``, ``warmup_from``, ``milestones``
    (epochs, counted from 0: the rate drops when that epoch starts) and
    ``decay`` are the ``step`` schedule's (module docstring).

    Raises:
        ValueError: unknown ``schedule`` or ``update < 1``.
    """
    if update < 1:
        raise ValueError(f"updates are counted from 1, got {update}")
    if schedule == "constant":
        return float(base)
    if schedule == "inv-sqrt":
        return float(base) / math.sqrt(update)
    if schedule == "step":
        warmup_updates = warmup_epochs * steps_per_epoch
        if update <= warmup_updates:
            return float(warmup_from + (base - warmup_from) * update / warmup_updates)
        epoch = (update - 1) // steps_per_epoch
        return float(base) * decay ** sum(1 for m in milestones if epoch >= m)
    raise ValueError(f"learning-rate schedule {schedule!r} not in {SCHEDULES}")
