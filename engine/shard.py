"""Each rank's shard of a prepared HDF5 file (layout: :mod:`preprocessing.h5format`).

Rank r of p reads rows ``[r*N//p, (r+1)*N//p)`` of a split as one hyperslab
(no rank reads the whole file; shards differ in size by at most one row).
With ``unit="household"`` (``mpidp train --privacy-unit household``) the
rows are grouped by household key whatever their order in the file
(:func:`household_layout`): every rank reads the split's keys (8 bytes a
row), the households are taken in the order of their first row and each
one's rows in file order, and each cut moves forward to the next household
boundary of that sequence, so every household lies whole on one rank and
the shard lists where its households start. A file from ``mpidp prep``
already has each household's rows consecutive (then the grouped order is
the file's, and each rank reads one hyperslab as for persons); any other
file is grouped all the same, its rows read in blocks (:func:`_read_rows_at`).
The features land in a float32 array with one extra trailing column of ones
(an image file's uint8 pixels normalised per channel on the way, by its
``channel_mean`` and ``channel_std``):
the bias "feature" of the first layer in the book-keeping layout
(:mod:`engine.dp.fast_mlp`), so a sampled batch is one contiguous gather.

Checks, each a :class:`~engine.errors.DataError` raised on every rank
(:func:`engine.errors.agree`): the file passes
:func:`preprocessing.h5format.read_info` (exists, is HDF5, ``format`` and
``format_version``, dataset shapes and types), the training split has at
least as many rows (households) as there are ranks, labels lie in
``0 .. n_classes-1`` and features are finite; the household unit needs a
file with household keys (format version 2).
"""
from __future__ import annotations

import mmap
from dataclasses import dataclass

import numpy as np

from collectives import MPI
from engine.errors import DataError, agree

#: Privacy units a shard can be cut for (``mpidp train --privacy-unit``).
UNITS = ("person", "household")
#: Bytes of a split's rows read at a time when a shard's rows are not one range.
_BLOCK_BYTES = 32 << 20
from preprocessing import h5format
from preprocessing.h5format import DataInfo


