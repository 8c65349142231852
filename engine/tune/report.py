"""What ``mpidp tune`` reports: the chosen trial, the table, the JSON, the train command.

:func:`write_report` (rank 0, at the end of a search) writes ``tune.json``,
prints the table and the chosen settings, and keeps only the chosen trial's
model, which :func:`publish` rewrites as the file to publish.
"""
from __future__ import annotations

import math
import os
import shlex
import shutil
import sys
from pathlib import Path

from engine.config import TrainConfig
from engine.errors import EXIT_DIVERGED
from engine.tune.options import Options
from engine.tune.space import describe_point, format_value, from_plain
from engine.tune.state import FORMAT, VERSION

_DEFAULTS = TrainConfig(data="")
#: The record's field each ``--select-on`` maximises.
SCORES = {"val_accuracy": "val_accuracy",
          "worst_group_val_accuracy": "val_worst_group_accuracy"}


def choose(records: list[dict], key: str = "val_accuracy") -> dict | None:
    """The finished trial with the best ``key`` score (the lowest number on a
    tie); None when no trial finished (with that score)."""
    done = [r for r in records if r.get("status") == "ok" and r.get(key) is not None
            and math.isfinite(r[key])]
    if not done:
        return None
    return max(done, key=lambda r: (r[key], -r["trial"]))


def train_command(data: str, settings: dict, privacy: dict, ranks: int,
                  selection: dict | None = None) -> str:
    """The ``mpidp train`` command line that trains ``settings`` with the search's
    privacy options (``privacy``: dp, target_epsilon, noise_multiplier, delta,
    accountant, privacy_unit) and its epoch choice (``selection``: select_on,
    group_by, min_group_size; None or empty for the default val accuracy)."""
    words = (["mpiexec", "-n", str(ranks)] if ranks > 1 else []) + \
        ["mpidp", "train", "--data", data]
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        if key == "hidden":
            words += [flag, ",".join(str(w) for w in value)]
        else:
            words += [flag, format_value(value)]
    if not privacy.get("dp", True):
        words.append("--no-dp")
    else:
        if privacy.get("target_epsilon") is not None:
            words += ["--target-epsilon", format_value(float(privacy["target_epsilon"]))]
        elif privacy.get("noise_multiplier") is not None and "noise_multiplier" not in settings:
            words += ["--noise-multiplier", format_value(float(privacy["noise_multiplier"]))]
        words += ["--delta", format_value(float(privacy.get("delta", _DEFAULTS.delta)))]
        if privacy.get("accountant", _DEFAULTS.accountant) != _DEFAULTS.accountant:
            words += ["--accountant", privacy["accountant"]]
        if privacy.get("privacy_unit", "person") != "person":
            words += ["--privacy-unit", privacy["privacy_unit"]]
    for key, value in (selection or {}).items():  # else the run picks its epoch otherwise
        if value is not None and not (key == "min_group_size"
                                      and value == _DEFAULTS.min_group_size):
            words += ["--" + key.replace("_", "-"), format_value(value)]
    return " ".join(shlex.quote(w) for w in words)


def _num(value, spec: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, spec)


