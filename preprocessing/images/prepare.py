"""``mpidp prep --format mnist|cifar10``: official image files into the prepared HDF5 file.

The same contract as the PUMS files (:mod:`preprocessing.h5format`), as
format version 4: ``/train``, ``/val`` (``--val-fraction``) and ``/test``,
each ``X`` uint8 ``[N, C*H*W]`` (an image's pixels in C, H, W order) and
``y`` int8 ``[N]``, rows in a random order; the image shape and the
per-channel mean and standard deviation of the training pixels (scaled to
``[0, 1]``) are attributes, and readers normalise on load
(:mod:`engine.shard`). ``--like FILE`` takes the statistics of another image
file instead (a file to score a model on, normalised as its training file).

Splits: the official test images are the test split and the official
training images the rest (``--test-fraction`` does not apply and is
refused). When only one official split is there (the shared MNIST test
set, 10,000 images), its images are split by ``--test-fraction`` (default
0.2). ``--val-fraction`` then moves a share of the training images to
``/val``.

Image sets are small (CIFAR-10 is 180 MB of pixels), so rank 0 reads,
splits and writes the file while the other ranks wait (yielding the CPU)
and agree on the outcome: every rank raises the same one-line error, and
the file appears whole, under its final name, or not at all. The readers
bound every size a file claims (:mod:`preprocessing.images.streams`); the
writer streams each split's rows from the sets as read into the file, a
piece at a time, without a shuffled copy of the whole set. A stop signal
during the write removes the temporary file at once and ends the run
(:mod:`preprocessing.images.stops`).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass

import numpy as np

from preprocessing import atomic, h5format
from preprocessing.errors import PrepError
from preprocessing.images.cifar10 import read_cifar10
from preprocessing.images.imageset import ImageSet
from preprocessing.images.mnist import read_mnist
from preprocessing.images.stops import WritePhase
from preprocessing.agreement import agree
from preprocessing.prep import DEFAULT_MAX_INVALID_SHARE

#: ``--format`` values that name image sets, and their readers.
READERS = {"mnist": read_mnist, "cifar10": read_cifar10}
#: PUMS-only options, by argparse name: an image set refuses them when given.
PUMS_ONLY = {"task": "--task", "task_file": "--task-file", "encoding": "--encoding",
             "universe": "--universe", "household_secret": "--household-secret",
             "check_fields": "--check-fields"}
#: Bytes of pixels gathered and written at a time (one HDF5 chunk), so a
#: stop signal is acted on within one piece's write.
_PIECE_BYTES = 1 << 20


@dataclass
class ImageReport:
    """What ``prepare_images`` did (rank 0's numbers; every rank gets them)."""

    out_bytes: int
    seconds: float
    images: int
    files: int
    rows: dict[str, int]
    shape: tuple[int, ...]
    n_classes: int
    notes: tuple[str, ...] = ()  # the summary's notes (empty_split_notes)


def check_options(args: argparse.Namespace) -> None:
    """Refuse options that contradict an image format (one line).

    Raises:
        PrepError: more than one input, or a PUMS-only option.
    """
    if len(args.inputs) != 1:
        raise PrepError(f"--format {args.format} reads one directory (or, for cifar10, the "
                        f"official .tar.gz); got {len(args.inputs)} inputs")
    for name, option in PUMS_ONLY.items():
        if getattr(args, name, None):
            raise PrepError(f"{option} applies to PUMS files, not to --format "
                            f"{args.format} images; drop it")
    if args.max_invalid_share != DEFAULT_MAX_INVALID_SHARE:
        raise PrepError(f"--max-invalid-share applies to PUMS files, not to --format "
                        f"{args.format} images; drop it")


def split_sets(sets: dict[str, ImageSet], test_fraction: float | None, val_fraction: float,
               seed: int, where: str) -> dict[str, np.ndarray]:
    """Row indices of each split into the concatenation ``train + test`` of the
    official sets, shuffled with ``seed``: ``{"train", "val", "test"}`` (``val``
    only when ``val_fraction > 0``).

    Raises:
        PrepError: ``--test-fraction`` given while both official splits are
            there, or fractions that leave no image for training (unless
            ``--test-fraction 1``: a file only for scoring).
    """
    rng = np.random.default_rng(seed)
    n_train = len(sets["train"]) if "train" in sets else 0
    n_test = len(sets["test"]) if "test" in sets else 0
    if n_train and n_test:
        if test_fraction is not None:
            raise PrepError(f"--test-fraction {test_fraction:g}: {where} has the official "
                            "test images, which are the test split; drop --test-fraction")
        train, test = rng.permutation(n_train), n_train + rng.permutation(n_test)
    else:
        fraction = 0.2 if test_fraction is None else test_fraction
        pool = rng.permutation(n_train + n_test)
        cut = len(pool) - int(round(fraction * len(pool)))
        if cut == 0 and fraction < 1:
            raise PrepError(f"--test-fraction {fraction:g} left none of the {len(pool):,} "
                            "images for training: give a smaller --test-fraction, or "
                            "--test-fraction 1 for a file only for scoring")
        train, test = pool[:cut], pool[cut:]
    n_val = int(round(val_fraction * len(train)))
    if len(train) and n_val == len(train):
        raise PrepError(f"--val-fraction {val_fraction:g} left none of the {len(train):,} "
                        "training images for training: give a smaller --val-fraction, or "
                        "more data")
    out = {"train": train[n_val:], "test": test}
    if val_fraction > 0:
        out["val"] = train[:n_val]
    return out


def empty_split_notes(rows: dict[str, int], test_fraction: float | None,
                      val_fraction: float, one_set: bool) -> list[str]:
    """``  note    --val-fraction 0.1 put none of ...``: a split that was asked
    for (a fraction above 0) and came out empty, in the words of the PUMS path's
    error (:mod:`preprocessing.pipeline`), which an image set only warns of:
    the file still trains with ``--select-on last`` (``mpidp train`` then
    prints no val figure; without it, it refuses an empty validation split).

    Args:
        rows: each split's row count.
        one_set: only one official split was there, cut by ``--test-fraction``.
    """
    notes = []
    test = 0.2 if test_fraction is None else test_fraction
    if one_set and test > 0 and rows["test"] == 0:
        notes.append(f"  note    --test-fraction {test:g} put none of the "
                     f"{rows['train'] + rows.get('val', 0):,} images in the test split: too "
                     "few images; give a larger --test-fraction, or more data")
    if val_fraction > 0 and rows.get("val") == 0:
        notes.append(f"  note    --val-fraction {val_fraction:g} put none of the "
                     f"{rows['train']:,} training images in the validation split: too few "
                     "images; give a larger --val-fraction, more data, or --val-fraction 0 "
                     "for a file without one")
    return notes


def channel_stats(images: np.ndarray) -> tuple[list[float], list[float]]:
    """Per-channel mean and standard deviation of uint8 ``[N, C, H, W]`` / 255
    (float64 sums; a constant channel gets 1, so normalising never divides by 0)."""
    return stats_of_counts(channel_counts(images))


def channel_counts(images: np.ndarray) -> np.ndarray:
    """int64 ``[C, 256]``: how many pixels of each channel have each value
    (counts of pieces add up to the counts of the whole)."""
    return np.stack([np.bincount(images[:, c].ravel(), minlength=256)
                     for c in range(images.shape[1])]).astype(np.int64)


def stats_of_counts(counts: np.ndarray) -> tuple[list[float], list[float]]:
    """:func:`channel_stats` from the :func:`channel_counts` of the images."""
    means, stds = [], []
    levels = np.arange(256) / 255.0
    for channel in counts.astype(np.float64):
        total = channel.sum()
        if total == 0:
            means.append(0.0)
            stds.append(1.0)
            continue
        mean = float(channel @ levels / total)
        var = float(channel @ (levels - mean) ** 2 / total)
        means.append(mean)
        stds.append(float(np.sqrt(var)) if var > 0 else 1.0)
    return means, stds


class _Rows:
    """The rows of the official sets in reading order (train, then test),
    gathered by index a piece at a time without concatenating the sets."""

    def __init__(self, sets: list[ImageSet]) -> None:
        self.sets = sets
        self.starts = np.cumsum([0] + [len(s) for s in sets])
        self.shape = tuple(int(n) for n in sets[0].images.shape[1:])
        self.width = int(np.prod(self.shape))

    def __len__(self) -> int:
        return int(self.starts[-1])

    def images(self, index: np.ndarray) -> np.ndarray:
        """uint8 ``[len(index), C, H, W]``: the rows ``index``, every one filled."""
        out = np.empty((len(index), *self.shape), dtype=np.uint8)
        for part, start, stop in zip(self.sets, self.starts, self.starts[1:]):
            mine = (index >= start) & (index < stop)
            out[mine] = part.images[index[mine] - start]
        return out

    def labels(self, index: np.ndarray) -> np.ndarray:
        return np.concatenate([s.labels for s in self.sets])[index]

    def pieces(self, index: np.ndarray) -> "list[np.ndarray]":
        """``index`` cut into pieces of about :data:`_PIECE_BYTES` of pixels."""
        step = max(1, _PIECE_BYTES // self.width)
        return [index[i:i + step] for i in range(0, len(index), step)]

    def stats(self, index: np.ndarray) -> tuple[list[float], list[float]]:
        """:func:`channel_stats` of the rows ``index``, a piece at a time."""
        counts = np.zeros((self.shape[0], 256), dtype=np.int64)
        for piece in self.pieces(index):
            counts += channel_counts(self.images(piece))
        return stats_of_counts(counts)


def like_statistics(path: str, fmt: str, shape: tuple[int, ...]) -> tuple[list, list]:
    """The channel means and standard deviations of the image file ``path``
    (``--like``: a file to score a model with is normalised as its training
    file was, so its encoding fingerprint matches).

    Raises:
        PrepError: ``path`` is not a prepared image file of ``fmt`` and ``shape``.
    """
    try:
        info = h5format.read_info(path)
    except h5format.FormatError as exc:
        raise PrepError(f"--like {path}: {exc}") from None
    if not info.is_image or info.task != fmt or tuple(info.image_shape) != shape:
        what = (f"{info.task} images of {'x'.join(map(str, info.image_shape))}"
                if info.is_image else "tabular rows")
        raise PrepError(f"--like {path} holds {what}; these are {fmt} images of "
                        f"{'x'.join(map(str, shape))}")
    return list(info.channel_mean), list(info.channel_std)


def _write(path: str, rows: _Rows, splits: dict[str, np.ndarray], attrs: dict, compression,
           phase: WritePhase) -> None:
    """Write each split's rows (``splits``: indices into ``rows``) a piece at a
    time, checking ``phase`` for a stop signal between pieces."""
    import h5py  # deferred: keeps `mpidp prep --help` fast

    options = {"compression": "gzip", "compression_opts": compression.level,
               "shuffle": True} if compression.enabled else {}
    with h5py.File(path, "w") as f:
        for split in h5format.SPLITS:
            if split not in splits:
                continue
            index = splits[split]
            n, width = len(index), rows.width
            chunk = (max(1, min(n, (1 << 20) // width)), width) if n else None
            X = f.create_dataset(h5format.x_name(split), (n, width), dtype=h5format.IMAGE_DTYPE,
                                 chunks=chunk, **(options if n else {}))
            start = 0
            for piece in rows.pieces(index):
                phase.check()
                X[start:start + len(piece)] = rows.images(piece).reshape(len(piece), width)
                start += len(piece)
            f.create_dataset(h5format.y_name(split),
                             data=rows.labels(index).astype(h5format.Y_DTYPE))
        h5format.write_attributes(f.attrs, attrs)
        phase.check()
    phase.check()


def _prepare(args: argparse.Namespace, val_fraction: float, compression,
             version: str) -> ImageReport:
    """Rank 0's work: read, split, compute the statistics, write atomically."""
    start = time.perf_counter()
    source = args.inputs[0]
    sets = READERS[args.format](source)
    splits = split_sets(sets, args.test_fraction, val_fraction, args.seed, source)
    order = [s for s in ("train", "test") if s in sets]
    rows = _Rows([sets[s] for s in order])
    n_classes = sets[order[0]].n_classes
    shape = rows.shape
    like = getattr(args, "like", None)
    if like:
        mean, std = like_statistics(like, args.format, shape)
    else:
        mean, std = rows.stats(splits["train"] if len(splits["train"])
                               else np.arange(len(rows)))
    layout = {"image_shape": list(shape), "channel_mean": mean, "channel_std": std}
    attrs = {**h5format.identity(h5format.IMAGE_VERSION), **layout,
             "task": args.format, "n_classes": n_classes,
             "encoding_fingerprint": h5format.fingerprint(json.dumps(
                 {"format": args.format, **layout}, sort_keys=True)),
             "sources": [entry for s in order for entry in sets[s].source],
             "seed": args.seed, "test_fraction": len(splits["test"]) / max(1, len(rows)),
             "val_fraction": val_fraction, "created_by": f"mpidp {version}".strip(),
             "drop_counts": {}, "like": like or ""}
    temporary = atomic.temporary_name(args.out)
    try:
        with WritePhase(temporary) as phase:
            _write(temporary, rows, splits, attrs, compression, phase)
            atomic.commit(temporary, args.out)
    except OSError as exc:
        raise PrepError(f"{args.out}: cannot write the output: {exc}") from None
    finally:
        atomic.discard(temporary)
    return ImageReport(out_bytes=os.path.getsize(args.out),
                       seconds=time.perf_counter() - start, images=len(rows),
                       files=sum(len(sets[s].source) for s in order),
                       rows={name: len(index) for name, index in splits.items()},
                       shape=shape, n_classes=n_classes,
                       notes=tuple(empty_split_notes(
                           {name: len(index) for name, index in splits.items()},
                           args.test_fraction, val_fraction, len(order) == 1)))


def prepare_images(comm, args: argparse.Namespace, val_fraction: float, compression,
                   version: str) -> ImageReport:
    """Collective over ``comm``: prepare ``args.inputs[0]`` as ``args.format`` into
    ``args.out`` (rank 0 works, the others wait); returns rank 0's report on
    every rank.

    Raises:
        PrepError: (collective) a missing or malformed file, a contradicting
            option, an output that cannot be written; nothing is left behind.
    """
    report = agree(comm, lambda: _prepare(args, val_fraction, compression, version)
                   if comm.Get_rank() == 0 else None)
    return comm.bcast(report, root=0)


def summary(report: ImageReport, args: argparse.Namespace, ranks: int) -> str:
    """The lines printed after a successful run."""
    shape = "x".join(map(str, report.shape))
    splits = ", ".join(f"{name} {report.rows[name]:,}" for name in h5format.SPLITS
                       if name in report.rows)
    return "\n".join([
        f"mpidp prep: wrote {args.out} ({report.out_bytes / 1e6:.1f} MB) in "
        f"{report.seconds:.2f} s on {ranks} rank{'s' if ranks > 1 else ''}",
        f"  read    {report.images:>12,} {args.format} images of {shape} from "
        f"{report.files} file{'s' if report.files > 1 else ''}",
        f"  kept    {report.images:>12,} ({splits}; {report.n_classes} classes)",
        *report.notes,
    ])
