"""Per-group figures of a binary classifier over MPI ranks, with disclosure control.

``mpidp eval --by SEX,RAC1P`` asks "accurate for whom?": for each group of
people (each code of a group attribute a prepared file keeps,
:mod:`preprocessing.groups`, or each cell of a cross of two ``A:B``) the
rows, the accuracy, the true-positive rate (recall of the positive class,
the label 1), the false-positive rate and the selection rate (share
predicted positive), each with an exact (Clopper-Pearson) 95% interval
(``scipy.stats.binomtest(...).proportion_ci(method="exact")``), and the gaps
fairness work reports: the largest minus the smallest of each rate, the
worst group's accuracy and the ratio of the smallest to the largest
selection rate (the "four-fifths rule" ratio). Two models on the same rows
(:func:`compare`) give each group's change in accuracy and McNemar's exact
test of it (``binomtest`` on the rows only one model gets right).

**Over the ranks.** Every cell a file's labels allow is known in advance
(:class:`Cells`: the product of the attributes' labelled codes), so each
rank counts its rows into the same ``[cells, counts]`` array
(:func:`count`) and one all-reduce of int64 counts adds them: a group
split over ranks is summed, a group present on one rank only is counted
there and zero elsewhere. The figures are exact integers, the same at any
number of ranks.

**Suppression.** A published table of a small cell's accuracy is itself a
disclosure: with the cell's row count, a reader learns how a model did on a
handful of identifiable people. Groups with fewer rows than
``min_group_size`` (default :data:`MIN_GROUP_SIZE`, 100: a cautious
minimum cell size of disclosure control, docs/groups.md) are suppressed: no figure of them, not even their row count or
their label, appears in any output, and the gaps are taken over the
published groups only. Within a published group, a rate whose own base
(positives for the TPR, negatives for the FPR) is under the threshold is
withheld too, and no count but the group's rows is published; a group
whose positives or negatives are under it shows its accuracy only (its
other rates would give that count away), and so do the smallest others
until the groups of accuracy only hold enough of each (:func:`accuracy_only`). Because
the overall figures are printed too, the suppressed cells' sum could be
derived from them by subtraction; so when the suppressed rows add up to
fewer than the threshold, the smallest published groups are suppressed as
well until they do (complementary suppression, :func:`suppress`). A table with no group left is refused.
This protects each table on its own; tables of different groupings of the
same rows can still be differenced, which only noise (a DP release) rules
out (docs/groups.md).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np

#: The default smallest group published (``--min-group-size``).
MIN_GROUP_SIZE = 100
#: Confidence of the intervals.
CONFIDENCE = 0.95
#: The separator of a cross of two attributes (``SEX:RAC1P``).
CROSS = ":"
#: The most attributes a cross may have.
MAX_CROSS = 2
#: Per cell and model, in this order: rows, correct predictions, positives
#: (label 1), true positives, negatives (label 0), false positives, selected
#: (predicted 1).
COUNTS = ("rows", "correct", "positives", "true_positives", "negatives", "false_positives",
          "selected")
#: The rates reported per group: name -> (numerator, denominator) in COUNTS.
RATES = {"accuracy": ("correct", "rows"), "tpr": ("true_positives", "positives"),
         "fpr": ("false_positives", "negatives"), "selection_rate": ("selected", "rows")}


@dataclass(frozen=True)
class Grouping:
    """What one item of ``--by`` names: an attribute (``SEX``) or a cross (``SEX:RAC1P``)."""

    attributes: tuple[str, ...]

    @property
    def name(self) -> str:
        return CROSS.join(self.attributes)


def parse_by(text: str) -> list[Grouping]:
    """``"SEX,RAC1P,SEX:RAC1P"`` -> one :class:`Grouping` per comma-separated item.

    Raises:
        ValueError: an empty item, an attribute named twice in a cross, a
            grouping asked twice (``SEX,SEX``; ``SEX:RAC1P,RAC1P:SEX``), or a
            cross of more than :data:`MAX_CROSS` attributes.
    """
    groupings, asked = [], {}
    for item in text.split(","):
        names = tuple(n.strip().upper() for n in item.split(CROSS))
        if not all(names):
            raise ValueError(f"--by {text}: an empty attribute name; write e.g. "
                             "--by SEX,RAC1P or --by SEX:RAC1P")
        if len(names) > MAX_CROSS:
            raise ValueError(f"--by {item}: a cross of {len(names)} attributes; at most "
                             f"{MAX_CROSS} (their cells get small fast)")
        if len(set(names)) != len(names):
            twice = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"--by {item}: names {twice} twice")
        key = tuple(sorted(names))
        if key in asked:
            raise ValueError(f"--by {text}: {item.strip()} asks for the groups of "
                             f"{asked[key]} again; name each grouping once")
        asked[key] = item.strip()
        groupings.append(Grouping(names))
    return groupings


@dataclass(frozen=True)
class Cells:
    """Every cell of a grouping a file allows: the product of its attributes'
    labelled codes, in code order.

    Attributes:
        grouping: what was asked.
        codes: per cell, one code per attribute.
        labels: per cell, its label (``"Female"``; ``"Female / White alone"``).
    """

    grouping: Grouping
    codes: tuple[tuple[int, ...], ...]
    labels: tuple[str, ...]

    @classmethod
    def of(cls, grouping: Grouping, labels: dict[str, dict[int, str]]) -> "Cells":
        """The cells of ``grouping``; ``labels``: attribute -> code -> label."""
        per = [sorted(labels[name].items()) for name in grouping.attributes]
        combos = list(itertools.product(*per))
        return cls(grouping, tuple(tuple(code for code, _ in combo) for combo in combos),
                   tuple(" / ".join(text for _, text in combo) for combo in combos))

    def __len__(self) -> int:
        return len(self.codes)

    def index(self, columns: dict[str, np.ndarray]) -> np.ndarray:
        """Each row's cell (int64), -1 for a row whose code has no label;
        ``columns``: attribute -> this rank's codes."""
        names = self.grouping.attributes
        n = len(next(iter(columns.values()))) if columns else 0
        cell = np.zeros(n, dtype=np.int64)
        bad = np.zeros(n, dtype=bool)
        stride = 1
        for position in reversed(range(len(names))):
            known = np.array(sorted({c[position] for c in self.codes}), dtype=np.int64)
            values = np.asarray(columns[names[position]], dtype=np.int64)
            at = np.clip(np.searchsorted(known, values), 0, max(0, len(known) - 1))
            bad |= known[at] != values if len(known) else np.ones(n, dtype=bool)
            cell += at * stride
            stride *= len(known)
        cell[bad] = -1
        return cell


