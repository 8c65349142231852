"""What ``mpidp bench allreduce`` prints: the table row, the footers, the plot, the summary.

Everything here reads records (:func:`collectives.bench.measure.measure`)
and measures nothing: :func:`summarize` turns the ``--json`` files of
several runs into one markdown table of medians of per-round ratios.
"""
from __future__ import annotations

import statistics
import textwrap
from typing import Any

from collectives.bench.errors import BenchUsageError
from collectives.bench.measure import paired_speedup
from collectives.describe import format_size

#: What :func:`summarize` reads of every record, with the JSON types it needs.
RECORD_FIELDS: dict[str, tuple[type, ...]] = {
    "algorithm": (str,), "runs": (str,), "bytes": (int,), "dtype": (str,), "op": (str,),
    "ranks": (int,), "avg_us": (int, float), "busbw_gbps": (int, float), "rounds_us": (list,)}
#: What runs summarized together must share: the table's caption states it once.
ALIKE = ("ranks", "dtype", "op", "placement", "oversubscribed")


def slow_spell(record: dict, min_xcore: float | None) -> bool:
    """Whether ``record`` was measured while the core-to-core copy bandwidth,
    before or after its size, was below ``min_xcore`` GB/s."""
    xcore = record.get("xcore_gbps")
    return min_xcore is not None and xcore is not None and min(xcore) < min_xcore


def fast_spell(record: dict, max_xcore: float | None) -> bool:
    """Whether ``record`` was not measured wholly below ``max_xcore`` GB/s core to
    core (before and after its size; not measured counts as not below)."""
    xcore = record.get("xcore_gbps")
    return max_xcore is not None and (xcore is None or max(xcore) >= max_xcore)


def record_problem(run: Any) -> str | None:
    """What makes ``run`` (one ``--json`` file's content) no ``mpidp bench
    allreduce`` run :func:`summarize` can read, or None."""
    if not isinstance(run, list):
        return f"holds a JSON {type(run).__name__}, not a list of records"
    if not run:
        return "holds no records (a run that measured nothing)"
    for k, record in enumerate(run):
        if not isinstance(record, dict):
            return f"record {k} is a JSON {type(record).__name__}, not an object"
        for field, kinds in RECORD_FIELDS.items():
            if field not in record:
                return f"record {k} has no {field!r}"
            if not isinstance(record[field], kinds) or isinstance(record[field], bool):
                return f"record {k}: {field!r} is {record[field]!r}"
        for field, kinds in (("placement", (str, type(None))), ("oversubscribed", (bool,))):
            if field in record and not isinstance(record[field], kinds):  # older: absent
                return f"record {k}: {field!r} is {record[field]!r}"
        rounds = record["rounds_us"]
        if not rounds or not all(isinstance(t, (int, float)) and t > 0 for t in rounds):
            return f"record {k}: 'rounds_us' is {rounds!r}, not times > 0"
    return None


def check_runs(runs: list[Any], names: list[str]) -> None:
    """Raise :class:`BenchUsageError` (one line naming the file) unless every
    run is a list of ``mpidp bench allreduce --json`` records and all were
    measured alike (:data:`ALIKE`: rank count, dtype, op, placement,
    oversubscription), which the summary's caption states once."""
    shared: list[dict[str, Any]] = []
    for name, run in zip(names, runs):
        problem = record_problem(run)
        if problem:
            raise BenchUsageError(f"{name}: not a run of mpidp bench allreduce --json "
                                  f"({problem})")
        kinds = {tuple(r.get(f, False if f == "oversubscribed" else None) for f in ALIKE)
                 for r in run}
        if len(kinds) > 1:
            raise BenchUsageError(f"{name}: records of differently made runs in one file "
                                  f"({', '.join(map(str, sorted(kinds, key=str)))})")
        shared.append(dict(zip(ALIKE, kinds.pop())))
    for name, kind in zip(names[1:], shared[1:]):
        differ = [f"{f} ({_shown(shared[0][f])} vs {_shown(kind[f])})" for f in ALIKE
                  if kind[f] != shared[0][f]]
        if differ:
            raise BenchUsageError(f"cannot summarize {names[0]} with {name}: they differ in "
                                  f"{', '.join(differ)}; summarize each kind of run apart")


def _shown(value: Any) -> str:
    """A value of :data:`ALIKE` as an error message says it (None: not recorded)."""
    return "not recorded" if value is None else str(value)


