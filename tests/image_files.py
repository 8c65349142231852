"""Small image sets in the official file layouts, for the image tests.

``idx_bytes`` and ``write_tar`` spell out the MNIST idx and the CIFAR-10
archive layouts; ``mnist_dir`` and ``cifar10_tar`` write sets a model can
learn (each class brightens its own band of rows), so a short training run
has something to find.
"""
from __future__ import annotations

import gzip
import io
import struct
import tarfile
from pathlib import Path

import numpy as np


def idx_bytes(magic: int, dims: tuple[int, ...], payload: bytes) -> bytes:
    """An idx file: big-endian magic and dimensions, then the payload."""
    return struct.pack(f">I{len(dims)}I", magic, *dims) + payload


def write_tar(path: Path, files: dict[str, bytes], prefix: str) -> Path:
    """A gzipped tar of ``{name: bytes}``, each member named ``prefix + name``."""
    with tarfile.open(path, "w:gz") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(prefix + name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def learnable(n: int, shape: tuple[int, int, int], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """uint8 images ``[n, C, H, W]`` of noise whose class (0..9) brightens band
    ``class`` of ten bands of rows, and their labels."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, size=n).astype(np.uint8)
    images = rng.integers(0, 100, size=(n, *shape)).astype(np.uint8)
    band = shape[1] // 10
    for c in range(10):
        rows = labels == c
        images[rows, :, c * band:(c + 1) * band, :] += 150
    return images, labels


def mnist_dir(root: Path, n_train: int, n_test: int, seed: int = 0) -> Path:
    """The four gzipped idx files of a learnable MNIST-shaped set (``n_train``
    0: the test pair only, like the shared real set)."""
    root.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        if not n:
            continue
        images, labels = learnable(n, (1, 28, 28), seed + len(prefix))
        (root / f"{prefix}-images-idx3-ubyte.gz").write_bytes(gzip.compress(
            idx_bytes(0x803, (n, 28, 28), images.tobytes())))
        (root / f"{prefix}-labels-idx1-ubyte.gz").write_bytes(gzip.compress(
            idx_bytes(0x801, (n,), labels.tobytes())))
    return root


def cifar10_tar(path: Path, per_batch: int, seed: int = 0) -> Path:
    """The official binary archive layout (``cifar-10-batches-bin/``, six batches
    of ``per_batch`` records: a label byte, then the R, G, B planes)."""
    files = {}
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]
    for i, name in enumerate(names):
        images, labels = learnable(per_batch, (3, 32, 32), seed + i)
        records = np.concatenate([labels[:, None], images.reshape(per_batch, -1)], axis=1)
        files[name] = records.astype(np.uint8).tobytes()
    return write_tar(path, files, "cifar-10-batches-bin/")


def prepare(comm, fmt: str, source: Path, out: Path) -> str:
    """Collective: ``mpidp prep --format fmt source --out out --val-fraction 0``
    in-process (preprocessing.images.prepare), returning ``out`` as a string."""
    from argparse import Namespace

    from preprocessing.h5write import Compression
    from preprocessing.images.prepare import prepare_images

    args = Namespace(format=fmt, inputs=[str(source)], out=str(out), seed=0,
                     test_fraction=None)
    prepare_images(comm, args, 0.0, Compression(), "test")
    return args.out
