"""The write step of ``mpidp prep``: rank 0 creates the output under a
temporary name, every rank encodes its rows and writes them (or, compressed,
sends its chunks to rank 0), rank 0 adds the root attributes and renames the
file into place; on any failure the temporary file is removed."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np

from preprocessing import atomic, encoding as enc, groups as group_attributes, h5format, \
    h5write, shuffle
from preprocessing.agreement import agree
from preprocessing.errors import PrepError

if TYPE_CHECKING:
    from preprocessing.pipeline import Settings

#: Rows encoded at once into the reused float32 buffer.
ENCODE_ROWS = 16384


def group_field(name: str) -> str:
    """The record field of group attribute ``name``."""
    return f"__group_{name}"


def _columns(split: str, part: np.ndarray, groups) -> list[tuple[str, np.ndarray]]:
    """The datasets of ``split`` besides ``X`` and the rows of ``part`` they
    hold: labels, household keys and each group attribute's codes."""
    out = [(h5format.y_name(split), part["__y"]),
           (h5format.household_name(split), part["__hkey"])]
    out += [(h5format.group_name(split, a.name), part[group_field(a.name)]) for a in groups]
    return [(name, np.ascontiguousarray(values)) for name, values in out]


def _encode_and_write(fd: int, layout, encoder, split: str, records: np.ndarray,
                      offset: int, buffer: np.ndarray, groups) -> None:
    for start in range(0, len(records), ENCODE_ROWS):
        part = records[start:start + ENCODE_ROWS]
        rows = buffer[:len(part)]
        encoder.encode({name: part[name] for name in part.dtype.names}, rows)
        h5write.write_rows(fd, layout, h5format.x_name(split), offset + start, rows)
        for name, values in _columns(split, part, groups):
            h5write.write_rows(fd, layout, name, offset + start, values)


def _write_compressed(comm, settings, layout, encoder, split: str, records, offset: int,
                      total: int, temporary: str) -> None:
    rows_per_chunk = layout.chunk_rows
    size, rank = comm.Get_size(), comm.Get_rank()
    n_chunks = -(-total // rows_per_chunk)
    starts = [min(total, (n_chunks * r // size) * rows_per_chunk) for r in range(size)]
    starts.append(total)
    mine = shuffle.rebalance(records, offset, starts, comm)
    first = starts[rank]
    groups = settings.task.groups()
    chunks_of: dict[str, list] = {h5format.x_name(split): []}
    chunks_of.update({name: [] for name, _ in _columns(split, mine[:0], groups)})
    buffer = np.empty((rows_per_chunk, encoder.n_features), dtype=np.float32)
    for at in range(0, len(mine), rows_per_chunk):
        part = mine[at:at + rows_per_chunk]
        rows = buffer[:len(part)]
        encoder.encode({name: part[name] for name in part.dtype.names}, rows)
        index = (first + at) // rows_per_chunk
        level = settings.compression.level
        for name, values in [(h5format.x_name(split), rows), *_columns(split, part, groups)]:
            chunks_of[name].append((index, h5write.compress_chunk(values, rows_per_chunk,
                                                                  level)))
    for name, chunks in chunks_of.items():
        every = comm.gather(chunks, root=0)
        if rank == 0:
            h5write.write_chunks(temporary, name, [c for p in every for c in p],
                                 rows_per_chunk)


def write_output(comm, settings: Settings, encoding_text: str, splits: dict,
                 attrs_later, step=lambda name: None) -> int:
    """Create, fill and commit the output file; collective. Returns its size.

    Args:
        splits: ``"train"``/``"val"``/``"test"`` -> (this rank's records in final order,
            their first global row, the split's global row count and
            household count).
        attrs_later: called on every rank after the rows are written; returns
            the root attributes (rank 0 stores them).
    """
    rank = comm.Get_rank()
    encoding = enc.Encoding.from_json(encoding_text)
    encoder = enc.Encoder(encoding, settings.task, settings.codebook)
    counts = {name: split[2] for name, split in splits.items()}

    def create():
        if rank != 0:
            return None
        temporary = atomic.temporary_name(settings.out)
        try:
            layout = h5write.create(temporary, counts, encoding.n_features, {},
                                    settings.compression,
                                    groups=[a.name for a in settings.task.groups()])
        except OSError as exc:
            atomic.discard(temporary)
            raise PrepError(f"{settings.out}: cannot create the output: {exc}") from None
        return temporary, layout

    temporary, layout = comm.bcast(agree(comm, create), root=0)
    try:
        def fill():
            try:
                if settings.compression.enabled:
                    for split, (part, first, n, _) in splits.items():
                        _write_compressed(comm, settings, layout, encoder, split, part,
                                          first, n, temporary)
                    return
                fd = os.open(temporary, os.O_WRONLY)
                try:
                    buffer = np.empty((ENCODE_ROWS, encoder.n_features), dtype=np.float32)
                    for split, (part, first, _, _) in splits.items():
                        _encode_and_write(fd, layout, encoder, split, part, first, buffer,
                                          settings.task.groups())
                finally:
                    os.close(fd)
            except OSError as exc:
                raise PrepError(f"{settings.out}: cannot write the output: "
                                f"{exc.strerror or exc}") from None

        step("create")
        agree(comm, fill)
        step("encode+write")
        attrs = attrs_later()
        step("sha256 gather")

        def finish():
            if rank != 0:
                return 0
            import h5py  # deferred: keeps `mpidp prep --help` fast

            try:
                with h5py.File(temporary, "r+") as handle:
                    h5format.write_attributes(handle.attrs, attrs)
                atomic.commit(temporary, settings.out)
            except OSError as exc:
                raise PrepError(f"{settings.out}: cannot write the output: {exc}") from None
            return os.path.getsize(settings.out)

        size = comm.bcast(agree(comm, finish), root=0)
        step("attrs+rename")
        return size
    except BaseException:
        atomic.discard(temporary)
        raise


def attributes(settings: Settings, encoding_text: str, drop_counts: dict,
               rows_per_file: np.ndarray, digests: dict[str, str], version: str,
               household_counts: dict[str, int]) -> dict:
    """The root attributes of the output (:data:`preprocessing.h5format.ATTRIBUTES`)."""
    task = settings.task
    encoding = enc.Encoding.from_json(encoding_text)
    return {
        **h5format.identity(h5format.version_for(encoding.layout)), "task": task.name,
        "n_classes": task.n_classes, "feature_names": encoding.feature_names,
        "encoding": encoding_text, "encoding_fingerprint": h5format.fingerprint(encoding_text),
        "drop_counts": drop_counts,
        "sources": [{"file": os.path.basename(inp.path), "member": inp.member,
                     "sha256": digests[inp.path], "rows": int(rows_per_file[inp.index])}
                    for inp in settings.inputs],
        "seed": settings.seed, "test_fraction": settings.test_fraction,
        "val_fraction": settings.val_fraction,
        "created_by": f"mpidp {version}".strip(),
        "label": str(task.label), "universe": ",".join(map(str, task.universe)),
        "like": os.path.basename(settings.like) if settings.like else "",
        "households": household_counts, "household_key": h5format.HOUSEHOLD_KEY,
        "groups": group_attributes.describe(task.groups(), {f.name for f in task.features}),
        "group": task.group,
    }
