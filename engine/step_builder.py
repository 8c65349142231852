"""The DP step, assembled in one place for everything that runs it.

``mpidp train`` (:mod:`engine.trainer`), ``mpidp bench dpsgd`` and the
audit's reference model (:mod:`engine.audit.reference`) all build their step
here, so the benchmark times what users run and the reference learns as the
target did. From an engine (the model's clipped-sum kernels, which each
caller makes its own way) and :class:`StepSettings`, :func:`build` makes
this rank's share of the noise, the optimizer, the
:class:`~engine.step.DPStep`, and on a GPU the step chosen by
``--cuda-graph`` (:func:`engine.fixed_step.choose`). :func:`step_buffer` is
the all-reduce buffer every step reduces: the flat gradient and one control
float; :func:`engine_capacity` the rows an engine preallocates.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from engine import fixed_step
from engine.dp.noise import GaussianNoise
from engine.nn.optim import build as build_optimizer
from engine.step import DPStep


@dataclass(frozen=True)
class StepSettings:
    """What a step does, whoever builds it.

    Attributes:
        batch_size: B, the public expected batch (the sum is divided by it).
        max_norm: the clipping bound C, or None for the non-private sum.
        noise_std: sigma * C, the deviation the reduced sum carries, or None.
        seed: the run's seed (the noise streams' and a graph-free replay's).
        noise_scheme, secure_noise: :class:`~engine.dp.noise.GaussianNoise`'s.
        optimizer, lr, momentum, weight_decay, nesterov: the update's.
        algorithm: the all-reduce algorithm; kernels: a forced back-end.
        cuda_graph: ``auto``, ``on`` or ``off`` (:func:`engine.fixed_step.choose`).
    """

    batch_size: int
    max_norm: float | None
    noise_std: float | None
    seed: int
    noise_scheme: str = "partition"
    secure_noise: bool = False
    optimizer: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    nesterov: bool = False
    algorithm: str = "auto"
    kernels: str | None = None
    cuda_graph: str = "off"


@dataclass
class BuiltStep:
    """A built step and the parts its caller keeps (checkpoints read them)."""

    #: the step to call (a DPStep, or on a GPU the graph's fixed-shape step)
    step: "DPStep | fixed_step.FixedShapeStep"
    #: the line saying which step runs and why (None on the CPU)
    note: str | None
    noise: GaussianNoise | None
    optimizer: object
    #: this rank's rows on the engine's device
    X: torch.Tensor
    y: torch.Tensor


def step_buffer(n_params: int, device: torch.device, host: bool,
                dtype=np.float32) -> tuple[object, torch.Tensor, object]:
    """The all-reduce buffer: ``n_params`` gradient entries and one control float
    (the trainer's stop requests ride in it). A numpy array when ``host`` (the
    CPU, or a GPU run whose all-reduce stages through host memory by choice),
    else a tensor on ``device``. Returns (buffer, grad view, control view)."""
    if host:
        buffer = np.zeros(n_params + 1, dtype=dtype)
        grad = torch.from_numpy(buffer[:n_params])
    else:
        buffer = torch.zeros(n_params + 1, dtype=getattr(torch, np.dtype(dtype).name),
                             device=device)
        grad = buffer[:n_params]
    return buffer, grad, buffer[n_params:]


def engine_capacity(expected_local_batch: float) -> int:
    """Rows an engine preallocates for a rank's Poisson batch of this mean: six
    standard deviations above it (an engine grows when a batch is larger)."""
    b = max(0.0, float(expected_local_batch))
    return int(b + 6 * math.sqrt(b) + 16)


def build(engine, X: np.ndarray | torch.Tensor, y: np.ndarray | torch.Tensor, buffer,
          grad: torch.Tensor, settings: StepSettings, comm, *, n_local: int | None = None,
          q: float | None = None, fixed_batch: int | None = None,
          households: bool = False,
          restore: "Callable[[BuiltStep], None] | None" = None) -> BuiltStep:
    """Collective (on a GPU, and when ``settings.cuda_graph`` is not ``off``):
    the step over ``engine`` (whose ``grad`` is ``grad``, the head of ``buffer``).

    Args:
        engine: :class:`~engine.dp.fast_mlp.FastMLP` or
            :class:`~engine.dp.module_engine.ModuleEngine` (or any object with
            their interface) over ``grad``.
        X, y: this rank's rows (with the ones column) and labels, numpy or
            torch; moved to the engine's device once.
        n_local, q: this rank's rows and the sampling rate (the graph's
            capacity follows), or ``fixed_batch``: every local batch's rows
            (shuffled batches); ``households``: grouped batches (no graph).
        restore: called with the eager step's parts before a graph is
            captured (a resumed run restores its optimizer and noise states
            there, so the graph is captured from the restored state).

    Raises:
        ConfigError: (collective) ``cuda_graph="on"`` where the graph cannot
            be used.
    """
    device = engine.params.device
    size, rank = comm.Get_size(), comm.Get_rank()
    as_tensor = (lambda a: a if isinstance(a, torch.Tensor) else torch.from_numpy(a))
    X, y = as_tensor(X).to(device), as_tensor(y).to(device)
    noise = None
    if settings.noise_std is not None:
        noise = GaussianNoise(grad.shape[0], settings.noise_std, size, rank, settings.seed,
                              settings.noise_scheme, device=device, backend=settings.kernels,
                              secure=settings.secure_noise)
    optimizer = build_optimizer(settings.optimizer, engine.params, settings.lr,
                                settings.momentum, settings.weight_decay,
                                backend=settings.kernels, nesterov=settings.nesterov)
    step = DPStep(engine, X, y, buffer, grad, optimizer, 1.0 / settings.batch_size, comm,
                  max_norm=settings.max_norm, noise=noise, algorithm=settings.algorithm)
    built = BuiltStep(step=step, note=None, noise=noise, optimizer=optimizer, X=X, y=y)
    if restore is not None:
        restore(built)
    rows = int(X.shape[0]) if n_local is None else int(n_local)
    rate = settings.batch_size / max(1, rows) if q is None else float(q)
    built.step, built.note = fixed_step.choose(step, settings.cuda_graph, comm, n_local=rows,
                                               q=min(1.0, rate), fixed_batch=fixed_batch,
                                               households=households)
    return built
