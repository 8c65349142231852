"""Per-epoch metrics: JSON lines for tools, a table for people (rank 0 writes)."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

#: Table columns: (key, header, width, format).
COLUMNS = (
    ("epoch", "epoch", 5, "{:d}"),
    ("train_loss", "train_loss", 10, "{:.4f}"),
    ("test_accuracy", "test_acc", 8, "{:.4f}"),
    ("epsilon", "epsilon", 8, "{:.3f}"),
    ("epoch_time_s", "s/epoch", 8, "{:.2f}"),
    ("examples_per_s", "examples/s", 10, "{:.0f}"),
    ("compute_s", "compute_s", 9, "{:.2f}"),
    ("comm_s", "comm_s", 7, "{:.2f}"),
)


def _cell(width: int, fmt: str, value) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-".rjust(width)
    return fmt.format(value).rjust(width)


def header() -> str:
    return "  ".join(name.rjust(width) for _, name, width, _ in COLUMNS)


def row(metrics: dict) -> str:
    return "  ".join(_cell(width, fmt, metrics.get(key)) for key, _, width, fmt in COLUMNS)


def table(rows: list[dict]) -> str:
    return "\n".join([header(), *(row(r) for r in rows)])


class JsonLines:
    """Appends one JSON object per line to ``path`` (None: does nothing)."""

    def __init__(self, path: str | os.PathLike | None, append: bool = False):
        self.path = Path(path) if path else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not append:
                self.path.write_text("")

    def write(self, record: dict) -> None:
        if self.path is None:
            return
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record, sort_keys=True, allow_nan=False,
                                    default=_json_default) + "\n")


def _json_default(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    raise TypeError(f"not JSON serialisable: {value!r}")


def finite_or_none(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None
