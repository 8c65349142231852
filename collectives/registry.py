"""The all-reduce algorithms by name.

Three kinds, one module each (``collectives/algorithms/``, ``collectives/auto/table.py``):

* a **schedule** (:func:`register`): ``schedule(rank, size, n) ->``
  :class:`collectives.schedule.Schedule`, the rounds of messages of one
  rank. It runs over any channel that can serve its shape
  (:mod:`collectives.channels`).
* a **library** collective (:func:`register_library`): a planner
  ``plan(ctx) -> bind`` that calls the MPI library's own collective
  (``native``); it needs no channel.
* a **selector** (:func:`register_selector`): ``choose(nbytes, placement) ->
  name`` of the algorithm to run (``auto``).

The dispatcher and the micro-benchmark only look algorithms up by name, so
neither knows which algorithm it runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from collectives.errors import UnknownAlgorithm
from collectives.schedule import Scheduler

if TYPE_CHECKING:
    from collectives.core.context import PlanContext

__all__ = ["Algorithm", "UnknownAlgorithm", "register", "register_library",
           "register_selector", "get", "names"]

Runner = Callable[[], None]
Binder = Callable[[Any], Runner]
Planner = Callable[["PlanContext"], Binder]
#: ``choose(nbytes, placement) -> algorithm name`` (see :mod:`collectives.auto.table`)
Selector = Callable[[int, str], str]


@dataclass(frozen=True)
class Algorithm:
    """A registered all-reduce: exactly one of ``schedule``, ``plan``, ``choose``."""

    name: str
    summary: str
    messages: str
    schedule: Scheduler | None = None
    plan: Planner | None = None
    choose: Selector | None = None
    #: ``host_only(ctx)`` of a library collective: its plan needs host memory
    #: (device buffers are staged even with a CUDA-aware MPI).
    host_only: Callable[["PlanContext"], bool] | None = None


_ALGORITHMS: dict[str, Algorithm] = {}


def _add(algorithm: Algorithm) -> None:
    if algorithm.name in _ALGORITHMS:
        raise ValueError(f"all-reduce algorithm {algorithm.name!r} registered twice")
    _ALGORITHMS[algorithm.name] = algorithm


def register(name: str, *, summary: str, messages: str) -> Callable[[Scheduler], Scheduler]:
    """Decorator: make the schedule available as ``algorithm=name``.

    Args:
        name: the algorithm's name in the API and the benchmark.
        summary: one line saying what it does.
        messages: what each rank sends, e.g. ``"2(p-1) messages of n/p"``.
    """

    def decorate(schedule: Scheduler) -> Scheduler:
        _add(Algorithm(name, summary, messages, schedule=schedule))
        return schedule

    return decorate


def register_library(name: str, *, summary: str, messages: str,
                     host_only: Callable[["PlanContext"], bool] | None = None
                     ) -> Callable[[Planner], Planner]:
    """Decorator: ``algorithm=name`` runs the planner (a library collective)."""

    def decorate(plan: Planner) -> Planner:
        _add(Algorithm(name, summary, messages, plan=plan, host_only=host_only))
        return plan

    return decorate


def register_selector(name: str, *, summary: str) -> Callable[[Selector], Selector]:
    """Decorator: ``algorithm=name`` uses the algorithm ``choose`` names."""

    def decorate(choose: Selector) -> Selector:
        _add(Algorithm(name, summary, "those of the algorithm it picks", choose=choose))
        return choose

    return decorate


def get(name: str) -> Algorithm:
    """The algorithm registered as ``name``; raises :class:`UnknownAlgorithm`."""
    try:
        return _ALGORITHMS[name]
    except (KeyError, TypeError):
        raise UnknownAlgorithm(f"unknown all-reduce algorithm {name!r}; choose from "
                               f"{', '.join(names())}") from None


def names() -> list[str]:
    """Registered algorithm names, in registration order."""
    return list(_ALGORITHMS)
