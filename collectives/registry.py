"""The all-reduce algorithms by name.

An algorithm is a *planner*: ``plan(ctx) -> bind``, called once per call
signature (communicator, length, dtype, op). ``ctx`` is a
:class:`collectives.context.PlanContext`: who the ranks are, the length and
dtype, the message tag, how to allocate temporaries, combine two arrays and
exchange messages. The planner allocates what the signature needs (temporary
buffers, the schedule of partners and chunks) and returns ``bind(view) ->
run``: given the contiguous 1-D array ``view`` that will be reduced, build the
message specs once and return ``run()``, which reduces ``view`` in place over
the communicator when every rank calls it. The dispatcher
(:func:`collectives.allreduce`) caches plans and bound runners, so a repeated
call with the same buffer costs only ``run()``.

A *selector* (``auto``) is registered with :func:`register_selector`: a
function of the call signature that names the algorithm to use.

One module per algorithm registers itself here; the dispatcher and the
micro-benchmark only ever look algorithms up by name, so neither knows which
algorithm it runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from collectives.errors import UnknownAlgorithm

if TYPE_CHECKING:
    from collectives.context import PlanContext

__all__ = ["Algorithm", "UnknownAlgorithm", "register", "register_selector", "get", "names"]

Runner = Callable[[], None]
Binder = Callable[[Any], Runner]
Planner = Callable[["PlanContext"], Binder]
#: ``choose(nbytes, placement) -> algorithm name`` (see :mod:`collectives.auto`)
Selector = Callable[[int, str], str]


@dataclass(frozen=True)
class Algorithm:
    """A registered all-reduce: a planner, or a selector of another algorithm."""

    name: str
    summary: str
    messages: str
    plan: Planner | None = None
    choose: Selector | None = None
    #: ``host_only(ctx)``: True when the plan needs host memory (device
    #: buffers are then staged even with a CUDA-aware MPI).
    host_only: Callable[["PlanContext"], bool] | None = None


_ALGORITHMS: dict[str, Algorithm] = {}


def _add(algorithm: Algorithm) -> None:
    if algorithm.name in _ALGORITHMS:
        raise ValueError(f"all-reduce algorithm {algorithm.name!r} registered twice")
    _ALGORITHMS[algorithm.name] = algorithm


def register(name: str, *, summary: str, messages: str,
             host_only: Callable[["PlanContext"], bool] | None = None
             ) -> Callable[[Planner], Planner]:
    """Decorator: make the planner available as ``algorithm=name``.

    Args:
        name: the algorithm's name in the API and the benchmark.
        summary: one line saying what it does.
        messages: what each rank sends, e.g. ``"2(p-1) messages of n/p"``.
        host_only: see :attr:`Algorithm.host_only`.
    """

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
