"""``auto``: picks an algorithm by message size and number of ranks.

Every rank must make the same choice, so it depends only on values that are
equal on all ranks (bytes, communicator size, whether the node is
oversubscribed); the choice is also part of the first-call check, so ranks
configured differently get an error, not a hang.

The thresholds come from ``mpidp bench allreduce`` on the development
machine (README, "Collectives"). Override them with
``MPIDP_ALLREDUCE_AUTO``: a comma-separated list of ``algorithm:max_bytes``
ending with a bare algorithm, e.g. ``native:262144,ring`` (native up to
256 KiB, ring above) or just ``ring``.
"""
from __future__ import annotations

import os

from collectives.registry import register_selector

#: (largest size in bytes, algorithm) per regime; the last entry has no limit.
THRESHOLDS: dict[str, list[tuple[int | None, str]]] = {
    "single": [(None, "recursive_doubling")],  # p = 1: every algorithm is a no-op
    "cores": [(256 * 1024, "native"), (None, "ring")],
    "oversubscribed": [(None, "native")],
}


def parse_thresholds(text: str) -> list[tuple[int | None, str]]:
    """``"native:262144,ring"`` -> ``[(262144, "native"), (None, "ring")]``."""
    from collectives.registry import names

    table: list[tuple[int | None, str]] = []
    items = [item.strip() for item in text.split(",") if item.strip()]
    for i, item in enumerate(items):
        name, _, limit = item.partition(":")
        if name not in names() or name == "auto":
            raise ValueError(f"MPIDP_ALLREDUCE_AUTO: unknown algorithm {name!r} in {text!r}")
        if (limit == "") != (i == len(items) - 1):
            raise ValueError(f"MPIDP_ALLREDUCE_AUTO={text!r}: every entry but the last needs "
                             "':max_bytes' and the last must have none")
        table.append((int(limit) if limit else None, name))
    if not table:
        raise ValueError("MPIDP_ALLREDUCE_AUTO is empty")
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