def table(records: list[dict], shown: list[str], chosen: dict | None,
          tuned_epsilon: float | None, worst: bool = False) -> list[str]:
    """The report's table, one row per trial (``*`` marks the chosen one); with
    ``worst``, a column of the worst group's val accuracy."""
    rows = [("trial", "settings", "val acc") + (("worst group",) if worst else ())
            + ("train s", "epsilon", "eps incl. tuning", "status")]
    for r in sorted(records, key=lambda r: r["trial"]):
        mark = "*" if chosen is not None and r["trial"] == chosen["trial"] else " "
        rows.append((f"{mark}{r['trial']}", describe_point(r["settings"], shown) or "-",
                     _num(r.get("val_accuracy"), ".4f"))
                    + ((_num(r.get("val_worst_group_accuracy"), ".4f"),) if worst else ())
                    + (_num(r.get("train_time_s"), ".1f"), _num(r.get("epsilon"), ".3f"),
                       _num(tuned_epsilon if r.get("epsilon") is not None else None, ".3f"),
                       r["status"]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    left = {1}
    return ["  ".join(cell.ljust(widths[i]) if i in left or i == len(row) - 1
                      else cell.rjust(widths[i]) for i, cell in enumerate(row)).rstrip()
            for row in rows]


def publish(directory: str, chosen: dict, statement, opts: Options) -> bool:
    """Rank 0: the chosen trial's directory keeps one file, ``best.pt``, the
    model to publish, stating the epsilon including the tuning.

    From the trial's ``best.pt`` (or its checkpoint's last parameters, through
    :func:`engine.checkpoint.published`): the mark of a trial of an unfinished
    search goes (``trial_of_search``, ``guarantee`` False:
    :func:`engine.checkpoint.tune_trial`), ``epsilon`` and ``privacy`` become
    the tuning's statement (``includes_tuning``, the trial's own epsilon
    beside it, ``guarantee`` True), and ``selected["tuning"]`` names the trial, its settings and,
    where the statement covers it, the score that chose it (noised, or from
    a split declared public). The trial's ``checkpoint.pt`` is removed: it
    holds the seed, the exact val and test figures and the trial's epsilon
    alone, none of which the statement covers, and a finished trial has
    nothing to resume. Idempotent (a re-run of a finished search publishes
    the same file again). Returns False, writing nothing, when the trial left
    no model (a re-run chose a trial whose model an earlier run had already
    removed as not chosen).

    Raises:
        CheckpointError: the trial's files cannot be read.
        WriteFailed: ``best.pt`` cannot be written (the directory is unchanged).
    """
    from engine import checkpoint as ckpt

    best = ckpt.best_path_in(directory)
    if best.is_file():
        payload = ckpt.load_file(best)
    elif ckpt.exists_in(directory):
        payload = ckpt.published(ckpt.load_file(ckpt.path_in(directory)), None)
    else:
        return False
    payload = {k: v for k, v in payload.items() if k in ckpt.PUBLISHED_KEYS}
    privacy = dict(payload.get("privacy") or {})
    # the search has ended: no longer one trial of it (engine.checkpoint.tune_trial)
    privacy.pop("trial_of_search", None)
    shuffled = privacy.get("sampling") == "shuffle"
    privacy.update(guarantee=None if privacy.get("epsilon") is None else not shuffled,
                   not_a_guarantee=ckpt.SHUFFLE_REASON if shuffled else None)
    if statement is not None:
        privacy.update(epsilon=statement.epsilon, delta=statement.delta, includes_tuning=True,
                       trial_epsilon=chosen.get("epsilon"), tuning=statement.text,
                       tuning_mode=statement.mode, epsilon_of="tuning",
                       spent_epsilon=None, guarantee=not shuffled)
    payload["privacy"] = privacy
    payload["epsilon"] = privacy.get("epsilon")
    tuning = {"trial": chosen["trial"], "settings": chosen["settings"]}
    worst = {k: chosen[k] for k in ("val_worst_group_accuracy", "val_worst_group", "group_by")
             if chosen.get(k) is not None}
    if chosen.get("val_noise_std") is not None:  # the noisy score the statement covers
        tuning.update(val_accuracy=chosen["val_accuracy"],
                      val_noise_std=chosen["val_noise_std"], val_split="val, noised", **worst)
    elif opts.public_split:  # exact, from a split the user declared public
        tuning.update(val_accuracy=chosen["val_accuracy"], val_noise_std=None,
                      val_split=f"{opts.public_split}, declared public", **worst)
    selected = {k: v for k, v in (payload.get("selected") or {}).items()
                if k in ckpt.PUBLISHED_SELECTION}
    payload["selected"] = {**selected, "tuning": tuning}
    ckpt.save(directory, payload, ckpt.BEST_NAME)
    ckpt.path_in(directory).unlink(missing_ok=True)
    return True


def write_report(opts: Options, space, info, trials, results: dict, statement, size: int,
            parallel: int, elapsed: float) -> int:
    """Rank 0: the table, tune.json, the chosen settings; prunes the other trials'
    checkpoints. Returns the exit code."""
    from engine import outputs
    from engine.tune import search

    records = sorted((results[t.key] for t in trials if t.key in results),
                     key=lambda r: r["trial"])
    tuned = statement.epsilon if statement is not None else None
    for r in records:
        r["epsilon_incl_tuning"] = tuned if r.get("epsilon") is not None else None
    chosen = choose(records, SCORES[opts.objective])
    by_number = {t.number: t for t in trials}
    command, checkpoint_dir = None, None
    if chosen is not None:
        settings = from_plain(chosen["settings"])
        selection = ({"select_on": opts.objective, "group_by": opts.group_by,
                      "min_group_size": opts.min_group_size}
                     if opts.objective != "val_accuracy" else None)
        command = train_command(opts.data, settings, opts.privacy, size, selection)
        checkpoint_dir = by_number[chosen["trial"]].directory(opts.out)
    # Only the chosen trial's model is kept: the others are not covered by the
    # tuning's privacy statement, and nothing else reads them.
    for trial in trials:
        if chosen is None or trial.number != chosen["trial"]:
            shutil.rmtree(trial.directory(opts.out), ignore_errors=True)
    kept = chosen is not None and publish(checkpoint_dir, chosen, statement, opts)
    document = {
        "format": FORMAT, "version": VERSION, "data": opts.data, "ranks": size,
        "parallel": parallel, "space": space.to_json(), "search": opts.search,
        "trials_planned": len(trials), "selection": (
            ("val accuracy" if opts.objective == "val_accuracy" else
             f"the accuracy of the worst {opts.group_by} group of at least "
             f"{opts.min_group_size} val rows")
            + ("" if opts.score_std is None else
                              f" with Gaussian noise of std {opts.score_std:g} on the count"
                              + (" (households' shares)" if opts.privacy["privacy_unit"]
                                 == "household" else ""))),
        "privacy": None if statement is None else statement.to_json(),
        "trials": records,
        "chosen": None if chosen is None else {
            **chosen, "checkpoint": checkpoint_dir, "train_command": command,
            "model": os.path.join(checkpoint_dir, "best.pt") if kept else None,
            "test_accuracy_note": "the test accuracy of the chosen trial, as mpidp train "
            "reports it; never used for the choice"},
        "elapsed_s": elapsed,
    }
    outputs.write_json(Path(opts.out) / search.REPORT_FILE, document, "--out", private=True)
    if not trials:
        print("the number of trials drawn (K ~ Poisson) is 0: nothing was trained, nothing "
              f"chosen, no privacy spent; report: {opts.out}/{search.REPORT_FILE}", flush=True)
        return 0
    print("")
    for line in table(records, space.varied, chosen, tuned,
                             worst=opts.objective != "val_accuracy"):
        print(line)
    for r in records:
        if r["status"] == "failed":
            print(f"  trial {r['trial']} failed: {r['message']}")
    if chosen is None:
        failed = sum(r["status"] == "failed" for r in records)
        why = (f"no trial finished ({failed} failed)" if failed == len(records) else
               f"no trial has a score ({failed} failed; the others scored no {opts.group_by} "
               f"group of --min-group-size {opts.min_group_size} rows)"
               if opts.objective != "val_accuracy" else
               f"no trial has a score ({failed} failed)")
        print(f"mpidp: error: {why}; the report is in {opts.out}/{search.REPORT_FILE}",
              file=sys.stderr, flush=True)
        return EXIT_DIVERGED
    eps = chosen.get("epsilon")
    worst = (f", worst {opts.group_by} group {chosen['val_worst_group']} "
             f"{chosen['val_worst_group_accuracy']:.4f}"
             if opts.objective != "val_accuracy" else "")
    print(f"\nchosen: trial {chosen['trial']}, val accuracy {chosen['val_accuracy']:.4f}"
          + worst
          + (f", epsilon {eps:.3f} per trial, {tuned:.3f} incl. tuning "
             f"(delta {opts.privacy['delta']:g})" if eps is not None and tuned is not None
             else "")
          + (f"; model: {os.path.join(checkpoint_dir, 'best.pt')}"
             + (" (it states the epsilon incl. tuning)" if tuned is not None else "")
             if kept else "; its model is no longer kept (an earlier run of this search "
             "chose another trial and removed it): train it again with the command below"))
    print(f"train it again with:\n  {command}")
    if opts.dp:
        print("(training again spends that run's epsilon on top of the tuning's: the settings "
              "were chosen on private data; the chosen trial's model needs no retraining)")
    print(f"report: {opts.out}/{search.REPORT_FILE}", flush=True)
    return 0
