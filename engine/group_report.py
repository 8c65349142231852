"""The terminal table of ``mpidp eval --by``: one block per grouping.

Renders :class:`engine.groups.GroupTable` (one model) and the tables of
:func:`engine.groups.compare` (two models on the same rows) as text. Only
the published groups are in a table (:mod:`engine.groups` decides which);
the header says how many of the possible groups are shown, never which
were left out or why one was.
"""
from __future__ import annotations

from engine.groups import GroupTable

#: Characters of a group's label shown in the table (the JSON has it whole).
LABEL_WIDTH = 36


def _label(text: str) -> str:
    return text if len(text) <= LABEL_WIDTH else text[:LABEL_WIDTH - 3] + "..."


def _rate(value: float | None, ci: list | None) -> str:
    if value is None:
        return f"{'-':<24}"
    return f"{value:.4f} [{ci[0]:.4f}, {ci[1]:.4f}]"


def _shown(t: GroupTable) -> str:
    return (f"{len(t.groups)} of {t.possible} groups shown (the others have fewer than "
            f"{t.min_group_size:,} rows, or none, or are withheld so that the total cannot "
            "reveal them)")


def _gaps(g: dict | None) -> str:
    if g is None:
        return "  gaps: fewer than two groups shown"
    parts = []
    names = {"accuracy_gap": "accuracy", "tpr_gap": "TPR", "fpr_gap": "FPR",
             "selection_rate_gap": "selection rate"}
    for key, name in names.items():
        if g.get(key) is not None:
            parts.append(f"{name} {g[key]:.4f}")
    ratio = g.get("selection_rate_ratio")
    worst = (f"; worst group {g['worst_group']} ({g['worst_group_accuracy']:.4f})"
             if g.get("worst_group") is not None else "")
    return ("  gaps (largest - smallest): " + ", ".join(parts)
            + (f"; selection-rate ratio (smallest / largest) {ratio:.3f}"
               if ratio is not None else "") + worst)


def table_text(t: GroupTable, where: str) -> list[str]:
    """One model's block: header, one line per published group, the gaps."""
    lines = [f"by {t.grouping.name} ({t.description}), {where}: {_shown(t)}",
             f"  {'group':<{LABEL_WIDTH}} {'rows':>9}  {'accuracy [95% CI]':<24}  "
             f"{'TPR [95% CI]':<24}  {'FPR [95% CI]':<24}  {'selection rate [95% CI]':<24}"]
    for g in t.groups:
        lines.append(f"  {_label(g['label']):<{LABEL_WIDTH}} {g['rows']:>9,}  "
                     f"{_rate(g['accuracy'], g['accuracy_ci'])}  {_rate(g['tpr'], g['tpr_ci'])}"
                     f"  {_rate(g['fpr'], g['fpr_ci'])}  "
                     f"{_rate(g['selection_rate'], g['selection_rate_ci'])}")
    lines.append(_gaps(t.gaps))
    return lines


def _largest_fall(label, change: float, privacy_cost: bool) -> str:
    """The line naming the group whose accuracy falls most from A to B, or, when
    none falls, that none does (and the smallest change)."""
    points = f"{100 * change:+.2f} points"
    if change < 0:
        what = "pays most for privacy" if privacy_cost else "falls most from A to B"
        return f"{what}: {label} ({points})"
    none = "no group pays for privacy" if privacy_cost else "no group falls from A to B"
    return f"{none}: every group gains or keeps its accuracy (least {label}, {points})"


def comparison_text(t: GroupTable, where: str, names: tuple[str, str],
                    privacy_cost: bool) -> list[str]:
    """Two models' block: per group each accuracy, the change and McNemar's p.

    ``privacy_cost``: A is non-private and B private, so a fall is what the
    group pays for privacy (said so).
    """
    lines = [f"by {t.grouping.name} ({t.description}), {where}: A = {names[0]}, "
             f"B = {names[1]}; {_shown(t)}",
             f"  {'group':<{LABEL_WIDTH}} {'rows':>9}  {'accuracy A [95% CI]':<24}  "
             f"{'accuracy B [95% CI]':<24}  {'B - A (points)':>14}  {'McNemar p':>9}"]
    for g in t.groups:
        a, b = g["a"], g["b"]
        lines.append(f"  {_label(g['label']):<{LABEL_WIDTH}} {g['rows']:>9,}  "
                     f"{_rate(a['accuracy'], a['accuracy_ci'])}  "
                     f"{_rate(b['accuracy'], b['accuracy_ci'])}  "
                     f"{100 * g['accuracy_change']:>+14.2f}  "
                     + (f"{g['mcnemar_p']:>9.3g}" if g["mcnemar_p"] is not None
                        else f"{'-':>9}"))
    if t.extra:
        lines.append("  " + _largest_fall(t.extra["pays_most"], t.extra["pays_most_change"],
                                          privacy_cost))
        for key, name in (("gaps_a", "A"), ("gaps_b", "B")):
            lines.append(_gaps(t.extra[key]).replace("  gaps", f"  {name}'s gaps", 1))
    return lines
