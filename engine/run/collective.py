"""The run's collective helpers: rank 0 (or each rank) checks or computes, every
rank learns the outcome."""
from __future__ import annotations

import secrets
from typing import Any, Callable

from engine.errors import MpidpError, agree


def rank0_check(comm, check: Callable[[], None]) -> None:
    """Collective: run ``check()`` on rank 0 (the rank that writes); its
    MpidpError is raised on every rank."""
    error = None
    if comm.Get_rank() == 0:
        try:
            check()
        except MpidpError as exc:
            error = exc
    agree(comm, error)


def every_rank_check(comm, check: Callable[[], Any]) -> Any:
    """Collective: run ``check()`` on every rank and return its value; an
    MpidpError raised on any rank is raised on every rank (the first failing
    rank's, by rank, naming that rank: :func:`engine.errors.agree`).

    For a check of what this rank alone was given (``engine.train``'s keywords
    are each rank's own): raised on that rank only, the error would leave the
    others waiting for it in their next collective.
    """
    error, value = None, None
    try:
        value = check()
    except MpidpError as exc:
        error = exc
    agree(comm, error)
    return value


def rank0_value(comm, compute: Callable[[], Any]) -> Any:
    """Collective: ``compute()`` on rank 0 alone, its value on every rank; its
    MpidpError is raised on every rank (:func:`rank0_check`)."""
    box: list = []
    rank0_check(comm, lambda: box.append(compute()))
    return comm.bcast(box[0] if box else None, root=0)


def shared_seed(comm, seed: int | None) -> int:
    """Collective: ``seed``, or rank 0's random one on every rank (when None)."""
    if seed is not None:
        return int(seed)
    return int(comm.bcast(secrets.randbits(62) if comm.Get_rank() == 0 else None, root=0))
