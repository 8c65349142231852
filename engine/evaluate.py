"""Evaluation in parallel: every rank scores its shard, counts are all-reduced.

Also ``mpidp eval``: accuracy and loss of a checkpoint's model on any
prepared file (for example other states, prepared with ``prep --like`` so the
encoding matches; ``prep --test-fraction 1`` puts every row in the test
split of a file meant only for scoring), on one split or on all of them::

    mpiexec -n 2 mpidp eval --checkpoint runs/a --data other.h5 --split test
    mpiexec -n 2 mpidp eval --checkpoint runs/a/checkpoint.pt --data pums.h5 --split all

A run's directory scores the run's model: the epoch selected on the
validation split when the run kept one (``best.pt``), else the last
parameters; a file scores the parameters it holds (``checkpoint.pt``: the
last epoch's; ``best.pt``: the selected one's). The epsilon printed is the
one the file states: for the model a ``mpidp tune`` chose, the epsilon
including the tuning (said so), never the trial's alone.
"""
from __future__ import annotations

import argparse
import json
from typing import Callable

import numpy as np

import collectives
from collectives import MPI
from engine.errors import CheckpointError, DataError, agree
from engine.shard import read_info, read_shard
from preprocessing.h5format import SPLITS

CHUNK_ROWS = 65536


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True,
                        help="checkpoint file (or the --checkpoint-dir of a training run)")
    parser.add_argument("--data", required=True, help="prepared HDF5 file (mpidp prep)")
    parser.add_argument("--split", default="test", choices=(*SPLITS, "all"),
                        help="which split to score: train, val (a file with a validation "
                        "split), test, or all (every split the file has, counted "
                        "together) (default: test)")
    parser.add_argument("--allreduce", default="auto",
                        help="all-reduce algorithm for the counts (default: auto)")
    parser.add_argument("--json", action="store_true", help="print one JSON document")


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
    import torch  # deferred: keeps `mpidp eval --help` fast

    correct, loss_sum = 0, 0.0
    with torch.no_grad():
        for start in range(0, y.shape[0], CHUNK_ROWS):
            xb = torch.from_numpy(X[start:start + CHUNK_ROWS])
            yb = torch.from_numpy(y[start:start + CHUNK_ROWS])
            out = logits_fn(xb)
            correct += int((out.argmax(1) == yb).sum())
            loss_sum += float(torch.nn.functional.cross_entropy(
                out.double(), yb, reduction="sum"))
    counts = np.array([correct, loss_sum, y.shape[0]], dtype=np.float64)
    collectives.allreduce(counts, comm, algorithm=algorithm)
    rows = int(counts[2])
    nan = float("nan")
    return {"accuracy": counts[0] / rows if rows else nan,
            "loss": counts[1] / rows if rows else nan,
            "rows": rows, "correct": int(counts[0])}


def run(args: argparse.Namespace) -> int:
    """Collective: score the checkpoint on ``--split`` of ``--data``; rank 0 prints.

    Raises:
        CheckpointError, DataError: on every rank (a model that does not fit the file).
    """
    # deferred: torch, kept out of `mpidp eval --help`
    import torch

    from engine import checkpoint as ckpt
    from engine.nn import models
    from engine.nn.model import MLPSpec

    comm = MPI.COMM_WORLD
    error, payload = None, None
    try:
        payload = ckpt.load_model(args.checkpoint)
        ckpt.check_data_path(args.data)
    except (CheckpointError, DataError) as exc:
        error = exc
    agree(comm, error)
    info = read_info(args.data, comm)
    recorded = payload["model"]
    spec = None if recorded.get("kind") == "module" else MLPSpec.from_dict(recorded)
    trained = payload.get("data", {})
    # The task first: a file of another task also differs in its features, and
    # "827 features, the model expects 99" hides the reason.
    if trained.get("task") and info.task and trained["task"] != info.task:
        raise DataError(f"{args.data} holds task {info.task!r}; the model was trained for "
                        f"{trained['task']!r} on {trained.get('path')}", collective=True)
    if spec is not None and (info.n_features != spec.dims[0]
                             or info.n_classes != spec.dims[-1]):
        raise DataError(f"{args.data} has {info.n_features} features and {info.n_classes} "
                        f"classes; the model expects {spec.dims[0]} and {spec.dims[-1]} "
                        "(prepare the file with `mpidp prep --like` the training file)",
                        collective=True)
    if trained.get("fingerprint") and info.fingerprint \
            and trained["fingerprint"] != info.fingerprint:
        raise DataError(f"{args.data} was encoded differently from the training file "
                        f"{trained.get('path')} (encoding fingerprints differ); prepare it "
                        "with `mpidp prep --like` the training file", collective=True)
    splits = _splits_to_score(info, args.split, args.data)
    recorded, params, selected = ckpt.model_of(payload, args.checkpoint)
    params = params.to(torch.float32)
    model_logits = models.checkpoint_logits(recorded, params, info.n_features, info.n_classes,
                                            str(args.checkpoint))
    per_split = {}
    for split in splits:  # one split in memory at a time
        shard = read_shard(info, split, comm, min_rows_per_rank=0)
        per_split[split] = evaluate_shard(model_logits, shard.X, shard.y, comm,
                                          args.allreduce)
        del shard
    result = dict(per_split[splits[0]]) if len(splits) == 1 else _together(per_split)
    if comm.Get_rank() == 0:
        step = selected.get("step", payload.get("step")) if selected else payload.get("step")
        privacy = payload.get("privacy") or {}
        tuned = bool(privacy.get("includes_tuning"))
        result.update(checkpoint=str(args.checkpoint), data=args.data, split=args.split,
                      step=step, epsilon=payload.get("epsilon"),
                      epsilon_includes_tuning=tuned)
        if tuned:
            result["trial_epsilon"] = privacy.get("trial_epsilon")
        if selected and selected.get("epoch") is not None:
            result["selected_epoch"] = selected.get("epoch")
        if args.split == "all":
            result["splits"] = per_split
        if args.json:
            print(json.dumps(result, default=str))
        else:
            eps = result["epsilon"]
            where = args.split if args.split != "all" else "all: " + "+".join(splits)
            model = (f"model of epoch {selected['epoch']} (step {step}), selected on "
                     "val_accuracy" if selected and selected.get("epoch") is not None
                     else f"model from step {step}")
            if eps is None:
                privacy_text = ", non-private)"
            elif tuned:
                privacy_text = f", epsilon {eps:.3f} incl. tuning)"
            else:
                privacy_text = f", epsilon {eps:.3f})"
            print(f"{args.data} [{where}]: accuracy {result['accuracy']:.4f}, "
                  f"loss {result['loss']:.4f}, {result['rows']:,} rows ({model}"
                  + privacy_text)
            if args.split == "all":
                for split, part in per_split.items():
                    print(f"  {split:<5} accuracy {part['accuracy']:.4f}, loss "
                          f"{part['loss']:.4f}, {part['rows']:,} rows")
    return 0


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


