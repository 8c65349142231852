"""What an audit reads, the checks it makes, and which rows it attacks.

The target is a checkpoint written by ``mpidp train`` (:mod:`engine.checkpoint`)
and the prepared file it was trained on (:mod:`engine.shard`); nothing else
is needed. Each split is cut in two by row parity (:func:`plan_rows`):

* **members**: ``m`` of the *even* rows of ``/train`` -- the model was
  trained on them;
* **non-members**: ``m`` of the *even* rows of ``/test`` -- people the model
  never saw, from the same population (prep splits by household and
  shuffles globally, so they are i.i.d. with the members);
* **population sample**: the *odd* rows of both splits -- what an attacker
  is assumed to know about the population: the reference model of the
  calibrated attack is trained on it (:mod:`engine.audit.reference`) and the
  attribute prior of the inversion attack is counted on it.

Why both splits feed the population sample: people of one household are
alike (and their employment is correlated) and a household lies wholly in
``/train`` or wholly in ``/test``. A reference model trained on test rows
only would have seen household mates of the non-members but of no member,
fit the non-members better, and so inflate the calibrated attack. Taking
the same share (half) of each split exposes members and non-members to the
same expected share of their household mates.

``m = min(even training rows, even test rows, --max-rows)``; members and
non-members are spread evenly over their rows (``floor(j n / m)``), which
the global shuffle makes uniform random samples.

Errors (exit code 2, raised on every rank): a missing or unreadable
checkpoint (:class:`~engine.errors.CheckpointError`), a missing or malformed
data file (:class:`~engine.errors.DataError`), a checkpoint and data file of
different tasks, encodings or sizes (:class:`AuditMismatch`), splits too
small to audit (:class:`SplitTooSmall`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch

from engine import checkpoint as ckpt
from engine.errors import CheckpointError, DataError, agree
from engine.models import checkpoint_spec
from engine.nn.mlp import MLPSpec
from engine.shard import read_info
from preprocessing.h5format import DataInfo

#: Fewest members (and non-members) an audit accepts.
MIN_ROWS = 20
#: What a model file that records only its data's public layout (a ``best.pt``
#: on its own) cannot have checked (:func:`layout_note`).
ENCODING = "the encoding (standardisation statistics)"


class AuditMismatch(DataError):
    """The checkpoint was not trained on this data file (task, encoding, rows)."""


class SplitTooSmall(DataError):
    """Too few rows to compare members with non-members."""


def spread(n: int, m: int) -> np.ndarray:
    """``m`` distinct indices spread evenly over ``range(n)``: ``floor(j n / m)``.

    Sorted int64; ``m <= n`` required.
    """
    if not 0 <= m <= n:
        raise ValueError(f"cannot pick {m} of {n} rows")
    return (np.arange(m, dtype=np.int64) * n) // max(m, 1)


@dataclass(frozen=True)
class RowPlan:
    """Global row indices (sorted int64) of each role; see the module docstring."""

    members: np.ndarray            # /train, even rows
    nonmembers: np.ndarray         # /test, even rows
    population_train: np.ndarray   # /train, odd rows
    population_test: np.ndarray    # /test, odd rows

    @property
    def m(self) -> int:
        return int(self.members.size)

    @property
    def population(self) -> int:
        return int(self.population_train.size + self.population_test.size)

    def summary(self) -> dict:
        return {"members": self.m, "nonmembers": int(self.nonmembers.size),
                "population": self.population,
                "members_from": "/train (even rows)", "nonmembers_from": "/test (even rows)",
                "population_from": "odd rows of /train and /test"}


def plan_rows(n_train: int, n_test: int, max_rows: int | None = None,
              path: str = "the data file") -> RowPlan:
    """Which rows are members, non-members and the population sample.

    Raises:
        SplitTooSmall: fewer than :data:`MIN_ROWS` members or non-members, or
            a ``max_rows`` below it (collective: depends on public sizes only).
    """
    if max_rows is not None and max_rows < MIN_ROWS:
        raise SplitTooSmall(f"--max-rows {max_rows} is below the minimum of {MIN_ROWS} "
                            "members", collective=True)
    even_train = np.arange(0, n_train, 2, dtype=np.int64)
    even_test = np.arange(0, n_test, 2, dtype=np.int64)
    m = min(even_train.size, even_test.size,
            max_rows if max_rows is not None else n_train)
    if m < MIN_ROWS:
        raise SplitTooSmall(
            f"{path}: {n_train} training and {n_test} test rows give {m} members and "
            f"{m} non-members (the even rows of each split; the odd rows are the "
            f"population sample); an audit needs at least {MIN_ROWS} of each, i.e. at "
            f"least {2 * MIN_ROWS - 1} rows in each split", collective=True)
    return RowPlan(members=even_train[spread(even_train.size, m)],
                   nonmembers=even_test[spread(even_test.size, m)],
                   population_train=np.arange(1, n_train, 2, dtype=np.int64),
                   population_test=np.arange(1, n_test, 2, dtype=np.int64))


def reference_rows(plan: RowPlan, size: int) -> tuple[np.ndarray, np.ndarray]:
    """``size`` population rows (at most all of them) for the reference model,
    the same share of each split's part: (train indices, test indices)."""
    a, b = plan.population_train.size, plan.population_test.size
    size = min(int(size), a + b)
    from_train = min(a, int(round(a * size / max(a + b, 1))))
    from_test = min(b, size - from_train)
    return (plan.population_train[spread(a, from_train)],
            plan.population_test[spread(b, from_test)])


