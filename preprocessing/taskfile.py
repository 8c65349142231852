"""A task from a TOML file: ``mpidp prep --task-file my_task.toml``.

The file defines one :class:`~preprocessing.tasks.Task` with the same parts
as a built-in one::

    name = "long_commute"                  # lower case, digits, _; not a built-in name
    description = "commute over 45 minutes of employed adults"   # optional
    label = "JWMNP > 45"                   # the positive class: one condition
    universe = ["AGEP >= 18", "ESR == 1"]  # optional; default: every record
    group = "RAC1P"                        # optional: folktables' group column (RAC1P)

    [features]                             # in output column order
    AGEP = "numeric"
    SCHL = "categorical"
    JWTR = "categorical"

A condition is ``COLUMN OP INTEGER`` with OP one of ``>= > <= < == !=``, as
for ``--universe``; a blank value satisfies none, so a record whose label
column is blank is a negative and one whose universe column is blank is
dropped. ``universe`` may also be one string of comma-separated conditions.
Every column must be in the 2018 person dictionary
(``pums_2018_person.json``), which gives a categorical feature its
categories; a feature with more than :data:`MAX_CATEGORIES` codes (``PUMA``:
70,202) must be numeric. ``RELP`` is read from ``RELSHIPP`` in 2019 and
later files, as in the built-in tasks. ``group`` names the column the
task's people are grouped by in folktables' sense (default ``RAC1P``): a
coded column of at most 60 labelled codes, kept in the file beside
``SEX``, ``RAC1P``, ``AGEP`` in bands and ``ST`` (:mod:`preprocessing.groups`).

Every problem is one :class:`~preprocessing.errors.PrepError` line naming
the file and the field (``features.SCL``, ``universe[1]``), with the
closest valid name where a name is misspelt; ``mpidp prep`` exits with
code 2 before reading any record.
"""
from __future__ import annotations

import difflib
import re

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, from PyPI (setup.py)
    import tomli as tomllib

from kernels.files import not_a_file
from preprocessing import groups
from preprocessing.dictionary import Codebook, Variable
from preprocessing.errors import PrepError
from preprocessing.tasks import MULTI_YEAR as _MULTI_YEAR
from preprocessing.tasks import TASKS, Condition, Feature, Task, parse_conditions

#: The fields of a task file; the first three are required.
FIELDS = ("name", "label", "features", "description", "universe", "group")
REQUIRED = ("name", "label", "features")
KINDS = ("numeric", "categorical")
#: The most categories a categorical feature may have (OCCP has 531).
MAX_CATEGORIES = 1000
_NAME = re.compile(r"[a-z][a-z0-9_]*")


def _closest(word: str, choices, upper: bool = False) -> str:
    """`` (did you mean X?)`` when a choice is close to ``word``, else ``""``."""
    pool = list(choices)
    key = word.upper() if upper else word.lower()
    matches = difflib.get_close_matches(key, pool, n=1, cutoff=0.6)
    return f" (did you mean {matches[0]}?)" if matches else ""


def n_categories(variable: Variable) -> int:
    """Categories of a variable as a categorical feature: its integer codes,
    plus one for a blank (counted from the ranges, never enumerated)."""
    return (sum(high - low + 1 for low, high in variable.ranges)
            + (1 if variable.blank_allowed else 0))


def numeric_column(name: str, codebook: Codebook, where: str) -> Variable:
    """The dictionary's entry for the column ``name``; PrepError (prefixed with
    ``where``) unless the 2018 person file has it with numeric codes."""
    if name not in codebook:
        raise PrepError(f"{where}: {name} is not a column of the 2018 person file"
                        f"{_closest(name, codebook.header, upper=True)}")
    variable = codebook[name]
    if variable.strings:
        raise PrepError(f"{where}: {name} has non-numeric codes, which mpidp does not read")
    return variable


def check_task(task: Task, codebook: Codebook, where: str) -> None:
    """Raise PrepError unless every column of ``task`` can be read and encoded.

    ``where`` prefixes each message (the task file's path).
    """
    for feature in task.features:
        at = f"{where}: features.{feature.name}"
        variable = numeric_column(feature.name, codebook, at)
        count = n_categories(variable)
        if feature.kind == "categorical" and count > MAX_CATEGORIES:
            raise PrepError(f"{at}: {count:,} categories in the data dictionary, more "
                            f"than {MAX_CATEGORIES:,}; declare it \"numeric\"")
        if feature.name == task.label.column:
            raise PrepError(f"{at}: the label's column cannot be a feature")
    numeric_column(task.label.column, codebook, f"{where}: label")
    for i, condition in enumerate(task.universe):
        numeric_column(condition.column, codebook, f"{where}: universe[{i}]")
    why = groups.problem(task.group)
    if why is not None:
        hint = ("" if task.group in codebook
                else _closest(task.group, codebook.header, upper=True))
        raise PrepError(f"{where}: group: {why}{hint}")


