"""Prediction tasks as data: features, label and universe of a PUMS task.

A task is a small declarative :class:`Task`; the pipeline knows nothing of
employment or income. Adding a task means adding one definition to
:data:`TASKS` (no code in the pipeline changes), or writing a task file
(``mpidp prep --task-file``, :mod:`preprocessing.taskfile`). The built-in
tasks are folktables' seven ACS problems (Ding, Hardt, Miller, Schmidt,
"Retiring Adult: New Datasets for Fair Machine Learning", NeurIPS 2021):
the same features, label and universe, so that on the same person file
``mpidp prep`` keeps exactly folktables' rows and labels (tested on real
files, ``tests/test_prep_tasks.py``), with one deliberate difference:

* ``employment`` (ACSEmployment) keeps working-age persons only,
  ``AGEP >= 16``; folktables keeps every age (``--universe AGEP>=0``
  restores its rows).

Where a folktables feature is blank (N/A), folktables passes NaN (then -1);
mpidp makes the blank a category of its own (``ESP=blank``), or, for a
numeric feature, imputes the mean and adds a flag column (``WKHP=blank``).
A blank label value is the negative class in both (``NaN > 20`` is false).

Categorical features are one-hot encoded with the category set of the 2018
data dictionary (plus a ``blank`` category where the dictionary has an N/A
value); numeric features are standardised with the training split's mean and
standard deviation. Quantities (``AGEP``, ``WKHP``, ``PINCP``, ``POVPIP``,
``JWMNP``) are numeric; codes are categorical, with two exceptions:
``PUMA`` and ``POWPUMA`` (travel_time) are numeric, the standardised code.
The dictionary defines them only as the range 00100-70301 (a PUMA is
numbered within its state), 70,202 possible categories of which a state
uses a few dozen: one-hot over the dictionary would be 70,000 mostly empty
columns, and categories taken from the data would make files of different
states incompatible. folktables too hands them to models as raw numbers.
A number is all a tree needs to split places apart, but an MLP cannot, so
they are *also* one-hot over :data:`PLACE_BUCKETS` buckets, the code
modulo 1024 (``Feature.buckets``): columns fixed in advance, the same for
every state, that tell an MLP which place a row is in (two PUMA codes of
the range share a bucket only if they differ by a multiple of 1024).
``OCCP`` (531 categories), ``POBP`` (224) and ``ST`` (52) are listed code
by code in the dictionary and stay categorical.

**Years.** A feature is read from the first of its :class:`Source` columns
present in a file's header; a source may recode its values into the
feature's (2018) codes. ``RELP`` (2018 and before) became ``RELSHIPP`` (codes
20-38) from 2019; the recode below maps it back so that a model trained on
2018 can score 2019 data with ``--like``. The map is not exact: 2019 has no
"roomer or boarder" (2018 code 11) and splits partners and spouses by sex.
A label, universe or group on ``RELP`` is read the same way (from
``RELSHIPP``, recoded), whether or not the task has ``RELP`` as a feature
(:data:`MULTI_YEAR`, :meth:`Task.feature`).
"""
from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from preprocessing import groups as group_attributes

#: Comparison operators a condition may use.
OPERATORS: dict[str, Callable[[np.ndarray, float], np.ndarray]] = {
    ">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt,
    "==": operator.eq, "!=": operator.ne,
}


@dataclass(frozen=True)
class Condition:
    """``column op value`` on integer codes, e.g. ``AGEP >= 16``.

    A blank value satisfies no condition (so blank rows leave the universe).
    """

    column: str
    op: str
    value: int

    def __post_init__(self) -> None:
        if self.op not in OPERATORS:
            raise ValueError(f"unknown operator {self.op!r} (use one of {', '.join(OPERATORS)})")

    def holds(self, values: np.ndarray) -> np.ndarray:
        """Boolean mask over integer ``values`` (blanks must be masked by the caller)."""
        return OPERATORS[self.op](values, self.value)

    def __str__(self) -> str:
        return f"{self.column}{self.op}{self.value}"


