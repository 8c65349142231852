"""Scaling results: per-run summaries, speed-ups, cost, and the tables people read.

Pure functions on plain dicts (no MPI, no torch), shared by ``mpidp bench
scaling`` and its ``--collect`` mode for cluster sweeps. A *run* is one
launch of ``mpidp train`` at one rank count::

    {"mode": "strong" | "weak", "dp": bool, "allreduce": str, "threads": "auto" | "N",
     "ranks": int, "nodes": int, "layout": "1x2", "batch_size": B (global),
     "oversubscribed": bool, "command": str, "epochs": [per-epoch records of train]}

and, from the image presets and the peers, ``"model"``, ``"grid_batch"`` (the
grid's batch: global for strong scaling, per rank for weak), ``"data_repeat"``
and ``"impl"`` (``mpidp``, or the peer ``torch-ddp`` / ``opacus-ddp`` of
:mod:`engine.bench.ddp_baseline`, whose records have the same schema; a
peer's ``comm_s`` may be null: DDP overlaps its all-reduce with the backward
pass).

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
  both on the validation accuracy in runs on a file with a ``/val`` split
  (what training stops on), else on the test accuracy;
* cost: nodes x training hours x price per node-hour;
* first-epoch overhead: the first epoch's time minus the steady epochs'
  average (start-up paid once); examples/s of the first epoch and of the
  steady ones apart;
* mpidp / peer: mpidp's examples/s over its peer's (the same configuration
  in PyTorch DDP, or Opacus' distributed DP-SGD for DP runs), steady epochs.
"""
from __future__ import annotations

import math
import statistics
from typing import Iterable

from engine.stopping import accuracy_after_time, monitored_accuracy, time_to_accuracy

#: Fields that name a series: runs of one series differ only in ranks (and layout).
#: The last four are absent (None) from the tabular presets' and older runs.
SERIES_FIELDS = ("mode", "dp", "allreduce", "threads", "model", "grid_batch", "data_repeat",
                 "impl")
#: How the tables name each implementation.
IMPL_NAMES = {"mpidp": "mpidp", "torch-ddp": "DDP", "opacus-ddp": "Opacus-DDP"}
#: What each peer is, in a series' title.
IMPL_TITLES = {"torch-ddp": "PyTorch DistributedDataParallel",
               "opacus-ddp": "Opacus distributed DP-SGD"}


def is_mpidp(run: dict) -> bool:
    """Whether a run (or summary) is mpidp's own (not a peer's)."""
    return run.get("impl") in (None, "mpidp")


def series_key(run: dict) -> tuple:
    return tuple(run.get(name) for name in SERIES_FIELDS)


def describe_series(summary: dict) -> str:
    """One line naming a series, e.g. 'strong scaling (global batch 256), DP-SGD, ...'."""
    if summary["mode"] == "weak":
        batch = f"weak scaling (batch {summary['local_batch']:g} per rank)"
    else:
        batch = f"strong scaling (global batch {summary['batch_size']})"
    threads = summary["threads"]
    threads_text = ("threads per rank as mpidp train chooses (cores // ranks per node "
                    "unless bound)" if threads == "auto" else f"{threads} thread(s) per rank")
    head = ""
    if summary.get("model"):
        head = f"{summary['model']}, "
        if (summary.get("data_repeat") or 1) > 1:
            head += f"training rows x{summary['data_repeat']}, "
    if not is_mpidp(summary):
        return (f"peer: {IMPL_TITLES.get(summary['impl'], summary['impl'])}: {head}{batch}, "
                f"{'DP-SGD' if summary['dp'] else 'non-private SGD'}, {threads_text}")
    return (f"{head}{batch}, {'DP-SGD' if summary['dp'] else 'non-private SGD'}, "
            f"all-reduce {summary['allreduce']}, {threads_text}")


