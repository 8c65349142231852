"""Per-epoch metrics: JSON lines for tools, a table for people (rank 0 writes).

The metrics file is the run's history, one JSON object per epoch, and is
rewritten whole and atomically (:func:`write_records`) after every epoch and
after every checkpoint. The history itself lives in the checkpoint, so the
file can always be rebuilt from it: a resumed run rewrites it from the
checkpoint first, which drops the records of epochs trained after the last
checkpoint (they are trained again), and any sequence of stops and resumes
leaves exactly one record per epoch, in order.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

from engine.outputs import replace_file

#: Table columns: (key, header, width, format), for a run that evaluates the
#: test split every epoch (a file without a validation split).
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
#: The columns of a run that scores a validation split every epoch: the test
#: split is scored once, at the end, and printed apart.
VAL_COLUMNS = tuple(("val_accuracy", "val_acc", 8, "{:.4f}") if c[0] == "test_accuracy"
                    else c for c in COLUMNS)


def _cell(width: int, fmt: str, value) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-".rjust(width)
    return fmt.format(value).rjust(width)


def _columns(val: bool) -> tuple:
    return VAL_COLUMNS if val else COLUMNS


def header(val: bool = False) -> str:
    """The table's header; ``val``: the run scores a validation split."""
    return "  ".join(name.rjust(width) for _, name, width, _ in _columns(val))


def row(metrics: dict, val: bool = False) -> str:
    return "  ".join(_cell(width, fmt, metrics.get(key))
                     for key, _, width, fmt in _columns(val))


def table(rows: list[dict], val: bool = False) -> str:
    return "\n".join([header(val), *(row(r, val) for r in rows)])


def write_records(path: str | os.PathLike, records: list[dict]) -> None:
    """Replace ``path`` atomically by one JSON line per record, readable by its
    owner only (mode 0600: the training figures are not covered by the epsilon).

    Raises:
        WriteFailed: the file cannot be written (the old one is left intact).
    """
    text = "".join(json.dumps(r, sort_keys=True, allow_nan=False, default=_json_default)
                   + "\n" for r in records)
    replace_file(path, text, lambda reason: f"cannot write the metrics file {path}: {reason}",
                 mode=0o600)  # exact training figures, not covered by the epsilon


def read_records(path: str | os.PathLike) -> list[dict]:
    """The records of a metrics file (no checks beyond JSON)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _json_default(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    raise TypeError(f"not JSON serialisable: {value!r}")


def finite_or_none(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None
