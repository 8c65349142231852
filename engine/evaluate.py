"""Evaluation in parallel: every rank scores its shard, counts are all-reduced.

Also ``mpidp eval``: accuracy and loss of a checkpoint's model on any
prepared file (for example other states, prepared with ``prep --like`` so the
encoding matches)::

    mpiexec -n 2 mpidp eval --checkpoint runs/a/checkpoint.pt --data other.h5 --split test
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

CHUNK_ROWS = 65536


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True,
                        help="checkpoint file (or the --checkpoint-dir of a training run)")
    parser.add_argument("--data", required=True, help="prepared HDF5 file (mpidp prep)")
    parser.add_argument("--split", default="test", choices=("train", "test"),
                        help="which split to score (default: test)")
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
        payload = ckpt.load_file(args.checkpoint)
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
    shard = read_shard(info, args.split, comm, min_rows_per_rank=0)
    params = payload["params"].to(torch.float32)
    model_logits = models.checkpoint_logits(recorded, params, info.n_features, info.n_classes,
                                            str(args.checkpoint))
    result = evaluate_shard(model_logits, shard.X, shard.y, comm, args.allreduce)
    if comm.Get_rank() == 0:
        result.update(checkpoint=str(args.checkpoint), data=args.data, split=args.split,
                      step=payload.get("step"), epsilon=payload.get("epsilon"))
        if args.json:
            print(json.dumps(result, default=str))
        else:
            eps = result["epsilon"]
            print(f"{args.data} [{args.split}]: accuracy {result['accuracy']:.4f}, "
                  f"loss {result['loss']:.4f}, {result['rows']:,} rows "
                  f"(model from step {result['step']}"
                  + (f", epsilon {eps:.3f})" if eps is not None else ", non-private)"))
    return 0
