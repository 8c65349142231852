"""Output paths, checked before any work: one rule for every mpidp command.

A run that fails after an hour because its output directory is read-only
has wasted the hour (and, for DP training, spent privacy for nothing), so
every command checks each output it will write before it reads any data:
the checkpoint directory and metrics file of ``mpidp train``, the JSON of
``mpidp audit``, the JSON and plots of the benchmarks.

The rule for missing directories is the same everywhere: **mpidp creates
the file or directory you name, never its parent.** A missing parent is
usually a typo (``runs/a`` for ``run/a``), and creating it would scatter
results, or start a second run of the same data under a new name. The one
exception is a path inside another output of the same command (``--metrics
DIR/metrics.jsonl`` with ``--checkpoint-dir DIR``): that directory is
created first, so its parent exists.

Each check raises :class:`~engine.errors.OutputError` (exit code 2) with a
message naming the option and what to do; callers check on rank 0 (the rank
that writes) and share the verdict with :func:`engine.errors.agree`.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

from engine.errors import OutputError, WriteFailed
import kernels.files
from preprocessing.atomic import probe_directory


def _parent(path: Path) -> Path:
    return path.absolute().parent


def _probe(directory: Path, option: str, path: Path) -> None:
    """Raise OutputError unless a file can be created in ``directory``."""
    try:
        probe_directory(directory)
    except OSError as exc:
        raise OutputError(f"{option} {path}: cannot write in {directory}: "
                          f"{exc.strerror}") from None


def _check_parent(path: Path, option: str) -> None:
    parent = _parent(path)
    if not parent.exists():
        raise OutputError(f"{option} {path}: directory {parent} does not exist (mpidp "
                          "creates the file or directory you name, never its parent: "
                          "create it first, or check the path for a typo)")
    if not parent.is_dir():
        raise OutputError(f"{option} {path}: {parent} is a file, not a directory")


def check_not_empty(path: str | os.PathLike | None, option: str) -> None:
    """Raise :class:`OutputError` for an empty (or blank) path: ``--json ''``
    names no file (``Path('')`` is the current directory)."""
    if path is not None and not str(path).strip():
        raise OutputError(f"{option} is empty; give a path, or leave {option} out")


#: The file name a message suggests for an option given a directory
#: (:func:`check_file`): one of the option's own kind.
EXAMPLE_NAMES = {"--json": "out.json", "--plot": "plot.png", "--metrics": "metrics.jsonl"}


def check_file(path: str | os.PathLike, option: str) -> Path:
    """Check that the file ``path`` (given as ``option``) can be written.

    It may exist (it is then replaced, atomically) but must not be a
    directory or empty; its directory must exist and accept a new file.
    A directory gets a file name of the option's kind suggested
    (:data:`EXAMPLE_NAMES`, else ``out.json``).

    Raises:
        OutputError: with a message naming ``option``.
    """
    check_not_empty(path, option)
    problem = kernels.files.not_an_output_file(path)
    spelt = os.sep if kernels.files.names_a_directory(path) else ""  # Path drops it
    path = Path(path)
    shown = f"{option} {path}{spelt}"
    if problem is not None:
        why, directory = problem
        name = EXAMPLE_NAMES.get(option, "out.json")
        raise OutputError(f"{shown}: {why}; give a file name, e.g. {path / name}"
                          if directory else f"{shown}: {why}; the output is "
                          f"{kernels.files.RENAMED_OVER}: give a file name")
    _check_parent(path, option)
    _probe(_parent(path), option, path)
    return path


def check_directory(path: str | os.PathLike, option: str, create: bool = True) -> Path:
    """Check (and with ``create``, make) the directory ``path`` given as ``option``.

    Raises:
        OutputError: ``path`` is a file, its parent is missing, or it is not
            writable.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputError(f"{option} {path}: is a file, not a directory")
    if not path.exists():
        _check_parent(path, option)
        if not create:
            raise OutputError(f"{option} {path}: does not exist")
        try:
            path.mkdir()
        except FileExistsError:  # created meanwhile: fine if it is a directory
            if not path.is_dir():
                raise OutputError(f"{option} {path}: is a file, not a directory") from None
        except OSError as exc:
            raise OutputError(f"{option} {path}: cannot create it: {exc.strerror}") from None
    _probe(path, option, path)
    return path


def check_free_space(directory: str | os.PathLike, needed: int, option: str,
                     what: str = "a checkpoint") -> None:
    """Raise :class:`OutputError` when ``directory``'s file system has fewer than
    ``needed`` bytes free (for an unprivileged writer)."""
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise OutputError(f"{option} {directory}: {format_bytes(free)} free on its file "
                          f"system; {what} needs about {format_bytes(needed)}")


def format_bytes(n: int) -> str:
    """``1.5 MiB`` for 1572864."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def check_all(files: dict[str, str | None]) -> None:
    """Check every file output ``{option: path}`` (None: not requested); the
    audit and benchmark commands call this on rank 0 before any work."""
    for option, path in files.items():
        if path is not None and path != "-":
            check_file(path, option)


def check_apart(files: dict[str, str | os.PathLike | None],
                keep: dict[str, str | os.PathLike | None]) -> None:
    """Refuse an output that would replace a file the command reads or writes
    otherwise: each of ``files`` (``{option: path}``, None: not requested)
    against every other one and every one of ``keep`` (its inputs, and
    outputs of its own such as the files of the checkpoint directory).

    Raises:
        OutputError: naming both options, before any work.
    """
    named = {option: path for option, path in files.items() if path and path != "-"}
    others = {**named, **keep}
    for option, path in named.items():
        del others[option]  # each pair once: against the outputs after it, and keep
        clash = kernels.files.same_as(path, others)
        if clash is not None:
            raise OutputError(f"{option} {path} is the file of {clash} ({others[clash]}): "
                              "writing it would replace that file; give another name")


def replace_file(path: str | os.PathLike, data: str | bytes,
                 failure: Callable[[str], str], mode: int = 0o666,
                 sync_directory: bool = False) -> None:
    """Replace ``path`` by ``data`` atomically (:func:`kernels.files.replace_file`:
    a hidden temporary name in the same directory, ``.NAME.PID.tmp``, flushed
    to disk, renamed over ``path``; with ``sync_directory`` the rename is
    flushed too).

    Raises:
        WriteFailed: ``failure(reason)`` as its message, the temporary file
            removed and the old ``path``, if any, intact.
    """
    try:
        kernels.files.replace_file(path, data, mode, sync_directory)
    except OSError as exc:
        raise WriteFailed(failure(exc.strerror)) from None


def write_json(path: str | os.PathLike, document, option: str,
               private: bool = False) -> None:
    """Write ``document`` as JSON to ``path`` atomically (:func:`replace_file`);
    ``private``: readable by its owner only (mode 0600, as a checkpoint), for
    files that hold figures the epsilon does not cover.

    Raises:
        WriteFailed: the file cannot be written (the old one, if any, is intact).
    """
    replace_file(path, json.dumps(document, indent=1) + "\n",
                 lambda reason: f"{option} {path}: cannot write it: {reason}",
                 mode=0o600 if private else 0o666)
