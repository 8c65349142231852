"""Cleaning: which records are kept, why the others are dropped, and the
compact codes of the kept ones.

Every record is checked against the data dictionary, column by column, in a
fixed order; the first problem found is the reason it is dropped:

0. the line is empty (nothing but commas and spaces: ``empty_line``; not a
   record with a problem, so it does not count towards the invalid share);
0. the line does not have the header's number of fields (``field_count``);
1. ``SERIALNO`` blank or not a serial number;
2. the universe columns (``AGEP`` for employment): not a number, blank where
   the dictionary has no N/A value, or a code outside the dictionary;
3. outside the universe (``AGEP < 16``);
4. the features and the label, with the same three checks.

Reasons are named ``"non_numeric:AGEP"``, ``"blank:SEX"``, ``"invalid:SCHL"``,
``"invalid:SERIALNO"`` and ``"universe"``; every rank uses the same list, so
counts add up across ranks. A blank that the dictionary allows (ESP for most
adults, MIL under 17) is not a problem: it becomes its own category.

The group attributes' columns (:mod:`preprocessing.groups`: ``SEX``,
``RAC1P``, ``AGEP``, ``ST`` and the task's group) are checked the same way,
after the task's own columns, and kept as int16 codes per kept record.

The kept records are reduced to one small code per feature: the category's
index for a categorical feature (categories = the dictionary's codes in
increasing order, then ``blank`` when allowed) and the raw integer for a
numeric one (:data:`NUMERIC_BLANK` when blank). The encoder turns those into
the float32 matrix after the shuffle, which moves only these few bytes per row.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from preprocessing.dictionary import Codebook, Variable
from preprocessing.parse import Columns
from preprocessing.tasks import Feature, Task

#: Stored for a blank value of a numeric feature.
NUMERIC_BLANK = np.iinfo(np.int32).min
#: The category name of a blank (N/A) value.
BLANK = "blank"


def category_codes(variable: Variable) -> list[int]:
    """The integer codes of a categorical variable, in category order."""
    return variable.codes()


def category_names(variable: Variable) -> list[str]:
    """Category labels as the dictionary writes the codes (zero-padded for
    character variables: ``"01"``), then ``"blank"`` when N/A is allowed."""
    pad = 0 if variable.numeric else variable.width
    names = [str(code).zfill(pad) if code >= 0 else str(code)
             for code in category_codes(variable)]
    return names + ([BLANK] if variable.blank_allowed else [])


def code_dtype(feature: Feature, codebook: Codebook) -> np.dtype:
    """The compact code type of a feature: uint8/uint16 category index, or
    the int32 value of a numeric feature."""
    if feature.kind == "numeric":
        return np.dtype(np.int32)
    n_categories = len(category_names(codebook[feature.name]))
    return np.dtype(np.uint8 if n_categories <= 256 else np.uint16)


def reason_names(task: Task) -> list[str]:
    """Every drop reason of a task, in a fixed order (index 0 is 'kept')."""
    names = ["kept", "empty_line", "field_count", "blank:SERIALNO", "invalid:SERIALNO"]
    for column in _check_order(task):
        names += [f"non_numeric:{column}", f"blank:{column}", f"invalid:{column}"]
    return names + ["universe"]


def _check_order(task: Task) -> list[str]:
    universe = list(dict.fromkeys(c.column for c in task.universe))
    rest = [c for c in task.columns() if c not in universe]
    return universe + rest


@dataclass
class Cleaned:
    """Result of cleaning consecutive records.

    Attributes:
        reason: int16 per record, 0 = kept, else an index into
            :func:`reason_names`.
        codes: feature -> per *kept* record, the category index (uint8 or
            uint16) or the raw value (int32) of a numeric feature.
        label: int8 per kept record, 1 for the positive class.
        household: int64 per kept record.
        person: int32 SPORDER per kept record (0: not known).
        groups: group attribute -> int16 code per kept record
            (:meth:`preprocessing.groups.GroupAttribute.codes`).
        first_bad: (record index, column, text) of the first record dropped
            for a reason other than the universe, or None.
    """

    reason: np.ndarray
    codes: dict[str, np.ndarray]
    label: np.ndarray
    household: np.ndarray
    first_bad: tuple[int, str, str] | None
    groups: dict[str, np.ndarray] = field(default_factory=dict)
    person: np.ndarray | None = None


class _Lookup:
    """Integer code -> category index through a table (-1 = invalid)."""

    def __init__(self, codes: list[int], recode: dict[int, int] | None) -> None:
        if recode is not None:
            index = {code: i for i, code in enumerate(codes)}
            pairs = [(raw, index.get(mapped, -1)) for raw, mapped in recode.items()]
        else:
            pairs = list(enumerate(codes))
            pairs = [(code, i) for i, code in pairs]
        raws = [raw for raw, _ in pairs] or [0]
        self.low, high = min(raws), max(raws)
        self.table = np.full(high - self.low + 1, -1, dtype=np.int32)
        for raw, i in pairs:
            self.table[raw - self.low] = i

    def __call__(self, values: np.ndarray) -> np.ndarray:
        shifted = values.astype(np.int64) - self.low
        inside = (shifted >= 0) & (shifted < len(self.table))
        return np.where(inside, self.table[np.clip(shifted, 0, len(self.table) - 1)], -1)


class Cleaner:
    """Cleans the records of files that read the task's variables from the
    same columns (``sources``: variable -> CSV column)."""

    def __init__(self, task: Task, codebook: Codebook, sources: dict[str, str]) -> None:
        self.task = task
        self.codebook = codebook
        self.sources = sources
        self.reasons = reason_names(task)
        self.reason_index = {name: i for i, name in enumerate(self.reasons)}
        self.order = _check_order(task)
        self.lookups: dict[str, _Lookup] = {}
        for feature in task.features:
            if feature.kind == "categorical":
                source = next(s for s in feature.sources if s.column == sources[feature.name])
                recode = dict(source.recode) if source.recode is not None else None
                self.lookups[feature.name] = _Lookup(category_codes(codebook[feature.name]),
                                                     recode)

    def _valid(self, name: str, values: np.ndarray) -> np.ndarray:
        if name in self.lookups:
            return self.lookups[name](values) >= 0
        feature = self.task.feature(name)
        if feature is not None:
            source = next(s for s in feature.sources if s.column == self.sources[name])
            if source.recode is not None:
                keys = np.array(sorted(source.recode), dtype=np.int64)
                return np.isin(values, keys)
        return self.codebook[name].valid(values)

    def clean(self, cols: Columns) -> Cleaned:
        """Check every record; return the reasons and the kept records' codes."""
        n = cols.n
        reason = np.zeros(n, dtype=np.int16)
        first: dict[int, tuple[int, str, str]] = {}

        def mark(mask: np.ndarray, why: str, column: str,
                 examples: list[tuple[int, str]] | None = None) -> None:
            fresh = mask & (reason == 0)
            if not fresh.any():
                return
            reason[fresh] = self.reason_index[why]
            row = int(np.argmax(fresh))
            text = dict(examples or []).get(row)
            if text is None:
                text = "" if why.startswith("blank") else str(cols.values[column][row])
            if why != "empty_line":
                first.setdefault(row, (row, column, text))

        if cols.empty.any():
            mark(cols.empty, "empty_line", "", [(int(np.argmax(cols.empty)), "")])
        if cols.wrong_fields.any():
            row = int(np.argmax(cols.wrong_fields))
            mark(cols.wrong_fields, "field_count", "",
                 [(row, f"{int(cols.field_counts[row])} fields, the header "
                        f"{cols.header_fields}")])
        mark(cols.blank["SERIALNO"], "blank:SERIALNO", "SERIALNO")
        mark(cols.bad["SERIALNO"], "invalid:SERIALNO", "SERIALNO",
             cols.examples.get("SERIALNO"))
        universe = list(dict.fromkeys(c.column for c in self.task.universe))
        for name in universe:
            self._check(cols, name, mark)
        inside = np.ones(n, dtype=bool)
        for condition in self.task.universe:  # in the 2018 codes, as the feature has them
            column = self.sources[condition.column]
            inside &= ~cols.blank[column] & condition.holds(
                self._as_feature_codes(condition.column, cols.values[column]))
        reason[~inside & (reason == 0)] = self.reason_index["universe"]
        for name in self.order[len(universe):]:
            self._check(cols, name, mark)

        keep = reason == 0
        codes = {}
        for feature in self.task.features:
            column = self.sources[feature.name]
            codes[feature.name] = self._codes(feature, cols.values[column][keep],
                                              cols.blank[column][keep])
        label_column = self.sources[self.task.label.column]
        label = (self.task.label.holds(self._as_feature_codes(
                     self.task.label.column, cols.values[label_column][keep]))
                 & ~cols.blank[label_column][keep]).astype(np.int8)
        groups = {}
        for attribute in self.task.groups():
            column = self.sources[attribute.column]
            groups[attribute.name] = attribute.codes(
                self._as_feature_codes(attribute.column, cols.values[column][keep]),
                cols.blank[column][keep])
        first_bad = first[min(first)] if first else None
        return Cleaned(reason=reason, codes=codes, label=label,
                       household=cols.household[keep], first_bad=first_bad, groups=groups,
                       person=cols.person[keep])

    def _as_feature_codes(self, name: str, values: np.ndarray) -> np.ndarray:
        """A column's valid values in the 2018 codes: recoded where the file
        gives the variable through a recoding source (RELP as RELSHIPP)."""
        feature = self.task.feature(name)
        if feature is None:
            return values
        source = next(s for s in feature.sources if s.column == self.sources[name])
        if source.recode is None or not len(values):
            return values
        keys = np.array(sorted(source.recode), dtype=np.int64)
        mapped = np.array([source.recode[k] for k in keys], dtype=np.int64)
        at = np.clip(np.searchsorted(keys, values), 0, len(keys) - 1)
        return np.where(keys[at] == values, mapped[at], values)

    def _check(self, cols: Columns, name: str, mark) -> None:
        column = self.sources[name]
        values, blank, bad = cols.values[column], cols.blank[column], cols.bad[column]
        if bad.any():
            mark(bad, f"non_numeric:{name}", column, cols.examples.get(column))
        if not self.codebook[name].blank_allowed:
            mark(blank, f"blank:{name}", column)
        mark(~blank & ~bad & ~self._valid(name, values), f"invalid:{name}", column)

    def _codes(self, feature: Feature, values: np.ndarray, blank: np.ndarray) -> np.ndarray:
        variable = self.codebook[feature.name]
        if feature.kind == "numeric":
            return np.where(blank, NUMERIC_BLANK, values).astype(np.int32)
        index = self.lookups[feature.name](values)
        if variable.blank_allowed:
            index = np.where(blank, len(category_names(variable)) - 1, index)
        return index.astype(code_dtype(feature, self.codebook))
