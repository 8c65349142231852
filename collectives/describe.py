"""``collectives.describe(comm)``: how all-reduces run on a communicator, for reports.

``mpidp info`` and bug reports print it; nothing outside this package needs
to know the communicator's state to ask.
"""
from __future__ import annotations

from typing import Any

from collectives.auto import table as auto
from collectives.channels.shm_pair import copy_choice
from collectives.errors import AllreduceError
from collectives.core.plans import comm_state
from collectives.runtime import MPI

_COPIES = {"auto": "cached or streaming, chosen per call from measured times",
           "on": "streaming (MPIDP_ALLREDUCE_STREAMING=on)",
           "off": "cached (MPIDP_ALLREDUCE_STREAMING=off)"}


def describe(comm: "MPI.Intracomm | None" = None) -> dict[str, Any]:
    """How :func:`collectives.allreduce` runs on ``comm`` (default ``COMM_WORLD``).

    Collective the first time ``comm`` is used by this package (it sets up
    the communicator's channels, as the first all-reduce would). Returns a
    dict with ``placement`` (see :mod:`collectives.auto.table`), ``channels`` (the
    channels this communicator has, in order of preference), ``shared_memory``
    (the shared-memory channel or ``"none"``), ``waiting`` (how a waiting
    rank waits), ``copies`` (how the shared pair copies, or None), ``auto``
    (``[[max_bytes or None, algorithm, channel], ...]``, what ``auto`` runs
    by size) and ``auto_text`` (the same in words).
    """
    state = comm_state(MPI.COMM_WORLD if comm is None else comm)
    shared = state.shared
    table = []
    for limit, name in auto.table_for(state.placement):
        _, channel = state.route(limit or 1 << 30, name)
        table.append([limit, name, channel])
    return {
        "placement": state.placement,
        "channels": [c.name for c in state.channels],
        "shared_memory": "none" if shared is None else shared.name,
        "waiting": ("inside MPI" if shared is None else "asleep (futex)" if shared.sleep
                    else "spinning"),
        "copies": _copies(state.channel_named("shm-pair")),
        "auto": table,
        "auto_text": auto_text(table),
    }


def _copies(pair: Any) -> str | None:
    if pair is None:
        return None
    try:
        setting, why = copy_choice(pair)
    except AllreduceError as error:
        return f"unusable: {error}"
    return f"cached ({why})" if why else _COPIES[setting]


def format_size(nbytes: int) -> str:
    """``262144`` -> ``256 KiB``."""
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= factor and nbytes % factor == 0:
            return f"{nbytes // factor} {unit}"
    return f"{nbytes} B"


def auto_text(table: list) -> str:
    """``[[256, "native", None], [None, "ring", "p2p"]]`` -> ``native up to 256 B, ring (p2p) above``."""
    def name(entry: list) -> str:
        return entry[1] + (f" ({entry[2]})" if len(entry) > 2 and entry[2] else "")

    if len(table) == 1:
        return f"{name(table[0])} at every size"
    return ", ".join(f"{name(e)} up to {format_size(e[0])}" if e[0] is not None
                     else f"{name(e)} above" for e in table)
