"""Who pays for privacy: per-group accuracy of every ACS task, non-private and DP.

Two steps, so the page is rendered from result files, never typed:

    python tools/group_table.py measure /work/shared/data/pums/acs2018_1yr_person_zips \\
        results/groups-2026-11-27 --work /tmp/groups [--ranks 2] [--tasks income,...]
    python tools/group_table.py render results/groups-2026-11-27 [--write docs/groups.md]

``measure``, per task, one command at a time on ``--ranks`` ranks: ``mpidp
prep`` of the zips (one household secret for every task), ``mpidp train``
non-private with the defaults and with DP-SGD at epsilon = 1 (delta 1e-5,
every other option at its default: docs/design/dp-defaults.md),
each selecting its epoch on the validation split, then ``mpidp eval
--checkpoint NONDP --checkpoint DP --by RAC1P,SEX`` on the test split (read
once here, after both runs ended). It writes ``OUT/TASK.json``: the
commands, the date, the commit, the machine (``collectives.machine``) and
the eval document, which holds only groups of at least 100 test rows (the
default ``--min-group-size``): the result files obey the page's disclosure
rule.

``render`` prints the tables (``--write`` replaces the text between
``<!-- group tables: begin -->`` and ``<!-- group tables: end -->`` of a
page; tests/test_docs.py checks that docs/groups.md matches its files).
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- group tables: begin -->", "<!-- group tables: end -->"
TASKS = ("employment", "income", "public_coverage", "mobility", "travel_time",
         "income_poverty_ratio", "health_insurance")
#: The two models: mpidp train's defaults, and DP-SGD at epsilon = 1 with them.
NON_PRIVATE = ["--no-dp"]
DP = ["--target-epsilon", "1", "--delta", "1e-5"]
BY = "RAC1P,SEX"


def _mpidp(ranks: int, *argv: str) -> str:
    command = [str(BIN / "mpiexec"), "-n", str(ranks), str(BIN / "mpidp"), *argv]
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout


def _shown(argv: list[str], ranks: int) -> str:
    return f"mpiexec -n {ranks} mpidp " + " ".join(argv)


def measure_task(zips: Path, work: Path, task: str, ranks: int, seed: int) -> dict:
    """Prepare, train both models, compare them per group; the record of one task."""
    secret = work / "household.secret"
    if not secret.exists():
        secret.write_bytes(bytes(range(32)))  # one split for every task's file
    data = work / f"{task}.h5"
    prep = ["prep", *map(str, sorted(zips.glob("*.zip"))), "--task", task,
            "--household-secret", str(secret), "--out", str(data), "--quiet"]
    if not data.exists():
        _mpidp(ranks, *prep)
    done, commands = {}, [_shown(["prep", f"{zips}/*.zip", "--task", task,
                                  "--household-secret", "SECRET", "--out", data.name], ranks)]
    for name, options in (("nondp", NON_PRIVATE), ("dp", DP)):
        run = work / f"{task}-{name}"
        argv = ["train", "--data", str(data), "--seed", str(seed), "--no-progress",
                "--checkpoint-dir", str(run), *options]
        if run.exists():
            subprocess.run(["rm", "-rf", str(run)], check=True)
        out = _mpidp(ranks, *argv)
        done[name] = next(x for x in out.splitlines() if x.startswith("done:"))
        commands.append(_shown(["train", "--data", data.name, "--seed", str(seed),
                                "--checkpoint-dir", run.name, *options], ranks))
    report = work / f"{task}-eval.json"
    argv = ["eval", "--checkpoint", str(work / f"{task}-nondp"), "--checkpoint",
            str(work / f"{task}-dp"), "--data", str(data), "--by", BY, "--json", str(report)]
    _mpidp(ranks, *argv)
    commands.append(_shown(["eval", "--checkpoint", f"{task}-nondp", "--checkpoint",
                            f"{task}-dp", "--data", data.name, "--by", BY, "--json",
                            report.name], ranks))
    return {"task": task, "commands": commands, "train": done,
            "eval": json.loads(report.read_text())}


def measure(args: argparse.Namespace) -> int:
    from collectives import machine

    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
                            capture_output=True, text=True).stdout.strip()
    lscpu = dict(line.split(":", 1) for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines() if ":" in line)
    cpu = {key: lscpu.get(key, "").strip() for key in ("Model name", "CPU family", "Model",
                                                      "CPU(s)")}
    for task in args.tasks.split(","):
        record = measure_task(args.zips, args.work, task, args.ranks, args.seed)
        record.update(date=datetime.date.today().isoformat(), commit=commit,
                      machine=machine.describe(), lscpu=cpu, ranks=args.ranks,
                      command=f"python tools/group_table.py measure {args.zips} {args.out} "
                      f"--ranks {args.ranks} --seed {args.seed} --tasks {task}")
        (args.out / f"{task}.json").write_text(json.dumps(record, indent=1) + "\n")
        print(f"{task}: written", flush=True)
    return 0


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _worst(gaps: dict | None) -> str:
    if not gaps or gaps.get("worst_group") is None:
        return "-"
    return f"{gaps['worst_group_accuracy']:.4f} ({gaps['worst_group']})"


def _gap(gaps: dict | None) -> str:
    return "-" if not gaps or gaps.get("accuracy_gap") is None else \
        f"{100 * gaps['accuracy_gap']:.2f}"


def table(records: list[dict], by: str) -> list[str]:
    """One markdown table: per task, both models' overall and worst-group accuracy,
    the largest gap, and the group that pays most for privacy."""
    lines = ["| task | test rows | groups shown | accuracy, non-private / DP "
             "| worst group, non-private | worst group, DP | largest gap (points), "
             "non-private / DP | pays most for privacy (points, McNemar p) |",
             "|---|---:|---:|---|---|---|---|---|"]
    for r in records:
        doc = r["eval"]
        t = next(t for t in doc["by"] if t["by"] == by)
        a, b = doc["models"]
        worst = min(t["groups"], key=lambda g: g["accuracy_change"])
        p = "-" if worst["mcnemar_p"] is None else f"{worst['mcnemar_p']:.2g}"  # withheld
        pays = (f"{worst['label']} ({100 * worst['accuracy_change']:+.2f}, {p})"
                if worst["accuracy_change"] < 0 else
                f"none: every group gains (least {worst['label']}, "
                f"{100 * worst['accuracy_change']:+.2f}, {p})")
        lines.append(
            f"| {r['task']} | {a['rows']:,} | {t['groups_shown']} of {t['groups_possible']} "
            f"| {a['accuracy']:.4f} / {b['accuracy']:.4f} | {_worst(t['gaps_a'])} "
            f"| {_worst(t['gaps_b'])} | {_gap(t['gaps_a'])} / {_gap(t['gaps_b'])} "
            f"| {pays} |")
    return lines


def render(folder: Path) -> str:
    """The tables and the line that says where they come from."""
    records = [json.loads((folder / f"{t}.json").read_text()) for t in TASKS
               if (folder / f"{t}.json").exists()]
    first = records[0]
    machine = first["machine"]
    dates = sorted({r["date"] for r in records})
    eps = ", ".join(f"{r['eval']['models'][1]['epsilon']:.3f}" for r in records)
    cpu = first.get("lscpu", {})
    model = (f"{cpu['Model name']} (family {cpu['CPU family']}, model {cpu['Model']}, "
             f"{cpu['CPU(s)']} vCPUs)" if cpu else f"{machine['cpu']} ({machine['cores']} cores)")
    head = [f"Measured {', '.join(dates)} on "
            f"{model}, {' '.join(machine['mpi'].split())}, "
            f"{first['ranks']} ranks, by `python tools/group_table.py measure "
            "/work/shared/data/pums/acs2018_1yr_person_zips "
            f"{folder.as_posix()} --ranks {first['ranks']} --seed 1` "
            f"(result files in `{folder.as_posix()}/`); the commands of one task:",
            "", "```sh", *first["commands"], "```", "",
            f"Test split of the ten shared states; groups of at least "
            f"{first['eval']['min_group_size']} test rows; DP epsilon per task (PLD): {eps}.",
            "", "**By race (RAC1P)**", ""]
    return "\n".join(head + table(records, "RAC1P") + ["", "**By sex (SEX)**", ""]
                     + table(records, "SEX")) + "\n"


def write(page: Path, text: str) -> None:
    content = page.read_text()
    start, end = content.index(BEGIN) + len(BEGIN), content.index(END)
    page.write_text(content[:start] + "\n" + text + content[end:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="step", required=True)
    m = sub.add_parser("measure")
    m.add_argument("zips", type=Path)
    m.add_argument("out", type=Path)
    m.add_argument("--work", type=Path, default=Path("/tmp/mpidp-groups"))
    m.add_argument("--ranks", type=int, default=2)
    m.add_argument("--seed", type=int, default=1)
    m.add_argument("--tasks", default=",".join(TASKS))
    r = sub.add_parser("render")
    r.add_argument("folder", type=Path)
    r.add_argument("--write", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.step == "measure":
        return measure(args)
    text = render(args.folder)
    if args.write:
        write(args.write, text)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
