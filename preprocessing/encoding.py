"""Encoding: compact codes -> float32 feature rows, and its description.

The encoding is data (:class:`Encoding`, stored as JSON in the output's
``encoding`` attribute), so another file can be encoded identically with
``mpidp prep --like``:

* a categorical feature is one-hot over its categories, in the order of the
  data dictionary (blank last): columns ``"SCHL=01"`` ... ``"SCHL=24"``,
  ``"SCHL=blank"``;
* a numeric feature is standardised, ``(x - mean) / std``, with the mean and
  the (population) standard deviation of the training split; a blank value
  (where the dictionary allows one) is imputed with the mean (0 after
  standardising) and flagged in an extra column ``"WKHP=blank"``.

Statistics are computed exactly: every rank sums its integer values and
squares as Python integers, the sums are added across ranks, and mean and
variance are formed from the exact totals, so they are bit-identical
whatever the number of ranks.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from preprocessing.cleaning import NUMERIC_BLANK, category_names
from preprocessing.dictionary import Codebook
from preprocessing.errors import PrepError
from preprocessing.tasks import Task

ENCODING_VERSION = 1
_SUM_CHUNK = 1 << 16
#: Column layouts of categorical features (``--encoding``).
LAYOUTS = ("onehot", "codes")


@dataclass(frozen=True)
class Encoding:
    """The features of a prepared file, in column order.

    ``features`` holds one dict per source variable: ``{"name", "kind",
    "categories"}`` or ``{"name", "kind", "mean", "std", "blank"}``, the latter
    with ``"buckets": n`` when the code is also one-hot modulo n (columns
    ``"PUMA%0"`` .. ``"PUMA%1023"``; in the codes layout one code column
    ``"PUMA%"``, its last category for a blank).
    """

    features: tuple[dict, ...]
    #: ``"onehot"`` or ``"codes"`` (see the module docstring).
    layout: str = "onehot"

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown encoding layout {self.layout!r} "
                             f"(one of {', '.join(LAYOUTS)})")

    def to_json(self) -> str:
        """Canonical JSON (the bytes that the fingerprint hashes); the one-hot
        layout is left implicit, so older files keep their fingerprints."""
        data = {"version": ENCODING_VERSION, "features": list(self.features)}
        if self.layout != "onehot":
            data["layout"] = self.layout
        return json.dumps(data, separators=(",", ":"))

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()

    @classmethod
    def from_json(cls, text: str) -> "Encoding":
        data = json.loads(text)
        if data.get("version") != ENCODING_VERSION:
            raise ValueError(f"encoding version {data.get('version')!r} is not "
                             f"{ENCODING_VERSION}")
        return cls(tuple(data["features"]), data.get("layout", "onehot"))

    @property
    def feature_names(self) -> list[str]:
        names = []
        for f in self.features:
            if f["kind"] == "categorical" and self.layout == "codes":
                names.append(f["name"])
            elif f["kind"] == "categorical":
                names += [f"{f['name']}={c}" for c in f["categories"]]
            else:
                names.append(f["name"])
                if f["blank"]:
                    names.append(f"{f['name']}=blank")
                buckets = f.get("buckets", 0)
                if buckets and self.layout == "codes":
                    names.append(f"{f['name']}%")
                elif buckets:
                    names += [f"{f['name']}%{i}" for i in range(buckets)]
        return names

    @property
    def n_features(self) -> int:
        return len(self.feature_names)

    @property
    def code_columns(self) -> list[tuple[int, int, str]]:
        """``(column, number of categories, name)`` of each code column (the
        ``codes`` layout's categorical features; empty for one-hot)."""
        if self.layout != "codes":
            return []
        names = self.feature_names
        columns = [(names.index(f["name"]), len(f["categories"]), f["name"])
                   for f in self.features if f["kind"] == "categorical"]
        columns += [(names.index(f"{f['name']}%"), f["buckets"] + 1, f"{f['name']}%")
                    for f in self.features if f.get("buckets")]
        return sorted(columns)


def local_sums(values: np.ndarray) -> tuple[int, int, int]:
    """Exact (count, sum, sum of squares) of the non-blank integers."""
    values = values[values != NUMERIC_BLANK].astype(np.int64)
    total, squares = 0, 0
    for start in range(0, len(values), _SUM_CHUNK):
        part = values[start:start + _SUM_CHUNK]
        total += int(part.sum())
        squares += int((part * part).sum())
    return len(values), total, squares


def mean_std(count: int, total: int, squares: int) -> tuple[float, float]:
    """Mean and population standard deviation from exact sums (std 1 if 0)."""
    if count == 0:
        return 0.0, 1.0
    mean = Fraction(total, count)
    variance = Fraction(squares, count) - mean * mean
    std = float(variance) ** 0.5
    return float(mean), (std if std > 0 else 1.0)


def build(task: Task, codebook: Codebook, stats: dict[str, tuple[int, int, int]],
          layout: str = "onehot") -> Encoding:
    """The encoding of a task from the dictionary and global exact sums, with
    categorical features in ``layout`` (:data:`LAYOUTS`)."""
    features = []
    for feature in task.features:
        variable = codebook[feature.name]
        if feature.kind == "categorical":
            features.append({"name": feature.name, "kind": "categorical",
                             "categories": category_names(variable)})
        else:
            mean, std = mean_std(*stats[feature.name])
            features.append({"name": feature.name, "kind": "numeric", "mean": mean,
                             "std": std, "blank": variable.blank_allowed})
            if feature.buckets:
                features[-1]["buckets"] = feature.buckets
    return Encoding(tuple(features), layout)


def check_compatible(encoding: Encoding, task: Task, codebook: Codebook, like: str) -> None:
    """Raise PrepError unless ``encoding`` (of file ``like``) fits ``task``."""
    names = [f["name"] for f in encoding.features]
    wanted = [f.name for f in task.features]
    if names != wanted:
        raise PrepError(f"{like}: its encoding has the features {', '.join(names)}, but "
                        f"task '{task.name}' has {', '.join(wanted)}")
    for spec, feature in zip(encoding.features, task.features):
        if spec["kind"] != feature.kind:
            raise PrepError(f"{like}: feature {feature.name} is {spec['kind']} there, "
                            f"{feature.kind} in task '{task.name}'")
        if spec.get("buckets", 0) != feature.buckets:
            raise PrepError(f"{like}: feature {feature.name} has {spec.get('buckets', 0)} "
                            f"buckets there, {feature.buckets} in task '{task.name}'; "
                            "prepare both files with the same mpidp version")
        if feature.kind == "categorical":
            ours = category_names(codebook[feature.name])
            if sorted(spec["categories"]) != sorted(ours):
                raise PrepError(f"{like}: the categories of {feature.name} differ from "
                                "this version's data dictionary; prepare both files with "
                                "the same mpidp version")


class Encoder:
    """Writes float32 rows for compact codes, as an :class:`Encoding` says.

    Args:
        encoding: the column layout and statistics.
        task, codebook: to map the cleaning's category indices (dictionary
            order) to the encoding's columns.
    """

    def __init__(self, encoding: Encoding, task: Task, codebook: Codebook) -> None:
        self.n_features = encoding.n_features
        self.plan = []  # (name, kind, column table | (col, mean, std, blank col))
        column = 0
        for spec in encoding.features:
            name = spec["name"]
            if spec["kind"] == "categorical":
                position = {c: i for i, c in enumerate(spec["categories"])}
                ours = category_names(codebook[name])
                if encoding.layout == "codes":
                    table = np.array([position[c] for c in ours], dtype=np.float32)
                    self.plan.append((name, "code", (column, table)))
                    column += 1
                    continue
                table = np.array([column + position[c] for c in ours], dtype=np.int64)
                self.plan.append((name, "categorical", table))
                column += len(spec["categories"])
            else:
                blank_col = column + 1 if spec["blank"] else -1
                self.plan.append((name, "numeric",
                                  (column, float(spec["mean"]), float(spec["std"]), blank_col)))
                column += 2 if spec["blank"] else 1
                buckets = spec.get("buckets", 0)
                if buckets:
                    coded = encoding.layout == "codes"
                    self.plan.append((name, "bucket", (column, buckets, coded)))
                    column += 1 if coded else buckets

    def encode(self, codes: dict[str, np.ndarray], out: np.ndarray) -> None:
        """Fill ``out`` (float32 ``[n, F]``, C order) with the encoded rows."""
        n = out.shape[0]
        out.fill(0.0)
        flat = out.reshape(-1)
        base = np.arange(n, dtype=np.int64) * self.n_features
        for name, kind, how in self.plan:
            values = codes[name][:n]
            if kind == "bucket":
                col, buckets, coded = how
                blank = values == NUMERIC_BLANK
                bucket = np.where(blank, buckets, values.astype(np.int64) % buckets)
                if coded:
                    out[:, col] = bucket
                else:  # a blank has no bucket (its own column says it is blank)
                    rows = np.flatnonzero(~blank)
                    flat[base[rows] + col + bucket[rows]] = 1.0
            elif kind == "code":
                out[:, how[0]] = how[1][values]
            elif kind == "categorical":
                flat[base + how[values]] = 1.0
            else:
                col, mean, std, blank_col = how
                blank = values == NUMERIC_BLANK
                scaled = (values.astype(np.float64) - mean) / std
                out[:, col] = np.where(blank, 0.0, scaled)
                if blank_col >= 0:
                    out[:, blank_col] = blank
