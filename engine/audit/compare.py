"""The audit comparison of docs/audit.md ("Results"): train models, attack each, print tables.

Trains, on a prepared file (the real PUMS files of docs/audit.md), with
``mpiexec -n RANKS mpidp train``: a non-private MLP and DP-SGD models at
epsilon = 8, 4 and 1 (same architecture, and the DP recipe that
docs/design/dp-defaults.md describes). Then, on
a second file prepared from the same person files with most households in
the test split (``mpidp prep --test-fraction 0.98 --like DATA``: about 2,200
training rows), a deliberately overfit non-private model and a DP model
(epsilon = 1) with the same settings. Runs ``mpidp audit`` on each
(membership with both attacks, inversion of each ``--attributes``) and
prints markdown tables. Every command it runs is printed first::

    flock /tmp/mpidp-bench.lock python -m engine.audit.compare --data pums.h5 \
        --inputs 'csv_p*.zip' --out-dir audit_runs --ranks 2

The small file is made by prep rather than by cutting rows out of DATA:
cutting the training split alone would leave the members' households
incomplete but the non-members' whole, and the audit's population sample
relies on both splits holding whole households (:mod:`engine.audit.inputs`).
``--reuse`` keeps files, checkpoints and audits already in ``--out-dir``.
"""
from __future__ import annotations

import argparse
import glob
import json
import shlex
import subprocess
import sys
from pathlib import Path

from collectives.launch import find_tool
from engine.choices import seed_value

#: The training settings: the DP recipe of docs/design/dp-defaults.md.
NONPRIVATE = ["--no-dp", "--lr", "0.05", "--batch-size", "256", "--epochs", "20"]
DP = ["--optimizer", "adam", "--lr", "0.002", "--batch-size", "1024", "--epochs", "20",
      "--max-grad-norm", "1", "--delta", "1e-5"]
#: The overfit setting: few rows, many epochs, small batches.
SMALL_TEST_FRACTION = "0.98"
SMALL = ["--optimizer", "adam", "--lr", "0.002", "--batch-size", "64", "--epochs", "300",
         "--max-grad-norm", "1", "--delta", "1e-5"]


def _run(argv: list[str]) -> None:
    print("$ " + " ".join(shlex.quote(a) for a in argv), flush=True)
    subprocess.run(argv, check=True)


def runs(data: str, small: str) -> list[tuple[str, str, list[str]]]:
    """(name, data file, training options) of every model."""
    return [("non-private", data, NONPRIVATE),
            *((f"DP eps={eps:g}", data, DP + ["--target-epsilon", str(eps)])
              for eps in (8, 4, 1)),
            ("overfit non-private (small)", small, ["--no-dp", *SMALL]),
            ("DP eps=1 (small)", small, SMALL + ["--target-epsilon", "1"])]


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


def _fmt(value, ci=None, digits=3) -> str:
    if value is None:
        return "-"
    if ci:
        return f"{value:.{digits}f} [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"
    return f"{value:.{digits}f}"


def _p(value) -> str:
    return "-" if value is None else (f"{value:.2g}" if value >= 1e-4 else "<1e-4")


