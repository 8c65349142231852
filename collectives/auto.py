"""``auto``: picks an algorithm by message size and placement.

The *placement* of a communicator is decided once, identically on every
rank (:attr:`collectives.plans.CommState.placement`):

* ``single``: one rank (every algorithm is a no-op);
* ``pair``: two ranks sharing a node, a core each (``recursive_doubling``
  and ``ring`` exchange through shared memory, :mod:`collectives.shm`);
* ``cores``: more ranks, or ranks on several nodes, a core each (on one
  node the ``ring`` goes through :mod:`collectives.shm_group`);
* ``oversubscribed``: three or more ranks on one node with fewer cores
  (the ``ring`` through :mod:`collectives.shm_group`, waiting ranks asleep);
* ``oversubscribed-pair``: two ranks on one node with one core;
* ``oversubscribed-nodes``: more ranks than cores on some node, ranks on
  several nodes (point-to-point algorithms only).

Every rank must make the same choice, so it depends only on values equal on
all ranks (bytes, placement); the choice is also part of the first-call
check, so ranks configured differently get an error, not a hang.

The thresholds come from ``mpidp bench allreduce`` on the development
machine (README, "Collectives"). Override them with
``MPIDP_ALLREDUCE_AUTO``: a comma-separated list of ``algorithm:max_bytes``
ending with a bare algorithm, e.g. ``native:131072,ring`` (native up to
128 KiB, ring above) or just ``ring``.
"""
from __future__ import annotations

import os

from collectives.errors import AllreduceError
from collectives.registry import register_selector

PLACEMENTS = ("single", "pair", "cores", "oversubscribed", "oversubscribed-pair",
              "oversubscribed-nodes")

#: (largest size in bytes, algorithm) per placement; the last entry has no
#: limit. Measured with ``mpidp bench allreduce --rounds 10`` (README):
#:
#: * ``pair`` (2 ranks, 2 cores): MPICH's shared-memory ``MPI_Allreduce``
#:   and the shared-memory recursive doubling tie up to 256 B (within 3-7%);
#:   from 512 B to 256 KiB recursive doubling was 1.1-6x faster than native
#:   and ahead of the ring (also through shared memory at p = 2: two
#:   exchanges instead of one); they tie at 512 KiB, and from 1 MiB the ring
#:   (half the combining, each piece all-gathered while in cache) is ahead:
#:   5.5-5.8x native against 2.4-2.8x at 1-8 MiB, 2.2-4.8x against 1.5-2.5x
#:   at 16-64 MiB (three runs of ``--rounds 10``). At 32-64 MiB the
#:   point-to-point ``rabenseifner`` is sometimes faster still (its time over
#:   the ring's at 64 MiB: 0.5-0.6 in five runs of eight, 1.3-1.5 in three);
#:   no fixed choice is within 10% of the best there in every run.
#: * ``cores``: without the shared-memory pair (point-to-point algorithms
#:   only, measured at 2 ranks), native beats them up to 64 KiB, they are
#:   within noise at 128-256 KiB, and the ring is 1.4-1.9x faster from
#:   512 KiB. Not measured at more ranks (the machine has 2 cores).
#: * ``oversubscribed`` (4 ranks on 2 cores): the shared-memory ring was
#:   the fastest or tied (with recursive doubling, 8-64 B) at every size
#:   from 8 B to 64 MiB: 1.8-5.8x native from 16 B to 512 KiB, 1.5-2.6x
#:   from 1 to 64 MiB; each of its steps wakes one sleeping neighbour,
#:   where a point-to-point step waits for MPICH's yield loop.
#: * ``oversubscribed-pair`` (2 ranks on 1 core, ``taskset -c 0``, waiting
#:   ranks asleep): recursive doubling, one shared-memory exchange, is the
#:   fastest up to 1 MiB (6-19x native up to 32 KiB, 24-33 us); they tie at
#:   2 MiB; from 4 MiB the ring, half the combining, is 1.2-1.5x faster.
#: * ``oversubscribed-nodes``: every wait costs a trip through the
#:   scheduler, so the fewest sequential steps win. Measured with the
#:   point-to-point algorithms on one node (4 ranks on 2 cores, before the
#:   shared-memory ring): recursive doubling (2 steps) ~2x faster than
#:   native up to 512 KiB and still ahead at 1 MiB; above, Rabenseifner
#:   (4 steps, n(p-1)/p data) within 10% of the best (2x native from 32 MiB).
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
    from collectives.registry import names

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
