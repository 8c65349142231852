"""Scaling results: per-run summaries, speed-ups, cost, and the tables people read.

Pure functions on plain dicts (no MPI, no torch), shared by ``mpidp bench
scaling`` and its ``--collect`` mode for cluster sweeps. A *run* is one
launch of ``mpidp train`` at one rank count::

    {"mode": "strong" | "weak", "dp": bool, "allreduce": str, "threads": "auto" | "N",
     "ranks": int, "nodes": int, "layout": "1x2", "batch_size": B (global),
     "oversubscribed": bool, "command": str, "epochs": [per-epoch records of train]}

Definitions (the seed project's and mlbench's):

* the first epoch is reported apart (start-up: kernels compiled, buffers
  allocated, pages faulted in); *steady* epochs are the others, and their
  average / min / max time per epoch is what scaling is computed from (with
  a single epoch, that epoch is used and marked);
* speed-up = T_base / T_n, the steady time per epoch of the series' run with
  the fewest ranks over this run's; efficiency = speed-up x ranks_base /
  ranks_n. An epoch is a fixed amount of data, so in weak scaling (fixed
  batch per rank) the same ratio is the throughput gain;
* comm / compute: time in the step's all-reduce (waiting for the slowest
  rank included) over the rest of the epoch, averaged over ranks (mlbench's
  communication-computation ratio);
* time to accuracy: training seconds (sum of epoch times, evaluation
  excluded) until the first evaluation at or above the target; accuracy
  after time: the last evaluation within the budget (:mod:`engine.stopping`);
* cost: nodes x training hours x price per node-hour.
"""
from __future__ import annotations

import math
import statistics
from typing import Iterable

from engine.stopping import accuracy_after_time, time_to_accuracy

#: Fields that name a series: runs of one series differ only in ranks (and layout).
SERIES_FIELDS = ("mode", "dp", "allreduce", "threads")


def series_key(run: dict) -> tuple:
    return tuple(run.get(name) for name in SERIES_FIELDS)


def describe_series(summary: dict) -> str:
    """One line naming a series, e.g. 'strong scaling (global batch 256), DP-SGD, ...'."""
    if summary["mode"] == "weak":
        batch = f"weak scaling (batch {summary['local_batch']:g} per rank)"
    else:
        batch = f"strong scaling (global batch {summary['batch_size']})"
    threads = summary["threads"]
    threads_text = ("threads per rank = cores // ranks per node" if threads == "auto"
                    else f"{threads} thread(s) per rank")
    return (f"{batch}, {'DP-SGD' if summary['dp'] else 'non-private SGD'}, "
            f"all-reduce {summary['allreduce']}, {threads_text}")