def parse_conditions(text: str) -> tuple[Condition, ...]:
    """Parse ``"AGEP>=16,PWGTP>=1"`` into conditions.

    Raises:
        ValueError: a term is not ``NAME OP INTEGER``.
    """
    terms = [t.strip() for t in text.split(",") if t.strip()]
    conditions = []
    for term in terms:
        match = re.fullmatch(r"([A-Za-z][A-Za-z0-9_]*)\s*(>=|<=|==|!=|>|<)\s*(-?\d+)", term)
        if not match:
            raise ValueError(f"cannot read the condition {term!r}; write e.g. 'AGEP>=16'")
        conditions.append(Condition(match.group(1).upper(), match.group(2), int(match.group(3))))
    return tuple(conditions)


@dataclass(frozen=True)
class Source:
    """A CSV column a feature may be read from, with an optional recode.

    Attributes:
        column: header name in the person file.
        recode: maps this column's codes to the feature's codes; codes not in
            the map are invalid. None: the codes are the feature's own.
        years: human note on which survey years use this column.
        caveat: what the recode cannot keep, for the note a file read through
            it gets (:meth:`Feature.note_for`).
    """

    column: str
    recode: Mapping[int, int] | None = None
    years: str = ""
    caveat: str = ""


@dataclass(frozen=True)
class Feature:
    """One input variable of a task.

    Attributes:
        name: the variable's name in the 2018 dictionary (its codes define the
            categories) and in the encoded feature names (``"SCHL=21"``).
        kind: ``"categorical"`` (one-hot) or ``"numeric"`` (standardised).
        sources: the columns it can be read from, in order of preference;
            default: the column of the same name.
        buckets: numeric features only: also one-hot the code modulo this
            many buckets (0: no), for codes that name places (PUMA).
    """

    name: str
    kind: str = "categorical"
    sources: tuple[Source, ...] = ()
    buckets: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("categorical", "numeric"):
            raise ValueError(f"{self.name}: kind must be 'categorical' or 'numeric'")
        if self.buckets and (self.kind != "numeric" or self.buckets < 2):
            raise ValueError(f"{self.name}: buckets need a numeric feature and at least 2")
        if not self.sources:
            object.__setattr__(self, "sources", (Source(self.name),))

    def note_for(self, column: str) -> str | None:
        """What a user should know when a file gives this feature as ``column``:
        read from another survey year's column, recoded (None for the
        feature's first source)."""
        if column == self.sources[0].column:
            return None
        source = next((s for s in self.sources if s.column == column), None)
        if source is None:
            return None
        years = f" ({source.years})" if source.years else ""
        how = "recoded to the 2018 codes" if source.recode is not None else "as is"
        caveat = f"; {source.caveat}" if source.caveat else ""
        return f"{self.name} read from {column}{years}, {how}{caveat}"


@dataclass(frozen=True)
class Task:
    """A binary classification task on the person file.

    Attributes:
        name: the name given to ``--task`` and stored in the output.
        description: one line for ``--help`` and the file's attributes.
        features: the inputs, in output column order.
        label: the positive class (``ESR == 1``); every other valid value,
            and a blank, is the negative class.
        universe: conditions a record must meet to be kept at all.
        group: the column folktables groups the task's people by (its
            ``group``: ``RAC1P`` for every ACS task); kept in the prepared
            file with :data:`preprocessing.groups.KEPT` (:meth:`groups`).
    """

    name: str
    description: str
    features: tuple[Feature, ...]
    label: Condition
    universe: tuple[Condition, ...] = field(default_factory=tuple)
    n_classes: int = 2
    group: str = "RAC1P"

    def with_universe(self, universe: tuple[Condition, ...]) -> "Task":
        """A copy with another universe (``--universe``)."""
        return Task(self.name, self.description, self.features, self.label, universe,
                    self.n_classes, self.group)

    def groups(self) -> tuple[group_attributes.GroupAttribute, ...]:
        """The group attributes a prepared file of this task keeps (never features
        unless listed in :attr:`features`)."""
        return group_attributes.attributes(self.group)

    def columns(self) -> list[str]:
        """The variables the task reads: features, label, universe columns, then
        the group attributes' columns."""
        names = [f.name for f in self.features] + [self.label.column]
        names += [c.column for c in self.universe]
        names += [a.column for a in self.groups()]
        return list(dict.fromkeys(names))

    def feature(self, name: str) -> Feature | None:
        """How the task reads the variable ``name`` (its columns, their recode):
        its feature of that name; else, for a label, universe or group column
        that other survey years name otherwise (:data:`MULTI_YEAR`: RELP,
        RELSHIPP from 2019), that variable's reading, so that ``--universe
        RELP==0`` keeps the same persons of a 2019 file whatever the task's
        features; else None (read as is, from the column of its name)."""
        found = next((f for f in self.features if f.name == name), None)
        if found is None and name in MULTI_YEAR and name in self.columns():
            return MULTI_YEAR[name]
        return found

    def notes(self, columns: Mapping[str, str]) -> list[str]:
        """:meth:`Feature.note_for` of every variable the task reads
        (:meth:`feature`: features, and label, universe or group columns of
        :data:`MULTI_YEAR`), for a file whose header gives each variable as
        ``columns[name]`` (e.g. RELP as RELSHIPP in a 2019 file)."""
        notes = []
        for name in self.columns():
            feature = self.feature(name)
            note = feature.note_for(columns.get(name, name)) if feature else None
            if note is not None:
                notes.append(note)
        return notes