def local_rows(indices: np.ndarray, offset: int, n_local: int) -> np.ndarray:
    """Positions within a shard (rows ``[offset, offset + n_local)``) of the
    sorted global ``indices`` that fall in it (int64, sorted)."""
    lo = np.searchsorted(indices, offset, side="left")
    hi = np.searchsorted(indices, offset + n_local, side="left")
    return indices[lo:hi] - offset


@dataclass
class Target:
    """The audited model and what its checkpoint says about its training."""

    checkpoint: str
    payload: dict
    spec: MLPSpec
    params: torch.Tensor       # float64 flat vector
    info: DataInfo             # of the audited file
    notes: list[str] = field(default_factory=list)

    @property
    def config(self) -> dict:
        return dict(self.payload.get("config") or {})

    @property
    def private(self) -> bool:
        return bool(self.config.get("dp", self.payload.get("epsilon") is not None))

    @property
    def selected(self) -> dict | None:
        """The selection whose parameters are audited (:func:`engine.checkpoint.model_of`),
        or None: the parameters of the checkpoint's own step."""
        return ckpt.model_of(self.payload, self.checkpoint)[2]

    def summary(self) -> dict:
        """The audited model: ``step`` is the step of the parameters audited (a
        run directory's selected epoch, not the step its run ended at)."""
        cfg = self.config
        accountant = self.payload.get("accountant") or {}
        privacy = self.payload.get("privacy") or {}
        selected = self.selected or {}
        return {"checkpoint": self.checkpoint, "model": self.spec.describe(),
                "private": self.private, "epsilon": self.payload.get("epsilon"),
                "epsilon_includes_tuning": bool(privacy.get("includes_tuning")),
                "delta": cfg.get("delta") if self.private else None,
                "noise_multiplier": accountant.get("sigma", privacy.get("noise_multiplier")),
                "step": selected.get("step", self.payload.get("step")),
                "selected_epoch": selected.get("epoch"),
                "run_step": selected.get("run_step", self.payload.get("step")),
                "trained_on": (self.payload.get("data") or {}).get("path")}


