"""The scaling figures: speed-up (with the ideal line), time per epoch, comm/compute;
and the data-parallel sweep's (:func:`plot_sweep`).

One PNG, one line per series (:func:`engine.bench.scaling_report.series_key`),
named in a legend below the panels; oversubscribed points are drawn hollow.
With a target accuracy, a fourth panel shows the time to accuracy against
the number of ranks (mlbench's task 2a figure).
"""
from __future__ import annotations

import textwrap

from engine.bench.scaling_report import describe_series, series_key

#: Characters per line of a series' name in the legend of :func:`plot`.
LEGEND_WIDTH = 72


def plot(summaries: list[dict], path: str, title: str) -> None:
    """Write the figure to ``path`` (PNG; matplotlib with the Agg back-end)."""
    import matplotlib  # deferred: only --plot needs matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_tta = any(s.get("tta_s") for s in summaries)
    panels = 4 if with_tta else 3
    keys = list(dict.fromkeys(series_key(s) for s in summaries))
    # The legend below the panels, in constrained layout (the figure grows by its
    # rows): series names are long, and a legend inside the first panel ran over
    # the second panel's label.
    columns = max(1, min(len(keys) + 1, panels - 1))  # the series and "ideal"
    legend_rows = -(-(len(keys) + 1) // columns)
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.9 + 0.35 * legend_rows),
                             layout="constrained")
    speed, times, ratio = axes[0], axes[1], axes[2]
    all_ranks = sorted({s["ranks"] for s in summaries})
    speed.plot(all_ranks, [r / all_ranks[0] for r in all_ranks], color="grey",
               linestyle=":", label="ideal")
    for key in keys:
        members = sorted((s for s in summaries if series_key(s) == key),
                         key=lambda s: s["ranks"])
        label = textwrap.fill(describe_series(members[0]), LEGEND_WIDTH)
        x = [s["ranks"] for s in members]
        line = speed.plot(x, [s.get("speedup") for s in members], marker="o", label=label)[0]
        color = line.get_color()
        avg = [s["epoch_avg_s"] for s in members]
        err = [[a - s["epoch_min_s"] for a, s in zip(avg, members)],
               [s["epoch_max_s"] - a for a, s in zip(avg, members)]]
        times.errorbar(x, avg, yerr=err, marker="o", color=color, capsize=3)
        ratio.plot(x, [s.get("comm_compute_ratio") for s in members], marker="o", color=color)
        if with_tta:
            axes[3].plot(x, [s.get("tta_s") for s in members], marker="o", color=color)
        for s in members:  # oversubscribed: hollow marker over the filled one
            if s.get("oversubscribed"):
                marks = [(speed, s.get("speedup")), (times, s["epoch_avg_s"]),
                         (ratio, s.get("comm_compute_ratio"))]
                if with_tta:
                    marks.append((axes[3], s.get("tta_s")))
                for ax, y in marks:
                    if y is not None:
                        ax.plot([s["ranks"]], [y], marker="o", markersize=11,
                                markerfacecolor="white", markeredgecolor=color)
    speed.set_ylabel("speed-up T_base / T_n (steady epochs)")
    times.set_ylabel("time per epoch, s (avg, min-max)")
    ratio.set_ylabel("communication / computation")
    if with_tta:
        target = next(s["target_accuracy"] for s in summaries if "target_accuracy" in s)
        axes[3].set_ylabel(f"training seconds to test accuracy {target:g}")
    for ax in axes:
        ax.set_xlabel("ranks" + (" (hollow: oversubscribed)"
                                 if any(s.get("oversubscribed") for s in summaries) else ""))
        ax.set_xticks(all_ranks)
        ax.grid(True, alpha=0.3)
    times.set_ylim(bottom=0)
    ratio.set_ylim(bottom=0)
    handles, labels = speed.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", fontsize=7, ncol=columns)
    _save(fig, path, title)


def plot_sweep(summaries: list[dict], path: str, title: str) -> None:
    """The data-parallel sweep's figure (``--preset dp-sweep``): one row of panels
    per privacy mode; against the ranks, steady (second-epoch) examples/s, the
    first-epoch overhead, and mpidp's examples/s over its peer's (when the peers
    ran). One colour per model and batch, one line style per data repeat; the
    peers' examples/s dashed and hollow in the first panel."""
    import matplotlib  # deferred: only --plot needs matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from engine.bench.scaling_report import is_mpidp, peer_column

    modes = [dp for dp in (False, True) if any(bool(s["dp"]) == dp for s in summaries)]
    peers = any(s.get("vs_peer") for s in summaries)
    panels = 3 if peers else 2
    fig, axes = plt.subplots(len(modes), panels, figsize=(4.4 * panels, 3.6 * len(modes)),
                             squeeze=False)
    all_ranks = sorted({s["ranks"] for s in summaries})
    combos = list(dict.fromkeys((s.get("model"), s.get("grid_batch")) for s in summaries))
    colours = {c: f"C{i % 10}" for i, c in enumerate(combos)}
    repeats = sorted({s.get("data_repeat") or 1 for s in summaries})
    styles = {r: ("-", "--", ":", "-.")[i % 4] for i, r in enumerate(repeats)}
    for row, dp in zip(axes, modes):
        rate, overhead = row[0], row[1]
        for (model, batch) in combos:
            for repeat in repeats:
                def series(mine: bool) -> list[dict]:
                    return sorted((s for s in summaries if bool(s["dp"]) == dp
                                   and (s.get("model"), s.get("grid_batch")) == (model, batch)
                                   and (s.get("data_repeat") or 1) == repeat
                                   and is_mpidp(s) == mine), key=lambda s: s["ranks"])
                members, others = series(True), series(False)
                if not members:
                    continue
                colour, style = colours[(model, batch)], styles[repeat]
                label = f"{model} B={batch} x{repeat}"
                x = [s["ranks"] for s in members]
                rate.plot(x, [s.get("examples_per_s") for s in members], marker="o",
                          color=colour, linestyle=style, label=label)
                if others:
                    rate.plot([s["ranks"] for s in others],
                              [s.get("examples_per_s") for s in others], marker="o",
                              markerfacecolor="white", color=colour, linestyle=style,
                              alpha=0.6)
                overhead.plot(x, [s.get("first_epoch_overhead_s") for s in members],
                              marker="o", color=colour, linestyle=style)
                if peers:
                    row[2].plot(x, [s.get("vs_peer") for s in members], marker="o",
                                color=colour, linestyle=style)
        what = "DP-SGD" if dp else "non-private"
        rate.set_ylabel(f"{what}: examples/s, 2nd epoch\n(hollow: peer)")
        overhead.set_ylabel(f"{what}: 1st - 2nd epoch, s")
        if peers:
            row[2].set_ylabel(f"{what}: {peer_column(dp)} (examples/s)")
            row[2].axhline(1.0, color="grey", linestyle=":")
        for ax in row:
            ax.set_xlabel("ranks")
            ax.set_xticks(all_ranks)
            ax.grid(True, alpha=0.3)
        rate.set_ylim(bottom=0)
        rate.legend(fontsize=6, loc="best")
    _save(fig, path, title)


def _save(fig, path: str, title: str) -> None:
    """Title, lay out (tight, unless the figure has a layout engine of its own),
    write (80 dpi) and close a figure."""
    import matplotlib.pyplot as plt

    fig.suptitle(title, fontsize=9)
    if fig.get_layout_engine() is None:
        fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
