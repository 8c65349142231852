"""The all-reduce algorithms by name.

Every algorithm is a function ``fn(buf, comm, op) -> None`` that reduces the
contiguous 1-D numpy array ``buf`` in place over ``comm`` with the MPI
operation ``op`` (``MPI.SUM``, ``MPI.MAX``, ``MPI.MIN``), called by every rank
of ``comm`` with buffers of the same length and dtype. One module per
algorithm registers its function with :func:`register`; the dispatcher
(:func:`collectives.allreduce`) and the micro-benchmark only ever look them
up here, so neither knows which algorithm it runs.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from collectives.runtime import MPI

AllreduceFn = Callable[[np.ndarray, "MPI.Comm", "MPI.Op"], None]

_ALGORITHMS: dict[str, AllreduceFn] = {}


class UnknownAlgorithm(ValueError):
    """An algorithm name that is not registered."""

    exit_code = 2


def register(name: str) -> Callable[[AllreduceFn], AllreduceFn]:
    """Decorator: make ``fn`` available as ``algorithm=name``."""

    def decorate(fn: AllreduceFn) -> AllreduceFn:
        if name in _ALGORITHMS:
            raise ValueError(f"all-reduce algorithm {name!r} registered twice")
        _ALGORITHMS[name] = fn
        return fn

    return decorate


def get(name: str) -> AllreduceFn:
    """The function registered as ``name``; raises :class:`UnknownAlgorithm`."""
    try:
        return _ALGORITHMS[name]
    except KeyError:
        raise UnknownAlgorithm(f"unknown all-reduce algorithm {name!r}; choose from "
                               f"{', '.join(names())}") from None


def names() -> list[str]:
    """Registered algorithm names, in registration order."""
    return list(_ALGORITHMS)