def shard_range(n: int, size: int, rank: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of ``n`` that rank ``rank`` of ``size`` owns."""
    return rank * n // size, (rank + 1) * n // size


@dataclass
class Shard:
    """This rank's rows of one split.

    ``X`` is float32 ``[n_local, F+1]`` whose last column is 1; ``y`` is
    int64 ``[n_local]``; ``n_total`` the split's global row count; local row
    i is the file's row ``offset + i`` when ``rows`` is None, else
    ``rows[i]``. For the household unit, ``groups`` is int64
    ``[H_local + 1]``: household h is local rows ``groups[h] .. groups[h+1]-1``
    (``groups[0] = 0``, ``groups[-1] = n_local``), and ``units_total`` the
    split's global number of households; for the person unit ``groups`` is
    None and ``units_total`` is ``n_total``. ``rows`` (int64 ``[n_local]``)
    is set only where the household unit regrouped a file whose households
    are not consecutive (:func:`group_by_key`); ``offset`` is then the
    shard's start in the grouped order.
    """

    X: np.ndarray
    y: np.ndarray
    offset: int
    n_total: int
    groups: np.ndarray | None = None
    units_total: int = 0
    rows: np.ndarray | None = None

    @property
    def n_local(self) -> int:
        return int(self.y.shape[0])

    @property
    def units_local(self) -> int:
        """Privacy units on this rank (rows, or households)."""
        return self.n_local if self.groups is None else int(self.groups.shape[0] - 1)

    def file_row(self, i: int) -> int:
        """The file's row (in the split) of local row ``i``."""
        return self.offset + int(i) if self.rows is None else int(self.rows[i])


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


def _read_rows(info: DataInfo, split: str, lo: int, hi: int) -> tuple:
    import h5py  # deferred: keeps `mpidp bench --help` fast (bench dpsgd imports this module)

    n_features = info.n_features
    X = _rows_buffer(hi - lo, n_features + 1)
    X[:, n_features] = 1.0
    with h5py.File(info.path, "r") as f:
        if hi > lo and info.is_image:
            _read_pixels(f[h5format.x_name(split)], lo, hi, info, X)
        elif hi > lo:
            f[h5format.x_name(split)].read_direct(X, source_sel=np.s_[lo:hi],
                                                  dest_sel=np.s_[:, :n_features])
        y = np.asarray(f[h5format.y_name(split)][lo:hi], dtype=np.int64)
    return X, y


#: Image rows read (as uint8) and normalised at a time.
_PIXEL_CHUNK = 4096


def pixel_tables(info: DataInfo) -> np.ndarray:
    """float32 ``[C, 256]``: the normalised value of each byte, per channel
    (``(v / 255 - mean_c) / std_c``, the file's ``channel_mean`` / ``channel_std``)."""
    levels = np.arange(256, dtype=np.float64) / 255.0
    mean = np.asarray(info.channel_mean, dtype=np.float64)[:, None]
    std = np.asarray(info.channel_std, dtype=np.float64)[:, None]
    return ((levels[None, :] - mean) / std).astype(np.float32)


def _read_pixels(dataset, lo: int, hi: int, info: DataInfo, X: np.ndarray) -> None:
    """Rows ``lo..hi`` of an image file's uint8 ``X``, normalised per channel into
    ``X[:, :F]`` (a table lookup per channel; chunks bound the uint8 copy)."""
    tables = pixel_tables(info)
    plane = info.image_shape[1] * info.image_shape[2]
    for start in range(lo, hi, _PIXEL_CHUNK):
        stop = min(hi, start + _PIXEL_CHUNK)
        raw = dataset[start:stop]
        for c, table in enumerate(tables):
            cols = np.s_[c * plane:(c + 1) * plane]
            np.take(table, raw[:, cols], out=X[start - lo:stop - lo, cols])


def _read_rows_at(info: DataInfo, split: str, rows: np.ndarray) -> tuple:
    """The split's rows ``rows`` (file rows, any order, distinct) in that order,
    as :func:`_read_rows` lays them out. Read in file order, a block of at
    most :data:`_BLOCK_BYTES` from each next wanted row, and each row written
    straight to its place (no second copy of the shard)."""
    import h5py  # deferred: as in _read_rows

    n_features, k = info.n_features, int(rows.shape[0])
    X = _rows_buffer(k, n_features + 1)
    X[:, n_features] = 1.0
    y = np.empty(k, dtype=np.int64)
    if k == 0:
        return X, y
    place = np.argsort(rows, kind="stable")
    wanted = rows[place]
    width = max(1, _BLOCK_BYTES // (8 * max(1, n_features)))
    with h5py.File(info.path, "r") as f:
        features, labels = f[h5format.x_name(split)], f[h5format.y_name(split)]
        j = 0
        while j < k:
            start = int(wanted[j])
            end = int(np.searchsorted(wanted, start + width, side="left"))
            stop = int(wanted[end - 1]) + 1
            pick = wanted[j:end] - start
            X[place[j:end], :n_features] = features[start:stop][pick]
            y[place[j:end]] = labels[start:stop][pick]
            j = end
    return X, y


@dataclass(frozen=True)
class HouseholdLayout:
    """A split's households in the order the shards take them (:func:`group_by_key`).

    ``starts`` is int64 ``[H + 1]``: household h is positions
    ``starts[h] .. starts[h+1]-1`` of the grouped order (``starts[-1]`` = the
    split's rows). ``order`` is None when each household's rows are
    consecutive in the file (the grouped order is the file's), else int64
    ``[N]``: the file row at each position of the grouped order.
    """

    starts: np.ndarray
    order: np.ndarray | None

    @property
    def households(self) -> int:
        return int(self.starts.shape[0] - 1)

    def cut(self, size: int, rank: int) -> tuple[int, int]:
        """Households ``[a, b)`` of rank ``rank`` of ``size``: each nominal cut
        (:func:`shard_range` of the rows) moved forward to the next household
        boundary, so the ranks' ranges partition the households, every one whole."""
        n = int(self.starts[-1])
        lo, hi = shard_range(n, size, rank)
        return (int(np.searchsorted(self.starts, lo, side="left")),
                int(np.searchsorted(self.starts, hi, side="left")))


def group_by_key(keys: np.ndarray) -> HouseholdLayout:
    """The households of a split from its household keys, whatever their order.

    Rows with equal keys form one household. When every household's rows
    are consecutive (``mpidp prep`` writes them so) the layout is the file's
    runs of equal keys; otherwise the households are ordered by their first
    row in the file and each one's rows kept in file order, so a file whose
    rows were shuffled person by person is trained with the same households
    as the grouped file, never one per row.
    """
    keys = np.asarray(keys)
    n = int(keys.shape[0])
    if n == 0:
        return HouseholdLayout(np.zeros(1, dtype=np.int64), None)
    runs = np.concatenate([[0], np.flatnonzero(keys[1:] != keys[:-1]) + 1]).astype(np.int64)
    if np.unique(keys[runs]).shape[0] == runs.shape[0]:  # no key starts two runs
        return HouseholdLayout(np.append(runs, n).astype(np.int64), None)
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    by_first = np.empty(first.shape[0], dtype=np.int64)
    by_first[np.argsort(first, kind="stable")] = np.arange(first.shape[0])
    household = by_first[inverse.reshape(-1)]
    order = np.argsort(household, kind="stable").astype(np.int64)
    starts = np.zeros(first.shape[0] + 1, dtype=np.int64)
    np.cumsum(np.bincount(household, minlength=first.shape[0]), out=starts[1:])
    return HouseholdLayout(starts, order)


def household_layout(path: str, split: str) -> HouseholdLayout:
    """:func:`group_by_key` of ``split``'s household keys, read whole (8 bytes a row)."""
    import h5py  # deferred: as in _read_rows

    with h5py.File(path, "r") as f:
        keys = f[h5format.household_name(split)][:]
    return group_by_key(keys)


def read_group_columns(info: DataInfo, split: str, shard: Shard, names: list[str],
                       comm: MPI.Comm) -> dict[str, np.ndarray]:
    """Collective: the codes of group attributes ``names`` (``/s/groups/NAME``,
    :mod:`preprocessing.groups`) for this rank's rows of ``shard``, as int64.
    They are read beside the shard, never into ``X``.

    Raises:
        DataError: on every rank, if a rank cannot read them.
    """
    import h5py  # deferred: as in _read_rows

    error, out = None, {}
    lo, hi = shard.offset, shard.offset + shard.n_local
    try:
        with h5py.File(info.path, "r") as f:
            for name in names:
                dataset = f[h5format.group_name(split, name)]
                values = dataset[lo:hi] if shard.rows is None else \
                    dataset[:][shard.rows]
                out[name] = np.asarray(values, dtype=np.int64)
    except (OSError, KeyError) as exc:
        error = DataError(f"{info.path}: cannot read /{split}/groups of rows {lo}..{hi}: "
                          f"{exc}")
    agree(comm, error)
    return out


def _check_codes(info: DataInfo, split: str, X: np.ndarray, file_row) -> None:
    """Raise DataError unless every code column holds integers ``0 .. count-1``
    (an embedding would index outside its table); ``file_row(i)`` names local
    row i in the message."""
    for column, count, name in info.code_columns:
        values = X[:, column]
        bad = (values < 0) | (values >= count) | (values != np.floor(values))
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            value = float(values[row])
            raise DataError(f"{info.path}: /{split}/X[{file_row(row)}, {column}] = {value:g} "
                            f"is not a code of {name} (an integer 0..{count - 1})")


def read_shard(info: DataInfo, split: str, comm: MPI.Comm,
               min_rows_per_rank: int = 0, unit: str = "person") -> Shard:
    """Collective over ``comm``: this rank's rows of ``split``, checked.

    Args:
        info: from :func:`read_info`.
        split: ``"train"`` or ``"test"``.
        comm: every rank of it must call this.
        min_rows_per_rank: 1 for training (every rank needs data to sample
            from: a row, or a household); 0 allows empty shards (evaluation).
        unit: ``"person"`` (plain row ranges) or ``"household"`` (the rows
            grouped by household key, ranges cut on household boundaries,
            the households listed: :func:`group_by_key`).

    Raises:
        DataError: on every rank, if the split has fewer rows (households)
            than ranks (when ``min_rows_per_rank`` is 1), the household unit
            is asked of a file without household keys, or a shard has bad
            labels, non-finite features or category codes out of range.
    """
    if unit not in UNITS:
        raise ValueError(f"unit {unit!r} not in {UNITS}")
    size, rank = comm.Get_size(), comm.Get_rank()
    n = info.rows[split]
    if unit == "household" and info.is_image:
        raise DataError(f"{info.path} holds images, which have no households: train with "
                        "--privacy-unit person (each image its own unit)", collective=True)
    if unit == "household" and not info.households:
        raise DataError(f"{info.path} has no household keys (prepared by an older mpidp, "
                        "format_version 1); re-run `mpidp prep` on its CSV files to train "
                        "with --privacy-unit household", collective=True)
    if min_rows_per_rank and n < size * min_rows_per_rank:
        raise DataError(f"{info.path}: /{split} has {n} rows, fewer than the {size} ranks "
                        "of this job; use fewer ranks or more data", collective=True)
    lo, hi = shard_range(n, size, rank)
    error, X, y, groups, rows = None, None, None, None, None
    try:
        if unit == "household":
            try:
                layout = household_layout(info.path, split)
            except OSError as exc:
                raise DataError(f"{info.path}: cannot read /{split}/household: {exc}") from None
            first, last = layout.cut(size, rank)
            lo, hi = int(layout.starts[first]), int(layout.starts[last])
            groups = layout.starts[first:last + 1] - lo
            if layout.order is not None:
                rows = layout.order[lo:hi]
            if min_rows_per_rank and hi == lo:
                raise DataError(f"{info.path}: /{split} has too few households for the "
                                f"{size} ranks of this job; use fewer ranks or more data")
        X, y = _read_rows(info, split, lo, hi) if rows is None \
            else _read_rows_at(info, split, rows)
        file_row = (lambda i: lo + int(i)) if rows is None else (lambda i: int(rows[i]))
        if y.size and (y.min() < 0 or y.max() >= info.n_classes):
            bad = int(np.flatnonzero((y < 0) | (y >= info.n_classes))[0])
            raise DataError(f"{info.path}: /{split}/y[{file_row(bad)}] = {int(y[bad])} is "
                            f"outside 0..{info.n_classes - 1} (n_classes={info.n_classes})")
        if not np.isfinite(X).all():
            bad = int(np.flatnonzero(~np.isfinite(X).all(axis=1))[0])
            raise DataError(f"{info.path}: /{split}/X row {file_row(bad)} has a NaN or "
                            "infinite value")
        _check_codes(info, split, X, file_row)
    except DataError as exc:
        error = exc
    except OSError as exc:
        error = DataError(f"{info.path}: cannot read /{split} rows {lo}..{hi}: {exc}")
    agree(comm, error)
    units = n if groups is None else comm.allreduce(int(groups.shape[0] - 1), op=MPI.SUM)
    return Shard(X=X, y=y, offset=lo, n_total=n, groups=groups, units_total=int(units),
                 rows=rows)
