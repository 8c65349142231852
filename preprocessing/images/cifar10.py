"""CIFAR-10 in the official files -> :class:`ImageSet` per split.

``path`` is a directory or a tar archive (``cifar-10-binary.tar.gz`` as
distributed; gzip, bzip2, xz or none; members are read in memory and never
extracted). The six batches ``data_batch_1 .. data_batch_5`` (train, in
that order) and ``test_batch`` are looked for directly under ``path`` and in
the official subdirectory, in two versions:

* binary (preferred when complete): ``*.bin`` in ``cifar-10-batches-bin/``;
  records of 3073 bytes: one label byte (0..9), then 1024 red, 1024 green and
  1024 blue bytes, each plane row-major 32x32;
* python: extension-less pickles in ``cifar-10-batches-py/``, each a dict with
  ``b"data"`` (uint8 ``[n, 3072]``, rows laid out as the binary records'
  pixels) and ``b"labels"`` (n ints), read with
  :func:`~preprocessing.images.safe_pickle.load_arrays`, which executes
  nothing and admits only arrays whose bytes are in the file.

Every size is checked against a bound before anything of that size is read
or inflated: a batch holds at most :data:`MAX_RECORDS` images (the official
count), so a binary batch is at most :data:`BINARY_MAX` bytes and a pickle
at most :data:`PICKLE_MAX`; a tar member's size is read from its header and
checked before its bytes are; a compressed archive stops inflating past
:data:`ARCHIVE_MAX` bytes and is read to its end, so its check (gzip's
CRC-32) runs before any batch is used, and a damaged header is an error, not
the end of the archive. An archive holds one version in one folder, as the
official ones do.

Example::

    sets = read_cifar10("cifar-10-binary.tar.gz")
    sets["train"].images.shape                # (50000, 3, 32, 32)
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from preprocessing.images.errors import CIFAR10_SOURCE, ImageFormatError, one_line
from preprocessing.images.imageset import ImageSet, first_out_of_range, source_entry
from preprocessing.images.safe_pickle import load_arrays
from preprocessing.images.streams import (DAMAGED, Capped, decompressed, not_regular,
                                          open_stored, read_exact)
from preprocessing.images.tar import Member, TarReader

N_CLASSES = 10
SHAPE = (3, 32, 32)
PIXELS = 3 * 32 * 32
RECORD = 1 + PIXELS
TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCHES = ("test_batch",)
#: The most images a batch may hold: the official batches' count.
MAX_RECORDS = 10_000
#: The largest binary batch: MAX_RECORDS records.
BINARY_MAX = MAX_RECORDS * RECORD
#: The largest python-version batch: MAX_RECORDS pixel rows and up to 256
#: bytes a row for its label, file name and the pickle's framing (the official
#: batches are 31.0 MB, under this bound by 2.2 MB).
PICKLE_MAX = MAX_RECORDS * (PIXELS + 256)
#: The most bytes an archive may inflate to: six batches of the larger
#: version and 64 MiB for the other members and the tar headers (the official
#: archives inflate to 185 MB).
ARCHIVE_MAX = 6 * PICKLE_MAX + (64 << 20)
#: The most members an archive may have (the official ones have 9).
MAX_MEMBERS = 1000

Parser = Callable[[bytes | bytearray, str], "tuple[np.ndarray, np.ndarray]"]


def read_cifar10(path: str | Path) -> dict[str, ImageSet]:
    """Read the six CIFAR-10 batches from a directory or a tar archive.

    Returns:
        ``{"train": ImageSet, "test": ImageSet}``: train is data_batch_1..5
        concatenated in order, test is test_batch; images uint8
        ``[N, 3, 32, 32]`` (channels R, G, B), labels uint8 ``[N]`` in 0..9;
        ``source`` has one entry per batch file.

    Raises:
        ImageFormatError: ``path`` is missing or not a readable tar archive
            (damaged anywhere: a header, the compressed stream, its CRC);
            neither version has all six batches (the message names the
            missing ones); the archive holds batches of two versions or
            folders, or one batch twice; a batch is larger than its bound
            (module docstring); a binary batch is empty or not a whole number
            of 3073-byte records; a pickle names anything but numpy's array
            globals, holds an array without all of its bytes, or is not the
            expected dict; a label is outside 0..9.
    """
    store = _open(Path(path))
    layout, prefix = _choose(store)
    sets = {}
    for split, batches in (("train", TRAIN_BATCHES), ("test", TEST_BATCHES)):
        images, labels, source = [], [], []
        for batch in batches:
            name = prefix + batch + layout.suffix
            stored = store.read(name, layout)
            batch_images, batch_labels = layout.parse(stored, store.describe(name))
            images.append(batch_images)
            labels.append(batch_labels)
            source.append(source_entry(name, stored, len(batch_labels)))
        sets[split] = ImageSet(images=np.concatenate(images), labels=np.concatenate(labels),
                               n_classes=N_CLASSES, source=source)
    return sets


def check_binary_size(size: int, name: str) -> None:
    """Refuse a binary batch of ``size`` bytes unless it is 1..MAX_RECORDS records."""
    if size == 0 or size % RECORD:
        raise ImageFormatError(
            f"{name}: expected a positive whole number of {RECORD}-byte records (1 label byte "
            f"+ {PIXELS} pixel bytes; official batches are 10000 records), found {size} "
            f"bytes = {size // RECORD} records + {size % RECORD} bytes")
    if size > BINARY_MAX:
        raise ImageFormatError(
            f"{name}: expected at most {MAX_RECORDS:,} records ({BINARY_MAX:,} bytes, the "
            f"official batch size), found {size:,} bytes = {size // RECORD:,} records; "
            f"refused before reading it")


def check_pickle_size(size: int, name: str) -> None:
    """Refuse a python-version batch of more than :data:`PICKLE_MAX` bytes."""
    if size > PICKLE_MAX:
        raise ImageFormatError(
            f"{name}: expected a python-version batch of at most {PICKLE_MAX:,} bytes "
            f"({MAX_RECORDS:,} images and their labels and names; the official batches are "
            f"31.0 MB), found {size:,} bytes; refused before reading it")


def parse_binary(data: bytes | bytearray, name: str) -> tuple[np.ndarray, np.ndarray]:
    """One binary batch -> (images ``[n, 3, 32, 32]``, labels ``[n]``), views of ``data``."""
    check_binary_size(len(data), name)
    records = np.frombuffer(data, dtype=np.uint8).reshape(-1, RECORD)
    labels = records[:, 0]
    _check_labels(labels, name, "record")
    return records[:, 1:].reshape(-1, *SHAPE), labels


def parse_pickle(data: bytes | bytearray, name: str) -> tuple[np.ndarray, np.ndarray]:
    """One python-version batch -> (images ``[n, 3, 32, 32]``, labels ``[n]``)."""
    check_pickle_size(len(data), name)
    batch = load_arrays(data, name)
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        found = (f"a dict with keys {sorted(map(repr, batch))[:6]}" if isinstance(batch, dict)
                 else type(batch).__name__)
        raise ImageFormatError(f"{name}: expected a dict with b'data' and b'labels', found "
                               f"{one_line(found)}")
    pixels = batch[b"data"]
    if (not isinstance(pixels, np.ndarray) or pixels.dtype != np.uint8 or pixels.ndim != 2
            or pixels.shape[1] != PIXELS or not 0 < len(pixels) <= MAX_RECORDS):
        found = (f"{pixels.dtype} array of shape {pixels.shape}" if isinstance(pixels, np.ndarray)
                 else type(pixels).__name__)
        raise ImageFormatError(f"{name}: expected b'data' to be a uint8 array [n, {PIXELS}] "
                               f"with 0 < n <= {MAX_RECORDS:,}, found {found}")
    labels = _pickled_labels(batch[b"labels"], name, len(pixels))
    _check_labels(labels, name, "label")
    return pixels.reshape(-1, *SHAPE), labels.astype(np.uint8)


def _pickled_labels(value: object, name: str, n: int) -> np.ndarray:
    """b'labels' as an int64 array of ``n`` values (from a list of Python ints,
    or a 1-D integer array), checked for type and length before conversion."""
    if isinstance(value, np.ndarray):
        ok = value.ndim == 1 and value.dtype.kind in "iu"
        found = f"{value.dtype} array of shape {value.shape}"
    else:
        ok = isinstance(value, list) and all(type(v) is int for v in value)
        found = type(value).__name__
    if not ok:
        raise ImageFormatError(f"{name}: expected b'labels' to be a list of ints, found {found}")
    if len(value) != n:
        raise ImageFormatError(f"{name}: expected {n} labels (one per row of b'data'), found "
                               f"{len(value)}")
    try:
        labels = np.asarray(value, dtype=np.int64)
    except OverflowError:
        bad = next(i for i, v in enumerate(value) if not -(1 << 63) <= v < (1 << 63))
        raise ImageFormatError(f"{name}: expected labels 0..{N_CLASSES - 1}, found "
                               f"{value[bad]} at label {bad}") from None
    if labels.size and labels.min() < 0:
        bad = int(np.flatnonzero(labels < 0)[0])
        raise ImageFormatError(f"{name}: expected labels 0..{N_CLASSES - 1}, found "
                               f"{labels[bad]} at label {bad}")
    return labels


def _check_labels(labels: np.ndarray, name: str, unit: str) -> None:
    bad = first_out_of_range(labels, N_CLASSES)
    if bad is not None:
        raise ImageFormatError(f"{name}: expected labels 0..{N_CLASSES - 1}, found "
                               f"{labels[bad]} at {unit} {bad}")


@dataclass(frozen=True)
class _Layout:
    version: str
    subdir: str
    suffix: str
    parse: Parser
    #: Refuses a stored batch by its size alone (before it is read).
    check_size: Callable[[int, str], None]


LAYOUTS = (_Layout("binary", "cifar-10-batches-bin/", ".bin", parse_binary, check_binary_size),
           _Layout("python", "cifar-10-batches-py/", "", parse_pickle, check_pickle_size))


def _candidates() -> list[tuple[_Layout, str, list[str]]]:
    """Every (layout, prefix, six file names) to look for, in order of preference."""
    return [(layout, prefix, [prefix + b + layout.suffix for b in TRAIN_BATCHES + TEST_BATCHES])
            for layout in LAYOUTS for prefix in (layout.subdir, "")]


def _choose(store: "_DirStore | _TarStore") -> tuple[_Layout, str]:
    """The first complete (layout, prefix); else an error naming the missing batches."""
    best = None
    for layout, prefix, names in _candidates():
        present = [n for n in names if store.has(n)]
        if len(present) == len(names):
            return layout, prefix
        if present and (best is None or len(present) > len(best[2])):
            best = (layout, names, present)
    if best is None:
        raise ImageFormatError(
            f"{store.path}: no CIFAR-10 batches found; expected data_batch_1..5.bin and "
            f"test_batch.bin (binary version, in cifar-10-batches-bin/) or data_batch_1..5 and "
            f"test_batch (python version, in cifar-10-batches-py/); {CIFAR10_SOURCE}")
    layout, names, present = best
    missing = [n for n in names if n not in present]
    raise ImageFormatError(
        f"{store.path}: expected all six CIFAR-10 batches of the {layout.version} version, "
        f"found {len(present)}, missing {', '.join(missing)}; {CIFAR10_SOURCE}")


def _open(path: Path) -> "_DirStore | _TarStore":
    if path.is_dir():
        return _DirStore(path)
    if path.is_file():
        return _TarStore(path, {name: (layout, prefix) for layout, prefix, names in _candidates()
                                for name in names})
    raise ImageFormatError(f"{path}: expected a directory or a .tar.gz of the CIFAR-10 "
                           f"batches, found {not_regular(path) or 'nothing'}; {CIFAR10_SOURCE}")


class _DirStore:
    """Batch files under a directory, read when asked for."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def has(self, name: str) -> bool:
        """Whether the batch file is there.

        Raises:
            ImageFormatError: something is there under its name but is not a
                regular file (:func:`not_regular`).
        """
        what = not_regular(self.path / name)
        if what is not None:
            raise ImageFormatError(f"{self.describe(name)}: expected a CIFAR-10 batch (a "
                                   f"regular file), found {what}; put the file itself there, "
                                   "or remove it")
        return (self.path / name).is_file()

    def describe(self, name: str) -> str:
        return str(self.path / name)

    def read(self, name: str, layout: _Layout) -> bytearray:
        """The file's bytes, its size checked before they are read into memory
        of that size (a file that changes size meanwhile is refused)."""
        where = self.describe(name)
        with open_stored(self.path / name) as f:
            try:
                size = os.fstat(f.fileno()).st_size
                layout.check_size(size, where)
                data = read_exact(f, size + 1)
            except OSError as exc:
                raise ImageFormatError(f"{where}: cannot be read ({one_line(exc)})") from None
        if len(data) != size:
            raise ImageFormatError(f"{where}: expected {size:,} bytes (its size when opened), "
                                   f"read {len(data):,}: it changed while it was read")
        return data