def check_compatible(payload: dict, info, checkpoint: str) -> list[str]:
    """Check that the model in ``payload`` was trained on the file ``info``.

    Membership is only meaningful on the very file the model was trained on:
    its ``/train`` rows are the members. Returns notes for the report (e.g.
    the file was moved).

    Raises:
        AuditMismatch: different task, encoding, shape or split sizes.
    """
    spec = checkpoint_spec(payload["model"], str(checkpoint), "mpidp audit")
    trained = payload.get("data") or {}
    where = trained.get("path") or "its training file"
    fix = (f"audit the model with the file it was trained on ({where}), or train a model "
           f"on {info.path}")
    if trained.get("task") and info.task and trained["task"] != info.task:
        raise AuditMismatch(f"{info.path} holds task {info.task!r} but the model in "
                            f"{checkpoint} was trained for task {trained['task']!r}; {fix}",
                            collective=True)
    unlike = info.encoded_unlike(trained)
    if unlike:
        raise AuditMismatch(f"{info.path} was encoded differently from the file the model "
                            f"in {checkpoint} was trained on ({unlike}); "
                            f"{fix}", collective=True)
    if info.n_features != spec.dims[0] or info.n_classes != spec.dims[-1]:
        raise AuditMismatch(f"{info.path} has {info.n_features} features and "
                            f"{info.n_classes} classes; the model in {checkpoint} expects "
                            f"{spec.dims[0]} and {spec.dims[-1]}; {fix}", collective=True)
    rows = trained.get("rows")
    if rows and dict(rows) != dict(info.rows):
        raise AuditMismatch(
            f"the model in {checkpoint} was trained on a file with {rows.get('train')} "
            f"training and {rows.get('test')} test rows, but {info.path} has "
            f"{info.rows['train']} and {info.rows['test']}: its /train rows are not the "
            f"model's training set; {fix}", collective=True)
    notes = []
    recorded = str(trained.get("path") or "")
    # a published model records the file's name only (engine.checkpoint.published)
    same = (os.path.basename(info.path) == recorded if recorded == os.path.basename(recorded)
            else os.path.abspath(info.path) == os.path.abspath(recorded))
    checked = data_checked(trained, info)
    if recorded and not same and checked == "encoding":
        same_as = ("task, encoding and split sizes" if rows else
                   "task and encoding (the model file records no split sizes)")
        notes.append(f"the model was trained on {recorded}; auditing {info.path}, which has "
                     f"the same {same_as} (assumed to be the same file)")
    elif recorded and not same:
        notes.append(layout_note(trained, info, "auditing", f"{ENCODING} and the split sizes")
                     + " (assumed to be the same file)")
    return notes


def data_checked(trained: dict | None, info: DataInfo) -> str:
    """How far a model file's record of its training data (its ``data``) lets
    ``mpidp eval`` and ``mpidp audit`` check the file ``info`` against it, as
    :meth:`DataInfo.encoded_unlike` compares them: ``"encoding"`` (the encoding's
    fingerprint: a ``checkpoint.pt``, or a run's directory), ``"layout"`` (the
    ``layout_fingerprint`` only: a ``best.pt`` on its own, which records the
    data's public layout and no statistic of the training rows) or ``"shape"``
    (neither: only the feature and class counts)."""
    trained = trained or {}
    if trained.get("fingerprint") and info.fingerprint:
        return "encoding"
    return "layout" if trained.get("layout_fingerprint") else "shape"


def layout_note(trained: dict | None, info: DataInfo, doing: str, unchecked: str) -> str:
    """The note of a command (``doing``: ``"scoring"``, ``"auditing"``) that took
    ``info`` for a model whose file could not have ``unchecked`` (its encoding, ...)
    checked (:func:`data_checked` is ``"layout"`` or ``"shape"``, never
    ``"encoding"``): what was checked, and how to have the rest checked."""
    recorded = (trained or {}).get("path")
    head = (f"the model was trained on {recorded}; {doing} {info.path}" if recorded
            else f"{doing} {info.path}")
    if data_checked(trained, info) == "layout":
        return (f"{head}, which has the same task and feature layout: the model file records "
                f"only the data's public layout, so {unchecked} could not be checked against "
                "the training data (give the run's directory, whose checkpoint.pt records "
                "them, to have them checked)")
    return (f"{head}, which has the feature and class counts the model expects: the model "
            f"file records neither the encoding nor the layout of its training data, so "
            f"{unchecked} could not be checked against the training data")


def load_target(checkpoint: str, data: str, comm) -> Target:
    """Collective: load the checkpoint and the data file's description, check them.

    Raises (on every rank of ``comm``): CheckpointError, DataError, AuditMismatch.
    """
    error, payload = None, None
    try:
        payload = ckpt.load_model(checkpoint)
        if "model" not in payload or "params" not in payload:
            raise CheckpointError(f"{checkpoint} holds no model (keys 'model' and 'params' "
                                  "missing); pass a checkpoint written by `mpidp train`")
        ckpt.check_data_path(data)
    except (CheckpointError, DataError) as exc:
        error = exc
    agree(comm, error)
    info = read_info(data, comm)
    notes = check_compatible(payload, info, checkpoint)
    spec = checkpoint_spec(payload["model"], str(checkpoint), "mpidp audit")
    params = ckpt.model_of(payload, checkpoint)[1].to(torch.float64)
    if params.shape != (spec.n_params,):
        raise CheckpointError(f"{checkpoint}: {params.numel()} parameters for a "
                              f"{spec.describe()}; the checkpoint is damaged", collective=True)
    return Target(checkpoint=str(checkpoint), payload=payload, spec=spec, params=params,
                  info=info, notes=notes)
