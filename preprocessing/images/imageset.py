"""The readers' common result: images, labels and where they came from."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ImageSet:
    """One split (train or test) of an image data set.

    Attributes:
        images: uint8, shape ``[N, C, H, W]``, C-contiguous and writable
            (MNIST ``[N, 1, 28, 28]``, CIFAR-10 ``[N, 3, 32, 32]`` with the
            channels in R, G, B order).
        labels: uint8, shape ``[N]``, each in ``0 .. n_classes - 1``.
        n_classes: how many classes the data set defines (10 for both).
        source: one dict per file read, in reading order:
            ``{"name": str, "sha256": str, "count": int}``; ``name`` is
            relative to the path given to the reader (for a tar archive, the
            member's name), ``sha256`` the hex digest of the file's bytes as
            stored (a ``.gz`` file's compressed bytes, a tar member's own
            bytes), ``count`` the images or labels it holds.

    Raises:
        ValueError: on construction, if the arrays break the contract above
            (a programming error in a reader, never a user's file).
    """

    images: np.ndarray
    labels: np.ndarray
    n_classes: int
    source: list[dict]

    def __post_init__(self) -> None:
        if self.images.dtype != np.uint8 or self.images.ndim != 4:
            raise ValueError(f"images must be uint8 [N, C, H, W], got {self.images.dtype} "
                             f"{self.images.shape}")
        if self.labels.dtype != np.uint8 or self.labels.shape != self.images.shape[:1]:
            raise ValueError(f"labels must be uint8 [{len(self.images)}], got "
                             f"{self.labels.dtype} {self.labels.shape}")

    def __len__(self) -> int:
        return len(self.images)


def source_entry(name: str, stored: bytes | bytearray, count: int) -> dict:
    """The :attr:`ImageSet.source` record of one file: name, sha256 of ``stored``, count."""
    return {"name": name, "sha256": hashlib.sha256(stored).hexdigest(), "count": int(count)}


def first_out_of_range(labels: np.ndarray, n_classes: int) -> int | None:
    """Index of the first label ``>= n_classes`` (labels are unsigned), or None."""
    bad = np.flatnonzero(labels >= n_classes)
    return int(bad[0]) if bad.size else None
