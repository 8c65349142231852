"""Synthetic image files in the prepared-HDF5 contract (format version 4), for the
image benchmarks when the real MNIST / CIFAR-10 files are not at hand.

:func:`write_images` writes what ``mpidp prep --format mnist|cifar10`` writes
(uint8 pixels ``[N, C*H*W]``, the image shape and the per-channel mean and
standard deviation of the training pixels as attributes): each class has a
smooth random template per channel (:func:`image_templates`), and every image
is its class's template plus a smooth random nuisance pattern and pixel
noise (:func:`image_rows`), so a convolutional model has a signal to learn
but no class is read off one pixel. ``python -m engine.bench.synthetic
--images CxHxW`` runs it from the command line.
"""
from __future__ import annotations

import json
import os

import numpy as np

import kernels.files
from preprocessing import h5format
from preprocessing.images.prepare import stats_of_counts


#: Cells per side of the coarse grids the class templates and the nuisance
#: patterns are drawn on (then blown up to the image's side: smooth patterns).
IMAGE_GRID = 4
#: Pixel-value scale of write_images' parts: the class template, the
#: per-image smooth nuisance and the per-pixel noise (around grey 128).
IMAGE_SIGNAL, IMAGE_NUISANCE, IMAGE_NOISE = 28.0, 40.0, 30.0
#: Rows of write_images generated (and written) at a time.
IMAGE_CHUNK = 8192


#: The most classes a file's labels hold: ``y`` is int8 (preprocessing.h5format.Y_DTYPE),
#: so labels 0..127.
MAX_CLASSES = int(np.iinfo(h5format.Y_DTYPE).max) + 1


def check_classes(n_classes: int) -> None:
    """Refuse a class count the file cannot hold (one line).

    Raises:
        ValueError: ``n_classes`` outside 2..:data:`MAX_CLASSES` (the labels are
            int8, and a file has at least two classes).
    """
    if not 2 <= n_classes <= MAX_CLASSES:
        raise ValueError(f"--classes {n_classes}: give 2..{MAX_CLASSES} (the labels are "
                         f"stored as {h5format.Y_DTYPE}, and a file has at least two classes)")


def _upsample(grid: np.ndarray, height: int, width: int) -> np.ndarray:
    """``[..., g, g]`` coarse cells blown up (nearest) to ``[..., height, width]``."""
    g = grid.shape[-1]
    fy, fx = -(-height // g), -(-width // g)
    return np.repeat(np.repeat(grid, fy, axis=-2), fx, axis=-1)[..., :height, :width]


def image_rows(rng: np.random.Generator, n: int, templates: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray]:
    """``n`` uint8 images ``[n, C*H*W]`` and their int8 labels: uniform classes,
    each image ``128 + template[label] + smooth nuisance + pixel noise``, clipped."""
    n_classes, c, h, w = templates.shape
    y = rng.integers(0, n_classes, n)
    g = min(IMAGE_GRID, h, w)
    nuisance = _upsample(rng.standard_normal((n, c, g, g), dtype=np.float32), h, w)
    pixels = 128.0 + templates[y] + IMAGE_NUISANCE * nuisance
    pixels += IMAGE_NOISE * rng.standard_normal(pixels.shape, dtype=np.float32)
    X = np.clip(np.rint(pixels), 0, 255).astype(np.uint8).reshape(n, c * h * w)
    return X, y.astype(np.int8)


def image_templates(shape: tuple[int, int, int], n_classes: int, seed: int) -> np.ndarray:
    """float32 ``[n_classes, C, H, W]``: each class's smooth random template (scaled
    by ``1/sqrt(C)``, so colour images are about as hard as grey ones)."""
    c, h, w = shape
    g = min(IMAGE_GRID, h, w)
    rng = np.random.default_rng([seed, 4])
    cells = rng.standard_normal((n_classes, c, g, g)).astype(np.float32)
    return (IMAGE_SIGNAL / np.sqrt(c)) * _upsample(cells, h, w)


def parse_image_shape(text: str) -> tuple[int, int, int]:
    """``"3x32x32"`` -> ``(3, 32, 32)``.

    Raises:
        ValueError: not three positive integers joined by ``x``.
    """
    try:
        shape = tuple(int(v) for v in str(text).lower().split("x"))
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"image shape {text!r}: expected CxHxW, e.g. 1x28x28 or 3x32x32")
    return shape  # type: ignore[return-value]


def write_images(path: str | os.PathLike, shape: tuple[int, int, int] = (1, 28, 28),
                 rows: int = 60_000, test_rows: int = 10_000, n_classes: int = 10,
                 seed: int = 0) -> str:
    """Write a synthetic image file (format version 4); returns its path.

    The layout and attributes are those ``mpidp prep --format mnist|cifar10``
    writes (:mod:`preprocessing.images.prepare`): ``/train`` and ``/test`` with
    uint8 ``X [N, C*H*W]`` (C, H, W order) and int8 ``y``, ``image_shape``,
    ``channel_mean`` and ``channel_std`` of the training pixels / 255, the
    encoding fingerprint of the layout, ``task`` ``synthetic-images``. Rows are
    generated and written in chunks (little memory for large files), under a
    temporary name renamed at the end (``n_classes`` is checked first:
    :func:`check_classes`, ValueError). Training and test images come from two
    random streams, so the test images do not depend on ``rows`` (the data
    repeats of ``mpidp bench scaling --preset dp-sweep`` are scored on the same
    test set).
    """
    import h5py  # deferred: keeps `mpidp bench --help` fast

    check_classes(n_classes)
    c, h, w = (int(v) for v in shape)
    width = c * h * w
    templates = image_templates((c, h, w), n_classes, seed)
    streams = {"train": np.random.default_rng([seed, 0]),
               "test": np.random.default_rng([seed, 1])}
    counts = np.zeros((c, 256), dtype=np.int64)
    with kernels.files.replacing(path) as tmp, h5py.File(tmp, "w") as f:
        for split, n in (("train", rows), ("test", test_rows)):
            chunk = (max(1, min(n, (1 << 20) // width)), width) if n else None
            X = f.create_dataset(h5format.x_name(split), (n, width),
                                 dtype=h5format.IMAGE_DTYPE, chunks=chunk)
            y = f.create_dataset(h5format.y_name(split), (n,), dtype=h5format.Y_DTYPE)
            for start in range(0, n, IMAGE_CHUNK):
                xb, yb = image_rows(streams[split], min(IMAGE_CHUNK, n - start),
                                    templates)
                X[start:start + len(yb)] = xb
                y[start:start + len(yb)] = yb
                if split == "train":
                    planes = xb.reshape(len(yb), c, h * w)
                    for channel in range(c):
                        counts[channel] += np.bincount(planes[:, channel].ravel(),
                                                       minlength=256)
        mean, std = stats_of_counts(counts)
        layout = {"image_shape": [c, h, w], "channel_mean": mean, "channel_std": std}
        task = "synthetic-images"
        h5format.write_attributes(f.attrs, {
            **h5format.identity(h5format.IMAGE_VERSION), **layout,
            "task": task, "n_classes": n_classes,
            "encoding_fingerprint": h5format.fingerprint(json.dumps(
                {"format": task, **layout}, sort_keys=True)),
            "sources": [], "seed": seed,
            "test_fraction": test_rows / max(1, rows + test_rows),
            "val_fraction": 0.0, "created_by": "mpidp engine.bench.synthetic",
            "drop_counts": {}})
    return str(path)
