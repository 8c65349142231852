"""Where a program composes its own parts into a run.

:class:`engine.trainer.Trainer` takes ``hooks=RunHooks(...)``; each hook is
called once, on every rank, at its point of the set-up. The canary audit
(:mod:`engine.audit.canary`) uses both: it adds its canary rows to the
training shard before the sampler is built, and wraps the built step to
add gradient canaries and read the reduced sums. A run without hooks is an
ordinary ``mpidp train`` run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class RunHooks:
    """Hooks of a run (None: the run's own part).

    Attributes:
        train_shard: ``train_shard(shard, trainer) -> shard``: the rank's
            training shard (:class:`engine.shard.Shard`) before the sampler
            and the step are built from it (rows may be added; households
            must stay whole).
        step: ``step(step, trainer) -> step``: the built step (the trainer's
            ``dp_step``, with its noise as ``trainer.noise``); the returned
            callable must keep the step's call contract and its ``settle()``.
    """

    train_shard: Callable[[Any, Any], Any] | None = None
    step: Callable[[Any, Any], Any] | None = None