def short_series(summary: dict) -> str:
    """A few words naming a series (for narrow tables)."""
    batch = (f"weak b={summary['local_batch']:g}/rank" if summary["mode"] == "weak"
             else f"strong B={summary['batch_size']}")
    head = f"{summary['model']} " if summary.get("model") else ""
    if (summary.get("data_repeat") or 1) > 1:
        head += f"x{summary['data_repeat']} "
    impl = "" if is_mpidp(summary) else f"{IMPL_NAMES.get(summary['impl'], summary['impl'])} "
    return (f"{impl}{head}{'DP' if summary['dp'] else 'non-DP'} {batch} "
            f"{summary['allreduce']} threads={summary['threads']}")


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
    steady, firsts, comm, compute, rates, first_rates = [], [], [], [], [], []
    accuracies, epsilons, totals, ttas, after = [], [], [], [], []
    single_epoch = False
    for run in runs:
        epochs = run["epochs"]
        firsts.append(epochs[0]["epoch_time_s"])
        rest = [e for e in epochs[1:] if not e.get("resumed_mid_epoch")]
        if not rest:
            rest, single_epoch = epochs[:1], True
        steady += [e["epoch_time_s"] for e in rest]
        comm += [e["comm_s"] for e in rest if e.get("comm_s") is not None]
        compute += [e["compute_s"] for e in rest if e.get("compute_s") is not None]
        rates += [e["examples_per_s"] for e in rest if e.get("examples_per_s")]
        if epochs[0].get("examples_per_s"):
            first_rates.append(epochs[0]["examples_per_s"])
        evaluated = [e for e in epochs if e.get("test_accuracy") is not None]
        if evaluated:
            accuracies.append(evaluated[-1]["test_accuracy"])
        if epochs[-1].get("epsilon") is not None:
            epsilons.append(epochs[-1]["epsilon"])
        history = _monitored(_with_train_time(epochs))
        totals.append(history[-1]["train_time_s"])
        if target_accuracy is not None:
            ttas.append(time_to_accuracy(history, target_accuracy))
        if time_budget is not None:
            after.append(accuracy_after_time(history, time_budget))
    avg_comm, avg_compute = _mean(comm), _mean(compute)
    summary = {name: first.get(name) for name in (*SERIES_FIELDS, "ranks", "nodes", "layout",
                                                  "batch_size", "oversubscribed")}
    first_epoch, steady_avg = statistics.median(firsts), _mean(steady)
    summary.update(
        local_batch=first["batch_size"] / first["ranks"],
        threads_used=first["epochs"][-1].get("threads"),
        repeats=len(runs), epochs_run=round(_mean([len(r["epochs"]) for r in runs])),
        first_epoch_s=first_epoch,
        epoch_avg_s=steady_avg, epoch_min_s=min(steady), epoch_max_s=max(steady),
        first_epoch_overhead_s=None if single_epoch else first_epoch - steady_avg,
        first_examples_per_s=statistics.median(first_rates) if first_rates else None,
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


def _monitored(epochs: list[dict]) -> list[dict]:
    """The records as the stopping metrics read them: in a run that scores a
    validation split every epoch (and the test split once, at the end), the
    accuracy is the validation accuracy, the one training stopped on
    (:func:`engine.stopping.monitored_accuracy`)."""
    if not any("val_accuracy" in e for e in epochs):
        return epochs
    return [dict(e, test_accuracy=monitored_accuracy(e)) for e in epochs]


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


def add_peers(summaries: list[dict]) -> list[dict]:
    """Give each mpidp summary its peer's figures, in place: ``peer`` (the peer's
    impl), ``peer_examples_per_s``, ``peer_first_epoch_s``, ``peer_epoch_avg_s``
    and ``vs_peer`` = mpidp's examples/s over the peer's (steady epochs); None
    where the peer did not run. The peer is the summary of the same series
    (all but ``impl``), ranks and layout whose impl is the peer of its privacy
    mode: torch-ddp for non-private runs, opacus-ddp for DP ones."""
    def key(s: dict) -> tuple:
        return (tuple(s.get(f) for f in SERIES_FIELDS if f != "impl"), s["ranks"],
                s.get("layout"))

    peers = {(key(s), s["impl"]): s for s in summaries if not is_mpidp(s)}
    if not peers:
        return summaries
    for s in summaries:
        if not is_mpidp(s):
            continue
        impl = "opacus-ddp" if s["dp"] else "torch-ddp"
        peer = peers.get((key(s), impl))
        mine, theirs = s.get("examples_per_s"), peer and peer.get("examples_per_s")
        s.update(peer=impl, peer_examples_per_s=theirs,
                 peer_first_epoch_s=peer["first_epoch_s"] if peer else None,
                 peer_epoch_avg_s=peer["epoch_avg_s"] if peer else None,
                 vs_peer=mine / theirs if mine and theirs else None)
    return summaries


def peer_column(dp: bool) -> str:
    """The header of the mpidp / peer ratio for DP or non-private rows."""
    return f"mpidp / {IMPL_NAMES['opacus-ddp' if dp else 'torch-ddp']}"


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


def _columns(summaries: list[dict], block: list[dict] | None = None
             ) -> list[tuple[str, str, str, int]]:
    """(key, header, format, width) of the scaling table's columns (the columns of
    the peers' figures when any summary has them; their header names the peer
    of ``block``'s privacy mode)."""
    cols = [("ranks_text", "ranks", "s", 6), ("layout", "layout", "s", 6),
            ("threads_used", "threads", "d", 7),
            ("first_epoch_s", "1st epoch s", ".3f", 11), ("epoch_avg_s", "avg s/epoch", ".3f", 11),
            ("epoch_min_s", "min", ".3f", 7), ("epoch_max_s", "max", ".3f", 7),
            ("speedup", "speed-up", ".2f", 8), ("efficiency", "efficiency", ".2f", 10),
            ("comm_s", "comm s", ".3f", 7), ("compute_s", "compute s", ".3f", 9),
            ("comm_compute_ratio", "comm/comp", ".3f", 9),
            ("test_accuracy", "test acc", ".4f", 8), ("epsilon", "epsilon", ".3f", 7)]
    if any("vs_peer" in s for s in summaries):
        dp = bool((block or summaries)[0]["dp"])
        peer = IMPL_NAMES["opacus-ddp" if dp else "torch-ddp"]
        cols.append(("examples_per_s", "ex/s", ".0f", 8))
        if block is None or is_mpidp(block[0]):  # a peer's own block has no peer
            cols += [("peer_examples_per_s", f"{peer} ex/s", ".0f", max(8, len(peer) + 5)),
                     ("vs_peer", peer_column(dp), ".2f", len(peer_column(dp)))]
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
    lines = []
    for key in dict.fromkeys(series_key(s) for s in summaries):
        members = [s for s in summaries if series_key(s) == key]
        cols = _columns(summaries, members)
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
    if any("vs_peer" in s for s in summaries):
        notes.append(PEER_NOTE)
    return "\n".join(lines + notes)


#: The footnote of tables with the peers' columns.
PEER_NOTE = ("mpidp / DDP, mpidp / Opacus-DDP: mpidp's examples/s over its peer's on the "
             "same configuration (PyTorch DistributedDataParallel for non-private runs, "
             "Opacus' distributed DP-SGD for DP ones), steady epochs; peers' rows: "
             "python -m engine.bench.ddp_baseline (comm s: Opacus' all-reduce; DDP overlaps "
             "its own with the backward pass, not measured)")


def _sweep_columns(dp: bool, peers: bool) -> list[tuple[str, str, str, int]]:
    cols = [("impl_name", "impl", "s", 10), ("model", "model", "s", 11),
            ("grid_batch", "batch", "d", 5), ("repeat_text", "data", "s", 4),
            ("ranks_text", "ranks", "s", 5), ("threads_used", "threads", "d", 7),
            ("first_epoch_s", "1st epoch s", ".3f", 11), ("epoch_avg_s", "2nd epoch s", ".3f", 11),
            ("first_epoch_overhead_s", "overhead s", ".3f", 10),
            ("first_examples_per_s", "1st ex/s", ".0f", 8),
            ("examples_per_s", "2nd ex/s", ".0f", 8), ("speedup", "speed-up", ".2f", 8),
            ("test_accuracy", "test acc", ".4f", 8), ("epsilon", "epsilon", ".3f", 7)]
    if peers:
        peer = IMPL_NAMES["opacus-ddp" if dp else "torch-ddp"]
        cols += [("peer_examples_per_s", f"{peer} ex/s", ".0f", max(8, len(peer) + 5)),
                 ("vs_peer", peer_column(dp), ".2f", len(peer_column(dp)))]
    return cols


def format_sweep_table(summaries: list[dict]) -> str:
    """The data-parallel sweep's table (``--preset dp-sweep``): one block per
    privacy mode, one row per model, batch, data repeat, implementation and
    rank count, the first and the second (steady) epoch apart, the speed-up
    over the fewest ranks, and on mpidp's rows the peer's examples/s and the
    ratio."""
    peers = any("vs_peer" in s for s in summaries)
    lines = []
    for dp in (False, True):
        block = [s for s in summaries if bool(s["dp"]) == dp]
        if not block:
            continue
        block.sort(key=lambda s: (str(s.get("model")), s.get("grid_batch") or 0,
                                  s.get("data_repeat") or 1, not is_mpidp(s), s["ranks"]))
        cols = _sweep_columns(dp, peers)
        lines.append(f"{'DP-SGD' if dp else 'non-private SGD'}, strong scaling (global "
                     "batch), speed-up over the fewest ranks of each row's series"
                     + (f"; peer: {IMPL_TITLES['opacus-ddp' if dp else 'torch-ddp']}"
                        if peers else ""))
        lines.append("  ".join(header.rjust(width) for _, header, _, width in cols))
        for s in block:
            impl = s.get("impl") or "mpidp"
            row = dict(s, ranks_text=_ranks_text(s), impl_name=IMPL_NAMES.get(impl, impl),
                       repeat_text=f"x{s.get('data_repeat') or 1}")
            lines.append("  ".join(_cell(row.get(k), fmt, width) for k, _, fmt, width in cols))
        lines.append("")
    notes = ["1st epoch: start-up included (kernels compiled, buffers allocated); 2nd: the "
             "steady epochs (the second when a run has two); overhead = 1st - 2nd; data xR: "
             "the training rows repeated R times; times exclude evaluation"]
    if any(s.get("oversubscribed") for s in summaries):
        notes.append("* oversubscribed: more ranks x threads than cores")
    if any(s.get("steady_is_first_epoch") for s in summaries):
        notes.append("runs of one epoch: the 2nd-epoch columns repeat the first, and there "
                     "is no overhead")
    if peers:
        notes.append(PEER_NOTE)
    return "\n".join(lines + notes)


def format_cost_table(summaries: list[dict]) -> str:
    """The money table (the seed's): nodes x training hours x price per node-hour."""
    price = summaries[0]["price_per_node_hour"]
    with_tta = any("cost_to_accuracy" in s for s in summaries)
    width = max([40] + [len(short_series(s)) for s in summaries])
    head = (f"{'series':<{width}} {'ranks':>6} {'layout':>6} {'train s':>9} {'node-hours':>10} "
            f"{'cost':>10}" + (f" {'cost to acc':>11}" if with_tta else ""))
    lines = [f"cost at {price:g} per node-hour (training time of each run: "
             f"{summaries[0]['epochs_run']} epochs or until it stopped)", head]
    for s in summaries:
        line = (f"{short_series(s):<{width}} {_ranks_text(s):>6} {s.get('layout') or '-':>6} "
                f"{s['train_time_s']:>9.2f} {s['node_hours']:>10.5f} {s['cost']:>10.5f}")
        if with_tta:
            line += " " + _cell(s.get("cost_to_accuracy"), ".5f", 11)
        lines.append(line)
    return "\n".join(lines)


def markdown_table(summaries: list[dict]) -> str:
    """The same results as a markdown table (for a page of docs/results/)."""
    cols = [c for c in _columns(summaries) if c[0] not in ("layout",)]
    if any("vs_peer" in s for s in summaries):
        cols = [c if c[0] != "vs_peer" else ("vs_peer", "mpidp / peer", c[2], c[3])
                for c in cols]
        cols = [c if c[0] != "peer_examples_per_s" else (c[0], "peer ex/s", c[2], c[3])
                for c in cols]
    lines = ["| series | " + " | ".join(h for _, h, _, _ in cols) + " |",
             "|---|" + "---:|" * len(cols)]
    for s in summaries:
        row = dict(s, ranks_text=_ranks_text(s))
        cells = [_cell(row.get(k), fmt, 0).strip() for k, _, fmt, _ in cols]
        lines.append(f"| {describe_series(s)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
