"""MNIST in the official idx files -> :class:`ImageSet` per split.

A directory holds the training pair (``train-images-idx3-ubyte`` and
``train-labels-idx1-ubyte``), the test pair (``t10k-...``), or both; each
file gzipped (``.gz``, as distributed) or not, and the ``train-images.idx3-ubyte``
spelling is accepted too. The idx format: a big-endian header (magic
``0x00000803`` for images: unsigned bytes, 3 dimensions; ``0x00000801`` for
labels: 1 dimension), the dimension sizes as big-endian uint32, then the
bytes, row-major. Example::

    sets = read_mnist("data/mnist")          # {"train": ..., "test": ...}
    sets["test"].images.shape                 # (10000, 1, 28, 28)
"""
from __future__ import annotations

import gzip
import struct
import zlib
from pathlib import Path

import numpy as np

from preprocessing.images.errors import MNIST_SOURCE, ImageFormatError, one_line
from preprocessing.images.imageset import ImageSet, first_out_of_range, source_entry

N_CLASSES = 10
ROWS = COLS = 28
IMAGES_MAGIC = 0x00000803  # unsigned bytes, 3 dimensions
LABELS_MAGIC = 0x00000801  # unsigned bytes, 1 dimension
_GZIP_MAGIC = b"\x1f\x8b"
#: split -> file-name prefix of the official files.
SPLITS = {"train": "train", "test": "t10k"}


def read_mnist(directory: str | Path) -> dict[str, ImageSet]:
    """Read every complete MNIST pair in ``directory``.

    Returns:
        ``{"train": ImageSet, "test": ImageSet}``, with only the splits whose
        pair is present; images uint8 ``[N, 1, 28, 28]``, labels uint8 ``[N]``
        in 0..9; ``source`` lists the images file then the labels file.

    Raises:
        ImageFormatError: the directory is missing or holds no pair; a pair is
            half present; a file is unreadable, a corrupt gzip stream, has the
            wrong magic, is not 28x28, holds no images, is shorter or longer
            than its header says, has a label outside 0..9; or the two files
            of a pair disagree on the count.
    """
    root = Path(directory)
    if not root.is_dir():
        found = "a file" if root.exists() else "nothing"
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
        result[split] = _read_pair(images_path, labels_path, root)
    if not result:
        raise ImageFormatError(
            f"{root}: no MNIST idx files found; expected the pair train-images-idx3-ubyte + "
            f"train-labels-idx1-ubyte and/or t10k-images-idx3-ubyte + t10k-labels-idx1-ubyte, "
            f"gzipped (.gz) or not; {MNIST_SOURCE}")
    return result


def _official_name(prefix: str, kind: str) -> str:
    return f"{prefix}-{kind}-idx{3 if kind == 'images' else 1}-ubyte"


def _find(root: Path, prefix: str, kind: str, ndim: int) -> Path | None:
    """The first existing spelling: official ``.gz``, unzipped, then the dot variants."""
    for stem in (f"{prefix}-{kind}-idx{ndim}-ubyte", f"{prefix}-{kind}.idx{ndim}-ubyte"):
        for name in (stem + ".gz", stem):
            if (root / name).is_file():
                return root / name
    return None


def _read_pair(images_path: Path, labels_path: Path, root: Path) -> ImageSet:
    images_stored, images_data = _load(images_path)
    labels_stored, labels_data = _load(labels_path)
    images = _parse_images(images_data, images_path)
    labels = _parse_labels(labels_data, labels_path)
    if len(labels) != len(images):
        raise ImageFormatError(
            f"{labels_path}: holds {len(labels)} labels but {images_path} holds {len(images)} "
            f"images; expected the same count (both files of one split)")
    return ImageSet(
        images=images, labels=labels, n_classes=N_CLASSES,
        source=[source_entry(str(images_path.relative_to(root)), images_stored, len(images)),
                source_entry(str(labels_path.relative_to(root)), labels_stored, len(labels))])


def _load(path: Path) -> tuple[bytes, bytes]:
    """(bytes as stored, idx bytes): a ``.gz`` file is decompressed."""
    try:
        stored = path.read_bytes()
    except OSError as exc:
        raise ImageFormatError(f"{path}: cannot be read ({one_line(exc)})") from None
    if path.suffix != ".gz":
        return stored, stored
    try:
        return stored, gzip.decompress(stored)
    except (OSError, EOFError, zlib.error) as exc:
        raise ImageFormatError(
            f"{path}: expected a complete gzip stream, found a corrupt or truncated one "
            f"({one_line(exc) or type(exc).__name__}); {MNIST_SOURCE}") from None


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


def _payload(data: bytes, path: Path, ndim: int, expected: int, what: str) -> np.ndarray:
    """The bytes after the header, which must be exactly ``expected`` long."""
    found = len(data) - (4 + 4 * ndim)
    if found < expected:
        raise ImageFormatError(f"{path}: expected {expected} bytes of {what} after the header, "
                               f"found {found} (the file is truncated)")
    if found > expected:
        raise ImageFormatError(f"{path}: expected {expected} bytes of {what} after the header, "
                               f"found {found} ({found - expected} trailing bytes)")
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)


def _parse_images(data: bytes, path: Path) -> np.ndarray:
    """uint8 ``[N, 1, 28, 28]``, a fresh writable copy."""
    count, rows, cols = _header(data, path, IMAGES_MAGIC, "images")
    if (rows, cols) != (ROWS, COLS):
        raise ImageFormatError(f"{path}: expected {ROWS}x{COLS} images (MNIST), found "
                               f"{rows}x{cols}")
    if count == 0:
        raise ImageFormatError(f"{path}: expected at least one image, found a count of 0")
    pixels = _payload(data, path, 3, count * rows * cols, f"{count} {rows}x{cols} images")
    return pixels.reshape(count, 1, rows, cols).copy()


def _parse_labels(data: bytes, path: Path) -> np.ndarray:
    """uint8 ``[N]`` in 0..9, a fresh writable copy."""
    (count,) = _header(data, path, LABELS_MAGIC, "labels")
    labels = _payload(data, path, 1, count, f"{count} labels")
    bad = first_out_of_range(labels, N_CLASSES)
    if bad is not None:
        raise ImageFormatError(f"{path}: expected labels 0..{N_CLASSES - 1}, found "
                               f"{labels[bad]} at index {bad}")
    return labels.copy()
