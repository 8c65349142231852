"""The DP step on a batch of fixed shape, and on CUDA all of it as one captured graph.

Poisson sampling gives every step a batch of another size, and a GPU runs a
step of a few hundred rows as dozens of small kernels, each launched from
Python: the step is launch-bound. A CUDA graph replays a captured sequence
of kernels with one launch, but only on the shapes and addresses it was
captured with. So :class:`FixedShapeStep` serves every batch through one
shape: a batch of ``capacity`` rows, the sampled ones first, the rest
padding (a valid row index), and a 0/1 mask. The engines' ``masked_sum``
(:meth:`engine.dp.fast_mlp.FastMLP.masked_sum`,
:meth:`engine.dp.module_engine.ModuleEngine.masked_sum`) zero the loss
gradient of the padding rows at the logits, so their gradients, norms and
clip factors (1) add exactly nothing, and leave the summed loss and the
clipped count on the device instead of reading them back.

Per step, on the host: the sampled row indices, their count and the noise
stream's counters are written into one pinned buffer and copied to the
device in one transfer; then the graph (gather, forward, backward, norms,
clipping, the clipped sum, this rank's noise, the loss and count added to
running totals on the device) is replayed with one launch; then, outside
it, the all-reduce (:func:`collectives.allreduce`, any algorithm, on the
same buffer as the eager step) and the optimizer's update, which depend on
the other ranks and on the step's learning rate. The noise stream's state
stays on the host and advances exactly as the eager step's does
(:meth:`engine.dp.noise.GaussianNoise.staged`): a run draws the same noise
with or without the graph. Where the stream cannot read its counter from
device memory (torch's generator), the noise is added after the replay.
The loss and the clipped count are read once an epoch (:meth:`settle`).

A batch larger than the capacity is never truncated (dropping sampled rows
would break the Poisson analysis the epsilon rests on): that step runs the
eager :class:`engine.step.DPStep` on all of its rows. The capacity is the
smallest with an overflow probability of at most :data:`OVERFLOW` a step
(:func:`capacity_for`, exact binomial tail), so the padding costs little
and the eager step runs about once in ten thousand steps.

On the CPU the fixed shape buys nothing (no launches to save); it runs there
only in the tests, which check it against the eager step. See docs/gpus.md.
"""
from __future__ import annotations

import time

import numpy as np
import torch

import collectives
from engine.errors import ConfigError
from engine.step import DPStep

#: Largest probability, per step, that a Poisson batch exceeds the capacity.
OVERFLOW = 1e-4
#: Runs of the step on a side stream before the capture (torch's rule: lazy
#: initialisation, cuBLAS workspaces and the kernels' compilation happen there).
WARMUP = 2


def graph_capable(device: torch.device) -> bool:
    """Whether steps on ``device`` can be captured as CUDA graphs."""
    return device.type == "cuda"


class GraphUnusable(RuntimeError):
    """The step could not be captured as a CUDA graph (the message says why)."""


def capacity_for(n: int, q: float, overflow: float = OVERFLOW) -> int:
    """The smallest capacity c (at least 1) with P(Binomial(n, q) > c) <= ``overflow``:
    the rows a rank's Poisson batch of n rows at rate q fits in, but rarely."""
    if n <= 0:
        return 1
    if q >= 1.0:
        return int(n)
    from scipy.stats import binom  # deferred: a few hundred ms to import

    c = int(binom.isf(overflow, n, q))
    while c > 0 and binom.sf(c - 1, n, q) <= overflow:  # isf may round up by one
        c -= 1
    while binom.sf(c, n, q) > overflow:
        c += 1
    return max(1, min(int(n), c))


def overflow_probability(n: int, q: float, capacity: int) -> float:
    """P(Binomial(n, q) > capacity): how often a step runs eagerly."""
    if capacity >= n:
        return 0.0
    from scipy.stats import binom

    return float(binom.sf(capacity, n, q))


