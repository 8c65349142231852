"""How the ranks of ``mpidp prep`` agree on an error: every step runs on every
rank, and a :class:`~preprocessing.errors.PrepError` raised on any of them is
raised on all of them (the lowest rank's), so that every rank stops with the
same one-line message and none aborts alone."""
from __future__ import annotations

import time

from preprocessing.errors import PrepError


def _wait_for_all(comm, nap: float = 2e-4) -> None:
    """Barrier that sleeps while it waits: a rank that finished its share
    early (the steps are uneven: one rank also hashes) gives its core back
    instead of spinning in MPI, which matters whenever the cores are shared."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(nap)


def agree(comm, step):
    """Run ``step()`` on every rank; if it raised :class:`PrepError` anywhere,
    raise the lowest rank's error on every rank (collective, so only rank 0
    prints it and no rank aborts)."""
    error, result = None, None
    try:
        result = step()
    except PrepError as exc:
        error = str(exc)
    _wait_for_all(comm)
    errors = comm.allgather(error)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise PrepError(first, collective=True)
    return result
