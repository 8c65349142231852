"""Every table of figures on the results pages and the README, rendered from result files.

    python tools/results_report.py            # rewrite the tables from results/
    python tools/results_report.py --check    # exit 1 and name the tables that differ
    python tools/results_report.py --commands # print every command that measures them

The figures live in JSON files under ``results/`` (the CPU set in
``results/cpu/``, the per-task accuracies in ``results/groups-2026-11-27/``),
each written by the benchmark that measured it with the command, the UTC date,
the commit and the machine (``collectives.machine.provenance``). A table sits on
its page between ``<!-- results: NAME begin -->`` and ``<!-- results: NAME
end -->``; this script replaces the text between the markers, so measuring
again replaces a table instead of adding to it. ``tests/test_docs.py`` checks
that every page equals its regeneration.

To measure again: run a page's commands (each page shows them, from
:data:`MEASURE`; ``--commands`` prints them all) from the repository's root
with the venv active, one at a time on an otherwise idle machine, then run
this script. A table whose file is missing says so and names the command.

One file, though over 500 lines: a tool is a script, run as ``python
tools/results_report.py`` and loaded by path in tests, with no package to
import siblings from. Its parts are marked sections: the result files'
helpers, one renderer per results page, the README's summary, and the
machinery that puts a table between its page's markers.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
CPU = ROOT / "results" / "cpu"
GROUPS = ROOT / "results" / "groups-2026-11-27"
#: The GPU check's result files (tools/gpu_check.sh; tables on docs/gpus.md).
GPU = ROOT / "results" / "gpu-h100-2026-11-27"
PAGES = ROOT / "docs" / "results"
MARKER = re.compile(r"<!-- results: (\S+) begin -->\n.*?<!-- results: \1 end -->", re.S)

#: page -> (result file or glob relative to the root, the command that writes it).
#: The page's "measure again" block is rendered from this, and a file whose
#: recorded command differs from it is flagged under its table.
MEASURE: dict[str, list[tuple[str | None, str]]] = {
    "what-dp-costs": [
        ("results/cpu/dpsgd-1-thread.json",
         "mpidp bench dpsgd --threads 1 --repeats 9 --json results/cpu/dpsgd-1-thread.json"),
        ("results/cpu/dpsgd-2-threads.json",
         "mpidp bench dpsgd --threads 2 --repeats 9 --json results/cpu/dpsgd-2-threads.json"),
        ("results/cpu/dpsgd-1-thread-avx2.json",
         "tools/as_avx2.sh mpidp bench dpsgd --threads 1 --repeats 9 "
         "--json results/cpu/dpsgd-1-thread-avx2.json"),
        ("results/cpu/noise-1-thread.json",
         "mpidp bench noise --threads 1 --repeats 7 --json results/cpu/noise-1-thread.json")],
    "collectives": [
        ("results/cpu/allreduce-2-ranks.json",
         "mpiexec -n 2 mpidp bench allreduce --rounds 10 -c "
         "--json results/cpu/allreduce-2-ranks.json")],
    "preprocessing": [
        ("results/cpu/prep.json", "mpidp bench prep --repeat 7 --json results/cpu/prep.json")],
    "scaling": [
        ("results/cpu/scaling.json",
         "mpidp bench scaling --ranks 1,2 --threads 1 --privacy dp,nodp --epochs 6 --repeat 2 "
         "--baseline none --json results/cpu/scaling.json")],
    "images-and-peers": [
        (None, "mpidp prep --format mnist ../shared/data/mnist --out mnist.h5 --val-fraction 0"),
        ("results/cpu/images.json",
         "mpidp bench scaling --preset dp-sweep --data mnist.h5 --models mnist-small,mnist-large "
         "--batch-sizes 256 --data-repeats 1 --ranks 1,2 --json results/cpu/images.json")],
    "accuracy-per-task": [
        ("results/groups-2026-11-27/*.json",
         "python tools/group_table.py measure ../shared/data/pums/acs2018_1yr_person_zips "
         "results/groups-2026-11-27 --ranks 2 --seed 1")],
    "audit": [
        (None, "mpiexec -n 2 mpidp prep ../shared/data/pums/acs2018_1yr_person_zips/*.zip "
               "--out pums.h5"),
        ("results/cpu/canary-eps*-seed*.json",
         "for E in 1 2 4 8; do for S in 1 2 3 4 5; do mpiexec -n 2 mpidp audit --attack canary "
         "--data pums.h5 --canaries 5000 --target-epsilon $E --epochs 25 --batch-size 80127 "
         "--hidden 64 --seed $S --json results/cpu/canary-eps$E-seed$S.json; done; done")],
    "reliability": [
        ("results/cpu/faults.json",
         "python tests/faults.py --runs 56 --seed 1 --json results/cpu/faults.json")],
    "test-suite": [
        ("results/cpu/test-suite.json",
         "python tests/run_suite.py --json results/cpu/test-suite.json"),
        ("results/cpu/test-suite-avx2.json",
         "tools/as_avx2.sh python tests/run_suite.py --json results/cpu/test-suite-avx2.json")],
}


# ---------------------------------------------------------------- result files

def load(path: Path):
    return json.loads(path.read_text(encoding="utf-8"))


def provenance(doc) -> dict:
    """command, date, commit and machine of a result file, whichever way its
    writer records them (a provenance block; tests/faults.py's summary; a
    group_table record; bench allreduce's list of records)."""
    if isinstance(doc, list):  # bench allreduce: machine facts on every record
        first = doc[0] if doc else {}
        return first.get("provenance") or {
            "machine": {"cpu": first.get("cpu"), "mpi": first.get("mpi_library")}}
    if "provenance" in doc:
        return doc["provenance"]
    if "summary" in doc:  # tests/faults.py
        s = doc["summary"]
        return {"command": s.get("command"), "date": s.get("date"), "commit": s.get("commit"),
                "machine": {"cpu": s.get("cpu")}}
    return {k: doc.get(k) for k in ("command", "date", "commit", "machine")}


def machine_text(machine: dict | None) -> str:
    machine = machine or {}
    parts = [machine.get("cpu") or "an unnamed CPU"]
    if machine.get("cores"):
        parts.append(f"{machine['cores']} cores")
    if machine.get("mpi"):
        parts.append(re.sub(r"\s*Version:\s*", " ", machine["mpi"]).strip())
    return ", ".join(parts)


def machines_text(machines: list[dict | None]) -> str:
    """The machines of several files, one description per CPU model, each as
    complete as any of its files allows (a file may record only the CPU)."""
    merged: dict[str, dict] = {}
    for m in machines:
        m = m or {}
        known = merged.setdefault(m.get("cpu") or "", {})
        known.update({k: v for k, v in m.items() if v and not known.get(k)})
    return "; ".join(machine_text(m) for m in merged.values())


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def documented(path: Path) -> str | None:
    """The command :data:`MEASURE` gives for exactly this file (not a glob)."""
    name = path.relative_to(ROOT).as_posix()
    return next((c for entries in MEASURE.values() for f, c in entries if f == name), None)


def link(page: Path, path: Path) -> str:
    return f"[{path.relative_to(ROOT).as_posix()}]({os.path.relpath(path, page.parent)})"


def sources(page: Path, paths: list[Path]) -> str:
    """The lines under a table: which files, made by which command, when, where."""
    made = [(p, provenance(load(p))) for p in paths]
    machines = machines_text([m.get("machine") for _, m in made])
    dates = sorted({(m.get("date") or "")[:10] for _, m in made} - {""})
    when = (dates[0] if len(dates) == 1 else
            f"from {dates[0]} to {dates[-1]}" if dates else "on a date the files do not record")
    lines = [f"Measured {when} on {machines}:", ""]
    if len(made) > 3:  # one family of files: one command shown, every file linked
        command = made[0][1].get("command")
        return "\n".join(lines + [
            f"- {len(made)} files, each by its own command, such as `{command}`: "
            + ", ".join(f"[{p.stem}]({os.path.relpath(p, page.parent)})" for p, _ in made)])
    for path, m in made:
        command = m.get("command")
        note = ""
        if command is None:
            note = " (the file records no command, date or commit)"
        elif documented(path) not in (None, command):
            note = " (a shorter run than the command above: measure again for the figures)"
        shown = f"`{command}`" if command else "its command"
        lines.append(f"- {shown}, {link(page, path)}{note}")
    return "\n".join(lines)


def missing(name: str) -> str:
    return (f"Not measured yet: run this page's commands for `{name}`, then "
            "`python tools/results_report.py`.")


def _f(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _n(value) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _span(values: list[float], digits: int = 2, unit: str = "", sign: str = "") -> str:
    """``lo-hi`` (one value when they print alike; ``lo to hi`` below zero)."""
    lo, hi = (f"{v:{sign}.{digits}f}" for v in (min(values), max(values)))
    if lo == hi:
        return lo + unit
    return f"{lo} to {hi}{unit}" if min(values) < 0 or sign else f"{lo}-{hi}{unit}"


# ---------------------------------------------------------------- what DP costs

#: column -> the run shown in it (the last: AVX2 code on this AVX-512 CPU, tools/as_avx2.sh).
DPSGD = {"1 thread": CPU / "dpsgd-1-thread.json", "2 threads": CPU / "dpsgd-2-threads.json",
         "1 thread, AVX2 code": CPU / "dpsgd-1-thread-avx2.json"}
METHODS = {
    "mpidp-dp": "mpidp, DP-SGD (the MLP's fused step)",
    "mpidp-nondp": "mpidp, the same step without clipping and noise",
    "mpidp-generic": "mpidp, DP-SGD, the MLP as an `nn.Module` through the per-layer rules",
    "mpidp-household": "mpidp, DP-SGD, `--privacy-unit household`",
    "mpidp-secure": "mpidp, DP-SGD, `--secure-noise`",
    "torch-sgd": "PyTorch: `nn.Module`, autograd, `torch.optim.SGD`, non-private",
    "naive": "a per-example loop, DP-SGD",
    "opacus-hooks": "Opacus, per-sample gradients from hooks (its default)",
    "opacus-ghost": "Opacus, ghost clipping (its fastest mode)",
    "embedding-dp": "mpidp, DP-SGD, `embedding-mlp` through the per-layer rules",
    "embedding-nondp": "mpidp, `embedding-mlp` without clipping and noise",
    "opacus-ghost-embedding": "Opacus, ghost clipping, the same `embedding-mlp`",
}
RATIOS = {
    "dp_over_nondp": "DP-SGD over the same step without privacy",
    "generic_over_fused": "a model through the per-layer rules over the fused MLP step (both DP)",
    "household_over_person": "`--privacy-unit household` over person",
    "secure_over_dp": "`--secure-noise` over the seeded noise",
    "embedding_dp_over_nondp": "`embedding-mlp`: DP over non-private",
    "embedding_over_opacus_ghost": "Opacus ghost clipping over mpidp, `embedding-mlp`, both DP",
}


def _dpsgd() -> dict[str, dict]:
    return {label: load(p) for label, p in DPSGD.items() if p.exists()}


def dp_methods(page: Path) -> str:
    runs = _dpsgd()
    if not runs:
        return missing("bench dpsgd")
    columns = list(runs)
    order = [m for m in METHODS if any(m in r["examples_per_s"] for r in runs.values())]
    first = next(iter(runs.values()))
    head = " | ".join(columns)
    lines = [f"| method | examples/s, {head} | mpidp DP-SGD's speed over it, "
             f"{' / '.join(columns)} |",
             "|---|" + "---:|" * len(columns) + "---:|"]
    for m in order:
        rates = [_n(runs[c]["examples_per_s"].get(m)) for c in columns]
        over = ("-" if m.startswith("embedding") or m == "opacus-ghost-embedding" else
                " / ".join(_f(runs[c].get("speedup", {}).get(m)) + "x" if
                           runs[c].get("speedup", {}).get(m) else "-" for c in columns))
        lines.append(f"| {METHODS[m]} | " + " | ".join(rates) + f" | {over} |")
    lines += ["", f"{first['model']}, expected batch {first['batch_size']}, {first['data']}; "
              f"median of {first['repeats']} rounds of {first['steps']} steps, the methods "
              f"taking turns in blocks of {first.get('block', first['steps'])} steps "
              "(the naive loop: fewer steps, at the end of a round). AVX2 code: the same "
              "CPU with Numba, torch, MKL, oneDNN and numpy told to leave AVX-512 alone "
              "(`tools/as_avx2.sh`), what the instruction set alone changes; not an AVX2 "
              "machine.", "", sources(page, [DPSGD[c] for c in columns])]
    return "\n".join(lines)


def dp_ratios(page: Path) -> str:
    runs = _dpsgd()
    if not runs:
        return missing("bench dpsgd")
    columns = list(runs)
    lines = [f"| time per example | {' | '.join(columns)} |", "|---|" + "---|" * len(columns)]
    for key, label in RATIOS.items():
        if not any(key in r for r in runs.values()):
            continue
        cells = []
        for c in columns:
            r = runs[c]
            if key not in r:
                cells.append("-")
                continue
            lo, hi = r.get(key + "_spread", [r[key], r[key]])
            cells.append(f"**{r[key]:.3f}** ({lo:.3f}-{hi:.3f} over "
                         f"{len(next(iter(r['all_rounds'].values())))} rounds)")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "Each ratio is the median of its per-round values (the methods of a round "
              "took turns in blocks of steps: [bench blocks](../design/bench-blocks.md)); in "
              "brackets the lowest and highest round.", "",
              sources(page, [DPSGD[c] for c in columns])]
    return "\n".join(lines)


def noise(page: Path) -> str:
    path = CPU / "noise-1-thread.json"
    if not path.exists():
        return missing("bench noise")
    doc = load(path)
    names = {"mpidp": "mpidp (`kernels/numba_cpu/gaussian.py`)",
             "torch": "`torch` (`normal_` + `add_`)",
             "numpy-sfc64": "numpy `Generator(SFC64)`, then `+=`",
             "numpy-pcg64": "numpy `Generator(PCG64)`, then `+=`"}
    lines = ["| generator | ns a sample | time over mpidp's |", "|---|---:|---:|"]
    for name, ns in doc["ns_per_sample"].items():
        lines.append(f"| {names.get(name, name)} | {ns:.3f} | {doc['over_mpidp'][name]:.2f}x |")
    lines += ["", f"{doc['size']:,} float32 samples a call (the seed's MLP's parameters), "
              f"{doc['threads']} thread(s); the ratio is the median of per-round ratios.", "",
              sources(page, [path])]
    return "\n".join(lines)


# ---------------------------------------------------------------- collectives

def allreduce(page: Path) -> str:
    path = CPU / "allreduce-2-ranks.json"
    if not path.exists():
        return missing("bench allreduce")
    from collectives.bench.report import summarize  # the benchmark's own --summarize

    return summarize([load(path)]) + "\n\n" + sources(page, [path])


# ---------------------------------------------------------------- preprocessing

def prep(page: Path) -> str:
    path = CPU / "prep.json"
    if not path.exists():
        return missing("bench prep")
    doc = load(path)
    medians, records = doc["median_seconds"], doc["records"]
    reference, one = medians.get("polars (1 process)"), medians.get("mpidp prep, 1 rank")
    lines = ["| pipeline | median s | records/s | polars' time over it | over 1 rank |",
             "|---|---:|---:|---:|---:|"]
    for name, seconds in medians.items():
        vs = f"{reference / seconds:.2f}x" if reference else "-"
        up = f"{one / seconds:.2f}x" if one and name.startswith("mpidp") else "-"
        lines.append(f"| {name} | {seconds:.2f} | {records / seconds:,.0f} | {vs} | {up} |")
    lines += ["", f"{records:,} person records, {doc['megabytes']:.0f} MB of CSV (a synthetic "
              f"file in the official format, `mpidp synth`); median of {doc['repeat']} "
              "interleaved runs, each a fresh process timed from launch to file written.", "",
              sources(page, [path])]
    return "\n".join(lines)


# ---------------------------------------------------------------- scaling, images

def scaling(page: Path) -> str:
    path = CPU / "scaling.json"
    if not path.exists():
        return missing("bench scaling")
    doc = load(path)
    lines = ["| run | ranks x threads | s/epoch, mean (min-max) | speed-up | comm/compute "
             "| test accuracy | epsilon |", "|---|---|---:|---:|---:|---:|---:|"]
    for s in sorted(doc["summaries"], key=lambda s: (not s["dp"], s["ranks"])):
        lines.append(
            f"| {'DP-SGD' if s['dp'] else 'non-private'}, batch {s['batch_size']} "
            f"| {s['ranks']} x {s['threads_used']} "
            f"| {s['epoch_avg_s']:.3f} ({s['epoch_min_s']:.3f}-{s['epoch_max_s']:.3f}) "
            f"| {_f(s.get('speedup'))}x | {_f(s.get('comm_compute_ratio'), 3)} "
            f"| {_f(s.get('test_accuracy'), 4)} | {_f(s.get('epsilon'), 3)} |")
    lines += ["", f"{os.path.basename(doc['data'])}; the epochs after the first of every "
              "round pooled; "
              "speed-up over 1 rank of the same series; comm/compute: seconds in the "
              "all-reduce (waits included) over seconds computing.", "", sources(page, [path])]
    return "\n".join(lines)


def images(page: Path) -> str:
    path = CPU / "images.json"
    if not path.exists():
        return missing("bench scaling --preset dp-sweep")
    doc = load(path)
    rows = [s for s in doc["summaries"] if s.get("impl") == "mpidp"]
    lines = ["| model | batch | ranks x threads | privacy | mpidp examples/s | peer "
             "| peer examples/s | mpidp / peer |", "|---|---:|---|---|---:|---|---:|---:|"]
    for s in sorted(rows, key=lambda s: (s["model"] or "", s["grid_batch"] or 0, s["ranks"],
                                         s["dp"])):
        peer = "Opacus-DDP" if s["dp"] else "PyTorch DDP"
        lines.append(f"| `{s['model']}` | {s['grid_batch']} | {s['ranks']} x {s['threads_used']} "
                     f"| {'DP-SGD' if s['dp'] else 'non-private'} | {_n(s['examples_per_s'])} "
                     f"| {peer} | {_n(s.get('peer_examples_per_s'))} "
                     f"| {_f(s.get('vs_peer'))}x |")
    lines += ["", f"{doc['data']}; steady epochs (after the first); each peer run launched "
              "the same way on the same configuration (`python -m engine.bench.ddp_baseline`: "
              "PyTorch DistributedDataParallel, Opacus' distributed DP-SGD).", "",
              sources(page, [path])]
    return "\n".join(lines)


# ---------------------------------------------------------------- accuracy

TASKS = ("employment", "income", "public_coverage", "mobility", "travel_time",
         "income_poverty_ratio", "health_insurance")


def _tasks() -> list[tuple[Path, dict]]:
    found = {p.stem: p for p in GROUPS.glob("*.json")} if GROUPS.is_dir() else {}
    return [(found[t], load(found[t])) for t in TASKS if t in found]


def _accuracies(doc: dict) -> tuple[dict, dict]:
    nondp, dp = doc["eval"]["models"][:2]
    return nondp, dp


def accuracy(page: Path) -> str:
    tasks = _tasks()
    if not tasks:
        return missing("accuracy per task")
    lines = ["| task | test rows | non-private | DP-SGD, epsilon = 1 | DP - non-private, "
             "points |", "|---|---:|---:|---:|---:|"]
    for _, doc in tasks:
        nondp, dp = _accuracies(doc)
        lines.append(f"| `{doc['task']}` | {nondp['rows']:,} | {nondp['accuracy']:.4f} "
                     f"| {dp['accuracy']:.4f} | {100 * (dp['accuracy'] - nondp['accuracy']):+.2f} |")
    lines += ["", "`mpidp train` with its defaults (SGD, lr 0.05, batch 256, 10 epochs, MLP "
              "128-128, C = 1), non-private and at epsilon = 1, delta = 1e-5; each run keeps "
              "the epoch with the best validation accuracy; the test split is scored once, "
              "afterwards, by `mpidp eval`.", "", sources(page, [p for p, _ in tasks])]
    return "\n".join(lines)


# ---------------------------------------------------------------- audit

def _canaries() -> list[tuple[Path, dict]]:
    return [(p, load(p)) for p in sorted(CPU.glob("canary-eps*-seed*.json"))]


def _claims(runs: list[tuple[Path, dict]]) -> dict[float, list[dict]]:
    by: dict[float, list[dict]] = {}
    for _, doc in runs:
        c = doc["canary"]
        by.setdefault(round(c["claimed_epsilon"], 1), []).append(c)
    return dict(sorted(by.items()))


def canary(page: Path) -> str:
    runs = _canaries()
    if not runs:
        return missing("canary audit")
    lines = ["| claimed epsilon | runs | lower bound, f-DP analysis | its share of the claim "
             "| lower bound, exact binomial | claim refuted |", "|---:|---:|---|---|---|---|"]
    for claim, cs in _claims(runs).items():
        fdp = [c["epsilon_fdp"] for c in cs]
        lines.append(f"| {claim:g} | {len(cs)} | {_span(fdp)} "
                     f"| {_span([100 * e / c['claimed_epsilon'] for e, c in zip(fdp, cs)], 0, '%')} "
                     f"| {_span([c['epsilon_lower_bound'] for c in cs])} "
                     f"| {sum(c['detected'] for c in cs)} of {len(cs)} |")
    first = runs[0][1]["canary"]
    lines += ["", f"{first['m']:,} white-box canaries, {first['ranks']} ranks, "
              f"{first['n_train']:,} training rows, {first['steps']} steps at q = "
              f"{first['q']:.3g}; lower bounds at {first['confidence']:.0%} confidence, "
              "each run one seed.", "", sources(page, [p for p, _ in runs])]
    return "\n".join(lines)


# ---------------------------------------------------------------- reliability, tests

FAULTS = {"sigkill": "SIGKILL of a random rank", "sigterm": "SIGTERM", "sigint": "SIGINT",
          "sigusr1": "SIGUSR1", "disk-full": "disk full", "read-only": "read-only file system",
          "corrupt": "checkpoint truncated or bits flipped"}


def faults(page: Path) -> str:
    path = CPU / "faults.json"
    if not path.exists():
        return missing("fault injection")
    doc = load(path)
    trials = [t for t in doc["trials"] if not t["detail"].startswith("after the run ended")]
    lines = ["| fault | injected | survived | resumed to a bit-identical end | refused cleanly "
             "| lost |", "|---|---:|---:|---:|---:|---:|"]
    for kind, label in FAULTS.items():
        mine = [t for t in trials if t["kind"] == kind]
        if mine:
            lines.append(f"| {label} | {len(mine)} | {sum(t['survived'] for t in mine)} "
                         f"| {sum(t['outcome'] == 'identical' for t in mine)} "
                         f"| {sum(t['outcome'] == 'refused' for t in mine)} "
                         f"| {sum(not t['survived'] for t in mine)} |")
    s = doc["summary"]
    lines += [f"| **all** | **{len(trials)}** | **{s['survived']}** "
              f"| **{s['bit_identical_finishes']}** | **{s['clean_refusals']}** "
              f"| **{s['lost']}** |", "",
              f"{s['ranks']} ranks, {s['rows']:,} training rows, {s['steps']} steps a run, "
              f"{s['invocations']} invocations ({s['resumes']} resumes), {s['seconds']} s.", "",
              sources(page, [path])]
    return "\n".join(lines)


def test_suite(page: Path) -> str:
    path = CPU / "test-suite.json"
    if not path.exists():
        return missing("test suite")
    doc = load(path)
    lines = ["| stage | result | tests | failed | skipped | s |", "|---|---|---:|---:|---:|---:|"]
    for st in doc["stages"]:
        failed = st.get("failures", 0) + st.get("errors", 0)
        lines.append(f"| {st['stage']} | {'passed' if st['exit_code'] == 0 else 'FAILED'} "
                     f"| {st.get('tests', '-')} | {failed} | {st.get('skipped', '-')} "
                     f"| {st['seconds']:.0f} |")
    lines += [f"| **all stages** | **{'passed' if doc['passed'] else 'FAILED'}** "
              f"| **{plural(doc['test_runs'], 'test run')}** | | | **{doc['seconds']:.0f}** |", "",
              "Times exclude the venv's installation (`make test` installs it first when "
              "`setup.py` changed)."]
    if doc.get("slowest"):  # where the time goes (tests/run_suite.py, from junit)
        lines += ["", "The slowest test runs (the serial stage runs two at a time, one per "
                  "core):", "", "| s | stage | test |", "|---:|---|---|"]
        lines += [f"| {r['seconds']:.1f} | {r['stage']} | `{r['test']}` |"
                  for r in doc["slowest"]]
    used = [path]
    avx2 = CPU / "test-suite-avx2.json"
    if avx2.exists():  # the same suite with AVX2 code (tools/as_avx2.sh)
        other = load(avx2)
        used.append(avx2)
        lines += ["", "With AVX2 code on the same CPU (`tools/as_avx2.sh`: Numba, torch, "
                  "MKL, oneDNN and numpy told to leave AVX-512 alone): "
                  f"{'passed' if other['passed'] else 'FAILED'}, "
                  f"{plural(other['test_runs'], 'test run')}, {other['seconds']:.0f} s. "
                  "The code an AVX2 machine runs gives the tests' answers; its speed is "
                  "this CPU's, not an AVX2 machine's."]
    lines += ["", sources(page, used)]
    return "\n".join(lines)


# ---------------------------------------------------------------- the README's table

def _median_over(doc: dict, algorithm: str, least: int = 0) -> list[float]:
    from collectives.bench.measure import paired_speedup

    native = {r["bytes"]: r["rounds_us"] for r in doc if r["algorithm"] == "native"}
    return [paired_speedup(native[r["bytes"]], r["rounds_us"]) for r in doc
            if r["algorithm"] == algorithm and r["bytes"] >= least and r["bytes"] in native]


def summary(page: Path) -> str:
    """One row per question, one figure or range per cell, the machine once."""
    rows: list[tuple[str, str, str, str]] = []
    used: list[Path] = []
    results = "docs/results"
    # the CPU's own code: the AVX2-code run is on the results page only
    own = {label: r for label, r in _dpsgd().items()
           if not r.get("machine", {}).get("isa_limit")}
    runs = {r["threads"]: r for r in own.values()}
    if runs:
        used += [DPSGD[label] for label in own]
        dp = [r["dp_over_nondp"] for r in runs.values() if "dp_over_nondp" in r]
        threads = sorted(t for t, r in runs.items() if "dp_over_nondp" in r)
        if dp:
            rows.append(("DP-SGD's time over non-private SGD, same step, 1 rank",
                         f"{_span(dp)}x ({'-'.join(map(str, threads))} thread"
                         f"{'s' if threads != [1] else ''})",
                         "99x (seed project)", f"{results}/what-dp-costs.md"))
        best_t, best = max(((t, r) for t, r in runs.items()),
                           key=lambda tr: tr[1]["examples_per_s"].get("mpidp-dp", 0))
        rate = best["examples_per_s"].get("mpidp-dp")
        if rate:
            rows.append((f"one DP-SGD epoch of the seed's workload ({best['rows']:,} rows), "
                         "1 rank", f"{best['rows'] / rate:.1f} s ({plural(best_t, 'thread')})",
                         "510 s on a GPU (seed project)", f"{results}/what-dp-costs.md"))
            ghost = best["examples_per_s"].get("opacus-ghost")
            if ghost:
                rows.append(("DP-SGD examples/s, 1 rank", f"{rate:,.0f} ({plural(best_t, 'thread')})",
                             f"{ghost:,.0f}, Opacus' fastest mode", f"{results}/what-dp-costs.md"))
    if (CPU / "noise-1-thread.json").exists():
        doc = load(CPU / "noise-1-thread.json")
        used.append(CPU / "noise-1-thread.json")
        if "torch" in doc["ns_per_sample"]:
            rows.append(("Gaussian noise, ns a sample, 1 thread",
                         f"{doc['ns_per_sample']['mpidp']:.2f}",
                         f"{doc['ns_per_sample']['torch']:.2f}, torch",
                         f"{results}/what-dp-costs.md#the-noise"))
    if (CPU / "scaling.json").exists():
        doc = load(CPU / "scaling.json")
        used.append(CPU / "scaling.json")
        top = [s for s in doc["summaries"] if s["dp"] and s["ranks"] > 1]
        if top:
            s = max(top, key=lambda s: s["ranks"])
            rows.append((f"DP-SGD's speed-up from 1 to {s['ranks']} ranks, "
                         f"{plural(s['threads_used'], 'thread')} each", f"{s['speedup']:.2f}x",
                         "2.0x, 1 to 2 GPUs (seed project)",
                         f"{results}/scaling.md"))
    if (CPU / "images.json").exists():
        doc = load(CPU / "images.json")
        used.append(CPU / "images.json")
        dp = [s for s in doc["summaries"] if s.get("impl") == "mpidp" and s["dp"]
              and s.get("vs_peer")]
        if dp:
            rows.append(("DP-SGD on MNIST images, examples/s over Opacus' distributed DP-SGD",
                         f"{_span([s['vs_peer'] for s in dp])}x", "1x, Opacus-DDP",
                         f"{results}/images-and-peers.md"))
    if (CPU / "allreduce-2-ranks.json").exists():
        doc = load(CPU / "allreduce-2-ranks.json")
        used.append(CPU / "allreduce-2-ranks.json")
        auto = _median_over(doc, "auto")
        if auto:
            sizes = sorted({r["bytes"] for r in doc})
            from collectives.bench.report import format_size

            rows.append((f"all-reduce, 2 ranks, {format_size(sizes[0])}-{format_size(sizes[-1])}"
                         ": `auto`'s speed over MPI's", f"{_span(auto)}x",
                         "1x, `MPI_Allreduce` (MPICH)", f"{results}/collectives.md"))
    if (CPU / "prep.json").exists():
        doc = load(CPU / "prep.json")
        used.append(CPU / "prep.json")
        medians = doc["median_seconds"]
        two = min((s, n) for n, s in medians.items() if n.startswith("mpidp"))
        peer = medians.get("polars (1 process)")
        # The yardstick measured in the same run first, then the seed's own figure.
        peers = [f"{peer:.2f}, polars in one process"] if peer else []
        if doc["records"] == 1_200_000:
            peers.append("78.5 sequential, 3.5 Spark (seed project)")
        rows.append((f"prep of {doc['records']:,} person records, s",
                     f"{two[0]:.2f} ({two[1].removeprefix('mpidp prep, ')})",
                     "; ".join(peers) or "-", f"{results}/preprocessing.md"))
    tasks = _tasks()
    if tasks:
        used += [p for p, _ in tasks]
        gaps = [100 * (dp["accuracy"] - nondp["accuracy"])
                for nondp, dp in (_accuracies(doc) for _, doc in tasks)]
        rows.append((f"test accuracy at epsilon = 1 against non-private, {len(tasks)} ACS tasks",
                     f"{_span(gaps, sign='+')} points", "-",
                     f"{results}/accuracy-per-task.md"))
        employment = dict((doc["task"], doc) for _, doc in tasks).get("employment")
        if employment:
            rows.append(("test accuracy, employment task, DP-SGD at epsilon = 1",
                         f"{_accuracies(employment)[1]['accuracy']:.3f}",
                         "0.66 (seed project)", f"{results}/accuracy-per-task.md"))
    claims = _claims(_canaries())
    if claims:
        used += [p for p, _ in _canaries()]
        claim, cs = max(claims.items())
        rows.append((f"canary audit: proven lower bound on epsilon at a claimed {claim:g}",
                     f"{_span([c['epsilon_fdp'] for c in cs])} ({plural(len(cs), 'run')})",
                     f"{claim:g}, the claim: a bound above it refutes it", f"{results}/audit.md"))
    if (CPU / "faults.json").exists():
        s = load(CPU / "faults.json")["summary"]
        used.append(CPU / "faults.json")
        rows.append(("injected faults (kills, signals, full disk, damaged checkpoints) "
                     "survived", f"{s['survived']} of {s['faults_injected']}", "-",
                     f"{results}/reliability.md"))
    if (CPU / "test-suite.json").exists():
        doc = load(CPU / "test-suite.json")
        used.append(CPU / "test-suite.json")
        rows.append(("`make test`: serial tests, then MPI tests at several rank counts",
                     f"{doc['seconds'] / 60:.1f} min, {doc['test_runs']:,} test runs",
                     "-", f"{results}/test-suite.md"))
    gpu = _gpu_rows()
    rows += gpu
    if not rows:
        return missing("any benchmark")
    lines = ["| question | mpidp | for comparison |", "|---|---|---|"]
    for question, figure, other, where in rows:
        target = os.path.relpath(ROOT / where.split("#")[0], page.parent)
        anchor = "#" + where.split("#")[1] if "#" in where else ""
        lines.append(f"| [{question}]({target}{anchor}) | {figure} | {other} |")
    made = [provenance(load(p)) for p in used if p.parent == CPU]
    machines = machines_text([m.get("machine") for m in made])
    dates = sorted({(m.get("date") or "")[:10] for m in made} - {""})
    span = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}" if dates else ""
    made_gpu = load(GPU / "bench_dpsgd_cuda.json") if gpu else {}
    device = made_gpu.get("device", "a GPU").split(" (")[0]
    gpu_date = made_gpu.get("date") or made_gpu.get("provenance", {}).get("date", "")[:10]
    lines += ["", f"Measured on {machines}" + (f", {span}" if span else "") +
              (f"; the GPU rows on one {device}, {gpu_date} (`make "
               "gpu-check`)" if gpu else "") +
              "; the seed project's figures are its own, published, on AWS GPUs. Each "
              "question links to its page: the command, the result file, how to read it."]
    return "\n".join(lines)


