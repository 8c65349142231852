"""Per-task accuracy table: scikit-learn's baselines beside mpidp, non-private and DP.

For every built-in task: ``mpidp prep`` on the given PUMS zips (one file
per task, the same household secret, so every model sees the same rows),
then on the training split scikit-learn's LogisticRegression and
HistGradientBoostingClassifier, and ``mpidp train`` non-private and with
DP-SGD at epsilon = 1 (delta 1e-5), once with the recipe below and once with
every other option at its default; mpidp selects its epoch on the
validation split and reads the test split once, at the end; the
scikit-learn models are fitted on train and scored on test. Prints a
markdown table and writes ``OUT/table.json``.

    python docs/task_table.py /work/shared/data/pums/acs2018_1yr_person_zips OUT [--ranks 2]

The mpidp settings are fixed in advance, the same for every task (below);
they were not searched per task, so no tuning cost is added to epsilon.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent
TASKS = ("employment", "income", "public_coverage", "mobility", "travel_time",
         "income_poverty_ratio", "health_insurance")
#: mpidp's recipes: the defaults for the non-private MLP; for DP-SGD the
#: recipe docs/design/dp-defaults.md describes.
NON_PRIVATE = ["--no-dp"]
DP = ["--optimizer", "adam", "--lr", "0.002", "--batch-size", "1024", "--epochs", "20",
      "--max-grad-norm", "1", "--target-epsilon", "1", "--delta", "1e-5"]
#: DP-SGD with every other option at mpidp train's defaults.
DP_DEFAULTS = ["--target-epsilon", "1", "--delta", "1e-5"]


def prep(zips: Path, out: Path, task: str, ranks: int, secret: Path) -> Path:
    path = out / f"{task}.h5"
    if not path.exists():
        subprocess.run([str(BIN / "mpiexec"), "-n", str(ranks), str(BIN / "mpidp"), "prep",
                        *map(str, sorted(zips.glob("*.zip"))), "--task", task,
                        "--household-secret", str(secret), "--out", str(path), "--quiet"],
                       check=True)
    return path


def sklearn_scores(path: Path) -> dict:
    import h5py
    from sklearn.ensemble import HistGradientBoostingClassifier
    from sklearn.linear_model import LogisticRegression

    with h5py.File(path, "r") as f:
        X, y = f["train/X"][:], f["train/y"][:]
        Xt, yt = f["test/X"][:], f["test/y"][:]
        rows = {s: int(f[f"{s}/y"].shape[0]) for s in ("train", "val", "test") if s in f}
    out = {"rows": rows}
    for name, model in (("logreg", LogisticRegression(max_iter=2000)),
                        ("hgb", HistGradientBoostingClassifier(random_state=0))):
        start = time.perf_counter()
        model.fit(X, y)
        out[name] = float((model.predict(Xt) == yt).mean())
        out[f"{name}_s"] = time.perf_counter() - start
    return out


def mpidp_run(path: Path, ranks: int, options: list[str], seed: int) -> dict:
    done = subprocess.run([str(BIN / "mpiexec"), "-n", str(ranks), str(BIN / "mpidp"),
                           "train", "--data", str(path), "--seed", str(seed),
                           "--no-progress", *options],
                          check=True, capture_output=True, text=True).stdout
    line = next(x for x in done.splitlines() if x.startswith("done:"))
    test = re.search(r"test accuracy ([0-9.]+)", line)
    val = re.search(r"val accuracy ([0-9.]+) \(epoch (\d+)", line)
    eps = re.search(r"epsilon ([0-9.]+)", line)
    return {"test": float(test.group(1)), "val": float(val.group(1)) if val else None,
            "epoch": int(val.group(2)) if val else None,
            "epsilon": float(eps.group(1)) if eps else None, "line": line}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("zips", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--tasks", default=",".join(TASKS))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    secret = args.out / "household.secret"
    if not secret.exists():
        secret.write_bytes(bytes(range(32)))  # one split for every file of the table
    results = {}
    print("| task | train / val / test rows | logistic regression | gradient boosting "
          "| mpidp non-private | mpidp DP, epsilon = 1 | DP gap (points) "
          "| DP, defaults | its gap |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for task in args.tasks.split(","):
        path = prep(args.zips, args.out, task, args.ranks, secret)
        r = sklearn_scores(path)
        r["nondp"] = mpidp_run(path, args.ranks, NON_PRIVATE, args.seed)
        r["dp"] = mpidp_run(path, args.ranks, DP, args.seed)
        r["dp_defaults"] = mpidp_run(path, args.ranks, DP_DEFAULTS, args.seed)
        results[task] = r
        rows = " / ".join(f"{r['rows'].get(s, 0):,}" for s in ("train", "val", "test"))
        gap = 100 * (r["nondp"]["test"] - r["dp"]["test"])
        gap2 = 100 * (r["nondp"]["test"] - r["dp_defaults"]["test"])
        print(f"| {task} | {rows} | {r['logreg']:.4f} | {r['hgb']:.4f} | "
              f"{r['nondp']['test']:.4f} | {r['dp']['test']:.4f} | {gap:.2f} | "
              f"{r['dp_defaults']['test']:.4f} | {gap2:.2f} |", flush=True)
    (args.out / "table.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