#: RELSHIPP (2019 and later) -> RELP (2018) codes. 2018 RELP: 00 reference
#: person, 01 husband/wife, 02 biological child, 03 adopted child, 04
#: stepchild, 05 sibling, 06 parent, 07 grandchild, 08 parent-in-law, 09
#: child-in-law, 10 other relative, 11 roomer/boarder, 12 housemate/roommate,
#: 13 unmarried partner, 14 foster child, 15 other nonrelative, 16
#: institutional GQ, 17 noninstitutional GQ. RELSHIPP: 20 reference person,
#: 21/23 opposite-/same-sex spouse, 22/24 opposite-/same-sex unmarried
#: partner, 25 biological child, 26 adopted, 27 stepchild, 28 sibling, 29
#: parent, 30 grandchild, 31 parent-in-law, 32 child-in-law, 33 other
#: relative, 34 roommate/housemate, 35 foster child, 36 other nonrelative,
#: 37 institutional GQ, 38 noninstitutional GQ.
RELSHIPP_TO_RELP: dict[int, int] = {
    20: 0, 21: 1, 22: 13, 23: 1, 24: 13, 25: 2, 26: 3, 27: 4, 28: 5, 29: 6, 30: 7,
    31: 8, 32: 9, 33: 10, 34: 12, 35: 14, 36: 15, 37: 16, 38: 17,
}

RELP = Feature("RELP", sources=(
    Source("RELP", years="2018 and before"),
    Source("RELSHIPP", RELSHIPP_TO_RELP, years="the 2019 survey and later",
           caveat="not exact: no roomer or boarder (2018 code 11), spouses and partners of "
                  "either sex merged")))


#: Variables whose column other survey years name otherwise, by name: read
#: through their sources wherever a task names them, as a feature, in its
#: label, universe or group (:meth:`Task.feature`).
MULTI_YEAR: dict[str, Feature] = {"RELP": RELP}


def _features(*names: str) -> tuple[Feature, ...]:
    """Features by name: quantities numeric, RELP with its 2019 source, the
    rest categorical."""
    return tuple(MULTI_YEAR.get(name) or Feature(name, "numeric" if name in NUMERIC else
                                                 "categorical",
                                                 buckets=PLACE_BUCKETS if name in PLACES else 0)
                 for name in names)


#: The built-in tasks' numeric features (see the module docstring for PUMA).
NUMERIC = frozenset({"AGEP", "WKHP", "PINCP", "POVPIP", "JWMNP", "PUMA", "POWPUMA"})
#: Numeric codes of places, also one-hot over PLACE_BUCKETS buckets (module docstring).
PLACES = frozenset({"PUMA", "POWPUMA"})
PLACE_BUCKETS = 1024

EMPLOYMENT = Task(
    name="employment",
    description="ACSEmployment: civilian employed at work (ESR == 1); differs from "
    "folktables: persons aged 16 and over only (folktables keeps every age)",
    features=_features("AGEP", "SCHL", "MAR", "RELP", "DIS", "ESP", "CIT", "MIG", "MIL",
                       "ANC", "NATIVITY", "DEAR", "DEYE", "DREM", "SEX", "RAC1P"),
    label=Condition("ESR", "==", 1),
    universe=(Condition("AGEP", ">=", 16),),
)

