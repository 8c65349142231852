"""Each rank's shard of a prepared HDF5 file (layout: :mod:`preprocessing.h5format`).

Rank r of p reads rows ``[r*N//p, (r+1)*N//p)`` of a split as one hyperslab
(no rank reads the whole file; shards differ in size by at most one row).
The features land in a float32 array with one extra trailing column of ones:
the bias "feature" of the first layer in the book-keeping layout
(:mod:`engine.nn.fast_mlp`), so a sampled batch is one contiguous gather.

Checks, each a :class:`~engine.errors.DataError` raised on every rank
(:func:`engine.errors.agree`): the file passes
:func:`preprocessing.h5format.read_info` (exists, is HDF5, ``format`` and
``format_version``, dataset shapes and types), the training split has at
least as many rows as there are ranks, labels lie in ``0 .. n_classes-1``
and features are finite.
"""
from __future__ import annotations

import mmap
from dataclasses import dataclass

import numpy as np

from collectives import MPI
from engine.errors import DataError, agree
from preprocessing import h5format
from preprocessing.h5format import DataInfo


def shard_range(n: int, size: int, rank: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of ``n`` that rank ``rank`` of ``size`` owns."""
    return rank * n // size, (rank + 1) * n // size


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


def read_info(path: str, comm: MPI.Comm | None = None) -> DataInfo:
    """Open ``path`` and check its layout (:func:`preprocessing.h5format.read_info`);
    collective when ``comm`` is given.

    Raises:
        DataError: on every rank of ``comm`` if any rank found a problem (the
            format's message, exit code 2).
    """
    error, info = None, None
    try:
        info = h5format.read_info(path)
    except h5format.FormatError as exc:
        error = DataError(str(exc))
    if comm is None:
        if error is not None:
            raise error
    else:
        agree(comm, error)
    return info


def _rows_buffer(rows: int, cols: int) -> np.ndarray:
    """A float32 ``[rows, cols]`` array, backed by transparent huge pages when the
    OS offers them: sampled batches are random row gathers, and with 4 KiB pages
    nearly every row costs a TLB miss."""
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
    import h5py  # deferred: keeps `mpidp bench --help` fast (bench dpsgd imports this module)

    X = _rows_buffer(hi - lo, n_features + 1)
    X[:, n_features] = 1.0
    with h5py.File(path, "r") as f:
        if hi > lo:
            f[h5format.x_name(split)].read_direct(X, source_sel=np.s_[lo:hi],
                                        dest_sel=np.s_[:, :n_features])
        y = np.asarray(f[h5format.y_name(split)][lo:hi], dtype=np.int64)
    return X, y


def read_shard(info: DataInfo, split: str, comm: MPI.Comm,
               min_rows_per_rank: int = 0) -> Shard:
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