def count(cells: np.ndarray, n_cells: int, y: np.ndarray, pred: np.ndarray) -> np.ndarray:
    """int64 ``[n_cells, len(COUNTS)]``: this rank's counts per cell (rows with
    cell -1 are the caller's error to report); add them over the ranks."""
    y = np.asarray(y).astype(bool)
    pred = np.asarray(pred).astype(bool)
    columns = (np.ones_like(y), y == pred, y, y & pred, ~y, ~y & pred, pred)
    out = np.zeros((n_cells, len(COUNTS)), dtype=np.int64)
    for j, values in enumerate(columns):
        out[:, j] = np.bincount(cells, weights=values, minlength=n_cells)[:n_cells]
    return out


def discordant(cells: np.ndarray, n_cells: int, y: np.ndarray, pred_a: np.ndarray,
               pred_b: np.ndarray) -> np.ndarray:
    """int64 ``[n_cells, 2]``: rows only model A gets right, rows only B gets right."""
    a, b = np.asarray(pred_a) == np.asarray(y), np.asarray(pred_b) == np.asarray(y)
    out = np.zeros((n_cells, 2), dtype=np.int64)
    out[:, 0] = np.bincount(cells, weights=a & ~b, minlength=n_cells)[:n_cells]
    out[:, 1] = np.bincount(cells, weights=~a & b, minlength=n_cells)[:n_cells]
    return out


