"""The run's collective helpers: rank 0 checks or computes, every rank learns the outcome."""
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
