"""The serial stage's modules, longest first, so that two workers end together.

``tests/run_suite.py`` spreads stage 1 over pytest-xdist workers one module
at a time (``--dist loadfile``) in collection order. xdist's own order (most
tests first) puts a module of a few long tests (the Slurm jobs, the fault
injection) wherever its count falls, and one worker may then run it alone
at the end. Longest first is the classic greedy rule for this: whatever is
left at the end is short.

The times come from the last stored run of the suite
(``results/cpu/test-suite.json``, its ``module_seconds``: what each
module took on one worker); a module it does not list (a new one) goes
after the listed ones, in collection order. The order changes nothing but
which worker runs a module when.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence, TypeVar

ROOT = Path(__file__).resolve().parent.parent
STORED = ROOT / "results" / "cpu" / "test-suite.json"

Item = TypeVar("Item")


def stored_seconds(path: Path = STORED) -> dict[str, float]:
    """Module path (``tests/test_x.py``) -> seconds in the stored run; empty
    where there is no stored run or it has no per-module times."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    times = doc.get("module_seconds", {}) if isinstance(doc, dict) else {}
    return {str(k): float(v) for k, v in times.items() if isinstance(v, (int, float))}


def module_of(nodeid: str) -> str:
    """``tests/test_x.py::test_y[a]`` -> ``tests/test_x.py``."""
    return nodeid.split("::", 1)[0]


def longest_first(items: Sequence[Item], seconds: dict[str, float],
                  nodeid=lambda item: item.nodeid) -> list[Item]:
    """``items`` regrouped by module, modules by ``seconds`` (longest first;
    unlisted modules after, in their first appearance's order); within a
    module the items keep their order."""
    groups: dict[str, list[Item]] = {}
    for item in items:
        groups.setdefault(module_of(nodeid(item)), []).append(item)
    position = {name: i for i, name in enumerate(groups)}
    order = sorted(groups, key=lambda name: (name not in seconds, -seconds.get(name, 0.0),
                                             position[name]))
    return [item for name in order for item in groups[name]]