def tables(results: list[tuple[str, dict, dict]]) -> str:
    """Markdown: the models, one table per membership attack, the inversion."""
    lines = ["| model | epsilon | members / non-members | loss: members / "
             "non-members | accuracy: members / non-members |",
             "|---|---:|---:|---:|---:|"]
    for name, main, _ in results:
        eps, fit, rows = main["target"]["epsilon"], main["fit"], main["rows"]
        lines.append(f"| {name} | {'-' if eps is None else f'{eps:.2f}'} | "
                     f"{rows['members']:,} / "
                     f"{rows['nonmembers']:,} | {fit['member_loss']:.3f} / "
                     f"{fit['nonmember_loss']:.3f} | {fit['member_accuracy']:.3f} / "
                     f"{fit['nonmember_accuracy']:.3f} |")
    keys = [("auc", "AUC"), ("advantage", "advantage"), ("tpr_at_fpr_0.01", "TPR @ 1% FPR"),
            ("tpr_at_fpr_0.001", "TPR @ 0.1% FPR")]
    for attack_name in ("loss", "calibrated"):
        found = [(name, next((a for a in main["membership"]["attacks"]
                              if a["attack"] == attack_name), None))
                 for name, main, _ in results]
        found = [(name, attack) for name, attack in found if attack]
        if not found:
            continue
        extra = [("yeom_balanced_accuracy", "Yeom balanced acc.")] \
            if attack_name == "loss" else []
        lines += ["", f"{found[0][1]['title']}:", "",
                  "| model | " + " | ".join(t for _, t in keys + extra)
                  + " | p (AUC / advantage) |",
                  "|---|" + "---:|" * (len(keys) + len(extra) + 1)]
        for name, attack in found:
            est, ci, p = attack["estimate"], attack["ci"], attack["p_values"]
            cells = [_fmt(est[k], ci.get(k)) for k, _ in keys + extra]
            lines.append(f"| {name} | " + " | ".join(cells)
                         + f" | {_p(p['auc_p_value'])} / {_p(p['advantage_p_value'])} |")
    attributes = list(results[0][2]) if results else []
    lines += ["", "Attribute inference, accuracy on members / non-members "
              "(baseline: the marginal's mode):", "",
              "| model | " + " | ".join(attributes) + " |",
              "|---|" + "---:|" * len(attributes)]
    for name, _, inv in results:
        cells = []
        for attribute in attributes:
            section = inv[attribute]["inversion"]
            m, n = section["members"], section["nonmembers"]
            cells.append(f"{m['accuracy']:.3f} / {n['accuracy']:.3f} "
                         f"({m['baseline_accuracy']:.3f} / {n['baseline_accuracy']:.3f})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="prepared file (mpidp prep)")
    parser.add_argument("--out-dir", default="audit_runs")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--inputs", required=True,
                        help="the person files DATA was prepared from (a glob), to prepare "
                        "the small file")
    parser.add_argument("--attributes", default="SEX,MAR,DIS")
    parser.add_argument("--seed", type=seed_value, default=1, help="training seed (default: 1)")
    parser.add_argument("--reuse", action="store_true",
                        help="keep checkpoints and audits already in --out-dir")
    args = parser.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mpi = [find_tool("mpiexec"), "-n", str(args.ranks), sys.executable, "-m", "engine.cli"]
    small = str(out / "small.h5")
    if not (args.reuse and Path(small).exists()):
        inputs = sorted(glob.glob(args.inputs))
        if not inputs:
            parser.error(f"--inputs {args.inputs}: no such files")
        # --val-fraction 0: every household not in test is a training one, as
        # before prep wrote validation splits (the audit needs none)
        _run(mpi + ["prep", *inputs, "--like", args.data, "--test-fraction",
                    SMALL_TEST_FRACTION, "--val-fraction", "0", "--out", small])
    attributes = [a for a in args.attributes.split(",") if a]
    results = []
    for name, data, options in runs(args.data, small):
        where = out / _slug(name)
        if not (args.reuse and (where / "checkpoint.pt").exists()):
            epochs = options[options.index("--epochs") + 1]
            _run(mpi + ["train", "--data", data, *options, "--seed", str(args.seed),
                        "--checkpoint-dir", str(where), "--checkpoint-every", epochs,
                        "--eval-every", epochs, "--no-progress"])
        main_json = out / f"{_slug(name)}.audit.json"
        if not (args.reuse and main_json.exists()):
            _run(mpi + ["audit", "--checkpoint", str(where), "--data", data,
                        "--attack", "membership", "--json", str(main_json), "--no-progress"])
        inversions = {}
        for attribute in attributes:
            path = out / f"{_slug(name)}.{attribute}.json"
            if not (args.reuse and path.exists()):
                _run(mpi + ["audit", "--checkpoint", str(where), "--data", data, "--attack",
                            "inversion", "--attribute", attribute, "--json", str(path),
                            "--no-progress"])
            inversions[attribute] = json.loads(path.read_text())
        results.append((name, json.loads(main_json.read_text()), inversions))
    text = tables(results)
    (out / "tables.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