def interval(k: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The exact (Clopper-Pearson) interval of a proportion ``k / n`` (``n`` > 0)."""
    from scipy.stats import binomtest  # deferred: scipy is slow to import

    ci = binomtest(int(k), int(n)).proportion_ci(confidence_level=confidence, method="exact")
    return float(ci.low), float(ci.high)


def suppress(rows: np.ndarray, min_group_size: int) -> np.ndarray:
    """Which cells to publish (bool per cell): those with at least
    ``min_group_size`` rows, less the smallest of them while the suppressed
    non-empty cells hold fewer rows than the threshold together (else the
    total minus the published cells would give them away). Empty cells are
    never published (they have no figures)."""
    rows = np.asarray(rows, dtype=np.int64)
    shown = rows >= min_group_size
    hidden = int(rows[(rows > 0) & ~shown].sum())
    for cell in np.argsort(np.where(shown, rows, np.iinfo(np.int64).max), kind="stable"):
        if hidden == 0 or hidden >= min_group_size or not shown[cell]:
            break
        shown[cell] = False
        hidden += int(rows[cell])
    return shown


@dataclass
class GroupTable:
    """One grouping's published figures.

    Attributes:
        grouping: the attribute(s).
        groups: per published group: ``label``, ``codes``, ``rows`` and per
            rate in :data:`RATES` its value and ``[low, high]`` interval
            (None where its own base is under the threshold: :func:`figures`).
        possible: the cells the file's labels allow; those not in ``groups``
            are empty or suppressed (which is never said).
        gaps: over the published groups (None with fewer than two).
        min_group_size: the threshold applied.
    """

    grouping: Grouping
    groups: list[dict]
    possible: int
    gaps: dict | None
    min_group_size: int
    description: str = ""
    extra: dict = field(default_factory=dict)


def accuracy_only(counts: np.ndarray, min_group_size: int) -> np.ndarray:
    """Which of the published groups (``counts``: their rows of counts) show
    their rows and accuracy only, their TPR, FPR and selection rate withheld.

    A group whose positives or negatives are under the threshold is a small
    cell inside it, and its rates give the cell's count away: with the
    selection rate and the accuracy, positives = rows x (1 - accuracy) when
    nothing is selected, and with the FPR too, always. Withholding them is not
    enough on its own: the overall figures less the other groups' give the
    withheld groups' positives and negatives as a sum. So, as the rows are
    suppressed (:func:`suppress`), the smallest other groups lose those rates
    too while the withheld groups' positives or negatives add up to fewer than
    the threshold; then no sum a reader can form is one of a small cell.
    """
    counts = np.asarray(counts, dtype=np.int64)
    positives = counts[:, COUNTS.index("positives")]
    negatives = counts[:, COUNTS.index("negatives")]
    least = max(1, min_group_size)
    plain = (positives < least) | (negatives < least)
    if plain.any():
        for group in np.argsort(counts[:, 0], kind="stable"):
            if positives[plain].sum() >= least and negatives[plain].sum() >= least:
                break
            plain[group] = True
    return plain


def figures(counts: np.ndarray, min_group_size: int = 1,
            confidence: float = CONFIDENCE, rates: bool = True) -> dict:
    """One cell's rows and rates (with intervals), from its counts row.

    A rate is published only where its own base reaches ``min_group_size``:
    the group's rows for the accuracy and the selection rate, its positives
    for the TPR and its negatives for the FPR (a TPR over three positives is
    a figure about three people); with ``rates`` False (:func:`accuracy_only`)
    only the accuracy is. A withheld rate is None. No count but the rows is
    returned: the others are sub-cells of the group.
    """
    values = {name: int(v) for name, v in zip(COUNTS, counts)}
    out: dict = {"rows": values["rows"]}
    for rate, (num, den) in RATES.items():
        n = values[den]
        shown = n >= max(1, min_group_size) and (rates or rate == "accuracy")
        out[rate] = values[num] / n if shown else None
        out[f"{rate}_ci"] = list(interval(values[num], n, confidence)) if shown else None
    return out


def gaps(groups: list[dict]) -> dict | None:
    """The disparities fairness work reports, over ``groups`` (two or more)."""
    if len(groups) < 2:
        return None
    out: dict = {}
    for rate in RATES:
        known = [g for g in groups if g[rate] is not None]
        if len(known) < 2:
            out[f"{rate}_gap"] = None
            continue
        low = min(known, key=lambda g: g[rate])
        high = max(known, key=lambda g: g[rate])
        out[f"{rate}_gap"] = high[rate] - low[rate]
        if rate == "accuracy":
            out.update(worst_group=low["label"], worst_group_accuracy=low[rate],
                       best_group=high["label"], best_group_accuracy=high[rate])
        if rate == "selection_rate":
            out["selection_rate_ratio"] = (low[rate] / high[rate] if high[rate] > 0
                                           else None)
    return out


def table(cells: Cells, counts: np.ndarray, min_group_size: int = MIN_GROUP_SIZE,
          description: str = "") -> GroupTable:
    """The published table of one model: ``counts`` ``[len(cells), len(COUNTS)]``
    summed over every rank."""
    published = np.flatnonzero(suppress(counts[:, 0], min_group_size))
    plain = accuracy_only(counts[published], min_group_size)
    groups = [{"label": cells.labels[i], "codes": list(cells.codes[i]),
               **figures(counts[i], min_group_size, rates=not only)}
              for i, only in zip(published, plain)]
    return GroupTable(cells.grouping, groups, len(cells), gaps(groups), min_group_size,
                      description)


def compare(cells: Cells, counts_a: np.ndarray, counts_b: np.ndarray, pairs: np.ndarray,
            min_group_size: int = MIN_GROUP_SIZE, description: str = "") -> GroupTable:
    """Two models on the same rows, group by group: each model's figures
    (``a``, ``b``), the change in accuracy ``b - a`` and McNemar's exact
    p-value (two-sided, from the rows only one model gets right, ``pairs``
    of :func:`discordant`, which are not published themselves; None where
    either count is under ``min_group_size``: the p-value and the change in
    accuracy together give both counts away); ``extra``
    names the group whose accuracy falls most from A to B (``pays_most``)
    and each model's gaps. Suppression is by rows, the same for both (the
    rows are the same)."""
    from scipy.stats import binomtest  # deferred: scipy is slow to import

    published = np.flatnonzero(suppress(counts_a[:, 0], min_group_size))
    plain = accuracy_only(counts_a[published], min_group_size)  # the labels': same for B
    groups = []
    for i, only in zip(published, plain):
        a = figures(counts_a[i], min_group_size, rates=not only)
        b = figures(counts_b[i], min_group_size, rates=not only)
        only_a, only_b = int(pairs[i, 0]), int(pairs[i, 1])
        p = (None if min(only_a, only_b) < min_group_size  # cells inside the group
             else binomtest(min(only_a, only_b), only_a + only_b).pvalue)
        groups.append({"label": cells.labels[i], "codes": list(cells.codes[i]),
                       "rows": a["rows"], "a": a, "b": b,
                       "accuracy_change": b["accuracy"] - a["accuracy"],
                       "mcnemar_p": None if p is None else float(p)})
    extra: dict = {}
    if groups:
        worst = min(groups, key=lambda g: g["accuracy_change"])
        extra = {"pays_most": worst["label"], "pays_most_change": worst["accuracy_change"],
                 "gaps_a": gaps([{**g["a"], "label": g["label"]} for g in groups]),
                 "gaps_b": gaps([{**g["b"], "label": g["label"]} for g in groups])}
    return GroupTable(cells.grouping, groups, len(cells), None, min_group_size, description,
                      extra)


def as_dict(t: GroupTable) -> dict:
    """A table as JSON-ready data (only published groups: nothing of the others)."""
    out = {"by": t.grouping.name, "description": t.description,
           "min_group_size": t.min_group_size, "groups_possible": t.possible,
           "groups_shown": len(t.groups), "groups": t.groups}
    if t.gaps is not None or not t.extra:
        out["gaps"] = t.gaps
    out.update(t.extra)
    return _finite(out)


def _finite(value):
    """NaN and infinities as None (JSON has neither)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
