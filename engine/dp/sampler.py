"""Which local rows each step uses: distributed Poisson sampling (or shuffling).

**Poisson** (the default, what the accountant assumes): at every step each
rank keeps each of its ``n_local`` rows independently with probability q:
exactly one coin per row, drawn as geometric skips between the kept rows
(one exponential per kept row, no pass over the shard). The union over ranks
is a Poisson sample of the whole training set with rate q (the shards
partition it). Empty batches happen and are valid steps. Each rank's rows
at a step are a function of the run's seed, the rank and the step alone
(counter-based, drawn a block of steps at a time), so a resumed run draws
what the uninterrupted one would have.

**Households** (``--privacy-unit household``): the same Poisson sampling,
of the rank's households instead of its rows (each kept with probability q;
shards end on household boundaries, so the union over ranks is a Poisson
sample of all households), then every row of each sampled household. The
batch's households are consecutive runs of rows, whose offsets the step
needs to clip each household's gradient as one (:attr:`groups`).

**Shuffle** (``--sampling shuffle``): fixed-size batches from a per-epoch
permutation of the shard. Common and cheap, but *outside the accountant's
assumption*: the epsilon reported for such a run is not a guarantee.
"""
from __future__ import annotations

import math

import numpy as np

from engine.dp.streams import STREAM_SAMPLER, STREAM_SHUFFLE, seed_sequence
from kernels.numba_cpu.bernoulli_rows import bernoulli_rows


class PoissonSampler:
    """Poisson sampling of a local shard of ``n_local`` rows at rate ``q``.

    Counter-based: the rows of a step are a function of (seed, rank, step)
    alone, drawn a block of steps at a time by geometric skips over the
    block's coins (:mod:`kernels.numba_cpu.bernoulli_rows`: one exponential
    per kept row, one numpy call per block). So a step's rows can be asked
    for in any order, and there is no state to checkpoint beyond the step
    count the trainer keeps.
    """

    assumption_met = True
    name = "poisson"
    #: Rows drawn per block of steps (about), and the most steps in a block.
    BLOCK_ROWS = 1 << 15
    BLOCK_STEPS = 128

    def __init__(self, n_local: int, q: float, seed: int, rank: int):
        if not 0.0 < q <= 1.0:
            raise ValueError(f"sampling rate q={q} must be in (0, 1]")
        self.n_local, self.q = int(n_local), float(q)
        self.seed, self.rank = int(seed), int(rank)
        expected = max(1.0, self.q * self.n_local)
        self.block_steps = int(max(1, min(self.BLOCK_STEPS, self.BLOCK_ROWS // expected)))
        # Exponentials per draw: the block's expected rows plus a margin.
        mean = expected * self.block_steps + self.block_steps
        self._chunk = int(mean + 4.0 * mean ** 0.5 + 16)
        self._scale = 0.0 if self.q >= 1.0 else 1.0 / -math.log1p(-self.q)
        self._block = -1
        self._rows = np.empty(0, dtype=np.int64)
        self._offsets = np.zeros(self.block_steps + 1, dtype=np.int64)

    def expected_local_batch(self) -> float:
        return self.q * self.n_local

    def sample(self, step: int) -> np.ndarray:
        """Sorted, distinct int64 local row indices of step ``step`` (possibly empty).

        A pure function of (seed, rank, step): calling it again, or for an
        earlier or later step, gives that step's rows (a view into the
        block's array: do not write to it).
        """
        block, j = divmod(int(step), self.block_steps)
        if block != self._block:
            self._draw_block(block)
        return self._rows[self._offsets[j]:self._offsets[j + 1]]

    def _draw_block(self, block: int) -> None:
        if self.n_local == 0:  # no rows, no coins: every step is empty
            self._rows, self._block = np.empty(0, dtype=np.int64), block
            self._offsets[:] = 0
            return
        rng = np.random.Generator(np.random.PCG64(seed_sequence(
            self.seed, self.rank, STREAM_SAMPLER, block)))
        state = np.array([-1, 0, 0], dtype=np.int64)
        rows = np.empty(self._chunk, dtype=np.int64)
        self._offsets[0] = 0
        while state[1] < self.block_steps:
            exponentials = rng.standard_exponential(self._chunk)
            if rows.shape[0] < state[2] + self._chunk:
                rows = np.concatenate([rows, np.empty(self._chunk, dtype=np.int64)])
            bernoulli_rows(exponentials, self._scale, self.n_local, self.block_steps, state,
                           rows, self._offsets)
        self._rows, self._block = rows, block

    def get_state(self) -> dict:
        """Nothing: a step's rows depend only on (seed, rank, step)."""
        return {}

    def set_state(self, state: dict) -> None:
        """Accepts any earlier state (a checkpoint of a version whose sampler kept a
        generator's state resumes with this version's draws: the same law)."""


class HouseholdSampler:
    """Poisson sampling of a local shard's households at rate ``q``.

    Args:
        groups: int64 ``[H+1]`` household starts of the shard
            (:attr:`engine.shard.Shard.groups`).
        q, seed, rank: as :class:`PoissonSampler` (its stream, over households).
    """

    assumption_met = True
    name = "poisson"

    def __init__(self, groups: np.ndarray, q: float, seed: int, rank: int):
        self.starts = np.asarray(groups, dtype=np.int64)
        self.units = PoissonSampler(self.starts.shape[0] - 1, q, seed, rank)
        self.q = self.units.q
        #: int64 ``[h+1]`` offsets of the last sample's households in its rows.
        self.groups = np.zeros(1, dtype=np.int64)

    def expected_local_batch(self) -> float:
        """Expected rows per step: q times the shard's rows."""
        return self.q * float(self.starts[-1])

    def sample(self, step: int) -> np.ndarray:
        """Sorted int64 local rows of this step's households (possibly none);
        sets :attr:`groups`."""
        chosen = self.units.sample(step)
        begins = self.starts[chosen]
        sizes = self.starts[chosen + 1] - begins
        offsets = np.zeros(chosen.shape[0] + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        self.groups = offsets
        # row r of household h: begins[h] + (r - offsets[h])
        return np.arange(offsets[-1], dtype=np.int64) + np.repeat(begins - offsets[:-1], sizes)

    def get_state(self) -> dict:
        return self.units.get_state()

    def set_state(self, state: dict) -> None:
        self.units.set_state(state)


class ShuffleSampler:
    """Fixed-size local batches from a permutation per epoch (not Poisson)."""

    assumption_met = False
    name = "shuffle"

    def __init__(self, n_local: int, local_batch: int, steps_per_epoch: int, seed: int,
                 rank: int):
        self.n_local, self.local_batch = int(n_local), int(local_batch)
        self.steps_per_epoch = int(steps_per_epoch)
        self.seed, self.rank = seed, rank
        self._epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    def expected_local_batch(self) -> float:
        return float(self.local_batch)

    def sample(self, step: int) -> np.ndarray:
        """The rows of global step ``step`` (stateless: a function of the step)."""
        epoch, j = divmod(int(step), self.steps_per_epoch)
        if epoch != self._epoch:
            rng = np.random.default_rng(seed_sequence(self.seed, self.rank,
                                                      STREAM_SHUFFLE, epoch))
            self._perm, self._epoch = rng.permutation(self.n_local), epoch
        start = j * self.local_batch
        rows = np.take(self._perm, np.arange(start, start + self.local_batch), mode="wrap")
        rows.sort()
        return rows.astype(np.int64, copy=False)

    def get_state(self) -> dict:
        return {}

    def set_state(self, state: dict) -> None:
        pass
