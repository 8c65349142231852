"""Independent random streams of a run: one per (rank, purpose), all from the run's seed.

The sampler and the noise both draw from streams derived here, so neither
imports the other and no two purposes can share a stream by accident.
"""
from __future__ import annotations

import numpy as np

#: Stream identifiers for seeding (rank, purpose) sub-streams of the run's seed.
STREAM_SAMPLER, STREAM_NOISE, STREAM_SHUFFLE = 0, 1, 2
#: The canary audit's streams (:mod:`engine.audit.canary`): each rank's coins
#: for its canaries' Poisson sampling, and the audit's secrets (which
#: coordinates, which canaries are included), drawn alike on every rank.
STREAM_CANARY_COINS, STREAM_CANARY_SECRETS = 3, 4
#: The black-box canary rows' secrets (inputs, labels, inclusion), alike on every rank.
STREAM_CANARY_ROWS = 5


def seed_sequence(seed: int, rank: int, stream: int, *extra: int) -> np.random.SeedSequence:
    """The independent seed of one rank's stream (``numpy.random.SeedSequence`` spawning).

    Args:
        seed: the run's seed (the same on every rank).
        rank: the rank the stream belongs to (or any per-owner number).
        stream: one of the ``STREAM_*`` identifiers.
        extra: further spawn-key words (e.g. the epoch of a shuffle).
    """
    return np.random.SeedSequence(entropy=int(seed), spawn_key=(int(rank), int(stream),
                                                                *map(int, extra)))
