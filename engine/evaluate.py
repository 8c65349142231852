"""Evaluation in parallel: every rank scores its shard, counts are all-reduced.

Also ``mpidp eval``: accuracy and loss of a checkpoint's model on any
prepared file (for example other states, prepared with ``prep --like`` so the
encoding matches; ``prep --test-fraction 1`` puts every row in the test
split of a file meant only for scoring), on one split or on all of them,
overall or per group of people, and two models side by side::

    mpiexec -n 2 mpidp eval --checkpoint runs/a --data other.h5 --split test
    mpiexec -n 2 mpidp eval --checkpoint runs/a/checkpoint.pt --data pums.h5 --split all
    mpiexec -n 2 mpidp eval --checkpoint runs/a --data pums.h5 --by SEX,RAC1P,SEX:AGEP \\
        --json groups.json --plot groups.png
    mpiexec -n 2 mpidp eval --checkpoint runs/nondp --checkpoint runs/dp --data pums.h5 --by RAC1P

A run's directory scores the run's model: the epoch selected on the
validation split when the run kept one (``best.pt``), else the last
parameters; a file scores the parameters it holds (``checkpoint.pt``: the
last epoch's; ``best.pt``: the selected one's). The epsilon printed is the
one the file states, with its unit and delta, as ``mpidp train``'s done line
(:func:`engine.checkpoint.epsilon_text`): for the model a ``mpidp tune``
chose, the epsilon including the tuning (said so), never the trial's alone;
for a run that ``--target-accuracy`` stopped, its budget (what its steps
spent beside it); and it says ``NOT a guarantee`` where the file does
(``--sampling shuffle``; a trial of a ``mpidp tune`` search that has not
ended). A ``checkpoint.pt`` states what its run would publish
(:func:`engine.checkpoint.statement_of`).

A checkpoint is untrusted input: its contents are checked before use
(:func:`engine.checkpoint.check_model_file`), and a model of the user's
(``MODULE:FACTORY``) is rebuilt only when ``--model`` names that factory
again: the name in the file alone is never imported.

The data file is checked against the file's record of its training data
(:func:`engine.audit.inputs.data_checked`): the task and label, and the
encoding's fingerprint where the record holds it (a run's directory, a
``checkpoint.pt``); a ``best.pt`` on its own records only the data's public
layout, so a file encoded with other statistics passes, and the text says so
in a ``note:`` line (the JSON: ``data_checked`` ``"layout"`` and the note in
``notes``; ``"shape"`` where the file records neither, ``"encoding"`` where
the whole check was made).

``--by`` groups the rows by the group attributes the file keeps (``SEX``,
``RAC1P``, ``AGEP`` in bands, ``ST``, the task's group:
:mod:`preprocessing.groups`; ``A:B`` crosses two): per group the rows,
accuracy, true- and false-positive rates and selection rate with exact
95% intervals, and the gaps between groups (:mod:`engine.groups`); groups
smaller than ``--min-group-size`` are left out of every output. Two
``--checkpoint`` score two models on the same rows and say which groups
lose most accuracy from the first to the second (docs/groups.md).
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
from typing import Callable

import numpy as np

import collectives
from collectives import MPI
from engine import group_plot, group_report, groups, outputs
from engine.errors import (CheckpointError, ConfigError, DataError, GroupError, OutputError,
                           WriteFailed, agree)
from engine.shard import read_group_columns, read_info, read_shard
from preprocessing import groups as group_attributes
from preprocessing.h5format import SPLITS

CHUNK_ROWS = 65536


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, action="append",
                        help="checkpoint file (or the --checkpoint-dir of a training run); "
                        "twice to compare two models on the same rows (typically the "
                        "non-private one first, the DP one second)")
    parser.add_argument("--data", required=True, help="prepared HDF5 file (mpidp prep)")
    parser.add_argument("--model", action="append", default=None, metavar="MODULE:FACTORY",
                        help="the factory of a model of yours that --checkpoint holds, as it "
                        "was trained (--model MODULE:FACTORY): mpidp imports and calls it to "
                        "rebuild the model, so name only code and files you trust; a name "
                        "read from a checkpoint is never imported otherwise (the checkpoint "
                        "is refused). Built-in models need none; twice for two such models")
    parser.add_argument("--split", default="test", choices=(*SPLITS, "all"),
                        help="which split to score: train, val (a file with a validation "
                        "split), test, or all (every split the file has, counted "
                        "together) (default: test)")
    parser.add_argument("--by", default=None, metavar="ATTR[,ATTR|A:B...]",
                        help="figures per group of a group attribute the file keeps (SEX, "
                        "RAC1P, AGEP, ST, the task's group), or of a cross of two (SEX:RAC1P); "
                        "comma-separated for several tables")
    parser.add_argument("--min-group-size", type=int, default=None,  # None: not given
                        metavar="N", help="groups with fewer rows are left out of every "
                        "output, figures and labels alike (default: 100, a common "
                        "disclosure-control threshold)")
    parser.add_argument("--plot", default=None, metavar="FILE.png",
                        help="with --by: a bar chart of each group's accuracy with its "
                        "interval (.png, or .svg)")
    parser.add_argument("--allreduce", default="auto",
                        help="all-reduce algorithm for the counts (default: auto)")
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                        help="print one JSON document instead of the text (or write it to "
                        "FILE, beside the text)")


def predict_shard(logits_fn: Callable, X, y) -> tuple[np.ndarray, float]:
    """This rank's predicted classes (int64) and the summed cross-entropy.

    Args:
        logits_fn: rows (torch, with the trailing ones column) -> logits.
        X, y: this rank's rows (numpy; X with the ones column), possibly empty.
    """
    import torch  # deferred: keeps `mpidp eval --help` fast

    pred = np.empty(y.shape[0], dtype=np.int64)
    loss_sum = 0.0
    with torch.no_grad():
        for start in range(0, y.shape[0], CHUNK_ROWS):
            xb = torch.from_numpy(X[start:start + CHUNK_ROWS])
            yb = torch.from_numpy(y[start:start + CHUNK_ROWS])
            out = logits_fn(xb)
            pred[start:start + yb.shape[0]] = out.argmax(1).numpy()
            loss_sum += float(torch.nn.functional.cross_entropy(
                out.double(), yb, reduction="sum"))
    return pred, loss_sum


def evaluate_shard(logits_fn: Callable, X, y, comm, algorithm: str = "auto") -> dict:
    """Collective: accuracy and mean cross-entropy over all ranks' rows.

    Args:
        logits_fn: rows (torch, with the trailing ones column) -> logits.
        X, y: this rank's rows (numpy; X with the ones column), possibly empty.
        comm: every rank of it must call this.

    Returns:
        ``{"accuracy", "loss", "rows", "correct"}`` (same on every rank);
        accuracy and loss are NaN when no rank has a row.
    """
    pred, loss_sum = predict_shard(logits_fn, X, y)
    return _overall(int((pred == y).sum()), loss_sum, y.shape[0], comm, algorithm)


def _overall(correct: int, loss_sum: float, rows: int, comm, algorithm: str) -> dict:
    counts = np.array([correct, loss_sum, rows], dtype=np.float64)
    collectives.allreduce(counts, comm, algorithm=algorithm)
    rows = int(counts[2])
    nan = float("nan")
    return {"accuracy": counts[0] / rows if rows else nan,
            "loss": counts[1] / rows if rows else nan,
            "rows": rows, "correct": int(counts[0])}


def _check_options(args: argparse.Namespace) -> list[groups.Grouping]:
    """The options' own checks, before any file is read (every rank parsed the
    same command line, so the errors are collective).

    Raises:
        ConfigError: three or more --checkpoint, --min-group-size below 1, --plot
            without --by or of another format, a --model that is no
            MODULE:FACTORY or given more often than --checkpoint.
        GroupError: a --by that cannot be read.
    """
    if len(args.checkpoint) > 2:
        raise ConfigError(f"--checkpoint given {len(args.checkpoint)} times: give one model, "
                          "or two to compare on the same rows", collective=True)
    _check_model_options(args.model or [], len(args.checkpoint))
    if args.min_group_size is not None and not args.by:
        raise ConfigError(f"--min-group-size {args.min_group_size} sizes the groups of --by: "
                          "give --by too (e.g. --by RAC1P), or leave --min-group-size out",
                          collective=True)
    if args.min_group_size is None:
        args.min_group_size = groups.MIN_GROUP_SIZE
    if args.min_group_size < 1:
        raise ConfigError(f"--min-group-size {args.min_group_size}: give at least 1 (the "
                          f"default, {groups.MIN_GROUP_SIZE}, is a common disclosure-control "
                          "threshold for published tables)", collective=True)
    if args.by is not None and not args.by.strip():  # '' was taken for no --by at all
        raise ConfigError("--by is empty; name a group attribute (e.g. --by SEX), or leave "
                          "--by out", collective=True)
    if args.plot and not args.by:
        raise ConfigError("--plot draws the groups of --by: give --by too (e.g. --by RAC1P)",
                          collective=True)
    if args.plot and not args.plot.lower().endswith(group_plot.FORMATS):
        raise ConfigError(f"--plot {args.plot}: name a .png or .svg file", collective=True)
    if not args.by:
        return []
    try:
        groupings = groups.parse_by(args.by)
    except ValueError as exc:
        raise GroupError(str(exc), collective=True) from None
    return groupings


def _check_model_options(named: list[str], checkpoints: int) -> None:
    """Raise ConfigError (collective) unless each ``--model`` is a MODULE:FACTORY,
    at most one per ``--checkpoint``."""
    from engine.nn.model_names import is_user_factory

    if len(named) > checkpoints:
        raise ConfigError(f"--model given {len(named)} times for {checkpoints} --checkpoint: "
                          "name the factory of each checkpoint's model of yours once",
                          collective=True)
    for name in named:
        if not is_user_factory(name):
            raise ConfigError(f"--model {name}: name a model of yours as MODULE:FACTORY (the "
                              "--model it was trained with); built-in models need no "
                              "--model", collective=True)


def _check_named_models(named: list[str], payloads: list[dict], checkpoints: list[str]
                        ) -> list[str | None]:
    """The ``--model`` for each checkpoint: its recorded ``MODULE:FACTORY`` when
    named, else None.

    Raises:
        CheckpointError: a checkpoint whose model is a factory of the user's
            that no ``--model`` names (it is never imported from a file
            alone), or a ``--model`` that no checkpoint's model is.
    """
    from engine import checkpoint as ckpt
    from engine import models

    recorded = [ckpt.model_of(p, c)[0] for p, c in zip(payloads, checkpoints)]
    names = [entry.get("name") for entry in recorded]
    unmatched = [n for n in named if n not in names] + [None]  # for the message
    chosen = []
    for entry, checkpoint in zip(recorded, checkpoints):
        name = models.factory_to_import(entry)
        models.check_named(entry, name if name in named else unmatched[0], checkpoint)
        chosen.append(name)
    for name in named:
        if name not in names:
            held = ", ".join(f"{c}: {n or 'an MLP'}" for c, n in zip(checkpoints, names))
            raise CheckpointError(f"--model {name} is no --checkpoint's model ({held}): name "
                                  "the factory a model was trained with, or leave --model out")
    return chosen


def _groupable() -> list[str]:
    """Every column a file could keep as a group attribute (for a typo's hint)."""
    from preprocessing import dictionary

    names = [a.name for a in group_attributes.KEPT]
    return names + [n for n, w in dictionary.load_labels().items() if w.codes and n not in names]


def _check_groups(info, groupings: list[groups.Grouping], data: str) -> None:
    """Raises GroupError (collective: every rank read the same header) unless the
    file keeps every attribute ``groupings`` names: an unknown attribute (no
    file can keep it), a file without group columns, or one without that one."""
    if not groupings:
        return
    for grouping in groupings:  # a name no file can keep, whatever this one keeps
        for name in grouping.attributes:
            why = group_attributes.problem(name) if name not in info.groups else None
            if why is None:
                continue
            if "not a column" in why:
                kept = [a.name for a in group_attributes.KEPT]
                close = (difflib.get_close_matches(name, kept, n=1)
                         or difflib.get_close_matches(name, _groupable(), n=1))
                why = f"unknown attribute {name}" + (f" (did you mean {close[0]}?)"
                                                     if close else "")
            raise GroupError(f"--by {grouping.name}: {why}; a prepared file keeps SEX, "
                             "RAC1P, AGEP (in bands), ST and its task's group column",
                             collective=True)
    if not info.groups and info.is_image:
        raise GroupError(f"--by: {data} is an image file: its rows are images, with no "
                         "person attributes to group by; score it overall (leave --by out)",
                         collective=True)
    if not info.groups:
        raise GroupError(f"--by: {data} keeps no group columns (prepared by an mpidp that "
                         "kept none, or a synthetic file); it is scored overall without "
                         "--by; prepare it again with mpidp prep to group its rows by SEX, "
                         "RAC1P, AGEP, ST and the task's group", collective=True)
    for grouping in groupings:
        for name in grouping.attributes:
            if name not in info.groups:
                raise GroupError(f"--by {grouping.name}: {data} keeps the group columns "
                                 f"{', '.join(info.groups)}, not {name} (a task file with "
                                 f"group = \"{name}\" keeps it)", collective=True)


class _Model:
    """One --checkpoint: its payload, the function to its logits, what it states."""

    def __init__(self, checkpoint: str, payload: dict, info, data: str,
                 named: str | None = None) -> None:
        import torch  # deferred: kept out of `mpidp eval --help`

        from engine import checkpoint as ckpt
        from engine import models
        from engine.nn.mlp import MLPSpec

        self.checkpoint = checkpoint
        self.payload = payload
        recorded = payload["model"]
        spec = None if recorded.get("kind") == "module" else MLPSpec.from_dict(recorded)
        trained = payload.get("data") or {}
        # The task first: a file of another task also differs in its features, and
        # "827 features, the model expects 99" hides the reason.
        if trained.get("task") and info.task and trained["task"] != info.task:
            raise DataError(f"{data} holds task {info.task!r}; the model was trained for "
                            f"{trained['task']!r} on {trained.get('path')}", collective=True)
        if spec is not None and (info.n_features != spec.dims[0]
                                 or info.n_classes != spec.dims[-1]):
            raise DataError(f"{data} has {info.n_features} features and {info.n_classes} "
                            f"classes; the model expects {spec.dims[0]} and {spec.dims[-1]} "
                            "(prepare the file with `mpidp prep --like` the training file)",
                            collective=True)
        unlike = info.encoded_unlike(trained)
        if unlike:
            raise DataError(f"{data} was encoded differently from the training file "
                            f"{trained.get('path')} ({unlike}); prepare "
                            "it with `mpidp prep --like` the training file", collective=True)
        from engine.audit.inputs import ENCODING, data_checked, layout_note  # deferred: torch

        #: how far the file's record of its training data checked ``data``: "encoding",
        #: or only "layout" (a best.pt alone) or "shape" (no record of either)
        self.data_checked = data_checked(trained, info)
        #: what the text says below the figures and the JSON in ``notes``
        self.notes = [] if self.data_checked == "encoding" else [
            layout_note(trained, info, "scoring", ENCODING)]
        recorded, params, self.selected = ckpt.model_of(payload, checkpoint)
        #: the privacy the file states: epsilon, delta, unit, whether a guarantee
        self.statement = ckpt.statement_of(payload)
        #: what epsilon protects: a row of an image file is an image
        self.unit = ckpt.stated_unit(self.statement, info.is_image)
        self.logits = models.checkpoint_logits(recorded, params.to(torch.float32),
                                               info.n_features, info.n_classes,
                                               str(checkpoint), model=named)

    @property
    def epsilon(self) -> float | None:
        """The epsilon the file states (:func:`engine.checkpoint.statement_of`)."""
        return self.statement.get("epsilon")

    def epsilon_text(self) -> str:
        """``epsilon 1.000 per person (delta 1e-05)`` and what qualifies it, as
        ``mpidp train``'s done line says it (:func:`engine.checkpoint.epsilon_text`)."""
        from engine import checkpoint as ckpt

        return ckpt.epsilon_text(self.statement, self.unit)

    def describe(self, split: str) -> dict:
        """What the text and the JSON say of the model beside its figures."""
        payload, selected, statement = self.payload, self.selected, self.statement
        step = selected.get("step", payload.get("step")) if selected else payload.get("step")
        tuned = bool(statement.get("includes_tuning"))
        out = {"checkpoint": str(self.checkpoint), "split": split, "step": step,
               "epsilon": self.epsilon, "epsilon_includes_tuning": tuned,
               "data_checked": self.data_checked, "notes": list(self.notes)}
        if self.epsilon is not None:
            out.update(delta=statement.get("delta"), privacy_unit=self.unit,
                       epsilon_is_guarantee=statement.get("guarantee") is not False,
                       epsilon_text=self.epsilon_text())
            if statement.get("guarantee") is False:
                out["not_a_guarantee"] = statement.get("not_a_guarantee")
            if statement.get("epsilon_of") == "budget":  # a --target-accuracy stop
                out.update(epsilon_of="budget", spent_epsilon=statement.get("spent_epsilon"))
        if statement.get("trial_of_search"):
            out["trial_of_search"] = statement["trial_of_search"]
        if tuned:
            out["trial_epsilon"] = statement.get("trial_epsilon")
        if selected and selected.get("epoch") is not None:
            out["selected_epoch"] = selected.get("epoch")
            out["selected_on"] = selected.get("on") or "val_accuracy"
        return out

    def name(self) -> str:
        """``runs/a (epsilon 1.000 per person)`` or ``runs/a (non-private)``
        (``incl. tuning``, ``NOT a guarantee`` where the file says so)."""
        if self.epsilon is None:
            return f"{self.checkpoint} (non-private)"
        tuned = " incl. tuning" if self.statement.get("includes_tuning") else ""
        warn = ", NOT a guarantee" if self.statement.get("guarantee") is False else ""
        return f"{self.checkpoint} (epsilon {self.epsilon:.3f} per {self.unit}{tuned}{warn})"


def _checkpoint_files(checkpoints: list[str]) -> dict[str, str]:
    """The files ``--checkpoint`` names (for a run's directory, its checkpoint
    and its selected model), which no output may replace."""
    from engine.checkpoint import run_files  # deferred: as load_model below

    files = {}
    for given in checkpoints:
        files.update(run_files(given, f"--checkpoint {given}") if os.path.isdir(given)
                     else {f"--checkpoint {given}": given})
    return files


def run(args: argparse.Namespace) -> int:
    """Collective: score the checkpoint(s) on ``--split`` of ``--data``, overall and
    ``--by`` group; rank 0 prints and writes.

    Raises:
        ConfigError, GroupError: bad options, before any file is read; a --by
            attribute the file does not keep, or a table with no group left.
        CheckpointError, DataError: on every rank (a model that does not fit the file,
            a file that is no model file, a factory of the user's that no
            --model names).
        OutputError: a --json or --plot file that cannot be written, before any work.
    """
    comm = MPI.COMM_WORLD
    groupings = _check_options(args)
    error, payloads, named = None, [], []
    try:
        if comm.Get_rank() == 0:
            outputs.check_all({"--json": args.json, "--plot": args.plot})
            outputs.check_apart({"--json": args.json, "--plot": args.plot},
                                {"--data": args.data, **_checkpoint_files(args.checkpoint)})
        from engine import checkpoint as ckpt  # deferred: torch, kept out of `--help`

        payloads = [ckpt.load_model(checkpoint) for checkpoint in args.checkpoint]
        named = _check_named_models(args.model or [], payloads, args.checkpoint)
        ckpt.check_data_path(args.data)
    except (CheckpointError, DataError, OutputError) as exc:
        error = exc
    agree(comm, error)
    info = read_info(args.data, comm)
    _check_groups(info, groupings, args.data)
    splits = _splits_to_score(info, args.split, args.data)
    models = [_Model(c, p, info, args.data, n)
              for c, p, n in zip(args.checkpoint, payloads, named)]
    per_split: list[dict] = [{} for _ in models]
    cells = [groups.Cells.of(g, {n: info.groups[n].labels for n in g.attributes})
             for g in groupings]
    width = len(groups.COUNTS)
    counts = [np.zeros((len(models), len(c), width), dtype=np.int64) for c in cells]
    pairs = [np.zeros((len(c), 2), dtype=np.int64) for c in cells]
    for split in splits:  # one split in memory at a time
        shard = read_shard(info, split, comm, min_rows_per_rank=0)
        predictions = []
        for m, model in enumerate(models):
            pred, loss_sum = predict_shard(model.logits, shard.X, shard.y)
            predictions.append(pred)
            per_split[m][split] = _overall(int((pred == shard.y).sum()), loss_sum,
                                           shard.n_local, comm, args.allreduce)
        if cells:
            names = sorted({n for g in groupings for n in g.attributes})
            columns = read_group_columns(info, split, shard, names, comm)
            _count_groups(cells, columns, shard, predictions, counts, pairs, split, info, comm)
        del shard
    flat = np.concatenate([c.reshape(-1) for c in counts] + [p.reshape(-1) for p in pairs]) \
        if cells else np.zeros(0, dtype=np.int64)
    collectives.allreduce(flat, comm, algorithm=args.allreduce)
    tables = _tables(cells, flat, counts, pairs, len(models), info, args)
    error = None
    if comm.Get_rank() == 0:
        try:
            _report(args, models, per_split, splits, tables)
        except WriteFailed as exc:  # a full disk: one line, every rank's exit code 74
            error = exc
    agree(comm, error)
    return 0


def _count_groups(cells, columns, shard, predictions, counts, pairs, split, info,
                  comm) -> None:
    """Add this rank's rows of one split into each grouping's counts.

    Raises:
        DataError: on every rank, if some rank holds a code its labels lack.
    """
    error = None
    for c, grouping_cells in enumerate(cells):
        index = grouping_cells.index({n: columns[n]
                                      for n in grouping_cells.grouping.attributes})
        if error is None and (index < 0).any():
            row = int(np.flatnonzero(index < 0)[0])
            bad = ", ".join(f"{n} {int(columns[n][row])}"
                            for n in grouping_cells.grouping.attributes)
            error = DataError(f"{info.path}: /{split} row {shard.file_row(row)} has {bad}, "
                              "a code the groups attribute does not label; re-run mpidp prep")
            continue
        for m, pred in enumerate(predictions):
            counts[c][m] += groups.count(index, len(grouping_cells), shard.y, pred)
        if len(predictions) == 2:
            pairs[c] += groups.discordant(index, len(grouping_cells), shard.y, *predictions)
    agree(comm, error)


def _tables(cells, flat, counts, pairs, n_models: int, info, args) -> list:
    """The published tables from the counts added over the ranks (the same on
    every rank, so a table with no group left is refused everywhere)."""
    at, tables = 0, []
    for c in counts:
        c[...] = flat[at:at + c.size].reshape(c.shape)
        at += c.size
    for p in pairs:
        p[...] = flat[at:at + p.size].reshape(p.shape)
        at += p.size
    for grouping_cells, c, p in zip(cells, counts, pairs):
        names = grouping_cells.grouping.attributes
        description = " x ".join(info.groups[n].description for n in names)
        if n_models == 1:
            t = groups.table(grouping_cells, c[0], args.min_group_size, description)
        else:
            t = groups.compare(grouping_cells, c[0], c[1], p, args.min_group_size, description)
        if not t.groups:
            raise GroupError(f"--by {grouping_cells.grouping.name}: every group has fewer than "
                             f"--min-group-size {args.min_group_size} rows (or could be derived "
                             "from the total): nothing can be published; group by fewer "
                             "attributes, or score more rows (--split all)", collective=True)
        tables.append(t)
    return tables


def _report(args, models: list[_Model], per_split: list[dict], splits: list[str],
            tables: list) -> None:
    """Rank 0: the text (unless --json prints JSON), the JSON document and the plot."""
    results = []
    for model, parts in zip(models, per_split):
        result = dict(parts[splits[0]]) if len(splits) == 1 else _together(parts)
        result.update(data=args.data, **model.describe(args.split))
        if args.split == "all":
            result["splits"] = parts
        results.append(result)
    where = f"{args.split} split" if args.split != "all" else "splits " + "+".join(splits)
    document = dict(results[0])
    if len(models) == 2:
        document = {"data": args.data, "split": args.split, "models": results,
                    "accuracy_change": results[1]["accuracy"] - results[0]["accuracy"]}
    if tables:
        document["min_group_size"] = args.min_group_size
        document["by"] = [groups.as_dict(t) for t in tables]
    if args.json not in (None, "-"):
        outputs.write_json(args.json, document, "--json")
    if args.json == "-":
        print(json.dumps(document, default=str))
    else:
        for model, result in zip(models, results):
            _print_overall(args, model, result, splits)
        privacy_cost = len(models) == 2 and models[0].epsilon is None \
            and models[1].epsilon is not None
        for t in tables:
            lines = (group_report.table_text(t, where) if len(models) == 1 else
                     group_report.comparison_text(t, where, (models[0].name(),
                                                             models[1].name()), privacy_cost))
            print("\n".join(lines))
    if args.plot:
        overall = [r["accuracy"] for r in results]
        names = [m.name() for m in models]
        group_plot.plot(tables, args.plot, overall, names,
                        f"{args.data} [{where}]: " + " vs ".join(names))


def _print_overall(args, model: _Model, result: dict, splits: list[str]) -> None:
    eps = result["epsilon"]
    selected, step = model.selected, result["step"]
    where = args.split if args.split != "all" else "all: " + "+".join(splits)
    what = (f"model of epoch {selected['epoch']} (step {step}), selected on "
            f"{result.get('selected_on', 'val_accuracy')}"
            if selected and selected.get("epoch") is not None
            else f"model from step {step}")
    privacy_text = ", non-private)" if eps is None else f", {model.epsilon_text()})"
    prefix = f"{model.checkpoint}: " if len(args.checkpoint) > 1 else ""
    print(f"{prefix}{args.data} [{where}]: accuracy {result['accuracy']:.4f}, "
          f"loss {result['loss']:.4f}, {result['rows']:,} rows ({what}" + privacy_text)
    if args.split == "all":
        for split, part in result["splits"].items():
            print(f"  {split:<5} accuracy {part['accuracy']:.4f}, loss "
                  f"{part['loss']:.4f}, {part['rows']:,} rows")
    for note in model.notes:
        print(f"{prefix}note: {note}")


def _splits_to_score(info, split: str, data: str) -> list[str]:
    """The splits ``--split`` names (every one with rows for ``all``).

    Raises:
        DataError: (collective: every rank read the same header) the split is
            not in the file or has no rows.
    """
    if split == "all":
        chosen = [s for s in info.splits if info.rows[s] > 0]
        if not chosen:
            raise DataError(f"{data} has no rows in any split", collective=True)
        return chosen
    if split not in info.rows:
        has = ", ".join(f"{s} ({info.rows[s]:,} rows)" for s in info.splits)
        raise DataError(f"{data} has no {split} split (it has {has}; prepared by an "
                        "older mpidp or with --val-fraction 0); choose another --split",
                        collective=True)
    if info.rows[split] == 0:
        others = [s for s in info.splits if info.rows[s] > 0]
        hint = (" (a file only for scoring, prepared with --test-fraction 1?)"
                if split == "train" else "")
        raise DataError(f"{data}: /{split} has no rows{hint}; choose --split "
                        f"{' or '.join(others + ['all'])}", collective=True)
    return [split]


def _together(per_split: dict[str, dict]) -> dict:
    """Counts of several splits added: the accuracy and loss over all their rows."""
    rows = sum(r["rows"] for r in per_split.values())
    correct = sum(r["correct"] for r in per_split.values())
    loss = sum(r["loss"] * r["rows"] for r in per_split.values() if r["rows"])
    return {"accuracy": correct / rows, "loss": loss / rows, "rows": rows, "correct": correct}