class _TarStore:
    """The wanted regular members of a tar archive, read in one sequential pass
    (module docstring: what is bounded and checked)."""

    def __init__(self, path: Path, wanted: dict[str, tuple[_Layout, str]]) -> None:
        self.path = path
        self.members: dict[str, bytearray] = {}
        folder: tuple[_Layout, str] | None = None
        with open_stored(path) as raw:
            try:
                stream, _ = decompressed(raw)
                capped = Capped(stream, ARCHIVE_MAX, str(path), "a CIFAR-10 archive's bound "
                                "(the official ones inflate to 185 MB)")
                reader = TarReader(capped, str(path), CIFAR10_SOURCE)
                for count, member in enumerate(reader, 1):
                    if count > MAX_MEMBERS:
                        raise ImageFormatError(
                            f"{path}: expected a CIFAR-10 archive (the official ones have 9 "
                            f"members), found more than {MAX_MEMBERS:,} members")
                    if member.name not in wanted:
                        continue
                    if not member.regular:
                        raise ImageFormatError(
                            f"{self.describe(member.name)}: expected a regular file, found "
                            f"a link, directory or sparse file; repack the archive")
                    folder = self._check(member, wanted[member.name], folder)
                    self.members[member.name] = reader.read(member)
                reader.finish()
            except ImageFormatError:
                raise
            except DAMAGED as exc:
                raise ImageFormatError(
                    f"{path}: expected a directory or a readable tar archive (.tar.gz, .tgz), "
                    f"found a file that is not one or is corrupt ({type(exc).__name__}: "
                    f"{one_line(exc) or 'cut short'}); {CIFAR10_SOURCE}") from None

    def _check(self, member: Member, where: tuple[_Layout, str],
               folder: tuple[_Layout, str] | None) -> tuple[_Layout, str]:
        """Refuse a member seen twice, from a second version or folder, or too
        large (before its bytes are read); returns the archive's (layout, folder)."""
        if member.name in self.members:
            raise ImageFormatError(f"{self.describe(member.name)}: expected each batch once in "
                                   f"the archive, found it twice; repack the archive")
        if folder is not None and folder != where:
            def said(layout_prefix: tuple[_Layout, str]) -> str:
                layout, prefix = layout_prefix
                return f"{layout.version} version in {prefix or 'the top folder'}"
            raise ImageFormatError(
                f"{self.path}: expected the batches of one CIFAR-10 version in one folder (as "
                f"in the official archives), found the {said(folder)} and the {said(where)} "
                f"({member.name}); keep one")
        where[0].check_size(member.size, self.describe(member.name))
        return where

    def has(self, name: str) -> bool:
        return name in self.members

    def describe(self, name: str) -> str:
        return f"{self.path}:{name}"

    def read(self, name: str, layout: _Layout) -> bytearray:
        """The member's bytes (its size was checked when the archive was read);
        the store lets go of them."""
        return self.members.pop(name)
