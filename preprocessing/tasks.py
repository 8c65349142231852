"""Prediction tasks as data: features, label and universe of a PUMS task.

A task is a small declarative :class:`Task`; the pipeline knows nothing of
employment or income. Adding a task means adding one definition to
:data:`TASKS` (no code in the pipeline changes). The two built-in tasks follow
folktables (Ding, Hardt, Miller, Schmidt, "Retiring Adult: New Datasets for
Fair Machine Learning", NeurIPS 2021):

* ``employment`` (ACSEmployment): is the person a civilian employed at work
  (``ESR == 1``)? 16 features; universe ``AGEP >= 16`` (folktables keeps every
  age; the issue asks for working-age persons, and ``--universe`` changes it).
* ``income`` (ACSIncome): is the total personal income above $50,000
  (``PINCP > 50000``)? 10 features; universe of the Adult data set
  (``AGEP > 16``, ``PINCP > 100``, ``WKHP > 0``, ``PWGTP >= 1``).

Categorical features are one-hot encoded with the category set of the 2018
data dictionary (plus a ``blank`` category where the dictionary has an N/A
value); numeric features are standardised with the training split's mean and
standard deviation.

**Years.** A feature is read from the first of its :class:`Source` columns
present in a file's header; a source may recode its values into the
feature's (2018) codes. ``RELP`` (2018 and before) became ``RELSHIPP`` (codes
20-38) from 2019; the recode below maps it back so that a model trained on
2018 can score 2019 data with ``--like``. The map is not exact: 2019 has no
"roomer or boarder" (2018 code 11) and splits partners and spouses by sex.
"""
from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

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
    """

    column: str
    recode: Mapping[int, int] | None = None
    years: str = ""


@dataclass(frozen=True)
class Feature:
    """One input variable of a task.

    Attributes:
        name: the variable's name in the 2018 dictionary (its codes define the
            categories) and in the encoded feature names (``"SCHL=21"``).
        kind: ``"categorical"`` (one-hot) or ``"numeric"`` (standardised).
        sources: the columns it can be read from, in order of preference;
            default: the column of the same name.
    """

    name: str
    kind: str = "categorical"
    sources: tuple[Source, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("categorical", "numeric"):
            raise ValueError(f"{self.name}: kind must be 'categorical' or 'numeric'")
        if not self.sources:
            object.__setattr__(self, "sources", (Source(self.name),))


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
    """

    name: str
    description: str
    features: tuple[Feature, ...]
    label: Condition
    universe: tuple[Condition, ...] = field(default_factory=tuple)
    n_classes: int = 2

    def with_universe(self, universe: tuple[Condition, ...]) -> "Task":
        """A copy with another universe (``--universe``)."""
        return Task(self.name, self.description, self.features, self.label, universe,
                    self.n_classes)

    def columns(self) -> list[str]:
        """The variables the task reads: features, label, then universe columns."""
        names = [f.name for f in self.features] + [self.label.column]
        names += [c.column for c in self.universe]
        return list(dict.fromkeys(names))

    def feature(self, name: str) -> Feature | None:
        return next((f for f in self.features if f.name == name), None)


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

RELP = Feature("RELP", sources=(Source("RELP", years="2018 and before"),
                                Source("RELSHIPP", RELSHIPP_TO_RELP, years="2019 and later")))

EMPLOYMENT = Task(
    name="employment",
    description="ACSEmployment (folktables): civilian employed at work, ESR == 1",
    features=(Feature("AGEP", "numeric"), Feature("SCHL"), Feature("MAR"), RELP,
              Feature("DIS"), Feature("ESP"), Feature("CIT"), Feature("MIG"),
              Feature("MIL"), Feature("ANC"), Feature("NATIVITY"), Feature("DEAR"),
              Feature("DEYE"), Feature("DREM"), Feature("SEX"), Feature("RAC1P")),
    label=Condition("ESR", "==", 1),
    universe=(Condition("AGEP", ">=", 16),),
)

INCOME = Task(
    name="income",
    description="ACSIncome (folktables): total personal income above $50,000, PINCP > 50000",
    features=(Feature("AGEP", "numeric"), Feature("COW"), Feature("SCHL"), Feature("MAR"),
              Feature("OCCP"), Feature("POBP"), RELP, Feature("WKHP", "numeric"),
              Feature("SEX"), Feature("RAC1P")),
    label=Condition("PINCP", ">", 50000),
    universe=(Condition("AGEP", ">", 16), Condition("PINCP", ">", 100),
              Condition("WKHP", ">", 0), Condition("PWGTP", ">=", 1)),
)

#: Every task ``--task`` accepts, by name.
TASKS: dict[str, Task] = {task.name: task for task in (EMPLOYMENT, INCOME)}
