"""Group attributes: the columns of a prepared file that people are grouped by.

A model of census microdata is asked "accurate for whom?": per sex, race,
age or state. ``mpidp prep`` therefore keeps, for every split, a few
columns a user may group the evaluation by (``mpidp eval --by``), whether
or not they are model features:

* :data:`KEPT`: ``SEX``, ``RAC1P`` (race), ``AGEP`` in the bands of
  :data:`AGE_BANDS`, and ``ST`` (state);
* the task's own ``group`` column in folktables' sense
  (:attr:`preprocessing.tasks.Task.group`: ``RAC1P`` for the seven ACS
  tasks; a task file may name another coded column).

Each is stored as ``/s/groups/NAME``, int16 codes (the dictionary's code,
e.g. ``RAC1P`` 1..9; for ``AGEP`` the first age of the person's band;
:data:`BLANK_CODE` for a blank where the dictionary allows one), and the
root attribute ``groups`` holds, per attribute, its description and the
label of every code, taken from the 2018 data dictionary
(:func:`preprocessing.dictionary.load_labels`), and whether the model
reads it as a feature. A group column is never part of ``/s/X``: a model
sees ``SEX`` only when the task lists it as a feature.

An attribute needs labelled codes (at most
:data:`preprocessing.dictionary.MAX_LABELLED_CODES`, ``ST``'s 52), or bands.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from preprocessing import dictionary

#: The first age of each ``AGEP`` band: 0-15, 16-24, 25-34, ..., 65-74, 75 and over
#: (the Census Bureau's ten-year bands from 25, the young split at the working age).
AGE_BANDS = (0, 16, 25, 35, 45, 55, 65, 75)
#: The code stored for a blank value (a group column whose dictionary allows N/A).
BLANK_CODE = -1
#: Element type of ``/s/groups/NAME``.
DTYPE = np.int16


@dataclass(frozen=True)
class GroupAttribute:
    """One attribute kept for grouping.

    Attributes:
        name: the attribute's name in the file and on ``--by`` (the column's).
        bands: for a quantity (``AGEP``): the first value of each band, in
            increasing order; the stored code is the band's first value.
            Empty: the column's codes are stored as they are.
    """

    name: str
    bands: tuple[int, ...] = ()

    @property
    def column(self) -> str:
        """The person-file column it is read from."""
        return self.name

    def codes(self, values: np.ndarray, blank: np.ndarray) -> np.ndarray:
        """int16 codes of integer column ``values`` (``blank``: which are blank)."""
        values = np.asarray(values, dtype=np.int64)
        if self.bands:
            edges = np.asarray(self.bands, dtype=np.int64)
            out = edges[np.clip(np.searchsorted(edges, values, side="right") - 1, 0, None)]
        else:
            out = values
        return np.where(blank, BLANK_CODE, out).astype(DTYPE)

    def labels(self, book: dict[str, dictionary.Labels] | None = None) -> dict[int, str]:
        """Code -> label: the dictionary's words, or ``"25-34"`` for a band."""
        if self.bands:
            ends = list(self.bands[1:])
            return {low: (f"{low}-{end - 1}" if i < len(ends) else f"{low} and over")
                    for i, (low, end) in enumerate(zip(self.bands, ends + [None]))}
        words = (book or dictionary.load_labels())[self.column]
        labels = dict(words.codes)
        if words.blank is not None:
            labels[BLANK_CODE] = words.blank
        return labels

    def description(self, book: dict[str, dictionary.Labels] | None = None) -> str:
        words = (book or dictionary.load_labels())[self.column]
        return words.description + (", in bands" if self.bands else "")


#: The attributes every PUMS file keeps.
KEPT = (GroupAttribute("SEX"), GroupAttribute("RAC1P"), GroupAttribute("AGEP", AGE_BANDS),
        GroupAttribute("ST"))


def attribute(name: str) -> GroupAttribute:
    """The attribute of that name: one of :data:`KEPT`, else the column's codes."""
    return next((a for a in KEPT if a.name == name), GroupAttribute(name))


def attributes(group: str) -> tuple[GroupAttribute, ...]:
    """The attributes a file of a task with folktables group ``group`` keeps."""
    return KEPT if any(a.name == group for a in KEPT) else KEPT + (attribute(group),)


def problem(name: str, book: dict[str, dictionary.Labels] | None = None) -> str | None:
    """Why column ``name`` cannot be a group attribute, or None when it can."""
    book = book or dictionary.load_labels()
    if any(a.name == name and a.bands for a in KEPT):
        return None
    if name not in book:
        return f"{name} is not a column of the 2018 person file"
    if not book[name].codes:
        return (f"{name} has no labelled codes in the data dictionary (a quantity, or more "
                f"than {dictionary.MAX_LABELLED_CODES} codes); a group column must be a code "
                "of few values")
    limit = np.iinfo(DTYPE)
    if not all(limit.min < code <= limit.max for code in book[name].codes):
        return f"{name}'s codes do not fit the group columns' {np.dtype(DTYPE).name}"
    return None


def describe(attrs: tuple[GroupAttribute, ...], features: set[str]) -> dict:
    """The ``groups`` root attribute: per attribute its description, labels
    (code as a string -> label), bands and whether the model reads it."""
    book = dictionary.load_labels()
    out = {}
    for a in attrs:
        entry = {"description": a.description(book), "column": a.column,
                 "labels": {str(code): text for code, text in a.labels(book).items()},
                 "feature": a.column in features}
        if a.bands:
            entry["bands"] = list(a.bands)
        out[a.name] = entry
    return out
