"""The chart of ``mpidp eval --by --plot FILE``: accuracy per group, with intervals.

One panel per grouping, one horizontal bar per published group (the
accuracy, its exact 95% interval as an error bar, the overall accuracy as a
line); with two models, two bars per group (A and B). Only the groups of
the tables are drawn (:mod:`engine.groups` has already left out the small
ones), and nothing else is written on the chart. PNG, or SVG (text kept as
text, so a test can search it) by the file's extension.
"""
from __future__ import annotations

import io

from engine.groups import GroupTable
from engine.outputs import replace_file

#: Extensions --plot accepts.
FORMATS = (".png", ".svg")


def plot(tables: list[GroupTable], path: str, overall: list[float], names: list[str],
         title: str) -> None:
    """Write the chart to ``path``, atomically (:func:`engine.outputs.replace_file`).

    Args:
        tables: one per grouping; comparison tables when ``names`` has two entries.
        overall: each model's accuracy over every row (a vertical line each).
        names: the models' names (one, or A and B).

    Raises:
        WriteFailed: the file cannot be written (an old one is left intact).
    """
    import matplotlib  # deferred: matplotlib is slow to import

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heights = [max(1, len(t.groups)) * (0.35 + 0.25 * (len(names) - 1)) + 1.2 for t in tables]
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "mpidp"}):
        fig, axes = plt.subplots(len(tables), 1, figsize=(9, sum(heights) + 0.6),
                                 gridspec_kw={"height_ratios": heights}, squeeze=False)
        colours = ("tab:blue", "tab:orange")
        for ax, t in zip(axes[:, 0], tables):
            labels = [g["label"] if len(g["label"]) <= 40 else g["label"][:37] + "..."
                      for g in t.groups]
            per = [[g] for g in t.groups] if len(names) == 1 else \
                [[g["a"], g["b"]] for g in t.groups]
            width = 0.8 / len(names)
            for m, name in enumerate(names):
                ys = [i + (m - (len(names) - 1) / 2) * width for i in range(len(t.groups))]
                acc = [p[m]["accuracy"] for p in per]
                low = [a - p[m]["accuracy_ci"][0] for a, p in zip(acc, per)]
                high = [p[m]["accuracy_ci"][1] - a for a, p in zip(acc, per)]
                ax.barh(ys, acc, height=width, xerr=[low, high], color=colours[m],
                        label=name, capsize=2)
                ax.axvline(overall[m], color=colours[m], linestyle="--", linewidth=1)
            ax.set_yticks(range(len(t.groups)), labels)
            ax.invert_yaxis()
            lows = [p[m]["accuracy_ci"][0] for p in per for m in range(len(names))] or [0.0]
            ax.set_xlim(max(0.0, min(lows + overall) - 0.05), 1.0)
            ax.set_xlabel("accuracy (bars: 95% exact intervals; dashed: all rows)")
            ax.set_title(f"by {t.grouping.name}: groups of at least {t.min_group_size} rows",
                         fontsize=10)
            if len(names) > 1:
                ax.legend(fontsize=8, loc="lower right")
        # the title 0.1 inch from the top and the panels 0.3 inch below the top
        # (matplotlib puts it at 98% of the height: 2 inches down, on the first
        # panel, in a chart of many groups; tight_layout leaves it out)
        inches = sum(heights) + 0.6
        fig.suptitle(title, fontsize=10, y=1 - 0.1 / inches, va="top")
        fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / inches))
        kind = path.rsplit(".", 1)[-1].lower()
        data = io.BytesIO()
        fig.savefig(data, format=kind, dpi=110,
                    metadata={"Date": None} if kind == "svg" else None)
        plt.close(fig)
    replace_file(path, data.getvalue(), lambda reason: f"--plot {path}: cannot write it: "
                 f"{reason}")
