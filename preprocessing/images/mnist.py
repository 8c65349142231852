"""MNIST in the official idx files -> :class:`ImageSet` per split.

A directory holds the training pair (``train-images-idx3-ubyte`` and
``train-labels-idx1-ubyte``), the test pair (``t10k-...``), or both; each
file gzipped (``.gz``, as distributed) or not, and the ``train-images.idx3-ubyte``
spelling is accepted too. The idx format: a big-endian header (magic
``0x00000803`` for images: unsigned bytes, 3 dimensions; ``0x00000801`` for
labels: 1 dimension), the dimension sizes as big-endian uint32, then the
bytes, row-major.

The header is read first, and a count above the official one
(:data:`MAX_COUNT`: 60,000 training, 10,000 test images) is refused before
anything else is read or inflated; then exactly the bytes the header
announces are read into memory allocated once for them, one more byte tells
a longer file, and a ``.gz`` stream is read to its end, so that gzip's CRC-32
and length are checked before the images are used. Where a file is there
both gzipped and not (or in both spellings), the reader refuses to choose.
Example::

    sets = read_mnist("data/mnist")          # {"train": ..., "test": ...}
    sets["test"].images.shape                 # (10000, 1, 28, 28)
"""
from __future__ import annotations

import gzip
import math
import struct
from pathlib import Path

import numpy as np

from preprocessing.images.errors import MNIST_SOURCE, ImageFormatError, one_line
from preprocessing.images.imageset import ImageSet, first_out_of_range
from preprocessing.images.streams import (DAMAGED, Hashing, count_rest, not_regular,
                                          open_stored, read_exact)

N_CLASSES = 10
ROWS = COLS = 28
IMAGES_MAGIC = 0x00000803  # unsigned bytes, 3 dimensions
LABELS_MAGIC = 0x00000801  # unsigned bytes, 1 dimension
_GZIP_MAGIC = b"\x1f\x8b"
#: split -> file-name prefix of the official files.
SPLITS = {"train": "train", "test": "t10k"}
#: file-name prefix -> the most images (and labels) its files may hold: the
#: official counts (Fashion-MNIST and KMNIST have the same).
MAX_COUNT = {"train": 60_000, "t10k": 10_000}
#: How far past its announced end a file is read to say how long it is.
_TRAILING_SCAN = 1 << 20


def read_mnist(directory: str | Path) -> dict[str, ImageSet]:
    """Read every complete MNIST pair in ``directory``.

    Returns:
        ``{"train": ImageSet, "test": ImageSet}``, with only the splits whose
        pair is present; images uint8 ``[N, 1, 28, 28]``, labels uint8 ``[N]``
        in 0..9; ``source`` lists the images file then the labels file.

    Raises:
        ImageFormatError: the directory is missing or holds no pair; a pair is
            half present; a file is there twice (gzipped and not, or in both
            spellings); a file is unreadable, a corrupt gzip stream (a bad
            CRC included), has the wrong magic, is not 28x28, holds no images
            or more than :data:`MAX_COUNT`, is shorter or longer than its
            header says, has a label outside 0..9; or the two files of a pair
            disagree on the count.
    """
    root = Path(directory)
    if not root.is_dir():
        found = not_regular(root) or ("a file" if root.exists() else "nothing")
        raise ImageFormatError(f"{root}: expected a directory of MNIST idx files, found "
                               f"{found}; {MNIST_SOURCE}")
    result: dict[str, ImageSet] = {}
    for split, prefix in SPLITS.items():
        images_path = _find(root, prefix, "images", 3)
        labels_path = _find(root, prefix, "labels", 1)
        if images_path is None and labels_path is None:
            continue
        if images_path is None or labels_path is None:
            have, lacking = (("images", "labels") if labels_path is None else ("labels", "images"))
            present = images_path or labels_path
            raise ImageFormatError(
                f"{present}: found the {split} {have} file but not its {lacking} file "
                f"({_official_name(prefix, lacking)}[.gz]) in {root}; {MNIST_SOURCE}")
        result[split] = _read_pair(images_path, labels_path, root, MAX_COUNT[prefix])
    if not result:
        raise ImageFormatError(
            f"{root}: no MNIST idx files found; expected the pair train-images-idx3-ubyte + "
            f"train-labels-idx1-ubyte and/or t10k-images-idx3-ubyte + t10k-labels-idx1-ubyte, "
            f"gzipped (.gz) or not; {MNIST_SOURCE}")
    return result


def _official_name(prefix: str, kind: str) -> str:
    return f"{prefix}-{kind}-idx{3 if kind == 'images' else 1}-ubyte"


def _find(root: Path, prefix: str, kind: str, ndim: int) -> Path | None:
    """The one existing spelling (official, ``.gz`` or not, or the dot variant).

    Raises:
        ImageFormatError: more than one is there: the reader does not choose;
            or one is there but is not a regular file (a directory, a FIFO, a
            symbolic link loop or to a device: :func:`not_regular`).
    """
    split = next(s for s, p in SPLITS.items() if p == prefix)
    names = [root / name for stem in (f"{prefix}-{kind}-idx{ndim}-ubyte",
                                      f"{prefix}-{kind}.idx{ndim}-ubyte")
             for name in (stem + ".gz", stem)]
    for path in names:
        what = not_regular(path)
        if what is not None:
            raise ImageFormatError(f"{path}: expected the {split} {kind} file (a regular "
                                   f"file), found {what}; put the file itself there, or "
                                   "remove it")
    found = [path for path in names if path.is_file()]
    if len(found) > 1:
        raise ImageFormatError(
            f"{root}: expected one {split} {kind} file, found {len(found)}: "
            f"{', '.join(p.name for p in found)}; they may differ and mpidp will not choose: "
            f"keep one")
    return found[0] if found else None


