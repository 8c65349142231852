"""The README's audit comparison: train models, attack each, print one table.

Trains, on a prepared file (the real PUMS file in the README), with
``mpiexec -n RANKS mpidp train``: a non-private MLP, DP-SGD models at
epsilon = 8, 4 and 1 (same architecture), and, on a small subset of the
training rows, a deliberately overfit non-private model and a DP model
(epsilon = 1) with the same settings; then runs ``mpidp audit`` on each
(membership with both attacks, inversion of each ``--attributes``) and prints
markdown tables. Every command it runs is printed first::

    flock /tmp/mpidp-bench.lock python -m engine.audit.compare --data pums.h5 \\
        --out-dir audit_runs --ranks 2

``--reuse`` keeps checkpoints (and audits) already in ``--out-dir``.
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

#: The README's training settings (section "Accuracy on the real PUMS files").
NONPRIVATE = ["--no-dp", "--lr", "0.05", "--batch-size", "256", "--epochs", "20"]
DP = ["--optimizer", "adam", "--lr", "0.002", "--batch-size", "1024", "--epochs", "20",
      "--max-grad-norm", "1", "--delta", "1e-5"]
#: The overfit setting: few rows, many epochs, small batches.
SMALL = ["--optimizer", "adam", "--lr", "0.002", "--batch-size", "64", "--epochs", "300",
         "--max-grad-norm", "1", "--delta", "1e-5"]


def write_subset(source: str, target: str, train_rows: int) -> str:
    """Copy ``source`` keeping only its first ``train_rows`` training rows (the
    rows are shuffled, so they are a random sample); every test row and every
    attribute (hence the encoding fingerprint) is kept."""
    import h5py

    tmp = f"{target}.tmp"
    with h5py.File(source, "r") as src, h5py.File(tmp, "w") as dst:
        for key, value in src.attrs.items():
            dst.attrs[key] = value
        dst.attrs["subset_of"] = str(source)
        for split, rows in (("train", train_rows), ("test", None)):
            for name in ("X", "y"):
                data = src[f"{split}/{name}"][:rows]
                dst.create_dataset(f"{split}/{name}", data=data)
    Path(tmp).replace(target)
    return target


def _mpiexec() -> str:
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else "mpiexec"


def _run(argv: list[str]) -> None:
    print("$ " + " ".join(shlex.quote(a) for a in argv), flush=True)
    subprocess.run(argv, check=True)


def runs(data: str, small: str) -> list[tuple[str, str, list[str]]]:
    """(name, data file, training options) of every model."""
    return [("non-private", data, NONPRIVATE),
            *((f"DP eps={eps:g}", data, DP + ["--target-epsilon", str(eps)])
              for eps in (8, 4, 1)),
            ("overfit non-private (subset)", small, ["--no-dp", *SMALL]),
            ("DP eps=1 (subset)", small, SMALL + ["--target-epsilon", "1"])]


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


def _fmt(value, ci=None, digits=3) -> str:
    if value is None:
        return "-"
    if ci:
        return f"{value:.{digits}f} [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"
    return f"{value:.{digits}f}"


def tables(results: list[tuple[str, dict, dict]]) -> str:
    """Markdown tables: membership, then inversion per attribute."""
    lines = ["| model | epsilon | test acc. | loss: members / non-members | AUC (loss) | "
             "AUC (calibrated) | advantage (loss) | TPR @ 1% FPR (loss) | "
             "TPR @ 0.1% FPR (calibrated) | Yeom balanced acc. |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, main, _ in results:
        attacks = {a["attack"]: a for a in main["membership"]["attacks"]}
        loss, cal = attacks["loss"], attacks.get("calibrated")
        eps = main["target"]["epsilon"]
        fit = main["fit"]
        lines.append(
            f"| {name} | {'-' if eps is None else f'{eps:.2f}'} | "
            f"{fit['nonmember_accuracy']:.4f} | {fit['member_loss']:.3f} / "
            f"{fit['nonmember_loss']:.3f} | "
            f"{_fmt(loss['estimate']['auc'], loss['ci'].get('auc'))} | "
            f"{_fmt(cal['estimate']['auc'], cal['ci'].get('auc')) if cal else '-'} | "
            f"{_fmt(loss['estimate']['advantage'], loss['ci'].get('advantage'))} | "
            f"{_fmt(loss['estimate']['tpr_at_fpr_0.01'], loss['ci'].get('tpr_at_fpr_0.01'))} | "
            f"{_fmt(cal['estimate']['tpr_at_fpr_0.001'], cal['ci'].get('tpr_at_fpr_0.001')) if cal else '-'} | "
            f"{_fmt(loss['estimate']['yeom_balanced_accuracy'], loss['ci'].get('yeom_balanced_accuracy'))} |")
    attributes = [a for a in (results[0][2] if results else {})]
    lines += ["", "| model | " + " | ".join(f"{a}: members / non-members (baseline)"
                                           for a in attributes) + " |",
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
    parser.add_argument("--subset-rows", type=int, default=2000,
                        help="training rows of the overfit models (default: 2000)")
    parser.add_argument("--attributes", default="SEX,MAR,DIS")
    parser.add_argument("--seed", type=int, default=1, help="training seed (default: 1)")
    parser.add_argument("--reuse", action="store_true",
                        help="keep checkpoints and audits already in --out-dir")
    args = parser.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    small = str(out / f"subset_{args.subset_rows}.h5")
    if not (args.reuse and Path(small).exists()):
        write_subset(args.data, small, args.subset_rows)
    mpi = [_mpiexec(), "-n", str(args.ranks), sys.executable, "-m", "engine.cli"]
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
