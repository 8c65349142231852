"""``auto``: picks an algorithm by message size and placement.

The *placement* of a communicator is decided once, identically on every
rank (:attr:`collectives.core.plans.CommState.placement`):

* ``single``: one rank (every algorithm is a no-op);
* ``pair``: two ranks sharing a node, a core each (schedules of pairwise
  exchanges run over the shared pair, :mod:`collectives.channels.shm_pair`);
* ``cores``: more ranks, or ranks on several nodes, a core each (on one
  node the ``ring`` runs over :mod:`collectives.channels.shm_group`);
* ``oversubscribed``: three or more ranks on one node with fewer cores
  (the ``ring`` over the node window, waiting ranks asleep);
* ``oversubscribed-pair``: two ranks on one node with one core;
* ``oversubscribed-nodes``: more ranks than cores on some node, ranks on
  several nodes (point-to-point messages only).

Every rank must make the same choice, so it depends only on values equal on
all ranks (bytes, placement); the choice is also part of the first-call
check, so ranks configured differently get an error, not a hang.

The thresholds come from ``mpidp bench allreduce`` (why each row:
``docs/design/auto-static-table.md``; today's figures:
``docs/results/collectives.md``). Override them with ``MPIDP_ALLREDUCE_AUTO``: a
comma-separated list of ``algorithm:max_bytes`` ending with a bare
algorithm, e.g. ``native:131072,ring`` (native up to 128 KiB, ring above)
or just ``ring``.
"""
from __future__ import annotations

import os

from collectives.errors import AllreduceError
from collectives.registry import names, register_selector

PLACEMENTS = ("single", "pair", "cores", "oversubscribed", "oversubscribed-pair",
              "oversubscribed-nodes")

#: (largest size in bytes, algorithm) per placement; the last entry has no
#: limit. Why each row (figures in docs/design/auto-static-table.md):
#:
#: * ``pair``: MPICH's shared-memory ``MPI_Allreduce`` ties the shared-pair
#:   exchange for the smallest messages; recursive doubling (one exchange)
#:   leads up to a few hundred KiB; the ring (half the combining, each piece
#:   handed back while in cache) leads above.
#: * ``cores``: without a shared pair, a point-to-point round trip costs more
#:   than MPI's whole small all-reduce; the bandwidth-optimal ring wins
#:   large messages.
#: * ``oversubscribed``: every step of the node-window ring wakes one
#:   sleeping neighbour, where a point-to-point step waits in MPICH's yield
#:   loop: the ring leads at every size.
#: * ``oversubscribed-pair``: one shared-memory exchange (recursive doubling)
#:   leads until the ring's halved combining outweighs its second exchange.
#: * ``oversubscribed-nodes``: every wait costs a trip through the
#:   scheduler, so the fewest sequential steps win: recursive doubling, then
#:   Rabenseifner (log p steps, n(p-1)/p data) for large messages.
THRESHOLDS: dict[str, list[tuple[int | None, str]]] = {
    "single": [(None, "recursive_doubling")],
    "pair": [(256, "native"), (512 * 1024, "recursive_doubling"), (None, "ring")],
    "cores": [(128 * 1024, "native"), (None, "ring")],
    "oversubscribed": [(None, "ring")],
    "oversubscribed-pair": [(2 * 1024 * 1024, "recursive_doubling"), (None, "ring")],
    "oversubscribed-nodes": [(1024 * 1024, "recursive_doubling"), (None, "rabenseifner")],
}


def parse_thresholds(text: str) -> list[tuple[int | None, str]]:
    """``"native:262144,ring"`` -> ``[(262144, "native"), (None, "ring")]``."""
    table: list[tuple[int | None, str]] = []
    items = [item.strip() for item in text.split(",") if item.strip()]
    for i, item in enumerate(items):
        name, _, limit = item.partition(":")
        if name not in names() or name == "auto":
            raise AllreduceError(f"MPIDP_ALLREDUCE_AUTO: unknown algorithm {name!r} in {text!r}")
        if (limit == "") != (i == len(items) - 1):
            raise AllreduceError(f"MPIDP_ALLREDUCE_AUTO={text!r}: every entry but the last "
                                 "needs ':max_bytes' and the last must have none")
        if limit and not limit.isdigit():
            raise AllreduceError(f"MPIDP_ALLREDUCE_AUTO={text!r}: {limit!r} is not a byte count")
        table.append((int(limit) if limit else None, name))
    if not table:
        raise AllreduceError("MPIDP_ALLREDUCE_AUTO is empty")
    return table


def table_for(placement: str) -> list[tuple[int | None, str]]:
    """The threshold table in force for a placement (or the override)."""
    override = os.environ.get("MPIDP_ALLREDUCE_AUTO", "").strip()
    if override:
        return parse_thresholds(override)
    return THRESHOLDS[placement]


@register_selector("auto", summary="picks by message size and placement from measured thresholds")
def choose(nbytes: int, placement: str) -> str:
    """The algorithm for ``nbytes`` on a communicator of this placement."""
    for limit, name in table_for(placement):
        if limit is None or nbytes <= limit:
            return name
    raise AssertionError("threshold table without a final entry")
