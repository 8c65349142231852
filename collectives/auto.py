"""``auto``: picks an algorithm by message size and number of ranks.

Every rank must make the same choice, so it depends only on values that are
equal on all ranks (bytes, communicator size, whether the node is
oversubscribed); the choice is also part of the first-call check, so ranks
configured differently get an error, not a hang.

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

#: (largest size in bytes, algorithm) per regime; the last entry has no limit.
#: Measured with ``mpidp bench allreduce --rounds 10`` (README, "Collectives"):
#:
#: * ``cores`` (a core per rank; 2 ranks): MPICH's shared-memory
#:   ``MPI_Allreduce`` beats every point-to-point algorithm up to 64 KiB
#:   (by 1.2-4x); at 128-256 KiB they are within noise of each other (which
#:   wins changed with the machine's load), from 512 KiB the ring is
#:   1.4-1.9x faster.
#: * ``oversubscribed`` (4 ranks on 2 cores): every wait costs a trip through
#:   the scheduler, so the fewest sequential steps win. Recursive doubling
#:   (2 steps) is ~2x faster than native up to 512 KiB and still ahead at
#:   1 MiB; above, Rabenseifner (4 steps, n(p-1)/p data) is within 10% of the
#:   best everywhere (2x native from 32 MiB).
THRESHOLDS: dict[str, list[tuple[int | None, str]]] = {
    "single": [(None, "recursive_doubling")],  # p = 1: every algorithm is a no-op
    "cores": [(128 * 1024, "native"), (None, "ring")],
    "oversubscribed": [(1024 * 1024, "recursive_doubling"), (None, "rabenseifner")],
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
            raise AllreduceError(f"MPIDP_ALLREDUCE_AUTO={text!r}: every entry but the last needs "
                             "':max_bytes' and the last must have none")
        if limit and not limit.isdigit():
            raise AllreduceError(f"MPIDP_ALLREDUCE_AUTO={text!r}: {limit!r} is not a byte count")
        table.append((int(limit) if limit else None, name))
    if not table:
        raise AllreduceError("MPIDP_ALLREDUCE_AUTO is empty")
    return table


def table_for(size: int, oversubscribed: bool) -> list[tuple[int | None, str]]:
    """The threshold table in force for ``size`` ranks."""
    override = os.environ.get("MPIDP_ALLREDUCE_AUTO", "").strip()
    if override:
        return parse_thresholds(override)
    if size == 1:
        return THRESHOLDS["single"]
    return THRESHOLDS["oversubscribed" if oversubscribed else "cores"]


@register_selector("auto", summary="picks by message size and ranks from measured thresholds")
def choose(nbytes: int, size: int, oversubscribed: bool) -> str:
    """The algorithm for ``nbytes`` on ``size`` ranks."""
    for limit, name in table_for(size, oversubscribed):
        if limit is None or nbytes <= limit:
            return name
    raise AssertionError("threshold table without a final entry")