INCOME = Task(
    name="income",
    description="ACSIncome: total personal income above $50,000 (PINCP > 50000) of "
    "workers over 16 (the Adult data set's filters)",
    features=_features("AGEP", "COW", "SCHL", "MAR", "OCCP", "POBP", "RELP", "WKHP", "SEX",
                       "RAC1P"),
    label=Condition("PINCP", ">", 50000),
    universe=(Condition("AGEP", ">", 16), Condition("PINCP", ">", 100),
              Condition("WKHP", ">", 0), Condition("PWGTP", ">=", 1)),
)

PUBLIC_COVERAGE = Task(
    name="public_coverage",
    description="ACSPublicCoverage: public health coverage (PUBCOV == 1) of persons "
    "under 65 with income at most $30,000",
    features=_features("AGEP", "SCHL", "MAR", "SEX", "DIS", "ESP", "CIT", "MIG", "MIL",
                       "ANC", "NATIVITY", "DEAR", "DEYE", "DREM", "PINCP", "ESR", "ST",
                       "FER", "RAC1P"),
    label=Condition("PUBCOV", "==", 1),
    universe=(Condition("AGEP", "<", 65), Condition("PINCP", "<=", 30000)),
)

MOBILITY = Task(
    name="mobility",
    description="ACSMobility: lived in the same house a year ago (MIG == 1), persons "
    "aged 19 to 34",
    features=_features("AGEP", "SCHL", "MAR", "SEX", "DIS", "ESP", "CIT", "MIL", "ANC",
                       "NATIVITY", "RELP", "DEAR", "DEYE", "DREM", "RAC1P", "GCL", "COW",
                       "ESR", "WKHP", "JWMNP", "PINCP"),
    label=Condition("MIG", "==", 1),
    universe=(Condition("AGEP", ">", 18), Condition("AGEP", "<", 35)),
)

TRAVEL_TIME = Task(
    name="travel_time",
    description="ACSTravelTime: commute longer than 20 minutes (JWMNP > 20) of employed "
    "persons over 16 (PUMA, POWPUMA numeric and bucketed)",
    features=_features("AGEP", "SCHL", "MAR", "SEX", "DIS", "ESP", "MIG", "RELP", "RAC1P",
                       "PUMA", "ST", "CIT", "OCCP", "JWTR", "POWPUMA", "POVPIP"),
    label=Condition("JWMNP", ">", 20),
    universe=(Condition("AGEP", ">", 16), Condition("PWGTP", ">=", 1),
              Condition("ESR", "==", 1)),
)

INCOME_POVERTY_RATIO = Task(
    name="income_poverty_ratio",
    description="ACSIncomePovertyRatio: income below 250% of the poverty threshold "
    "(POVPIP < 250), every person",
    features=_features("AGEP", "SCHL", "MAR", "SEX", "DIS", "ESP", "MIG", "CIT", "MIL",
                       "ANC", "NATIVITY", "RELP", "DEAR", "DEYE", "DREM", "RAC1P", "GCL",
                       "ESR", "OCCP", "WKHP"),
    label=Condition("POVPIP", "<", 250),
)

HEALTH_INSURANCE = Task(
    name="health_insurance",
    description="ACSHealthInsurance: health insurance bought directly from an insurer "
    "(HINS2 == 1), every person",
    features=_features("AGEP", "SCHL", "MAR", "SEX", "DIS", "ESP", "CIT", "MIG", "MIL",
                       "ANC", "NATIVITY", "DEAR", "DEYE", "DREM", "RACAIAN", "RACASN",
                       "RACBLK", "RACNH", "RACPI", "RACSOR", "RACWHT", "PINCP", "ESR", "ST",
                       "FER"),
    label=Condition("HINS2", "==", 1),
)

#: Every task ``--task`` accepts, by name.
TASKS: dict[str, Task] = {task.name: task for task in (
    EMPLOYMENT, INCOME, PUBLIC_COVERAGE, MOBILITY, TRAVEL_TIME, INCOME_POVERTY_RATIO,
    HEALTH_INSURANCE)}
