"""Membership inference: run the attacks on the scores, with bootstrap intervals.

The harness never knows what an attack computes; an attack never knows how it
is evaluated. An attack is a module in :data:`ATTACKS` with

* ``NAME``, ``TITLE`` and ``NEEDS_REFERENCE`` (does it need the reference
  model's scores?),
* ``scores(observed) -> (member_scores, nonmember_scores)`` (higher: more
  likely a member), from an :class:`Observations`,
* ``statistic(member_scores, nonmember_scores) -> {name: value}``.

:func:`evaluate` computes the statistics on the audited rows and their
percentile bootstrap intervals, each widened to contain its estimate
(:func:`engine.audit.stats.percentile_interval`); the bootstrap
replicates are split over the ranks (replicate i is seeded by (seed, i)
alone, so the intervals do not depend on the number of ranks).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.audit import calibrated, loss_threshold, stats

#: name -> attack module (see module docstring).
ATTACKS = {module.NAME: module for module in (loss_threshold, calibrated)}


@dataclass
class Observations:
    """What the attacker sees of each audited record (float64, global row order):
    the target's ``log p(y | x)`` and the reference model's (None without one)."""

    member_logp: np.ndarray
    nonmember_logp: np.ndarray
    member_ref_logp: np.ndarray | None = None
    nonmember_ref_logp: np.ndarray | None = None


def evaluate(attack, observed: Observations, comm, resamples: int = 1000,
             confidence: float = 0.95, seed: int = 0, progress: bool = False) -> dict:
    """Collective: one attack's statistics and their bootstrap intervals.

    Every rank passes the same ``observed`` (all rows); each computes the
    replicates ``i = rank, rank + size, ...`` and all of them are gathered.

    Returns (same on every rank)::

        {"attack": NAME, "title": TITLE, "estimate": {stat: value},
         "ci": {stat: [low, high]} ({} for R = 0; low <= value <= high),
         "confidence": c, "resamples": R,
         "p_values": {"auc_p_value", "advantage_p_value"}}   (stats.no_leak_tests)
    """
    from tqdm import tqdm  # deferred: keeps `mpidp audit --help` fast

    members, nonmembers = attack.scores(observed)
    estimate = attack.statistic(members, nonmembers)
    keys = list(estimate)
    rank, size = comm.Get_rank(), comm.Get_size()
    ids = list(range(rank, resamples, size))
    bar = tqdm(total=len(ids), desc=f"bootstrap {attack.NAME}", unit="resample",
               leave=False, disable=not progress or rank != 0)

    def vector(pos, neg):
        bar.update()
        values = attack.statistic(pos, neg)
        return [values[k] for k in keys]

    mine = stats.bootstrap_replicates(members, nonmembers, vector, ids, seed)
    bar.close()
    everyone = comm.allgather((ids, mine))
    replicates = np.empty((resamples, len(keys)), dtype=np.float64)
    for part_ids, part in everyone:
        if len(part_ids):
            replicates[part_ids] = part
    ci = {}
    if resamples > 0:
        interval = stats.percentile_interval(replicates, confidence,
                                             estimate=[estimate[k] for k in keys])
        ci = {k: [float(interval[0, j]), float(interval[1, j])] for j, k in enumerate(keys)}
    return {"attack": attack.NAME, "title": attack.TITLE, "estimate": estimate, "ci": ci,
            "confidence": confidence, "resamples": resamples,
            "p_values": stats.no_leak_tests(members, nonmembers)}
