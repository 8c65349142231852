"""One DP-SGD step on every rank, written once.

The trainer, ``mpidp bench dpsgd`` (methods ``mpidp-dp`` and ``mpidp-nondp``)
and the audit's reference model all call :class:`DPStep`, so the benchmark
times the step users run and the reference model learns the way the target
did. A call, on the rows the caller sampled:

1. **load** this rank's rows ``X[rows]``, ``y[rows]`` into the engine's buffers;
2. **clip**: the per-example clipped gradient sum into ``grad``
   (:mod:`engine.dp.fast_mlp`; the plain sum when ``max_norm`` is None);
3. **noise**: this rank's share of the Gaussian noise (:mod:`engine.dp.noise`;
   none when ``noise`` is None); an optional ``extra(grad)`` runs just before
   it, after the clipped sum: the canary audit (:mod:`engine.audit.canary`)
   adds its gradient canaries there, as if they were clipped rows (None,
   the default, everywhere else);
4. **comm**: ONE all-reduce of the whole ``buffer`` through
   :func:`collectives.allreduce` (the gradient, and whatever the caller keeps
   after it: the trainer's control float that carries stop requests);
5. **update**: the optimizer's step with the reduced sum times ``inv_batch``
   (1/B, the public expected batch size, not the sampled one).

Sampling stays with the caller (the trainer's Poisson or shuffle sampler,
the benchmark's pre-drawn batches, the audit's global sample of each part),
because the three sample differently; a caller that times the step passes
the clock reading it took before sampling, so ``sample_s`` covers sampling
and gathering. Components are bound once at construction and a call
allocates nothing of its own: it is the hot loop of training.
"""
from __future__ import annotations

import time

import torch

import collectives
from collectives import MPI
from engine.dp.noise import GaussianNoise
from engine.dp.fast_mlp import FastMLP

#: Breakdown of a step's time, in the order of the step; the keys of ``times``
#: (the trainer's metrics and the scaling report read them by these names).
PHASES = ("sample_s", "clip_s", "noise_s", "comm_s", "update_s")


class DPStep:
    """Load -> clipped sum -> noise -> all-reduce -> update (see module docstring).

    Args:
        engine: the model's :class:`~engine.dp.fast_mlp.FastMLP`; its ``grad``
            must be ``grad`` below.
        X, y: this rank's rows on the engine's device: ``X`` ``[n, F+1]`` of the
            parameters' dtype (trailing ones column), ``y`` int64 ``[n]``.
        buffer: the flat all-reduce buffer (numpy array or tensor) whose first
            ``n_params`` entries are ``grad``; entries after them are reduced
            along (summed over the ranks) and otherwise left alone.
        grad: flat view of ``buffer[:n_params]`` the engine writes and the
            optimizer reads.
        optimizer: an :mod:`engine.nn.optim` optimizer over the engine's
            parameters (its ``lr`` may be changed between calls).
        inv_batch: 1/B, B the public expected batch size.
        comm: the communicator; every rank of it calls the step in lockstep.
        max_norm: clipping bound C, or None for the non-private sum.
        noise: this rank's :class:`~engine.dp.noise.GaussianNoise`, or None.
        algorithm: all-reduce algorithm name (:func:`collectives.names`).
        extra: None, or a callable ``extra(grad)`` run after the clipped sum and
            before the noise (the canary audit's hook; may be set later through
            the attribute of that name).
    """

    def __init__(self, engine: FastMLP, X: torch.Tensor, y: torch.Tensor, buffer,
                 grad: torch.Tensor, optimizer, inv_batch: float, comm: MPI.Comm, *,
                 max_norm: float | None, noise: GaussianNoise | None = None,
                 algorithm: str = "auto", extra=None) -> None:
        if engine.grad.data_ptr() != grad.data_ptr():
            raise ValueError("the engine must write its sums into grad")
        self.engine, self.X, self.y = engine, X, y
        self.buffer, self.grad = buffer, grad
        self.optimizer = optimizer
        self.inv_batch = float(inv_batch)
        self.max_norm = None if max_norm is None else float(max_norm)
        self.comm, self.algorithm = comm, algorithm
        self.extra = extra
        # Bound once: the call below is the training loop's body.
        self._load = engine.load
        self._clipped_sum = engine.clipped_sum
        self.set_noise(noise)
        self._update = optimizer.step

    def set_noise(self, noise: GaussianNoise | None) -> None:
        """Add ``noise`` from the next call on (None: none). The step binds the
        noise to ``grad`` once (:meth:`GaussianNoise.bind`), so a change to the
        noise's deviation after construction takes effect only through this."""
        self.noise = noise
        self._add_noise = None if noise is None else noise.bind(self.grad)

    def __call__(self, rows: torch.Tensor, times: dict[str, float] | None = None,
                 started: float | None = None,
                 groups: torch.Tensor | None = None) -> tuple[int, float, int]:
        """Collective over ``comm``: one step on this rank's sampled ``rows``.

        Args:
            rows: int64 tensor of local row indices into ``X`` (sorted; may be
                empty: an empty local batch is a valid step).
            groups: for the household unit, int64 ``[H+1]`` offsets of the
                sampled households in ``rows`` (each household's summed
                gradient is clipped as one); None clips per row.
            times: if given, the seconds of each phase are added to its
                :data:`PHASES` keys.
            started: ``time.perf_counter()`` read before the rows were
                sampled (default: now), the start of ``sample_s``.

        Returns:
            (k rows used, their summed cross-entropy loss, how many rows were
            clipped).
        """
        pc = time.perf_counter
        t0 = pc() if started is None else started
        k = self._load(self.X, self.y, rows)
        t1 = pc()
        loss, clipped = self._clipped_sum(k, self.max_norm, groups)
        if self.extra is not None:
            self.extra(self.grad)
        t2 = pc()
        if self._add_noise is not None:
            self._add_noise()
        t3 = pc()
        collectives.allreduce(self.buffer, self.comm, algorithm=self.algorithm)
        t4 = pc()
        self._update(self.grad, self.inv_batch)
        t5 = pc()
        if times is not None:
            times["sample_s"] += t1 - t0
            times["clip_s"] += t2 - t1
            times["noise_s"] += t3 - t2
            times["comm_s"] += t4 - t3
            times["update_s"] += t5 - t4
        return k, loss, clipped

    def settle(self) -> tuple[float, int]:
        """Loss and clipped count not yet returned by a call: none here (every call
        returns its own); :class:`engine.fixed_step.FixedShapeStep` keeps them
        on the device until asked."""
        return 0.0, 0
