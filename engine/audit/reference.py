"""The reference model of the calibrated membership attack (Watson et al. 2022).

Difficulty calibration needs a model that has *not* seen the audited records
but was trained the way the target was, on data from the same population: its
loss on a record says how hard the record is for any such model. We train one
on the population sample (:mod:`engine.audit.inputs`: the odd rows of both
splits, disjoint from members and non-members) with the target's architecture (the same
:class:`~engine.nn.mlp.MLPSpec`), optimizer, learning rate, momentum, expected
batch size and number of epochs, and on as many rows as the target (or all
of the sample if it is smaller). It is trained **without** DP: its job is to
predict how hard a record is, and the target's own noise would only blur that.

The training reuses the engine's pieces: the trainer's step
(:class:`engine.step.DPStep`, without clipping or noise: forward, backward,
gradient sum, one all-reduce, update), :class:`engine.dp.sampler.PoissonSampler`
and :func:`engine.nn.optim.build`. The rows come in parts (one per split),
each spread over the ranks in consecutive blocks. To give the same model
whatever the number of ranks, every rank draws the same *global* Poisson
sample of each part (a sampler per part, seeded by the audit's seed and the
part's number alone) and keeps the rows it holds (sampling stays outside
the step: the step takes the rows); the union of the parts' samples is a
Poisson sample of all rows. The sums are float64, so ranks change only the
last bits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

import collectives
from engine.dp.fast_mlp import FastMLP
from engine.dp.sampler import PoissonSampler
from engine.errors import DivergedError
from engine.nn.mlp import init_params
from engine.step_builder import StepSettings, build, engine_capacity, step_buffer

#: Stream id of the reference model's seed (kept apart from the target's streams).
REFERENCE_STREAM = 7


def training_plan(n_rows: int, batch_size: int, epochs: int) -> tuple[int, float, int]:
    """(expected batch B, sampling rate q = B / n, total steps) of the reference run,
    with the trainer's rule ``steps per epoch = round(n / B)``."""
    batch = max(1, min(int(batch_size), n_rows))
    return batch, batch / n_rows, max(1, int(epochs)) * max(1, round(n_rows / batch))


@dataclass
class Part:
    """This rank's rows of one part of the reference data.

    ``X`` (float32, with the ones column) and ``y`` are the rows; ``offset`` is
    the index of the first of them within the part's ``n`` rows (the ranks'
    rows are consecutive blocks in rank order).
    """

    X: np.ndarray
    y: np.ndarray
    offset: int
    n: int


def train_reference(spec, settings: dict, parts: list[Part], comm, seed: int, epochs: int,
                    progress: bool = False):
    """Collective: train the reference model on the rows of ``parts``.

    Args:
        spec: the target's :class:`~engine.nn.mlp.MLPSpec`.
        settings: the target's training config (``optimizer``, ``lr``,
            ``momentum``, ``batch_size``), as stored in its checkpoint.
        parts: this rank's rows of each part (same number of parts everywhere).
        comm: every rank must call this.
        seed: the audit's seed; epochs: passes over the reference rows.

    Returns:
        The flat float64 parameter vector (a torch tensor, same on every rank).

    Raises:
        DivergedError: the loss became NaN or infinite (collective).
    """
    n_rows = sum(part.n for part in parts)
    batch, q, steps = training_plan(n_rows, settings.get("batch_size", 256), epochs)
    own_seed = int(np.random.SeedSequence(int(seed), spawn_key=(REFERENCE_STREAM,))
                   .generate_state(1, np.uint64)[0] >> 2)
    params = init_params(spec, own_seed, dtype=torch.float64)
    buffer, grad, _ = step_buffer(spec.n_params, torch.device("cpu"), host=True,
                                  dtype=np.float64)
    engine = FastMLP(spec, params, grad, capacity=engine_capacity(batch), backend="torch")
    # One global sampler per part ("rank" = part number: the same on every rank).
    samplers = [PoissonSampler(part.n, q, seed=own_seed, rank=i) if part.n else None
                for i, part in enumerate(parts)]
    bases = np.cumsum([0] + [part.y.shape[0] for part in parts])
    X = torch.from_numpy(np.concatenate([np.asarray(p.X, dtype=np.float64) for p in parts]))
    y = torch.from_numpy(np.concatenate([np.asarray(p.y, dtype=np.int64) for p in parts]))
    # No clipping and no noise: the reference model is trained without DP.
    step_settings = StepSettings(batch_size=batch, max_norm=None, noise_std=None, seed=own_seed,
                                 optimizer=settings.get("optimizer", "sgd"),
                                 lr=float(settings.get("lr", 0.05)),
                                 momentum=float(settings.get("momentum", 0.9)))
    dp_step = build(engine, X, y, buffer, grad, step_settings, comm).step
    bar = tqdm(total=steps, unit="step", desc="reference model", leave=False,
               disable=not progress)
    loss_sum = 0.0
    for step in range(steps):
        mine = []
        for part, sampler, base in zip(parts, samplers, bases):
            if sampler is None:
                continue
            rows = sampler.sample(step)
            lo, hi = part.offset, part.offset + part.y.shape[0]
            mine.append(rows[np.searchsorted(rows, lo):np.searchsorted(rows, hi)] - lo + base)
        _, loss, _ = dp_step(torch.from_numpy(np.concatenate(mine or [np.empty(0, np.int64)])))
        loss_sum += loss
        bar.update()
    bar.close()
    finite = np.array([float(bool(torch.isfinite(params).all())), loss_sum])
    collectives.allreduce(finite, comm)
    if finite[0] < comm.Get_size() or not math.isfinite(finite[1]):
        raise DivergedError("the reference model of the calibrated attack diverged (NaN or "
                            "infinite loss) with the target's learning rate; use "
                            "--no-calibration, or fewer --reference-epochs",
                            collective=True)
    return params
