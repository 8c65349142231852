"""Which epoch's parameters are the run's model (``--select-on``), and the test
split scored once with them.

With a validation split the default is ``val_accuracy``: the parameters of
the epoch with the best (all-reduced, so the same on every rank) validation
accuracy are kept, in memory, in the checkpoint (``best``) and in
``best.pt``; the test split is scored once, when the run finishes, with
them. ``worst_group_val_accuracy`` keeps instead the epoch whose worst
validation group (of ``--group-by``, among the groups of at least
``--min-group-size`` validation rows) is most accurate (:class:`GroupScore`):
the same exact-score selection on the validation split, with another score.
``last`` keeps the last epoch's. A file without a validation split
scores its test split every ``--eval-every`` epochs instead, as before.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

import numpy as np

import collectives
from engine import groups
from engine import metrics as metrics_mod
from engine.config import TrainConfig
from engine.errors import ConfigError, DataError, GroupError

#: The score each selection keeps the best of, in an epoch's record.
SCORES = {"val_accuracy": "val_accuracy",
          "worst_group_val_accuracy": "val_worst_group_accuracy"}


def select_on(cfg: TrainConfig, info) -> str:
    """Collective (every rank read the same header): the run's ``--select-on``,
    after checking the file has training rows and the validation split that
    ``val_accuracy`` needs.

    Raises:
        DataError: no training rows.
        ConfigError: ``val_accuracy`` on a file without validation rows.
    """
    if info.rows["train"] == 0:
        raise DataError(f"{cfg.data} has no training rows (a file only for scoring, "
                        "made with mpidp prep --test-fraction 1?): train on a file with "
                        "a training split, and score this one with mpidp eval",
                        collective=True)
    chosen = cfg.select_on or ("val_accuracy" if info.has_val else "last")
    if chosen not in SCORES:
        return chosen
    default = "" if cfg.select_on else " (the default for a file with one)"
    if not info.has_val:
        raise ConfigError(f"--select-on {chosen}: {cfg.data} has no validation "
                          "split (prepared by an older mpidp, or with --val-fraction 0); "
                          "prepare it again with mpidp prep --val-fraction F, or use "
                          "--select-on last", collective=True)
    if info.rows["val"] == 0:
        raise ConfigError(f"{cfg.data}: the validation split /val has no rows, and "
                          f"--select-on {chosen}{default} needs some; prepare the "
                          "file again with a larger --val-fraction, or pass "
                          "--select-on last", collective=True)
    if chosen == "worst_group_val_accuracy":
        attribute = group_attribute(cfg, info)
        if attribute not in info.groups:
            raise GroupError(f"--select-on worst_group_val_accuracy --group-by {attribute}: "
                             f"{cfg.data} {groups_kept(info)}", collective=True)
    return chosen


def groups_kept(info) -> str:
    """What a file keeps to group its rows by, as a message says it."""
    if info.groups:
        return f"keeps the group columns {', '.join(info.groups)}"
    if info.is_image:
        return ("is an image file, with no person attributes to group by: select on "
                "val_accuracy")
    return "keeps no group columns (prepare it again with mpidp prep)"


def group_attribute(cfg: TrainConfig, info) -> str:
    """The attribute worst_group_val_accuracy groups by: ``--group-by``, else the
    file's task group (folktables' ``group``, RAC1P for the ACS tasks)."""
    return cfg.group_by or info.group or "RAC1P"


def check_scorable(sizes: np.ndarray, attribute: str, min_group_size: int) -> None:
    """Raise GroupError (collective) unless some group of ``attribute`` has
    ``min_group_size`` validation rows (``sizes``: rows per group)."""
    if not (np.asarray(sizes) >= min_group_size).any():
        raise GroupError(f"--select-on worst_group_val_accuracy: no {attribute} group "
                         f"has --min-group-size {min_group_size} validation rows; "
                         "lower it, or prepare the file with a larger --val-fraction",
                         collective=True)


def val_group_sizes(info, attribute: str) -> np.ndarray:
    """Validation rows per group of ``attribute`` (one process reads the whole
    column: the same answer on every rank, no collective)."""
    import h5py  # deferred: as the shard reads it

    from preprocessing.h5format import group_name

    cells = groups.Cells.of(groups.Grouping((attribute,)),
                            {attribute: info.groups[attribute].labels})
    if not info.rows.get("val"):
        return np.zeros(len(cells), dtype=np.int64)
    with h5py.File(info.path, "r") as f:
        column = f[group_name("val", attribute)][:]
    index = cells.index({attribute: column})
    return np.bincount(index[index >= 0], minlength=len(cells))


class GroupScore:
    """The worst validation group's accuracy of the current parameters.

    Built once (collective) with the validation shard and its group column;
    each call predicts the shard again and all-reduces one int64 array of
    per-group counts (:mod:`engine.groups`), so every rank gets the same
    score. Groups with fewer than ``min_group_size`` validation rows are not
    scored (their accuracy is too uncertain to steer the choice); the score
    is exact, like ``val_accuracy``, and never published
    (:func:`engine.checkpoint.published`).

    Raises:
        GroupError: (collective) no validation group has ``min_group_size`` rows.
    """

    def __init__(self, cfg: TrainConfig, info, shard, comm) -> None:
        from engine.shard import read_group_columns  # deferred: h5py, only when selected

        self.attribute = group_attribute(cfg, info)
        self.shard, self.comm, self.allreduce = shard, comm, cfg.allreduce
        self.cells = groups.Cells.of(groups.Grouping((self.attribute,)),
                                     {self.attribute: info.groups[self.attribute].labels})
        column = read_group_columns(info, "val", shard, [self.attribute], comm)
        self.index = self.cells.index(column)
        sizes = np.bincount(self.index[self.index >= 0], minlength=len(self.cells))
        sizes = sizes.astype(np.int64)
        collectives.allreduce(sizes, comm, algorithm=cfg.allreduce)
        self.scored = sizes >= cfg.min_group_size
        check_scorable(sizes, self.attribute, cfg.min_group_size)

    def __call__(self, logits) -> dict:
        """Collective: ``{"val_worst_group_accuracy", "val_worst_group"}``."""
        from engine.evaluate import predict_shard  # deferred: as the trainer imports it

        pred, _ = predict_shard(logits, self.shard.X, self.shard.y)
        keep = self.index >= 0
        counts = groups.count(self.index[keep], len(self.cells), self.shard.y[keep],
                              pred[keep])
        collectives.allreduce(counts.reshape(-1), self.comm, algorithm=self.allreduce)
        accuracy = counts[:, 1] / np.maximum(counts[:, 0], 1)
        worst = int(np.flatnonzero(self.scored)[np.argmin(accuracy[self.scored])])
        return {"val_worst_group_accuracy": float(accuracy[worst]),
                "val_worst_group": self.cells.labels[worst]}


class Selection:
    """The run's selected epoch.

    Args:
        on: ``val_accuracy``, ``worst_group_val_accuracy`` or ``last``
            (:func:`select_on`).
        best: a resumed run's best epoch so far (the checkpoint's ``best``), or
            None: ``{"epoch", "step", "val_accuracy", "val_loss", "params"}``
            (and ``val_worst_group_accuracy``, ``val_worst_group``), the
            parameters on the CPU.
    """

    def __init__(self, on: str, best: dict | None = None) -> None:
        self.on, self.best = on, best

    @property
    def score(self) -> str | None:
        """The record's field this selection maximises (None for ``last``)."""
        return SCORES.get(self.on)

    def consider(self, record: dict, params: torch.Tensor) -> None:
        """Keep this epoch's parameters if its score (:attr:`score`) is the best
        so far (the first of equal ones)."""
        value = record.get(self.score) if self.score else None
        if value is None or not math.isfinite(value):
            return
        if self.best is None or value > self.best[self.score]:
            self.best = {"epoch": record["epoch"], "step": record["step"],
                         "val_accuracy": metrics_mod.finite_or_none(record.get("val_accuracy")),
                         "val_loss": metrics_mod.finite_or_none(record.get("val_loss")),
                         "params": params.detach().to("cpu", copy=True)}
            if self.score != "val_accuracy":
                self.best.update(val_worst_group_accuracy=float(value),
                                 val_worst_group=record.get("val_worst_group"))

    def selected_epoch(self, last_epoch: int) -> int:
        """The epoch whose parameters are the run's model."""
        return self.best["epoch"] if self.best is not None else last_epoch

    def final_test(self, record: dict, params: torch.Tensor,
                   evaluate: Callable[[], dict]) -> None:
        """Collective (``evaluate`` is): score the test split once with the
        selected parameters (``evaluate()`` scores the current ``params``) into
        the last epoch's ``record``; ``params`` are training's again after."""
        selected = self.selected_epoch(record["epoch"])
        if self.best is not None:
            last = params.detach().clone()
            with torch.no_grad():
                params.copy_(self.best["params"].to(params.device))
            try:
                result = evaluate()
            finally:
                with torch.no_grad():
                    params.copy_(last)  # the checkpoint keeps training's state
        else:
            result = evaluate()
        record.update(test_accuracy=metrics_mod.finite_or_none(result["accuracy"]),
                      test_loss=metrics_mod.finite_or_none(result["loss"]),
                      test_rows=result["rows"], selected_epoch=selected, select_on=self.on)

    def test_line(self, record: dict) -> str:
        """``test (once, at the end): accuracy ...`` for a run with a validation split."""
        accuracy, loss = record.get("test_accuracy"), record.get("test_loss")
        numbers = (f"accuracy {accuracy:.4f}, loss {loss:.4f} on "
                   f"{record.get('test_rows', 0):,} rows" if accuracy is not None
                   else "the test split has no rows")
        if self.best is not None:
            worst = (f", worst group {self.best['val_worst_group']}"
                     if self.score != "val_accuracy" else "")
            whose = (f"the parameters of epoch {self.best['epoch']}, selected on "
                     f"{self.on} ({self.best[self.score]:.4f}{worst})")
        elif self.on in SCORES:
            whose = "the last parameters (no epoch was scored on the validation split)"
        else:
            whose = "the last parameters (--select-on last)"
        return f"test (once, at the end): {numbers}; {whose}"

    def adopt(self, params: torch.Tensor) -> None:
        """Make the selected epoch's parameters the run's (``Run.model``); the
        checkpoint already holds the last ones, which a resume continues from."""
        if self.best is not None:
            with torch.no_grad():
                params.copy_(self.best["params"].to(params.device))
