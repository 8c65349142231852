"""The GPU figures of docs/gpus.md, rendered from the result files of a GPU check.

    python tools/gpu_tables.py results/gpu-h100-2026-11-27          # print the tables
    python tools/gpu_tables.py results/gpu-h100-2026-11-27 --write docs/gpus.md

A directory holds ``bench_dpsgd_cuda.json`` (``mpidp bench dpsgd --device
cuda --json``) and ``train_seed_workload.json`` (the epochs of the training
runs of ``tools/gpu_check.sh``, written by ``tools/gpu_train_record.py``);
each names its command, date, device and code. Where the directory also
holds ``peers_<model>.json`` (``mpidp bench scaling --device cuda --json``,
the check's step ``peers``), a third table puts whole DP training runs
beside Opacus-DDP on the same GPU. ``--write`` replaces the text between the markers
``<!-- gpu tables: begin -->`` and ``<!-- gpu tables: end -->`` of a page,
so measuring again replaces the tables instead of adding to them
(tests/test_docs.py checks the page matches its files).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

BEGIN, END = "<!-- gpu tables: begin -->", "<!-- gpu tables: end -->"
#: model -> the goal of the issue the figures answer: DP / non-DP at most, and
#: mpidp DP over the best Opacus at least.
MODEL_ROWS = ("mlp", "embedding-mlp", "mnist-small", "resnet20")


def _steady(epochs: list[dict]) -> float:
    """Median seconds of the epochs after the first (which pays compiles)."""
    rest = [e["epoch_time_s"] for e in epochs if e["epoch"] > 1] or \
        [e["epoch_time_s"] for e in epochs]
    return statistics.median(rest)


def bench_table(bench: dict) -> list[str]:
    lines = ["| model, batch | mpidp DP, examples/s | DP / non-DP | same, eager step "
             "| eager / graph | Opacus ghost / mpidp DP | Opacus hooks / mpidp DP "
             "| PyTorch SGD / mpidp non-DP | graph alone, DP / non-DP |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name in MODEL_ROWS:
        r = bench["models"].get(name)
        if r is None:
            continue
        replay = r.get("graph_replay_us", {})
        alone = (f"{replay['mpidp-dp']:.0f} / {replay['mpidp-nondp']:.0f} us"
                 if {"mpidp-dp", "mpidp-nondp"} <= set(replay) else "-")

        def ratio(key: str) -> str:
            return f"{r[key]:.2f}" if key in r else "-"
        lines.append(f"| {name}, {r['batch_size']} | {r['examples_per_s']['mpidp-dp']:,.0f} "
                     f"| {ratio('dp_over_nondp')} | {ratio('dp_over_nondp_eager')} "
                     f"| {ratio('eager_over_graph_dp')} | {ratio('opacus_ghost_over_dp')} "
                     f"| {ratio('opacus_hooks_over_dp')} | {ratio('torch_sgd_over_nondp')} "
                     f"| {alone} |")
    return lines


def train_table(train: dict) -> list[str]:
    runs = train["runs"]
    labels = {"cuda_graph": "GPU, DP, one CUDA graph a step (the default)",
              "cuda_nodp": "GPU, non-private, one CUDA graph a step",
              "cuda_eager": "GPU, DP, eager step (--cuda-graph off)",
              "cpu": "the same machine's CPU cores, DP (1 rank x 16 threads)"}
    lines = ["| run | s/epoch |", "|---|---|"]
    for key, label in labels.items():
        if key in runs:
            lines.append(f"| {label} | {_steady(runs[key]):.3f} |")
    graph, nodp, cpu = (runs.get(k) for k in ("cuda_graph", "cuda_nodp", "cpu"))
    notes = []
    if graph and nodp:
        notes.append(f"DP / non-DP {_steady(graph) / _steady(nodp):.2f}")
    if graph and cpu:
        notes.append(f"GPU over CPU cores {_steady(cpu) / _steady(graph):.2f}x")
    if notes:
        lines += ["", "On the GPU, " + ", ".join(notes) + "."]
    return lines


def peers_table(folder: Path) -> list[str]:
    """mpidp's DP runs beside Opacus-DDP (steady epochs), one row per file."""
    lines = []
    for path in sorted(folder.glob("peers_*.json")):
        sweep = json.loads(path.read_text(encoding="utf-8"))
        for r in sweep["summaries"]:
            if r["impl"] != "mpidp" or not r["dp"] or r.get("vs_peer") is None:
                continue
            lines.append(f"| {r['model']}, {r['batch_size']} | {r['examples_per_s']:,.0f} "
                         f"| {r['peer_examples_per_s']:,.0f} | {r['vs_peer']:.2f} "
                         f"| `{r['command'].split(' --metrics')[0]}` |")
    if not lines:
        return []
    return ["| model, batch | mpidp DP, examples/s | Opacus-DDP, examples/s "
            "| mpidp / Opacus-DDP | mpidp's command |", "|---|---|---|---|---|", *lines]


def _dated(bench: dict) -> dict:
    """``date`` and ``command`` at the top (older files), else from ``provenance``
    (the command without its ``--json`` path)."""
    where = bench.get("provenance", {})
    command = bench.get("command") or where["command"].split(" --json")[0]
    return {**bench, "date": bench.get("date") or where["date"][:10],
            "command": f"{command} (tools/gpu_check.sh)" if "gpu_check" not in command
            else command}


def render(folder: Path) -> str:
    bench = _dated(json.loads((folder / "bench_dpsgd_cuda.json").read_text(encoding="utf-8")))
    train = json.loads((folder / "train_seed_workload.json").read_text(encoding="utf-8"))
    parts = [f"Measured {bench['date']} on {bench['device']}, in a machine with "
             f"{bench['machine'].get('cpu', 'a CPU')} (results/{folder.name}/).",
             "", f"The step, `{bench['command']}`: each ratio is time per example, the "
             "median of the rounds' ratios.", "", *bench_table(bench), "",
             f"The seed's workload trained end to end, median of the epochs after the first "
             f"(`{train['command']}`):", "", *train_table(train)]
    peers = peers_table(folder)
    if peers:
        parts += ["", "Whole DP training runs beside Opacus' distributed DP-SGD on the same "
                  "GPU, same data, model, batch and epochs (`mpidp bench scaling --device "
                  "cuda --ranks 1 --privacy dp`, the check's step peers; the second epoch):",
                  "", *peers]
    return "\n".join(parts) + "\n"


def write(page: Path, text: str) -> None:
    """Replace the text between the markers of ``page`` with ``text``."""
    body = page.read_text(encoding="utf-8")
    head, sep, rest = body.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise SystemExit(f"{page}: no {BEGIN} ... {END} markers")
    page.write_text(f"{head}{BEGIN}\n{text}{END}{tail}", encoding="utf-8")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--write", type=Path, default=None, metavar="PAGE")
    args = parser.parse_args(argv)
    text = render(args.folder)
    if args.write:
        write(args.write, text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
