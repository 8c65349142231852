"""Gaussian noise, added exactly once to the all-reduced gradient sum.

DP-SGD releases ``sum_i clip(g_i) + N(0, sigma^2 C^2 I)``. With p ranks each
adding to its local sum before the all-reduce, the noise must be split so
the *reduced* buffer carries that variance once (adding full noise on every
rank would inflate it p-fold). Two schemes:

* ``partition`` (default, cheapest): the flat buffer of D coordinates is cut
  into p contiguous blocks; rank r adds full-variance noise N(0, sigma^2 C^2)
  to block r only. Every coordinate gets exactly one draw, and a step costs
  D/p samples per rank instead of D.
* ``split``: every rank adds N(0, sigma^2 C^2 / p) to every coordinate; the
  sum of p independent draws has variance sigma^2 C^2.

Each rank draws from its own stream (seeded from the run's seed and the
rank, :func:`engine.dp.streams.seed_sequence`), reproducible and checkpointed.
The Gaussian kernel comes from :mod:`kernels.registry` for the buffer's
device.

``secure=True`` (``mpidp train --secure-noise``) is for releases. It closes
the two openings a floating-point Gaussian sampler leaves (Mironov 2012;
Jin et al. 2022), as Opacus' ``secure_mode`` does: each rank's stream is
keyed from the operating system's CSPRNG, never from the run's seed (so a
known ``--seed`` does not reveal the noise), and every coordinate's noise
is the sum of four independent draws of half the standard deviation, which
fills in the gaps in the low-order bits that a single draw's value leaves
(Holohan and Braghin 2021). It costs four draws per coordinate instead of
one, and the run is not reproducible. (A discrete Gaussian sampler with
exact integer arithmetic, Canonne, Kamath and Steinke 2020, would be the
principled alternative; it is not implemented.)
"""
from __future__ import annotations

import functools
import math
import secrets
from typing import Callable

import torch

from engine.choices import NOISE_SCHEMES as SCHEMES
from engine.dp.streams import STREAM_NOISE, seed_sequence
from kernels import registry

#: Draws summed per coordinate by the secure mode (each of std / sqrt(DRAWS)).
SECURE_DRAWS = 4


def _nothing() -> None:
    """The bound noise of a rank with no coordinates (or none to add)."""


class StagedNoise:
    """One step's noise in two halves: :meth:`take` on the host advances the
    stream exactly as the bound call would and returns the counter of each
    draw; :meth:`add` launches the draws reading those counters from device
    memory (int64 words: low, high per draw), so a captured graph adds fresh
    noise at every replay, the same the eager step would add."""

    def __init__(self, stream, view: torch.Tensor, std: float, draws: int) -> None:
        self.stream, self.view, self.std, self.draws = stream, view, float(std), int(draws)
        self._n = int(view.shape[0])

    def take(self) -> list[int]:
        """Host side: the counters of this step's draws (the stream advances)."""
        return [self.stream.take(self._n) for _ in range(self.draws)]

    def add(self, counters: torch.Tensor) -> None:
        """Device side: add the draws whose counters ``counters`` (int64
        ``[2 * draws]`` on the view's device) holds when the kernels run."""
        for j in range(self.draws):
            self.stream.add_at_(self.view, self.std, counters[2 * j:2 * j + 2])


class GaussianNoise:
    """This rank's share of N(0, (sigma C)^2) on a flat buffer of ``dim`` coordinates.

    Args:
        dim: coordinates of the gradient buffer.
        std: sigma * C, the standard deviation the reduced sum must carry.
        size, rank: the communicator's.
        seed: the run's seed.
        scheme: ``"partition"`` or ``"split"``.
        device: of the buffer (picks the kernel).
        backend: force a kernel back-end (``"torch"``), None for the best one.
        secure: key the stream from the OS's CSPRNG instead of ``seed`` and
            sum :data:`SECURE_DRAWS` draws per coordinate (module docstring).
    """

    def __init__(self, dim: int, std: float, size: int, rank: int, seed: int,
                 scheme: str = "partition", device="cpu", backend: str | None = None,
                 secure: bool = False):
        if scheme not in SCHEMES:
            raise ValueError(f"noise scheme {scheme!r} not in {SCHEMES}")
        self.scheme, self.std = scheme, float(std)
        if scheme == "partition":
            self.lo, self.hi = rank * dim // size, (rank + 1) * dim // size
            self.local_std = self.std
        else:
            self.lo, self.hi = 0, dim
            self.local_std = self.std / math.sqrt(size)
        self.secure = bool(secure)
        self.draws = SECURE_DRAWS if self.secure else 1
        self.local_std /= math.sqrt(self.draws)
        if self.secure:
            seed = secrets.randbits(128)  # this rank's own key, never the run's seed
        device = torch.device(device)
        make = registry.get("gaussian_stream", device, backend)
        seeds = seed_sequence(seed, rank, STREAM_NOISE)
        # CPU kernels take the seeds only; other devices' kernels also take the device.
        self.stream = make(seeds) if device.type == "cpu" else make(seeds, device)
        self.backend = make.backend

    def add_(self, buf: torch.Tensor) -> None:
        """Add this rank's share of the noise to ``buf`` (the local clipped sum)."""
        self.bind(buf)()

    def bind(self, buf: torch.Tensor) -> Callable[[], None]:
        """:meth:`add_` on this ``buf``, as a call without arguments: the slice
        and the kernel's own view of it are made once, because the training
        step adds noise to the same buffer every step and making them per call
        cost a sizeable part of the CPU kernel's time. ``buf`` must stay alive
        and keep its storage; :meth:`set_state` applies to the bound call too;
        a later change to ``local_std`` does not (bind again)."""
        if self.hi <= self.lo or self.local_std <= 0:
            return _nothing
        view = buf[self.lo:self.hi]
        binder = getattr(self.stream, "bind", None)
        add = binder(view, self.local_std) if binder is not None else \
            functools.partial(self.stream.add_, view, self.local_std)
        if self.draws == 1:
            return add
        draws = range(self.draws)

        def add_draws() -> None:
            for _ in draws:
                add()
        return add_draws

    def staged(self, buf: torch.Tensor) -> "StagedNoise | None":
        """:meth:`bind` split for a captured CUDA graph (:mod:`engine.fixed_step`),
        or None where the stream cannot read its counter from device memory
        (torch's generator: add the noise outside the graph) or there is no
        noise to add on this rank."""
        if self.hi <= self.lo or self.local_std <= 0:
            return None
        if not hasattr(self.stream, "add_at_"):
            return None
        return StagedNoise(self.stream, buf[self.lo:self.hi], self.local_std, self.draws)

    def get_state(self) -> list:
        return self.stream.get_state()

    def set_state(self, state: list) -> None:
        self.stream.set_state(state)
