"""Each rank's shard of a prepared HDF5 file (the contract in README.md).

Rank r of p reads rows ``[r*N//p, (r+1)*N//p)`` of a split as one hyperslab
(no rank reads the whole file; shards differ in size by at most one row).
The features land in a float32 array with one extra trailing column of ones:
the bias "feature" of the first layer in the book-keeping layout
(:mod:`engine.nn.fast_mlp`), so a sampled batch is one contiguous gather.

Checks, each a :class:`~engine.errors.DataError` raised on every rank
(:func:`engine.errors.agree`): the file exists and is HDF5, ``format`` is
``"mpidp"`` with a supported ``format_version``, the datasets have the
documented shapes and types, the training split has at least as many rows
as there are ranks, labels lie in ``0 .. n_classes-1`` and features are finite.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
from dataclasses import dataclass, field

import numpy as np

from engine.errors import DataError, agree

FORMAT = "mpidp"
FORMAT_VERSIONS = (1,)
SPLITS = ("train", "test")


def shard_range(n: int, size: int, rank: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of ``n`` that rank ``rank`` of ``size`` owns."""
    return rank * n // size, (rank + 1) * n // size


@dataclass(frozen=True)
class DataInfo:
    """What a prepared file says about itself (read from its attributes)."""

    path: str
    n_features: int
    n_classes: int
    rows: dict[str, int]
    feature_names: list[str] = field(default_factory=list)
    task: str = ""
    fingerprint: str = ""

    def summary(self) -> dict:
        return {"path": self.path, "n_features": self.n_features,
                "n_classes": self.n_classes, "rows": dict(self.rows), "task": self.task,
                "fingerprint": self.fingerprint}


@dataclass
class Shard:
    """This rank's rows of one split.

    ``X`` is float32 ``[n_local, F+1]`` whose last column is 1; ``y`` is
    int64 ``[n_local]``; ``offset`` is the first global row; ``n_total`` the
    split's global row count.
    """

    X: np.ndarray
    y: np.ndarray
    offset: int
    n_total: int

    @property
    def n_local(self) -> int:
        return int(self.y.shape[0])


def _attr(attrs, name, default=None):
    value = attrs.get(name, default)
    if isinstance(value, bytes):
        value = value.decode()
    if isinstance(value, np.generic):
        value = value.item()
    return value


def _read_info(path: str) -> DataInfo:
    import h5py

    if not os.path.exists(path):
        raise DataError(f"data file {path} does not exist (make one with `mpidp prep`)")
    try:
        handle = h5py.File(path, "r")
    except OSError as exc:
        raise DataError(f"{path} is not a readable HDF5 file ({exc}); make it with "
                        "`mpidp prep`") from None
    with handle as f:
        fmt = _attr(f.attrs, "format")
        if fmt != FORMAT:
            raise DataError(f"{path}: attribute format={fmt!r}, expected {FORMAT!r}; "
                            "this is not a file written by `mpidp prep`")
        version = _attr(f.attrs, "format_version")
        if version not in FORMAT_VERSIONS:
            raise DataError(f"{path}: format_version={version!r} is not supported "
                            f"(supported: {FORMAT_VERSIONS}); re-run `mpidp prep`")
        rows: dict[str, int] = {}
        n_features = None
        for split in SPLITS:
            if f"{split}/X" not in f or f"{split}/y" not in f:
                raise DataError(f"{path}: missing /{split}/X or /{split}/y")
            X, y = f[f"{split}/X"], f[f"{split}/y"]
            if X.ndim != 2 or y.ndim != 1 or X.shape[0] != y.shape[0]:
                raise DataError(f"{path}: /{split}/X must be [N, F] and /{split}/y [N]; "
                                f"found {X.shape} and {y.shape}")
            if X.dtype.kind != "f" or y.dtype.kind not in "iu":
                raise DataError(f"{path}: /{split}/X must be float and /{split}/y integer; "
                                f"found {X.dtype} and {y.dtype}")
            if n_features is not None and X.shape[1] != n_features:
                raise DataError(f"{path}: /train/X has {n_features} features but "
                                f"/{split}/X has {X.shape[1]}")
            n_features = int(X.shape[1])
            rows[split] = int(X.shape[0])
        n_classes = _attr(f.attrs, "n_classes")
        if not isinstance(n_classes, int) or n_classes < 2:
            raise DataError(f"{path}: attribute n_classes={n_classes!r} must be an "
                            "integer >= 2")
        names_text = _attr(f.attrs, "feature_names", "[]")
        try:
            names = json.loads(names_text) if isinstance(names_text, str) else list(names_text)
        except ValueError:
            raise DataError(f"{path}: attribute feature_names is not a JSON list") from None
        if names and len(names) != n_features:
            raise DataError(f"{path}: {len(names)} feature_names for {n_features} "
                            "feature columns")
        fingerprint = _attr(f.attrs, "encoding_fingerprint", "") or ""
        if not fingerprint and names:
            fingerprint = "names:" + hashlib.sha256(
                json.dumps(names).encode()).hexdigest()
        return DataInfo(path=path, n_features=n_features, n_classes=n_classes, rows=rows,
                        feature_names=names, task=str(_attr(f.attrs, "task", "") or ""),
                        fingerprint=fingerprint)


