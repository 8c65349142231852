"""Which epoch's parameters are the run's model (``--select-on``), and the test
split scored once with them.

With a validation split the default is ``val_accuracy``: the parameters of
the epoch with the best (all-reduced, so the same on every rank) validation
accuracy are kept, in memory, in the checkpoint (``best``) and in
``best.pt``; the test split is scored once, when the run finishes, with
them. ``last`` keeps the last epoch's. A file without a validation split
scores its test split every ``--eval-every`` epochs instead, as before.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from engine import metrics as metrics_mod
from engine.config import TrainConfig
from engine.errors import ConfigError, DataError


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
    if chosen != "val_accuracy":
        return chosen
    default = "" if cfg.select_on else " (the default for a file with one)"
    if not info.has_val:
        raise ConfigError(f"--select-on val_accuracy: {cfg.data} has no validation "
                          "split (prepared by an older mpidp, or with --val-fraction 0); "
                          "prepare it again with mpidp prep --val-fraction F, or use "
                          "--select-on last", collective=True)
    if info.rows["val"] == 0:
        raise ConfigError(f"{cfg.data}: the validation split /val has no rows, and "
                          f"--select-on val_accuracy{default} needs some; prepare the "
                          "file again with a larger --val-fraction, or pass "
                          "--select-on last", collective=True)
    return chosen


class Selection:
    """The run's selected epoch.

    Args:
        on: ``val_accuracy`` or ``last`` (:func:`select_on`).
        best: a resumed run's best epoch so far (the checkpoint's ``best``), or
            None: ``{"epoch", "step", "val_accuracy", "val_loss", "params"}``,
            the parameters on the CPU.
    """

    def __init__(self, on: str, best: dict | None = None) -> None:
        self.on, self.best = on, best

    def consider(self, record: dict, params: torch.Tensor) -> None:
        """Keep this epoch's parameters if its validation accuracy is the best so
        far (``val_accuracy``; the first of equal ones)."""
        accuracy = record.get("val_accuracy")
        if self.on != "val_accuracy" or accuracy is None or not math.isfinite(accuracy):
            return
        if self.best is None or accuracy > self.best["val_accuracy"]:
            self.best = {"epoch": record["epoch"], "step": record["step"],
                         "val_accuracy": float(accuracy),
                         "val_loss": metrics_mod.finite_or_none(record.get("val_loss")),
                         "params": params.detach().to("cpu", copy=True)}

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
            whose = (f"the parameters of epoch {self.best['epoch']}, selected on "
                     f"val_accuracy ({self.best['val_accuracy']:.4f})")
        elif self.on == "val_accuracy":
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
