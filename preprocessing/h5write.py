"""Writing the prepared HDF5 file from many ranks with a serial h5py.

h5py here is built without parallel HDF5, so only one process may use the
HDF5 library on the file. The ranks still write in parallel:

* **Uncompressed (default).** Rank 0 creates the file with every dataset
  chunked by rows and its storage allocated up front (``H5D_ALLOC_TIME_EARLY``,
  no fill), asks HDF5 where each chunk lives (``get_chunk_info``), writes the
  attributes and closes the file. Every rank then ``pwrite``s its rows' raw
  bytes at those offsets: the encoded rows never pass through rank 0 and the
  ranks write at the same time.
* **Compressed (``gzip``).** Each rank compresses its own chunks (HDF5's
  byte-shuffle filter, then zlib, exactly what HDF5's ``shuffle`` and
  ``deflate`` filters do) and rank 0 stores the compressed chunks with
  ``write_direct_chunk``; the ranks own whole chunks (the rows are
  rebalanced to chunk boundaries first).

The file is written under a temporary name in the output's directory and
renamed into place when every rank has succeeded (:mod:`preprocessing.atomic`).
"""
from __future__ import annotations

import os
import zlib
from dataclasses import dataclass, field

import numpy as np

from preprocessing import h5format

#: Target bytes of one chunk of ``X`` (rows per chunk = this / (4 F)).
CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class Compression:
    """``none`` or ``gzip`` with a level (``gzip:1`` .. ``gzip:9``, default 4)."""

    kind: str = "none"
    level: int = 4

    @classmethod
    def parse(cls, text: str) -> "Compression":
        """Raises ValueError for anything but ``none``, ``gzip``, ``gzip:N``."""
        name, _, level = text.partition(":")
        if name == "none" and not level:
            return cls()
        if name == "gzip" and (not level or (level.isdigit() and 1 <= int(level) <= 9)):
            return cls("gzip", int(level) if level else 4)
        raise ValueError(f"unknown compression {text!r}; use none, gzip or gzip:1..9")

    @property
    def enabled(self) -> bool:
        return self.kind != "none"


@dataclass
class Layout:
    """Where the datasets of a created file live.

    Attributes:
        chunk_rows: rows per chunk (the same for every dataset).
        shapes: dataset path -> shape.
        row_bytes: dataset path -> bytes per row.
        chunk_offsets: dataset path -> file offset of each chunk (uncompressed
            files only).
    """

    chunk_rows: int
    shapes: dict[str, tuple[int, ...]]
    row_bytes: dict[str, int]
    chunk_offsets: dict[str, list[int]] = field(default_factory=dict)