def read_info(path: str, comm=None) -> DataInfo:
    """Open ``path`` and check its layout (collective when ``comm`` is given).

    Raises:
        DataError: on every rank of ``comm`` if any rank found a problem.
    """
    error, info = None, None
    try:
        info = _read_info(path)
    except DataError as exc:
        error = exc
    if comm is None:
        if error is not None:
            raise error
    else:
        agree(comm, error)
    return info


def _rows_buffer(rows: int, cols: int) -> np.ndarray:
    """A float32 ``[rows, cols]`` array, backed by transparent huge pages when the
    OS offers them: sampled batches are random row gathers, and with 4 KiB pages
    nearly every row costs a TLB miss (measured between training steps: a
    256-row gather from a 320 MB shard takes 19 us with huge pages, 25 us
    without)."""
    nbytes = rows * cols * 4
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < (64 << 20) or advice is None:
        return np.empty((rows, cols), dtype=np.float32)
    try:
        # Private: a shared anonymous map is shmem, which gets huge pages only
        # if shmem_enabled says so (usually never); MAP_SHARED is mmap's default.
        area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        area.madvise(advice)
    except (OSError, ValueError):
        return np.empty((rows, cols), dtype=np.float32)
    return np.frombuffer(area, dtype=np.float32, count=rows * cols).reshape(rows, cols)


def _read_rows(path: str, split: str, lo: int, hi: int, n_features: int) -> tuple:
    import h5py

    X = _rows_buffer(hi - lo, n_features + 1)
    X[:, n_features] = 1.0
    with h5py.File(path, "r") as f:
        if hi > lo:
            f[f"{split}/X"].read_direct(X, source_sel=np.s_[lo:hi],
                                        dest_sel=np.s_[:, :n_features])
        y = np.asarray(f[f"{split}/y"][lo:hi], dtype=np.int64)
    return X, y


def read_shard(info: DataInfo, split: str, comm, min_rows_per_rank: int = 0) -> Shard:
    """Collective over ``comm``: this rank's rows of ``split``, checked.

    Args:
        info: from :func:`read_info`.
        split: ``"train"`` or ``"test"``.
        comm: every rank of it must call this.
        min_rows_per_rank: 1 for training (every rank needs data to sample
            from); 0 allows empty shards (evaluation).

    Raises:
        DataError: on every rank, if the split has fewer rows than ranks
            (when ``min_rows_per_rank`` is 1), or a shard has bad labels or
            non-finite features.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    n = info.rows[split]
    if min_rows_per_rank and n < size * min_rows_per_rank:
        raise DataError(f"{info.path}: /{split} has {n} rows, fewer than the {size} ranks "
                        "of this job; use fewer ranks or more data", collective=True)
    lo, hi = shard_range(n, size, rank)
    error, X, y = None, None, None
    try:
        X, y = _read_rows(info.path, split, lo, hi, info.n_features)
        if y.size and (y.min() < 0 or y.max() >= info.n_classes):
            bad = int(np.flatnonzero((y < 0) | (y >= info.n_classes))[0]) + lo
            raise DataError(f"{info.path}: /{split}/y[{bad}] = {int(y[bad - lo])} is outside "
                            f"0..{info.n_classes - 1} (n_classes={info.n_classes})")
        if not np.isfinite(X).all():
            bad = int(np.flatnonzero(~np.isfinite(X).all(axis=1))[0]) + lo
            raise DataError(f"{info.path}: /{split}/X row {bad} has a NaN or infinite value")
    except DataError as exc:
        error = exc
    except OSError as exc:
        error = DataError(f"{info.path}: cannot read /{split} rows {lo}..{hi}: {exc}")
    agree(comm, error)
    return Shard(X=X, y=y, offset=lo, n_total=n)