def summarize(runs: list[list[dict]], min_xcore: float | None = None,
              max_xcore: float | None = None, names: list[str] | None = None) -> str:
    """A markdown table of several runs' records (medians of per-round ratios).

    ``names`` are the runs' files, for errors (default ``run 1``, ``run
    2``...): runs that are not records of this benchmark, or that differ in
    rank count, dtype, op, placement or oversubscription, are refused
    (:func:`check_runs`). With ``min_xcore``, sizes measured in a slow spell
    (:func:`slow_spell`) are left out; with ``max_xcore``, all but those
    measured wholly in one (:func:`fast_spell`); the caption says how many.
    """
    check_runs(runs, list(names) if names else [f"run {i + 1}" for i in range(len(runs))])
    median = statistics.median
    measured = {(i, r["bytes"]) for i, records in enumerate(runs) for r in records}
    dropped = {(i, r["bytes"]) for i, records in enumerate(runs) for r in records
               if slow_spell(r, min_xcore) or fast_spell(r, max_xcore)}
    runs = [[r for r in records if (i, r["bytes"]) not in dropped]
            for i, records in enumerate(runs)]
    cells: dict[tuple[int, str], list[dict]] = {}
    rounds = {(i, r["bytes"], r["algorithm"]): r["rounds_us"]
              for i, records in enumerate(runs) for r in records}
    for i, records in enumerate(runs):
        for r in records:
            native = rounds.get((i, r["bytes"], "native"))
            if native is not None:
                r = dict(r, speedup=paired_speedup(native, r["rounds_us"]))
                cells.setdefault((r["bytes"], r["algorithm"]), []).append(r)
    algorithms = list(dict.fromkeys(name for _, name in cells))
    shown = [a for a in algorithms if a != "native"]
    lines = ["| size | native time | " + " | ".join(shown) + " | ring busbw (native) |",
             "|---:|---:|" + "---:|" * len(shown) + "---:|"]
    first = next((records[0] for records in runs if records), None)
    if first is None:
        return "No size left to summarize" + (" (see --min-xcore / --max-xcore)."
                                              if min_xcore or max_xcore else ".")
    for nbytes in sorted({b for b, _ in cells}):
        speed = {a: median(r["speedup"] for r in cells[(nbytes, a)]) for a in algorithms
                 if (nbytes, a) in cells}
        t = median(r["avg_us"] for r in cells[(nbytes, "native")])
        best = max((v, a) for a, v in speed.items() if a != "auto")[1]
        row = []
        for a in shown:
            text = f"{speed[a]:.2f}" if a in speed else "-"
            if a == "auto" and a in speed:
                # auto against the best side by side, round by round (not through
                # native's rounds, whose noise the two speed-ups would both carry).
                paired = [1 / paired_speedup(rounds[(i, nbytes, best)], rounds[(i, nbytes, a)])
                          for i in range(len(runs))
                          if (i, nbytes, a) in rounds and (i, nbytes, best) in rounds]
                text += f" ({cells[(nbytes, a)][0]['runs']}, {median(paired):.2f} of best)"
            row.append(text)
        bus = (f"{median(r['busbw_gbps'] for r in cells[(nbytes, 'ring')]):.2f} "
               f"({median(r['busbw_gbps'] for r in cells[(nbytes, 'native')]):.2f})"
               if (nbytes, "ring") in cells else "-")
        time_text = f"{t:.1f} us" if t < 1000 else f"{t / 1000:.2f} ms"
        lines.append(f"| {format_size(nbytes)} | {time_text} | " + " | ".join(row) +
                     f" | {bus} |")
    ceiling = median(r[0].get("copy_ceiling_gbps") or 0 for r in runs if r)
    stolen = [r["steal_pct"] for records in runs for r in records
              if r.get("steal_pct") is not None]
    machine = (f" Host steal time per size: {min(stolen):.1f}-{max(stolen):.1f}% "
               f"(median {median(stolen):.1f}%)." if stolen else "")
    xcore = [x for records in runs for r in records for x in (r.get("xcore_gbps") or [])]
    if xcore:
        machine += (f" Core-to-core copy (rank 0 -> 1) before/after each size: "
                    f"{min(xcore):.1f}-{max(xcore):.1f} GB/s.")
    if min_xcore is not None or max_xcore is not None:
        rule = " or ".join(([f"below {min_xcore:g}"] if min_xcore is not None else []) +
                           ([f"not wholly below {max_xcore:g}"] if max_xcore is not None
                            else []))
        machine += (f" Left out, measured {rule} GB/s core to core: "
                    f"{len(dropped)} of {len(measured)} sizes over the runs.")
    streamed = [100 * r["streamed"] for records in runs for r in records
                if r.get("streamed") is not None]
    if streamed:
        machine += (f" Calls that streamed (2-rank pair, per run and size): "
                    f"{min(streamed):.0f}-{max(streamed):.0f}% (median {median(streamed):.0f}%).")
    lines.append(f"\n{len(runs)} run(s) of {first['ranks']} ranks"
                 f"{' (oversubscribed)' if first.get('oversubscribed') else ''}, "
                 f"{first['dtype']} {first['op']}; algorithm columns: native's time / its "
                 "time (> 1 is faster), median over rounds and runs; auto: what it ran and "
                 "its time over the best algorithm's (1.00 = the best), median over rounds "
                 "and runs of the two's times in the same round; busbw in GB/s; "
                 f"memory-copy ceiling {ceiling:.1f} GB/s.{machine}")
    return "\n".join(lines)


HEADER = (f"{'size':>10} {'count':>10} {'type':>8} {'algorithm':<30} {'time(us)':>10} "
          f"{'min(us)':>10} {'max(us)':>10} {'algbw(GB/s)':>11} {'busbw(GB/s)':>11} "
          f"{'x native':>8} {'#wrong':>6}")