def _read_pair(images_path: Path, labels_path: Path, root: Path, bound: int) -> ImageSet:
    images, images_sha = _read_idx(images_path, IMAGES_MAGIC, "images", bound)
    labels, labels_sha = _read_idx(labels_path, LABELS_MAGIC, "labels", bound)
    if len(labels) != len(images):
        raise ImageFormatError(
            f"{labels_path}: holds {len(labels)} labels but {images_path} holds {len(images)} "
            f"images; expected the same count (both files of one split)")
    bad = first_out_of_range(labels, N_CLASSES)
    if bad is not None:
        raise ImageFormatError(f"{labels_path}: expected labels 0..{N_CLASSES - 1}, found "
                               f"{labels[bad]} at index {bad}")
    return ImageSet(
        images=images.reshape(-1, 1, ROWS, COLS), labels=labels, n_classes=N_CLASSES,
        source=[_entry(images_path, root, images_sha, len(images)),
                _entry(labels_path, root, labels_sha, len(labels))])


def _entry(path: Path, root: Path, sha256: str, count: int) -> dict:
    return {"name": str(path.relative_to(root)), "sha256": sha256, "count": int(count)}


def _read_idx(path: Path, magic: int, what: str, bound: int) -> tuple[np.ndarray, str]:
    """(the payload as uint8 ``[count, ...]`` over memory of its own, the sha256
    of the file as stored), reading as the module docstring says."""
    with open_stored(path) as raw:
        stored = Hashing(raw)
        gzipped = path.suffix == ".gz"
        stream = gzip.GzipFile(fileobj=stored, mode="rb") if gzipped else stored
        try:
            ndim = magic & 0xFF
            dims = _header(read_exact(stream, 4 + 4 * ndim), path, magic, what)
            _check_dims(dims, path, what, bound)
            expected = math.prod(dims)
            payload = read_exact(stream, expected)
            _check_length(len(payload), expected, stream, path, f"{dims[0]} "
                          + (f"{dims[1]}x{dims[2]} " if ndim == 3 else "") + what)
            while stored.read(1 << 20):  # the rest as stored (gzip read it all already)
                pass
        except DAMAGED as exc:
            if not gzipped:
                raise ImageFormatError(f"{path}: cannot be read ({one_line(exc)})") from None
            raise ImageFormatError(
                f"{path}: expected a complete gzip stream, found a corrupt or truncated one "
                f"({one_line(exc) or type(exc).__name__}); {MNIST_SOURCE}") from None
    return np.frombuffer(payload, dtype=np.uint8).reshape(dims), stored.sha256


def _header(data: bytes, path: Path, magic: int, what: str) -> tuple[int, ...]:
    """Check the magic number and return the dimension sizes."""
    ndim = magic & 0xFF
    size = 4 + 4 * ndim
    if len(data) < size:
        raise ImageFormatError(f"{path}: expected an idx {what} header of {size} bytes, found "
                               f"a file of {len(data)} bytes")
    found = int.from_bytes(data[:4], "big")
    if found != magic:
        hint = "; it looks gzip-compressed: name it .gz" if data[:2] == _GZIP_MAGIC else ""
        raise ImageFormatError(
            f"{path}: expected the idx magic number 0x{magic:08X} ({what}: unsigned bytes, "
            f"{ndim} dimension{'s' if ndim > 1 else ''}), found 0x{found:08X}{hint}")
    return struct.unpack(f">{ndim}I", data[4:size])


def _check_dims(dims: tuple[int, ...], path: Path, what: str, bound: int) -> None:
    """Refuse images that are not 28x28, and a count of 0 or above ``bound``."""
    if what == "images":
        if dims[1:] != (ROWS, COLS):
            raise ImageFormatError(f"{path}: expected {ROWS}x{COLS} images (MNIST), found "
                                   f"{dims[1]}x{dims[2]}")
        if dims[0] == 0:
            raise ImageFormatError(f"{path}: expected at least one image, found a count of 0")
    if dims[0] > bound:
        raise ImageFormatError(
            f"{path}: expected at most {bound:,} {what} (the official file's count), found a "
            f"header claiming {dims[0]:,}; refused before reading on")


def _check_length(found: int, expected: int, stream, path: Path, what: str) -> None:
    """The payload was ``expected`` bytes and the stream ends right after it."""
    if found < expected:
        raise ImageFormatError(f"{path}: expected {expected} bytes of {what} after the header, "
                               f"found {found} (the file is truncated)")
    extra, ended = count_rest(stream, _TRAILING_SCAN)
    if extra and ended:
        raise ImageFormatError(f"{path}: expected {expected} bytes of {what} after the header, "
                               f"found {expected + extra} ({extra} trailing bytes)")
    if extra:
        raise ImageFormatError(f"{path}: expected {expected} bytes of {what} after the header, "
                               f"found more than {expected + extra} (more than {extra} trailing "
                               f"bytes; the rest was not read)")
