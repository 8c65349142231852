"""What every rank of a run must have been given alike: the settings and the data.

Under ``mpidp train`` every rank parses the same command line, so both hold by
construction. A program of the user's own calls :func:`engine.train` on each
rank with arguments of its own making, and two mistakes there do not fail by
themselves: settings that differ by rank (``epochs=1 + rank``: one rank runs
on alone and waits in an all-reduce for ever) and a file per rank (each rank
reads its share of its own file: the model trains on a mix, and the epsilon,
planned for one file's rows, holds for none).
"""
from __future__ import annotations

import hashlib

import numpy as np

from engine.config import TrainConfig
from engine.errors import ConfigError, DataError
from preprocessing import h5format
from preprocessing.h5format import DataInfo

#: Settings a rank may hold for itself: whether it draws a progress bar, its
#: threads (cores can differ by node) and the path of the data, which may be a
#: copy on each node's own disk (the file's contents are compared instead).
OWN = ("progress", "threads", "data")


def check_same_settings(cfg: TrainConfig, comm) -> None:
    """Collective: every rank of ``comm`` holds the same settings (but :data:`OWN`).

    Raises:
        ConfigError: (collective) naming the first setting that differs, the
            first rank holding another value, and both values.
    """
    mine = {k: v for k, v in cfg.to_dict().items() if k not in OWN}
    every = comm.allgather(mine)
    for rank, theirs in enumerate(every[1:], start=1):
        for name, value in every[0].items():
            if theirs.get(name) != value:
                raise ConfigError(
                    f"engine.train(): rank {rank} was given {name}={theirs.get(name)!r} but "
                    f"rank 0 {name}={value!r}: every rank must call it with the same "
                    "settings (the ranks train one model in lock-step)", collective=True)


def identity(info: DataInfo) -> str:
    """A digest of what makes a prepared file itself: its shape, attributes'
    fingerprint, and the first, middle and last rows (features and labels) of
    each split.

    Two preparations of different data differ in their rows; a copy of one file
    (on each node's own disk) does not. Reads at most six rows of each split.
    """
    import h5py  # deferred: as the shard reader's

    digest = hashlib.sha256(repr((info.n_features, info.n_classes, sorted(info.rows.items()),
                                  info.fingerprint, info.task)).encode())
    with h5py.File(info.path, "r") as handle:
        for split, rows in sorted(info.rows.items()):
            ends = sorted({0, rows // 2, rows - 1}) if rows else []
            for name in (h5format.x_name(split), h5format.y_name(split)):
                for row in ends:
                    digest.update(np.ascontiguousarray(handle[name][row]).tobytes())
    return digest.hexdigest()


def check_same_file(info: DataInfo, comm) -> None:
    """Collective: every rank of ``comm`` was given the same data (:func:`identity`).

    Raises:
        DataError: (collective) naming the first rank whose file differs from
            rank 0's, and both paths.
    """
    every = comm.allgather((info.path, identity(info)))
    for rank, (path, digest) in enumerate(every[1:], start=1):
        if digest != every[0][1]:
            same_path = " (the same path, another file on that rank's node)" \
                if path == every[0][0] else ""
            raise DataError(
                f"engine.train(): rank {rank} was given the data file {path}, whose rows differ "
                f"from those of rank 0's {every[0][0]}{same_path}: every rank must be given "
                "the same file, of which each reads its own share (one file per rank trains "
                "on a mix, and the epsilon holds for neither)", collective=True)