def format_row(row: dict) -> str:
    name = row["algorithm"]
    if row["runs"] != name:
        name = f"{name} ({row['runs']})"
    ratio = f"{row['x_native']:.2f}" if row["x_native"] else "-"
    wrong = "-" if row["wrong"] is None else str(row["wrong"])
    return (f"{format_size(row['bytes']):>10} {row['count']:>10} {row['dtype']:>8} "
            f"{name:<30} {row['avg_us']:>10.2f} {row['min_us']:>10.2f} {row['max_us']:>10.2f} "
            f"{row['algbw_gbps']:>11.3f} {row['busbw_gbps']:>11.3f} {ratio:>8} {wrong:>6}")


#: Characters per line of a plot's title (at 10 pt, well inside its 12 in width).
TITLE_CHARS = 110


def plot(records: list[dict], path: str, title: str, ceiling: float | None) -> None:
    """Latency and busbw against size, one line per algorithm, log axes; the
    title is wrapped at :data:`TITLE_CHARS` (a run's one-line description
    ran off both sides of the figure)."""
    import matplotlib  # deferred: optional and slow to import; only --plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (lat, bw) = plt.subplots(1, 2, figsize=(12, 4.8))
    for name in dict.fromkeys(r["algorithm"] for r in records):
        rows = [r for r in records if r["algorithm"] == name]
        x = [r["bytes"] for r in rows]
        style = {"linestyle": "--"} if name == "native" else {}
        lat.plot(x, [r["avg_us"] for r in rows], marker=".", label=name, **style)
        bw.plot(x, [r["busbw_gbps"] for r in rows], marker=".", label=name, **style)
    if ceiling:
        bw.axhline(ceiling, color="grey", linestyle=":", label=f"memcpy {ceiling:.1f} GB/s")
    for ax, ylabel in ((lat, "time per call (us)"), (bw, "busbw (GB/s)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(textwrap.fill(" ".join(title.split()), TITLE_CHARS), fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def steal_line(total: float | None, records: list[dict], proc_stat: bool = True) -> str:
    """The footer line on host steal time (see :func:`collectives.bench.measure.cpu_ticks`).

    ``total`` is the run's share (None: not measured), ``proc_stat`` whether
    there was a ``/proc/stat`` to read. With one, a share is not measured
    only when no clock tick (1/100 s on Linux) passed meanwhile: the line
    then says the run or its sizes were too short, not that it cannot be
    measured here.
    """
    if not proc_stat:
        return "# host steal time: not measurable here (no /proc/stat)"
    per_size = [r for r in records if r.get("steal_pct") is not None]
    head = "# host steal time (CPU time a VM host gave to others): "
    if total is None and not per_size:
        return ("# host steal time: not measured, the run was too short (under a clock tick "
                "of /proc/stat)")
    if not per_size:
        return (f"{head}{total:.1f}% over the run; per size not measured, each size was too "
                "short (under a clock tick of /proc/stat)")
    worst = max(per_size, key=lambda r: r["steal_pct"])
    run = "" if total is None else f"{total:.1f}% over the run, "
    return (f"{head}{run}at most {worst['steal_pct']:.1f}% at {format_size(worst['bytes'])}; "
            "above a few percent, timings of ranks that wait for each other suffer most")


def streaming_line(records: list[dict]) -> str | None:
    """The footer line on streaming copies (see :mod:`collectives.channels.copy_mode`), or None
    when no algorithm could choose them."""
    shares: dict[str, list[float]] = {}
    for r in records:
        if r.get("streamed") is not None:
            shares.setdefault(r["algorithm"], []).append(100 * r["streamed"])
    if not shares:
        return None
    parts = ", ".join(f"{name} {min(v):.0f}-{max(v):.0f}%" for name, v in shares.items())
    return ("# streaming copies (the 2-rank shared-memory ring chooses per call between cached "
            f"and streaming copies): share of timed calls that streamed, per size: {parts} "
            "(per size in --json: streamed; MPIDP_ALLREDUCE_STREAMING=on/off fixes it)")


def xcore_line(records: list[dict]) -> str:
    """The footer line on the core-to-core copy bandwidth
    (see :mod:`collectives.bench.core_probe`)."""
    values = [x for r in records for x in (r.get("xcore_gbps") or [])]
    if not values:
        first = records[0] if records else {}
        why = ("one rank" if first.get("ranks") == 1 else
               "an oversubscribed node" if first.get("oversubscribed") else
               "ranks 0 and 1 on different nodes" if first else
               "one rank, ranks 0 and 1 on different nodes, or an oversubscribed node")
        return f"# core-to-core copy: not measured ({why})"
    return (f"# core-to-core copy (rank 0 -> 1, {format_size(1 << 20)} through shared memory) "
            f"before/after each size: {min(values):.1f}-{max(values):.1f} GB/s; where it "
            "drops, data crosses between cores slowly (on a virtual machine: e.g. the host "
            "running the vCPUs on cores without a shared cache) and every all-reduce slows "
            "(per size in --json: xcore_gbps; --summarize --min-xcore leaves such sizes out)")
