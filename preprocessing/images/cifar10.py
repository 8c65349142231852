"""CIFAR-10 in the official files -> :class:`ImageSet` per split.

``path`` is a directory or a tar archive (``cifar-10-binary.tar.gz`` as
distributed; any tarfile compression is read, members are read in memory and
never extracted). The six batches ``data_batch_1 .. data_batch_5`` (train, in
that order) and ``test_batch`` are looked for directly under ``path`` and in
the official subdirectory, in two versions:

* binary (preferred when complete): ``*.bin`` in ``cifar-10-batches-bin/``;
  records of 3073 bytes: one label byte (0..9), then 1024 red, 1024 green and
  1024 blue bytes, each plane row-major 32x32;
* python: extension-less pickles in ``cifar-10-batches-py/``, each a dict with
  ``b"data"`` (uint8 ``[n, 3072]``, rows laid out as the binary records'
  pixels) and ``b"labels"`` (n ints), read with
  :func:`~preprocessing.images.safe_pickle.load_arrays`, which executes
  nothing.

Example::

    sets = read_cifar10("cifar-10-binary.tar.gz")
    sets["train"].images.shape                # (50000, 3, 32, 32)
"""
from __future__ import annotations

import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from preprocessing.images.errors import CIFAR10_SOURCE, ImageFormatError, one_line
from preprocessing.images.imageset import ImageSet, first_out_of_range, source_entry
from preprocessing.images.safe_pickle import load_arrays

N_CLASSES = 10
SHAPE = (3, 32, 32)
PIXELS = 3 * 32 * 32
RECORD = 1 + PIXELS
TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCHES = ("test_batch",)

Parser = Callable[[bytes, str], "tuple[np.ndarray, np.ndarray]"]


def read_cifar10(path: str | Path) -> dict[str, ImageSet]:
    """Read the six CIFAR-10 batches from a directory or a tar archive.

    Returns:
        ``{"train": ImageSet, "test": ImageSet}``: train is data_batch_1..5
        concatenated in order, test is test_batch; images uint8
        ``[N, 3, 32, 32]`` (channels R, G, B), labels uint8 ``[N]`` in 0..9;
        ``source`` has one entry per batch file.

    Raises:
        ImageFormatError: ``path`` is missing or not a readable tar archive;
            neither version has all six batches (the message names the
            missing ones); a binary batch is empty or not a whole number of
            3073-byte records; a pickle names anything but numpy's array
            globals or is not the expected dict; a label is outside 0..9.
    """
    store = _open(Path(path))
    layout, prefix = _choose(store)
    sets = {}
    for split, batches in (("train", TRAIN_BATCHES), ("test", TEST_BATCHES)):
        images, labels, source = [], [], []
        for batch in batches:
            name = prefix + batch + layout.suffix
            stored = store.read(name)
            batch_images, batch_labels = layout.parse(stored, store.describe(name))
            images.append(batch_images)
            labels.append(batch_labels)
            source.append(source_entry(name, stored, len(batch_labels)))
        sets[split] = ImageSet(images=np.concatenate(images), labels=np.concatenate(labels),
                               n_classes=N_CLASSES, source=source)
    return sets


def parse_binary(data: bytes, name: str) -> tuple[np.ndarray, np.ndarray]:
    """One binary batch -> (images ``[n, 3, 32, 32]``, labels ``[n]``), views of ``data``."""
    if len(data) == 0 or len(data) % RECORD:
        raise ImageFormatError(
            f"{name}: expected a positive whole number of {RECORD}-byte records (1 label byte "
            f"+ {PIXELS} pixel bytes; official batches are 10000 records), found {len(data)} "
            f"bytes = {len(data) // RECORD} records + {len(data) % RECORD} bytes")
    records = np.frombuffer(data, dtype=np.uint8).reshape(-1, RECORD)
    labels = records[:, 0]
    _check_labels(labels, name, "record")
    return records[:, 1:].reshape(-1, *SHAPE), labels


def parse_pickle(data: bytes, name: str) -> tuple[np.ndarray, np.ndarray]:
    """One python-version batch -> (images ``[n, 3, 32, 32]``, labels ``[n]``)."""
    batch = load_arrays(data, name)
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        found = (f"a dict with keys {sorted(map(repr, batch))[:6]}" if isinstance(batch, dict)
                 else type(batch).__name__)
        raise ImageFormatError(f"{name}: expected a dict with b'data' and b'labels', found "
                               f"{one_line(found)}")
    pixels = batch[b"data"]
    if (not isinstance(pixels, np.ndarray) or pixels.dtype != np.uint8 or pixels.ndim != 2
            or pixels.shape[1] != PIXELS or len(pixels) == 0):
        found = (f"{pixels.dtype} array of shape {pixels.shape}" if isinstance(pixels, np.ndarray)
                 else type(pixels).__name__)
        raise ImageFormatError(f"{name}: expected b'data' to be a uint8 array [n, {PIXELS}] "
                               f"with n > 0, found {found}")
    labels = _pickled_labels(batch[b"labels"], name)
    if len(labels) != len(pixels):
        raise ImageFormatError(f"{name}: expected {len(pixels)} labels (one per row of "
                               f"b'data'), found {len(labels)}")
    _check_labels(labels, name, "label")
    return pixels.reshape(-1, *SHAPE), labels.astype(np.uint8)


def _pickled_labels(value: object, name: str) -> np.ndarray:
    """b'labels' as an integer array (a list of ints, or a 1-D integer array)."""
    try:
        labels = np.asarray(value)
    except (ValueError, TypeError):
        labels = None
    if labels is None or labels.ndim != 1 or (labels.size and labels.dtype.kind not in "iu"):
        raise ImageFormatError(f"{name}: expected b'labels' to be a list of ints, found "
                               f"{type(value).__name__}")
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


LAYOUTS = (_Layout("binary", "cifar-10-batches-bin/", ".bin", parse_binary),
           _Layout("python", "cifar-10-batches-py/", "", parse_pickle))


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
        return _TarStore(path, {n for *_, names in _candidates() for n in names})
    raise ImageFormatError(f"{path}: expected a directory or a .tar.gz of the CIFAR-10 "
                           f"batches, found nothing; {CIFAR10_SOURCE}")


class _DirStore:
    """Batch files under a directory, read when asked for."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def has(self, name: str) -> bool:
        return (self.path / name).is_file()

    def describe(self, name: str) -> str:
        return str(self.path / name)

    def read(self, name: str) -> bytes:
        try:
            return (self.path / name).read_bytes()
        except OSError as exc:
            raise ImageFormatError(f"{self.path / name}: cannot be read "
                                   f"({one_line(exc)})") from None


class _TarStore:
    """The wanted regular members of a tar archive, read in one sequential pass."""

    def __init__(self, path: Path, wanted: set[str]) -> None:
        self.path = path
        self.members: dict[str, bytes] = {}
        try:
            with tarfile.open(path, mode="r|*") as archive:
                for member in archive:
                    name = member.name.removeprefix("./")
                    if member.isfile() and name in wanted:
                        self.members[name] = archive.extractfile(member).read()
        except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
            raise ImageFormatError(
                f"{path}: expected a directory or a readable tar archive (.tar.gz, .tgz), "
                f"found a file that is not one or is corrupt ({type(exc).__name__}: "
                f"{one_line(exc)}); {CIFAR10_SOURCE}") from None

    def has(self, name: str) -> bool:
        return name in self.members

    def describe(self, name: str) -> str:
        return f"{self.path}:{name}"

    def read(self, name: str) -> bytes:
        return self.members[name]