def _conditions(text: str, where: str) -> tuple[Condition, ...]:
    try:
        return parse_conditions(text)
    except ValueError as exc:
        raise PrepError(f"{where}: {exc}") from None


def _features(table, where: str) -> tuple[Feature, ...]:
    if not isinstance(table, dict) or not table:
        raise PrepError(f"{where}: features: a table of NAME = \"numeric\" or "
                        "\"categorical\" lines under [features], at least one")
    features: dict[str, Feature] = {}
    for key, kind in table.items():
        name = key.upper()
        at = f"{where}: features.{key}"
        if name in features:
            raise PrepError(f"{at}: {name} is given twice")
        if not isinstance(kind, str) or kind not in KINDS:
            hint = _closest(kind, KINDS) if isinstance(kind, str) else ""
            raise PrepError(f"{at}: the kind must be \"numeric\" or \"categorical\", not "
                            f"{kind!r}{hint}")
        known = _MULTI_YEAR.get(name)
        features[name] = (known if known is not None and kind == known.kind
                          else Feature(name, kind))
    return tuple(features.values())


def parse(data: dict, codebook: Codebook, where: str) -> Task:
    """The task a parsed TOML document defines (``where``: its path, for messages).

    Raises:
        PrepError: a field missing, unknown, of the wrong type or naming
            something the dictionary lacks.
    """
    for key in data:
        if key not in FIELDS:
            raise PrepError(f"{where}: unknown field {key!r}{_closest(key, FIELDS)}; a task "
                            f"file has {', '.join(FIELDS)}")
    for key in REQUIRED:
        if key not in data:
            raise PrepError(f"{where}: the field {key!r} is missing (see "
                            "docs/preprocessing.md, Tasks)")
    name = data["name"]
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise PrepError(f"{where}: name: {name!r} is not a task name (lower-case letters, "
                        "digits and _, starting with a letter)")
    if name in TASKS:
        raise PrepError(f"{where}: name: {name!r} is a built-in task; use --task {name}, "
                        "or give this task another name")
    description = data.get("description", f"defined in {where}")
    if not isinstance(description, str) or "\n" in description:
        raise PrepError(f"{where}: description: one line of text")
    label = data["label"]
    if not isinstance(label, str):
        raise PrepError(f"{where}: label: a condition in quotes, e.g. \"PINCP > 50000\"")
    labels = _conditions(label, f"{where}: label")
    if len(labels) != 1:
        raise PrepError(f"{where}: label: one condition, e.g. \"PINCP > 50000\", not "
                        f"{len(labels)}")
    universe = data.get("universe", [])
    if isinstance(universe, str):
        conditions = _conditions(universe, f"{where}: universe")
    elif isinstance(universe, list):
        conditions = ()
        for i, term in enumerate(universe):
            if not isinstance(term, str):
                raise PrepError(f"{where}: universe[{i}]: a condition in quotes, e.g. "
                                "\"AGEP >= 16\"")
            found = _conditions(term, f"{where}: universe[{i}]")
            if len(found) != 1:
                raise PrepError(f"{where}: universe[{i}]: one condition per item")
            conditions += found
    else:
        raise PrepError(f"{where}: universe: a list of conditions, e.g. "
                        "[\"AGEP >= 16\", \"PWGTP >= 1\"]")
    group = data.get("group", "RAC1P")
    if not isinstance(group, str):
        raise PrepError(f"{where}: group: a column name in quotes, e.g. \"RAC1P\"")
    task = Task(name=name, description=description, features=_features(data["features"], where),
                label=labels[0], universe=conditions, group=group.upper())
    check_task(task, codebook, where)
    return task


#: The longest file read as a task file (a task is a few hundred bytes).
MAX_TASK_FILE = 1 << 20


def load(path: str, codebook: Codebook) -> Task:
    """The task defined in the TOML file ``path``.

    Raises:
        PrepError: the file cannot be read, is a device or pipe, is larger
            than :data:`MAX_TASK_FILE`, is not TOML (a UTF-8 byte-order mark
            is skipped), or is not a valid task.
    """
    special = not_a_file(path)
    if special is not None:  # /dev/urandom would be read until memory ran out
        raise PrepError(f"--task-file {path} is {special}, not a TOML file")
    try:
        with open(path, "rb") as handle:
            text = handle.read(MAX_TASK_FILE + 1)
        if len(text) > MAX_TASK_FILE:
            raise PrepError(f"--task-file {path}: more than {MAX_TASK_FILE:,} bytes, not a "
                            "task file")
        # a byte-order mark, as Windows editors save "UTF-8": TOML has none
        data = tomllib.loads(text.removeprefix(b"\xef\xbb\xbf").decode("utf-8"))
    except FileNotFoundError:
        raise PrepError(f"{path}: no such file (given to --task-file)") from None
    except OSError as exc:
        raise PrepError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise PrepError(f"{path}: not a valid TOML file ({exc})") from None
    return parse(data, codebook, path)