def short_series(summary: dict) -> str:
    """A few words naming a series (for narrow tables)."""
    batch = (f"weak b={summary['local_batch']:g}/rank" if summary["mode"] == "weak"
             else f"strong B={summary['batch_size']}")
    return (f"{'DP' if summary['dp'] else 'non-DP'} {batch} {summary['allreduce']} "
            f"threads={summary['threads']}")


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(runs: list[dict], target_accuracy: float | None = None,
              time_budget: float | None = None) -> dict:
    """One summary of repeated runs of one configuration (same series and ranks).

    Steady epochs of every repeat are pooled (avg / min / max over them);
    the first epoch, accuracy, epsilon and the stopping metrics are medians
    over the repeats.

    Raises:
        ValueError: a run without epochs, or runs of different configurations.
    """
    if not runs or any(not run.get("epochs") for run in runs):
        raise ValueError("every run needs at least one epoch record")
    first = runs[0]
    if any(series_key(r) != series_key(first) or r["ranks"] != first["ranks"] for r in runs):
        raise ValueError("summarize() combines repeats of one configuration only")
    steady, firsts, comm, compute, rates = [], [], [], [], []
    accuracies, epsilons, totals, ttas, after = [], [], [], [], []
    single_epoch = False
    for run in runs:
        epochs = run["epochs"]
        firsts.append(epochs[0]["epoch_time_s"])
        rest = [e for e in epochs[1:] if not e.get("resumed_mid_epoch")]
        if not rest:
            rest, single_epoch = epochs[:1], True
        steady += [e["epoch_time_s"] for e in rest]
        comm += [e["comm_s"] for e in rest]
        compute += [e["compute_s"] for e in rest]
        rates += [e["examples_per_s"] for e in rest if e.get("examples_per_s")]
        evaluated = [e for e in epochs if e.get("test_accuracy") is not None]
        if evaluated:
            accuracies.append(evaluated[-1]["test_accuracy"])
        if epochs[-1].get("epsilon") is not None:
            epsilons.append(epochs[-1]["epsilon"])
        history = _with_train_time(epochs)
        totals.append(history[-1]["train_time_s"])
        if target_accuracy is not None:
            ttas.append(time_to_accuracy(history, target_accuracy))
        if time_budget is not None:
            after.append(accuracy_after_time(history, time_budget))
    avg_comm, avg_compute = _mean(comm), _mean(compute)
    summary = {name: first.get(name) for name in (*SERIES_FIELDS, "ranks", "nodes", "layout",
                                                  "batch_size", "oversubscribed")}
    summary.update(
        local_batch=first["batch_size"] / first["ranks"],
        threads_used=first["epochs"][-1].get("threads"),
        repeats=len(runs), epochs_run=round(_mean([len(r["epochs"]) for r in runs])),
        first_epoch_s=statistics.median(firsts),
        epoch_avg_s=_mean(steady), epoch_min_s=min(steady), epoch_max_s=max(steady),
        steady_epochs=len(steady), steady_is_first_epoch=single_epoch,
        comm_s=avg_comm, compute_s=avg_compute,
        comm_compute_ratio=(avg_comm / avg_compute if avg_compute else None),
        examples_per_s=_mean(rates),
        test_accuracy=statistics.median(accuracies) if accuracies else None,
        epsilon=statistics.median(epsilons) if epsilons else None,
        train_time_s=statistics.median(totals),
        stop_reason=runs[-1]["epochs"][-1].get("stop_reason"),
        command=first.get("command"))
    if target_accuracy is not None:
        reached = [t for t in ttas if t is not None]
        summary.update(target_accuracy=target_accuracy,
                       tta_s=statistics.median(t[0] for t in reached) if reached else None,
                       tta_epochs=statistics.median(t[1] for t in reached) if reached else None,
                       tta_reached=f"{len(reached)}/{len(ttas)}")
    if time_budget is not None:
        within = [a for a in after if a is not None]
        summary.update(time_budget=time_budget,
                       accuracy_after_time=(statistics.median(a[0] for a in within)
                                            if within else None))
    return summary


def _with_train_time(epochs: list[dict]) -> list[dict]:
    """The records with cumulative ``train_time_s`` (present in records of this
    mpidp; computed for older metrics files)."""
    if all("train_time_s" in e for e in epochs):
        return epochs
    total, out = 0.0, []
    for e in epochs:
        total += e["epoch_time_s"]
        out.append(dict(e, train_time_s=total))
    return out


def group_runs(runs: Iterable[dict]) -> list[list[dict]]:
    """Runs grouped by configuration (series and ranks and layout), in first-seen order."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault((series_key(run), run["ranks"], run.get("layout")), []).append(run)
    return list(groups.values())


def add_speedups(summaries: list[dict]) -> list[dict]:
    """Fill ``speedup``, ``efficiency`` (and ``tta_speedup``) in place, per series,
    against the series' summary with the fewest ranks (the first such one)."""
    for key in dict.fromkeys(series_key(s) for s in summaries):
        members = [s for s in summaries if series_key(s) == key]
        base = min(members, key=lambda s: s["ranks"])
        for s in members:
            s["baseline_ranks"] = base["ranks"]
            if base["epoch_avg_s"] and s["epoch_avg_s"]:
                s["speedup"] = base["epoch_avg_s"] / s["epoch_avg_s"]
                s["efficiency"] = s["speedup"] * base["ranks"] / s["ranks"]
            else:
                s["speedup"] = s["efficiency"] = None
            if base.get("tta_s") and s.get("tta_s"):
                s["tta_speedup"] = base["tta_s"] / s["tta_s"]
            elif "tta_s" in s:
                s["tta_speedup"] = None
    return summaries


def add_cost(summaries: list[dict], price_per_node_hour: float) -> list[dict]:
    """Fill ``node_hours`` and ``cost`` (of the training time of the run) and,
    with a target, ``cost_to_accuracy``, in place."""
    for s in summaries:
        nodes = s.get("nodes") or 1
        s["price_per_node_hour"] = price_per_node_hour
        s["node_hours"] = nodes * s["train_time_s"] / 3600.0
        s["cost"] = s["node_hours"] * price_per_node_hour
        if "tta_s" in s:
            s["cost_to_accuracy"] = (nodes * s["tta_s"] / 3600.0 * price_per_node_hour
                                     if s["tta_s"] is not None else None)
    return summaries


# ---------------------------------------------------------------- tables
def _cell(value, fmt: str, width: int) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-".rjust(width)
    return format(value, fmt).rjust(width)