def _gpu_rows() -> list[tuple[str, str, str, str]]:
    """The summary's GPU rows, from the GPU check's files (docs/gpus.md has them all)."""
    if not (GPU / "bench_dpsgd_cuda.json").exists():
        return []
    bench = load(GPU / "bench_dpsgd_cuda.json")["models"]
    train = load(GPU / "train_seed_workload.json")["runs"] \
        if (GPU / "train_seed_workload.json").exists() else {}
    rows = []

    def steady(epochs: list[dict]) -> float:
        rest = [e["epoch_time_s"] for e in epochs if e["epoch"] > 1] or \
            [e["epoch_time_s"] for e in epochs]
        return sorted(rest)[len(rest) // 2]

    if "cuda_graph" in train:
        rows.append(("one DP-SGD epoch of the seed's workload (790,000 rows), one GPU",
                     f"{steady(train['cuda_graph']):.2f} s", "510 s on a GPU (seed project)",
                     "docs/gpus.md#figures"))
    dp = [r["dp_over_nondp"] for r in bench.values() if "dp_over_nondp" in r]
    if dp:
        rows.append((f"DP-SGD's time over non-private SGD on one GPU, same step, "
                     f"{len(dp)} models", f"{_span(dp)}x", "99x (seed project)",
                     "docs/gpus.md#figures"))
    ghost = [r["opacus_ghost_over_dp"] for r in bench.values() if "opacus_ghost_over_dp" in r]
    if ghost:
        rows.append((f"DP-SGD on one GPU, speed over Opacus' ghost clipping, {len(ghost)} models",
                     f"{_span(ghost, digits=1)}x", "1x, Opacus", "docs/gpus.md#figures"))
    peers = [r["vs_peer"] for path in sorted(GPU.glob("peers_*.json"))
             for r in load(path)["summaries"]
             if r["impl"] == "mpidp" and r["dp"] and r.get("vs_peer") is not None]
    if peers:
        rows.append((f"DP-SGD training on one GPU, speed over Opacus-DDP, {len(peers)} models",
                     f"{_span(peers, digits=1)}x", "1x, Opacus-DDP", "docs/gpus.md#figures"))
    return rows


# ---------------------------------------------------------------- the index

def commands_block(key: str) -> Callable[[Path], str]:
    def render(page: Path) -> str:
        body = "\n".join(c for _, c in MEASURE[key])
        return ("```sh\n. .venv/bin/activate      # from the repository's root\n" + body +
                "\npython tools/results_report.py   # rewrite the tables below\n```")
    return render


@dataclass(frozen=True)
class Table:
    name: str
    page: Path
    render: Callable[[Path], str]


def _page(key: str) -> Path:
    return PAGES / f"{key}.md"


TABLES = [
    Table("summary", ROOT / "README.md", summary),
    Table("dp-methods", _page("what-dp-costs"), dp_methods),
    Table("dp-ratios", _page("what-dp-costs"), dp_ratios),
    Table("noise", _page("what-dp-costs"), noise),
    Table("allreduce", _page("collectives"), allreduce),
    Table("prep", _page("preprocessing"), prep),
    Table("scaling", _page("scaling"), scaling),
    Table("images", _page("images-and-peers"), images),
    Table("accuracy", _page("accuracy-per-task"), accuracy),
    Table("canary", _page("audit"), canary),
    Table("faults", _page("reliability"), faults),
    Table("test-suite", _page("test-suite"), test_suite),
    *(Table(f"{key}-commands", _page(key), commands_block(key)) for key in MEASURE),
]


# ---------------------------------------------------------------- pages

def _shown(page: Path) -> str:
    return page.relative_to(ROOT).as_posix() if page.is_relative_to(ROOT) else str(page)


def rendered(page: Path, text: str) -> tuple[str, list[str]]:
    """``text`` of ``page`` with its tables rendered, and the problems found
    (a marker no table has, a table without its marker)."""
    mine = {t.name: t for t in TABLES if t.page == page}
    problems, seen = [], set()

    def replace(match: re.Match) -> str:
        name = match.group(1)
        if name not in mine:
            problems.append(f"{_shown(page)}: no table {name!r} renders here")
            return match.group(0)
        seen.add(name)
        body = mine[name].render(page).rstrip("\n")
        return f"<!-- results: {name} begin -->\n\n{body}\n\n<!-- results: {name} end -->"

    out = MARKER.sub(replace, text)
    problems += [f"{_shown(page)}: no markers for table {n!r}" for n in mine
                 if n not in seen]
    return out, problems


def stale() -> list[str]:
    """One line per page whose tables differ from their result files (or that
    lacks a table's markers): what ``--check`` and tests/test_docs.py report."""
    lines = []
    for page in dict.fromkeys(t.page for t in TABLES):
        if not page.exists():
            lines.append(f"{_shown(page)}: missing")
            continue
        text = page.read_text(encoding="utf-8")
        new, problems = rendered(page, text)
        lines += problems
        if new != text:
            lines.append(f"{_shown(page)}: differs from its result files")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if a page differs from its files")
    parser.add_argument("--commands", action="store_true",
                        help="print every command that measures the tables")
    args = parser.parse_args(argv)
    if args.commands:
        for entries in MEASURE.values():
            for _, command in entries:
                print(command)
        return 0
    if args.check:
        problems = stale()
        for line in problems:
            print(line)
        return 1 if problems else 0
    problems = []
    for page in dict.fromkeys(t.page for t in TABLES):
        text = page.read_text(encoding="utf-8")
        new, found = rendered(page, text)
        problems += found
        if new != text:
            page.write_text(new, encoding="utf-8")
            print(f"rewrote {_shown(page)}")
    for line in problems:
        print(line, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
