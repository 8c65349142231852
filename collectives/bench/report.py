"""What ``mpidp bench allreduce`` prints: the table row, the footers, the plot, the summary.

Everything here reads records (:func:`collectives.bench.measure.measure`)
and measures nothing: :func:`summarize` turns the ``--json`` files of
several runs into one markdown table of medians of per-round ratios.
"""
from __future__ import annotations

import statistics

from collectives.bench.measure import paired_speedup
from collectives.describe import format_size


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


def summarize(runs: list[list[dict]], min_xcore: float | None = None,
              max_xcore: float | None = None) -> str:
    """A markdown table of several runs' records (medians of per-round ratios).

    With ``min_xcore``, sizes measured in a slow spell (:func:`slow_spell`)
    are left out; with ``max_xcore``, all but those measured wholly in one
    (:func:`fast_spell`); the caption says how many.
    """
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


def plot(records: list[dict], path: str, title: str, ceiling: float | None) -> None:
    """Latency and busbw against size, one line per algorithm, log axes."""
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
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def steal_line(total: float, records: list[dict]) -> str:
    """The footer line on host steal time (see :func:`collectives.bench.measure.cpu_ticks`)."""
    per_size = [r for r in records if r.get("steal_pct") is not None]
    if not per_size:
        return "# host steal time: not measurable here (no /proc/stat)"
    worst = max(per_size, key=lambda r: r["steal_pct"])
    return (f"# host steal time (CPU time a VM host gave to others): {total:.1f}% over the "
            f"run, at most {worst['steal_pct']:.1f}% at {format_size(worst['bytes'])}; above "
            "a few percent, timings of ranks that wait for each other suffer most")


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
        return ("# core-to-core copy: not measured (one rank, ranks 0 and 1 on different "
                "nodes, or an oversubscribed node)")
    return (f"# core-to-core copy (rank 0 -> 1, {format_size(1 << 20)} through shared memory) "
            f"before/after each size: {min(values):.1f}-{max(values):.1f} GB/s; where it "
            "drops, data crosses between cores slowly (on a virtual machine: e.g. the host "
            "running the vCPUs on cores without a shared cache) and every all-reduce slows "
            "(per size in --json: xcore_gbps; --summarize --min-xcore leaves such sizes out)")