def chunk_rows_for(n_features: int, most_rows: int | None = None) -> int:
    """Rows per chunk: about :data:`CHUNK_BYTES` of ``X``, and no more than
    ``most_rows`` (the largest split's rows: a chunk is allocated whole, so
    a small file of few columns would otherwise be mostly padding)."""
    rows = max(1, CHUNK_BYTES // (4 * max(1, n_features)))
    return rows if most_rows is None else max(1, min(rows, most_rows))


def dataset_specs(counts: dict[str, int], n_features: int,
                  groups: list[str] | tuple[str, ...] = ()) -> dict[str, tuple[tuple, str]]:
    """``/train/X`` etc. -> (shape, dtype) for splits with ``counts`` rows and
    the group attributes ``groups`` (:mod:`preprocessing.h5format`)."""
    specs = {}
    for split, n in counts.items():
        specs[h5format.x_name(split)] = ((n, n_features), h5format.X_DTYPE)
        specs[h5format.y_name(split)] = ((n,), h5format.Y_DTYPE)
        specs[h5format.household_name(split)] = ((n,), h5format.HOUSEHOLD_DTYPE)
        for name in groups:
            specs[h5format.group_name(split, name)] = ((n,), h5format.GROUP_DTYPE)
    return specs


def create(path: str, counts: dict[str, int], n_features: int, attrs: dict,
           compression: Compression, groups: list[str] | tuple[str, ...] = ()) -> Layout:
    """Create the file with its datasets and attributes; rank 0 only.

    Args:
        counts: split name (``"train"``, ``"test"``) -> rows.
        groups: the group attributes kept (``/s/groups/NAME`` in every split).
        attrs: root attributes (str, int, float; dicts/lists are stored as JSON:
            :func:`preprocessing.h5format.write_attributes`).
    """
    import h5py  # deferred: keeps `mpidp prep --help` fast

    rows = chunk_rows_for(n_features, max(counts.values(), default=1))
    specs = dataset_specs(counts, n_features, groups)
    layout = Layout(chunk_rows=rows, shapes={k: s for k, (s, _) in specs.items()},
                    row_bytes={})
    with h5py.File(path, "w", libver=("v108", "latest"), track_order=True) as handle:
        h5format.write_attributes(handle.attrs, attrs)
        for name, (shape, dtype) in specs.items():
            chunks = (rows,) + shape[1:]
            kwargs = dict(shape=shape, dtype=dtype, chunks=chunks,
                          maxshape=(None,) + shape[1:], track_times=False)
            if compression.enabled:
                kwargs.update(compression="gzip", compression_opts=compression.level,
                              shuffle=True)
            else:
                dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
                dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
                kwargs.update(dcpl=dcpl, fill_time="never")
            dataset = handle.create_dataset(name, **kwargs)
            layout.row_bytes[name] = int(np.prod(shape[1:], dtype=np.int64)) * \
                np.dtype(dtype).itemsize
            if not compression.enabled:
                n_chunks = dataset.id.get_num_chunks()
                layout.chunk_offsets[name] = [dataset.id.get_chunk_info(i).byte_offset
                                              for i in range(n_chunks)]
                # get_chunk_info lists chunks in storage order; index them by rows.
                starts = [dataset.id.get_chunk_info(i).chunk_offset[0]
                          for i in range(n_chunks)]
                by_row = sorted(zip(starts, layout.chunk_offsets[name]))
                layout.chunk_offsets[name] = [offset for _, offset in by_row]
    return layout


def write_rows(fd: int, layout: Layout, name: str, first_row: int, data: np.ndarray) -> int:
    """``pwrite`` rows ``[first_row, first_row + len(data))`` of dataset
    ``name`` into an uncompressed file; any rank. Returns bytes written."""
    data = np.ascontiguousarray(data)
    raw = memoryview(data.reshape(-1).view(np.uint8))
    row_bytes = layout.row_bytes[name]
    offsets = layout.chunk_offsets[name]
    rows = layout.chunk_rows
    row, end = first_row, first_row + len(data)
    while row < end:
        chunk, inside = divmod(row, rows)
        take = min(rows - inside, end - row)
        start = (row - first_row) * row_bytes
        view = raw[start:start + take * row_bytes]
        position = offsets[chunk] + inside * row_bytes
        while len(view):
            written = os.pwrite(fd, view, position)
            view, position = view[written:], position + written
        row += take
    return len(data) * row_bytes


def compress_chunk(data: np.ndarray, chunk_rows: int, level: int) -> bytes:
    """One full chunk as HDF5's shuffle + deflate filters would store it
    (a short last chunk is padded with zeros to the full chunk shape)."""
    full = np.zeros((chunk_rows,) + data.shape[1:], dtype=data.dtype)
    full[:len(data)] = data
    itemsize = full.dtype.itemsize
    shuffled = full.reshape(-1).view(np.uint8).reshape(-1, itemsize).T.tobytes()
    return zlib.compress(shuffled, level)


def write_chunks(path: str, name: str, chunks: list[tuple[int, bytes]], chunk_rows: int) -> None:
    """Store compressed chunks ``(chunk index, bytes)`` of dataset ``name``; rank 0."""
    import h5py  # deferred: keeps `mpidp prep --help` fast

    with h5py.File(path, "r+") as handle:
        dataset = handle[name]
        for index, blob in chunks:
            offset = (index * chunk_rows,) + (0,) * (dataset.ndim - 1)
            dataset.id.write_direct_chunk(offset, blob, filter_mask=0)
