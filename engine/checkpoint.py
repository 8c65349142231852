"""Atomic checkpoints: write to a temporary file, fsync, rename.

A checkpoint is one file, ``<dir>/checkpoint.pt`` (``torch.save`` of plain
data and tensors, loaded with ``weights_only=True``), written by rank 0 after
it gathered every rank's RNG states. A crash mid-write leaves the previous
checkpoint intact: readers only ever see a complete file.

It is as sensitive as the training data (it holds the noise generators'
states, which with the model could help undo the noise): keep it private.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from engine.errors import CheckpointError

FILENAME = "checkpoint.pt"
FORMAT = "mpidp-checkpoint"
VERSION = 1


def path_in(directory: str | os.PathLike) -> Path:
    return Path(directory) / FILENAME


def _plain(value):
    """Numpy scalars and tuples -> Python types (``weights_only`` loading accepts
    only plain containers, numbers, strings and tensors)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.copy())
    return value


def save(directory: str | os.PathLike, payload: dict) -> Path:
    """Write ``payload`` atomically to ``<directory>/checkpoint.pt``; returns the path.

    Raises:
        CheckpointError: the directory cannot be created or written.
    """
    directory = Path(directory)
    target = path_in(directory)
    tmp = directory / f".{FILENAME}.{os.getpid()}.tmp"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as handle:
            torch.save(_plain({"format": FORMAT, "version": VERSION, **payload}), handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise CheckpointError(f"cannot write checkpoint {target}: {exc}") from None
    return target


def load(directory: str | os.PathLike) -> dict | None:
    """The checkpoint in ``directory``, or None when there is none.

    Raises:
        CheckpointError: the file exists but is not a readable mpidp checkpoint.
    """
    return load_file(path_in(directory), missing_ok=True)


def load_file(path: str | os.PathLike, missing_ok: bool = False) -> dict | None:
    """Load a checkpoint file (see :func:`load`)."""
    path = Path(path)
    if path.is_dir():
        path = path_in(path)
    if not path.exists():
        if missing_ok:
            return None
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling failure means "corrupt"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise CheckpointError(f"{path} is not a readable checkpoint ({type(exc).__name__}: "
                              f"{first})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not an mpidp checkpoint")
    if payload.get("version") != VERSION:
        raise CheckpointError(f"{path}: checkpoint version {payload.get('version')} is not "
                              f"supported (expected {VERSION})")
    return payload
