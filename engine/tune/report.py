"""What ``mpidp tune`` reports: the chosen trial, the table, the JSON, the train command."""
from __future__ import annotations

import math
import shlex

from engine.config import TrainConfig
from engine.tune.space import describe_point, format_value

_DEFAULTS = TrainConfig(data="")
#: The record's field each ``--select-on`` maximises.
SCORES = {"val_accuracy": "val_accuracy",
          "worst_group_val_accuracy": "val_worst_group_accuracy"}


def choose(records: list[dict], key: str = "val_accuracy") -> dict | None:
    """The finished trial with the best ``key`` score (the lowest number on a
    tie); None when no trial finished (with that score)."""
    done = [r for r in records if r.get("status") == "ok" and r.get(key) is not None
            and math.isfinite(r[key])]
    if not done:
        return None
    return max(done, key=lambda r: (r[key], -r["trial"]))


def train_command(data: str, settings: dict, privacy: dict, ranks: int) -> str:
    """The ``mpidp train`` command line that trains ``settings`` with the search's
    privacy options (``privacy``: dp, target_epsilon, noise_multiplier, delta,
    accountant, privacy_unit)."""
    words = (["mpiexec", "-n", str(ranks)] if ranks > 1 else []) + \
        ["mpidp", "train", "--data", data]
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        if key == "hidden":
            words += [flag, ",".join(str(w) for w in value)]
        else:
            words += [flag, format_value(value)]
    if not privacy.get("dp", True):
        words.append("--no-dp")
    else:
        if privacy.get("target_epsilon") is not None:
            words += ["--target-epsilon", format_value(float(privacy["target_epsilon"]))]
        elif privacy.get("noise_multiplier") is not None and "noise_multiplier" not in settings:
            words += ["--noise-multiplier", format_value(float(privacy["noise_multiplier"]))]
        words += ["--delta", format_value(float(privacy.get("delta", _DEFAULTS.delta)))]
        if privacy.get("accountant", _DEFAULTS.accountant) != _DEFAULTS.accountant:
            words += ["--accountant", privacy["accountant"]]
        if privacy.get("privacy_unit", "person") != "person":
            words += ["--privacy-unit", privacy["privacy_unit"]]
    return " ".join(shlex.quote(w) for w in words)


def _num(value, spec: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, spec)


def table(records: list[dict], shown: list[str], chosen: dict | None,
          tuned_epsilon: float | None, worst: bool = False) -> list[str]:
    """The report's table, one row per trial (``*`` marks the chosen one); with
    ``worst``, a column of the worst group's val accuracy."""
    rows = [("trial", "settings", "val acc") + (("worst group",) if worst else ())
            + ("train s", "epsilon", "eps incl. tuning", "status")]
    for r in sorted(records, key=lambda r: r["trial"]):
        mark = "*" if chosen is not None and r["trial"] == chosen["trial"] else " "
        rows.append((f"{mark}{r['trial']}", describe_point(r["settings"], shown) or "-",
                     _num(r.get("val_accuracy"), ".4f"))
                    + ((_num(r.get("val_worst_group_accuracy"), ".4f"),) if worst else ())
                    + (_num(r.get("train_time_s"), ".1f"), _num(r.get("epsilon"), ".3f"),
                       _num(tuned_epsilon if r.get("epsilon") is not None else None, ".3f"),
                       r["status"]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    left = {1}
    return ["  ".join(cell.ljust(widths[i]) if i in left or i == len(row) - 1
                      else cell.rjust(widths[i]) for i, cell in enumerate(row)).rstrip()
            for row in rows]