def _columns(summaries: list[dict]) -> list[tuple[str, str, str, int]]:
    """(key, header, format, width) of the scaling table's columns."""
    cols = [("ranks_text", "ranks", "s", 6), ("layout", "layout", "s", 6),
            ("threads_used", "threads", "d", 7),
            ("first_epoch_s", "1st epoch s", ".3f", 11), ("epoch_avg_s", "avg s/epoch", ".3f", 11),
            ("epoch_min_s", "min", ".3f", 7), ("epoch_max_s", "max", ".3f", 7),
            ("speedup", "speed-up", ".2f", 8), ("efficiency", "efficiency", ".2f", 10),
            ("comm_s", "comm s", ".3f", 7), ("compute_s", "compute s", ".3f", 9),
            ("comm_compute_ratio", "comm/comp", ".3f", 9),
            ("test_accuracy", "test acc", ".4f", 8), ("epsilon", "epsilon", ".3f", 7)]
    if any("tta_s" in s for s in summaries):
        target = next(s["target_accuracy"] for s in summaries if "tta_s" in s)
        cols += [("tta_s", f"s to {target:g}", ".2f", 9), ("tta_epochs", "epochs", "g", 6),
                 ("tta_speedup", "tta speed-up", ".2f", 12)]
    if any("accuracy_after_time" in s for s in summaries):
        budget = next(s["time_budget"] for s in summaries if "accuracy_after_time" in s)
        cols.append(("accuracy_after_time", f"acc@{budget:g}s", ".4f", 9))
    return cols


def _ranks_text(s: dict) -> str:
    return f"{s['ranks']}{'*' if s.get('oversubscribed') else ''}"


def format_table(summaries: list[dict]) -> str:
    """The aligned scaling table: one block per series, a footnote for
    oversubscribed runs and for series whose speed-up base is not one rank."""
    cols = _columns(summaries)
    lines = []
    for key in dict.fromkeys(series_key(s) for s in summaries):
        members = [s for s in summaries if series_key(s) == key]
        lines.append(describe_series(members[0]))
        lines.append("  ".join(header.rjust(width) for _, header, _, width in cols))
        for s in members:
            row = dict(s, ranks_text=_ranks_text(s), layout=s.get("layout") or "-")
            lines.append("  ".join(_cell(row.get(k), fmt, width) for k, _, fmt, width in cols))
        if members[0].get("baseline_ranks", 1) != 1:
            lines.append(f"(speed-up relative to {members[0]['baseline_ranks']} ranks)")
        lines.append("")
    notes = []
    if any(s.get("oversubscribed") for s in summaries):
        notes.append("* oversubscribed: more ranks x threads than cores; waiting ranks "
                     "compete with computing ones, so these rows measure contention, not "
                     "scaling")
    if any(s.get("steady_is_first_epoch") for s in summaries):
        notes.append("runs of one epoch: avg/min/max are that first epoch (no steady state)")
    notes.append("1st epoch: start-up included (kernels compiled, buffers allocated); "
                 "avg/min/max and everything right of them: the other epochs; times "
                 "exclude evaluation")
    return "\n".join(lines + notes)


def format_cost_table(summaries: list[dict]) -> str:
    """The money table (the seed's): nodes x training hours x price per node-hour."""
    price = summaries[0]["price_per_node_hour"]
    with_tta = any("cost_to_accuracy" in s for s in summaries)
    head = (f"{'series':<40} {'ranks':>6} {'layout':>6} {'train s':>9} {'node-hours':>10} "
            f"{'cost':>10}" + (f" {'cost to acc':>11}" if with_tta else ""))
    lines = [f"cost at {price:g} per node-hour (training time of each run: "
             f"{summaries[0]['epochs_run']} epochs or until it stopped)", head]
    for s in summaries:
        line = (f"{short_series(s):<40} {_ranks_text(s):>6} {s.get('layout') or '-':>6} "
                f"{s['train_time_s']:>9.2f} {s['node_hours']:>10.5f} {s['cost']:>10.5f}")
        if with_tta:
            line += " " + _cell(s.get("cost_to_accuracy"), ".5f", 11)
        lines.append(line)
    return "\n".join(lines)


def markdown_table(summaries: list[dict]) -> str:
    """The same results as a markdown table (for docs/results.md)."""
    cols = [c for c in _columns(summaries) if c[0] not in ("layout",)]
    lines = ["| series | " + " | ".join(h for _, h, _, _ in cols) + " |",
             "|---|" + "---:|" * len(cols)]
    for s in summaries:
        row = dict(s, ranks_text=_ranks_text(s))
        cells = [_cell(row.get(k), fmt, 0).strip() for k, _, fmt, _ in cols]
        lines.append(f"| {describe_series(s)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
