"""The reference model of the calibrated membership attack (Watson et al. 2022).

Difficulty calibration needs a model that has *not* seen the audited records
but was trained the way the target was, on data from the same population: its
loss on a record says how hard the record is for any such model. We train one
on the population sample (:mod:`engine.audit.inputs`: odd test rows, disjoint
from members and non-members) with the target's architecture (the same
:class:`~engine.model.MLPSpec`), optimizer, learning rate, momentum, expected
batch size and number of epochs, and on as many rows as the target (or all
of the sample if it is smaller). It is trained **without** DP: its job is to
predict how hard a record is, and the target's own noise would only blur that.

The training reuses the engine's pieces: :class:`engine.fast_mlp.FastMLP`
(forward, backward, gradient sum), :class:`engine.sampler.PoissonSampler`,
:func:`engine.optim.build`, and one all-reduce of the gradient per step. To
give the same model whatever the number of ranks, every rank draws the same
*global* Poisson sample (a sampler seeded as rank 0 over all reference rows)
and keeps the rows it holds; the sums are float64, so ranks change only the
last bits of the result.
"""
from __future__ import annotations

import math

import numpy as np

from engine.errors import DivergedError

#: Stream id of the reference model's seed (kept apart from the target's streams).
REFERENCE_STREAM = 7


def training_plan(n_rows: int, batch_size: int, epochs: int) -> tuple[int, float, int]:
    """(expected batch B, sampling rate q = B / n, total steps) of the reference run,
    with the trainer's rule ``steps per epoch = round(n / B)``."""
    batch = max(1, min(int(batch_size), n_rows))
    return batch, batch / n_rows, max(1, int(epochs)) * max(1, round(n_rows / batch))


def train_reference(spec, settings: dict, X: np.ndarray, y: np.ndarray, offset: int,
                    n_rows: int, comm, seed: int, epochs: int, progress: bool = False):
    """Collective: train the reference model on ``n_rows`` rows split over the ranks.

    Args:
        spec: the target's :class:`~engine.model.MLPSpec`.
        settings: the target's training config (``optimizer``, ``lr``,
            ``momentum``, ``batch_size``), as stored in its checkpoint.
        X, y: this rank's reference rows (X float32 with the ones column).
        offset: index of this rank's first row among the ``n_rows``; the
            ranks' rows must be consecutive blocks in rank order.
        comm: every rank must call this.
        seed: the audit's seed; epochs: passes over the reference rows.

    Returns:
        The flat float64 parameter vector (a torch tensor, same on every rank).

    Raises:
        DivergedError: the loss became NaN or infinite (collective).
    """
    import torch
    from tqdm import tqdm

    import collectives
    from engine.fast_mlp import FastMLP
    from engine.model import init_params
    from engine.optim import build as build_optimizer
    from engine.sampler import PoissonSampler

    batch, q, steps = training_plan(n_rows, settings.get("batch_size", 256), epochs)
    own_seed = int(np.random.SeedSequence(int(seed), spawn_key=(REFERENCE_STREAM,))
                   .generate_state(1, np.uint64)[0] >> 2)
    params = init_params(spec, own_seed, dtype=torch.float64)
    buffer = np.zeros(spec.n_params, dtype=np.float64)
    grad = torch.from_numpy(buffer)
    capacity = int(batch + 6 * math.sqrt(batch) + 16)
    engine = FastMLP(spec, params, grad, capacity=capacity, backend="torch")
    optimizer = build_optimizer(settings.get("optimizer", "sgd"), params,
                                float(settings.get("lr", 0.05)),
                                float(settings.get("momentum", 0.9)))
    sampler = PoissonSampler(n_rows, q, seed=own_seed, rank=0)
    X64 = torch.from_numpy(np.ascontiguousarray(X, dtype=np.float64))
    y64 = torch.from_numpy(np.asarray(y, dtype=np.int64))
    lo, hi = offset, offset + y64.shape[0]
    bar = tqdm(total=steps, unit="step", desc="reference model", leave=False,
               disable=not progress)
    loss_sum = 0.0
    for step in range(steps):
        rows = sampler.sample(step)
        mine = rows[np.searchsorted(rows, lo):np.searchsorted(rows, hi)] - lo
        k = engine.load(X64, y64, torch.from_numpy(mine))
        loss, _ = engine.clipped_sum(k, None)
        loss_sum += loss
        collectives.allreduce(buffer, comm)
        optimizer.step(grad, 1.0 / batch)
        bar.update()
    bar.close()
    finite = np.array([float(bool(torch.isfinite(params).all())), loss_sum])
    collectives.allreduce(finite, comm)
    if finite[0] < comm.Get_size() or not math.isfinite(finite[1]):
        raise DivergedError("the reference model of the calibrated attack diverged (NaN or "
                            "infinite loss) with the target's learning rate; use "
                            "--calibration none, or fewer --reference-epochs",
                            collective=True)
    return params
