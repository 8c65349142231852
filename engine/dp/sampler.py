"""Which local rows each step uses: distributed Poisson sampling (or shuffling).

**Poisson** (the default, what the accountant assumes): at every step each
rank keeps each of its ``n_local`` rows independently with probability q.
It draws the batch size ``k ~ Binomial(n_local, q)`` and then a uniformly
random set of ``k`` distinct rows — the same distribution as a per-row coin flip, without a
pass over the shard. The union over ranks is a Poisson sample of the whole
training set with rate q (the shards partition it). Empty batches happen
and are valid steps. Each rank's stream is its own (seeded from the run's
seed and the rank) and its state is checkpointed.

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

import numpy as np

from engine.dp.streams import STREAM_SAMPLER, STREAM_SHUFFLE, seed_sequence


class PoissonSampler:
    """Poisson sampling of a local shard of ``n_local`` rows at rate ``q``."""

    assumption_met = True
    name = "poisson"

    def __init__(self, n_local: int, q: float, seed: int, rank: int):
        if not 0.0 < q <= 1.0:
            raise ValueError(f"sampling rate q={q} must be in (0, 1]")
        self.n_local, self.q = int(n_local), float(q)
        self.rng = np.random.Generator(np.random.PCG64(seed_sequence(seed, rank,
                                                                     STREAM_SAMPLER)))

    def expected_local_batch(self) -> float:
        return self.q * self.n_local

    def sample(self, step: int) -> np.ndarray:
        """Sorted int64 local row indices of this step (possibly empty).

        The k distinct rows: k uniform draws, then fresh draws for the
        duplicates until all are distinct. The procedure commutes with any
        relabelling of the rows, so every k-subset is equally likely (the
        same law as ``Generator.choice(n, k, replace=False)``, at a third of
        its cost for k << n; the tests check the inclusion frequencies).
        """
        k = int(self.rng.binomial(self.n_local, self.q))
        if 4 * k > self.n_local:  # dense: duplicates would be frequent
            rows = self.rng.choice(self.n_local, size=k, replace=False)
            rows.sort()
            return rows.astype(np.int64, copy=False)
        rows = self.rng.integers(0, self.n_local, size=k, dtype=np.int64)
        rows.sort()
        while k > 1:
            distinct = np.flatnonzero(rows[1:] != rows[:-1])
            missing = k - 1 - distinct.size
            if missing == 0:
                break
            rows = np.concatenate([rows[:1], rows[1:][distinct],
                                   self.rng.integers(0, self.n_local, size=missing,
                                                     dtype=np.int64)])
            rows.sort()
        return rows

    def get_state(self) -> dict:
        return self.rng.bit_generator.state

    def set_state(self, state: dict) -> None:
        self.rng.bit_generator.state = state


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
