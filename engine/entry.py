"""Every rank calls :func:`engine.train`, as many times: the check at its entry.

A call under ``if rank == 0:``, or one more call on one rank than on
another, would leave the ranks that made it waiting in its first collective
for ever. :func:`wait_for_peers` runs first in every call: the other ranks'
programs ending without the call (their marks, on this node) is an error,
:class:`collectives.errors.PeerEnded` (exit code 2), and a long wait is one
line on stderr (:func:`collectives.core.ended.wait_for_peers`).
"""
from __future__ import annotations

from collectives.core import ended

_calls = 0


def wait_for_peers(comm, notice_s: float | None = None) -> None:
    """Collective: return once every rank of ``comm`` has called engine.train.

    Raises:
        PeerEnded: (this rank only) a peer's program on this node ended
            without this call.
    """
    global _calls
    _calls += 1
    this_call = f"its call number {_calls} here" if _calls > 1 else "this call"
    ended.wait_for_peers(comm, "engine.train()", this_call, notice_s)