class FixedShapeStep:
    """:class:`engine.step.DPStep`'s step, on a batch of ``capacity`` rows and a mask.

    Same call as ``DPStep`` (which it wraps, and runs for what it cannot
    serve: a batch above the capacity, households, the canary audit's
    ``extra``), but the loss and clipped count it returns are 0: they are
    summed on the device and read by :meth:`settle`.

    Args:
        step: the eager step, whose components (engine, rows, buffer,
            optimizer, noise, communicator, algorithm) this one uses.
        capacity: rows of the fixed batch (:func:`capacity_for`).
        graph: capture the step as a CUDA graph (:meth:`prepare`); False runs
            the same fixed-shape step eagerly (the tests' CPU check).
        staged_noise: draw the noise from counters staged with the rows
            (default: with the graph, where the stream can); otherwise the
            eager step's bound noise is added after the body.

    Raises:
        ValueError: the engine has no ``masked_sum``, or ``graph`` off a GPU.
    """

    def __init__(self, step: DPStep, capacity: int, graph: bool = False,
                 staged_noise: bool | None = None) -> None:
        engine = step.engine
        if not hasattr(engine, "masked_sum"):
            raise ValueError(f"{type(engine).__name__} has no fixed-shape step")
        device = engine.params.device
        if graph and not graph_capable(device):
            raise ValueError("a CUDA graph needs the parameters on a CUDA device")
        self.step, self.engine, self.device = step, engine, device
        self.capacity, self.graph = int(capacity), bool(graph)
        self.overflows = 0  # steps run eagerly because the batch was larger
        self._staged = None if step.noise is None else step.noise.staged(step.grad)
        if not (graph if staged_noise is None else staged_noise):
            self._staged = None  # eagerly, the bound noise does the same in one call
        draws = 0 if self._staged is None else self._staged.draws
        words = self.capacity + 1 + 2 * draws
        cuda = device.type == "cuda"
        self._host = torch.zeros(words, dtype=torch.int64, pin_memory=cuda)
        self._host_np = self._host.numpy()
        self._host_words = self._host_np.view(np.uint64)
        self._inputs = torch.zeros(words, dtype=torch.int64, device=device) if cuda \
            else self._host
        cap = self.capacity
        self._rows = self._inputs[:cap]
        self._k = self._inputs[cap:cap + 1]
        self._counters = self._inputs[cap + 1:]
        self._copied = torch.cuda.Event() if cuda else None
        dtype = engine.params.dtype
        self._positions = torch.arange(cap, device=device)
        self._live = torch.empty(cap, dtype=torch.bool, device=device)
        self._mask = torch.empty(cap, dtype=dtype, device=device)
        self._loss = torch.zeros((), dtype=torch.float64, device=device)
        self._count = torch.zeros(1, dtype=torch.int32, device=device)
        self._loss_total = torch.zeros((), dtype=torch.float64, device=device)
        self._count_total = torch.zeros(1, dtype=torch.int64, device=device)
        self._replay = None
        self._graph = None
        self._max_norm = step.max_norm

    # ------------------------------------------------------------------ body
    def _body(self) -> None:
        """The step from the staged inputs to this rank's noisy clipped sum, all
        on the device (what the graph holds)."""
        torch.lt(self._positions, self._k, out=self._live)
        self._mask.copy_(self._live)
        step = self.step
        self.engine.masked_sum(step.X, step.y, self._rows, self._mask, self._max_norm,
                               self._loss, self._count)
        self._loss_total.add_(self._loss)
        self._count_total.add_(self._count)
        if self._staged is not None:
            self._staged.add(self._counters)

    def _stage(self, rows: torch.Tensor) -> int:
        """Write the rows, their count and the noise's counters into the pinned
        buffer and copy it to the device in one transfer; returns k."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has read the buffer
        k, cap = int(rows.shape[0]), self.capacity
        host = self._host_np
        host[:k] = rows.numpy()
        host[k:cap] = 0  # padding: a valid row, masked out
        host[cap] = k
        if self._staged is not None:
            for j, counter in enumerate(self._staged.take()):
                self._host_words[cap + 1 + 2 * j] = counter & 0xFFFFFFFFFFFFFFFF
                self._host_words[cap + 2 + 2 * j] = counter >> 64
        if self._copied is not None:
            self._inputs.copy_(self._host, non_blocking=True)
            self._copied.record()
        return k

    # --------------------------------------------------------------- capture
    def prepare(self) -> None:
        """Capture the graph (``graph=True``; nothing otherwise). Runs the step's
        body on a side stream first, then captures it, then checks that a
        replay gives what the body gives eagerly on the same inputs (a
        dry batch of the first ``capacity`` rows, noise from counter 0: the
        stream's state is not touched, and every call rewrites the gradient).

        Raises:
            GraphUnusable: the capture or the check failed (the message says
                why); the step then must not be used with ``graph=True``.
        """
        if not self.graph or self._replay is not None:
            return
        n_rows = int(self.step.X.shape[0])
        host = self._host_np
        host[:] = 0
        host[:self.capacity] = np.arange(self.capacity) % max(1, n_rows)
        host[self.capacity] = min(self.capacity, n_rows)
        self._inputs.copy_(self._host)
        try:
            self._capture()
            self._check()
        except GraphUnusable:
            self._release()
            raise
        except Exception as exc:  # torch, the kernels or the user's model: say which
            self._release()
            text = str(exc).strip().splitlines()
            raise GraphUnusable(f"{type(exc).__name__}: {text[0] if text else ''}"[:300]) \
                from None
        finally:
            self._loss_total.zero_()
            self._count_total.zero_()

    def _capture(self) -> None:
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                self._body()
        current.wait_stream(side)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._body()
        self._graph, self._replay = graph, graph.replay

    def _check(self) -> None:
        """A replay gives what the eager body gives on the same inputs, or
        GraphUnusable. Not bit for bit: a GPU's convolution and scatter
        kernels may sum in another order from one call to the next."""
        grad = self.step.grad
        self._replay()
        replayed = (grad.clone(), self._loss.clone(), self._count.clone())
        self._body()
        for name, a, b in zip(("gradient", "loss", "clipped count"), replayed,
                              (grad, self._loss, self._count)):
            a, b = a.double(), b.double()
            scale = float(b.abs().max()) if b.numel() else 0.0
            diff = float((a - b).abs().max()) if b.numel() else 0.0
            allowed = max(1.0, self.capacity / 100) if name == "clipped count" \
                else 1e-3 * scale + 1e-12
            if not diff <= allowed:  # NaN fails too
                raise GraphUnusable(f"a replay of the captured step gives another {name} than "
                                    f"the step run eagerly (largest difference {diff:.3g} of "
                                    f"{scale:.3g})")

    def _release(self) -> None:
        self._graph = self._replay = None

    # ------------------------------------------------------------------ call
    def __call__(self, rows: torch.Tensor, times: dict[str, float] | None = None,
                 started: float | None = None,
                 groups: torch.Tensor | None = None) -> tuple[int, float, int]:
        """Collective over the step's communicator: one step on ``rows``
        (:meth:`engine.step.DPStep.__call__`'s contract); returns (k, 0.0, 0):
        the loss and clipped count wait on the device for :meth:`settle`,
        except for a step run eagerly, which returns them as ``DPStep`` does."""
        k = int(rows.shape[0])
        step = self.step
        if k > self.capacity or groups is not None or step.extra is not None:
            self.overflows += k > self.capacity
            return step(rows, times, started, groups)
        pc = time.perf_counter
        t0 = pc() if started is None else started
        self._stage(rows)
        t1 = pc()
        if self._replay is not None:
            self._replay()
        else:
            self._body()
        t2 = pc()
        if self._staged is None and step._add_noise is not None:
            step._add_noise()
        t3 = pc()
        collectives.allreduce(step.buffer, step.comm, algorithm=step.algorithm)
        t4 = pc()
        step._update(step.grad, step.inv_batch)
        t5 = pc()
        if times is not None:
            times["sample_s"] += t1 - t0
            times["clip_s"] += t2 - t1
            times["noise_s"] += t3 - t2
            times["comm_s"] += t4 - t3
            times["update_s"] += t5 - t4
        return k, 0.0, 0

    def settle(self) -> tuple[float, int]:
        """The summed loss and clipped count of the steps since the last call
        (reads the device: once an epoch), and zero them."""
        loss, count = float(self._loss_total), int(self._count_total)
        self._loss_total.zero_()
        self._count_total.zero_()
        return loss, count

    @property
    def extra(self):
        """The eager step's ``extra`` hook (the canary audit's); a step with one
        runs eagerly."""
        return self.step.extra

    @extra.setter
    def extra(self, hook) -> None:
        self.step.extra = hook

    def set_noise(self, noise) -> None:
        """As :meth:`engine.step.DPStep.set_noise`. A captured graph holds the
        noise it was captured with, so it is dropped: the fixed-shape step then
        runs eagerly, adding the new noise after its body."""
        self._release()
        self.step.set_noise(noise)
        self._staged = None


def choose(step: DPStep, mode: str, comm, *, n_local: int, q: float,
           fixed_batch: int | None = None, households: bool = False,
           ) -> tuple[DPStep | FixedShapeStep, str | None]:
    """Collective: the step a run uses under ``--cuda-graph MODE`` and a line
    that says which and why (None on the CPU, where there is nothing to say).

    ``n_local`` and ``q``: this rank's rows and the sampling rate (the
    capacity follows from them), or ``fixed_batch``: the rows of every local
    batch (``--sampling shuffle``). ``households``: the batches are
    households, whose sizes vary (no fixed shape: the eager step).

    Every rank captures its step; if any cannot, every rank runs the eager
    step (the line names the first rank that could not, and why).

    Raises:
        ConfigError: (collective) ``mode`` is ``on`` and some rank cannot.
    """
    device = step.engine.params.device
    if not graph_capable(device):
        return step, None
    if mode == "off":
        return step, "the eager step runs (--cuda-graph off)"
    why, fixed = None, None
    if households:
        why = "household batches have no fixed shape (households of any size)"
    elif not hasattr(step.engine, "masked_sum"):
        why = f"{type(step.engine).__name__} has no fixed-shape step"
    else:
        capacity = fixed_batch if fixed_batch is not None else capacity_for(n_local, q)
        fixed = FixedShapeStep(step, max(1, capacity), graph=True)
        try:
            fixed.prepare()
        except GraphUnusable as exc:
            why = f"the step cannot be captured ({exc})"
    whys = comm.allgather(why)
    failed = [(rank, text) for rank, text in enumerate(whys) if text]
    if failed:
        rank, text = failed[0]
        where = f"rank {rank}: " if comm.Get_size() > 1 else ""
        if mode == "on":
            raise ConfigError(f"--cuda-graph on: {where}{text}; use --cuda-graph auto or off",
                              collective=True)
        return step, f"no CUDA graph, the eager step runs: {where}{text}"
    if fixed_batch is not None:
        return fixed, f"each step runs as one CUDA graph on a batch of {fixed.capacity} rows"
    p = overflow_probability(n_local, q, fixed.capacity)
    return fixed, (f"each step runs as one CUDA graph on a batch of {fixed.capacity} rows (a "
                   f"larger Poisson batch, probability {p:.1g} a step, runs eagerly, whole)")
