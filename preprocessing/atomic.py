"""All-or-nothing output: a temporary name in the output's directory, then a rename.

The file is written as ``.NAME.mpidp-tmp-XXXXXXXX`` next to the final path
and renamed over it (:func:`kernels.files.move_into_place`, atomic within
one file system) once every rank has finished writing. Any failure on any
rank removes the temporary file before the error ends the job, so a failed
run leaves neither a partial file nor a half-replaced old one. (A rank killed by a
signal cannot clean up; its temporary file keeps the hidden name above.)
"""
from __future__ import annotations

import os
import uuid

import kernels.files
from preprocessing import h5format
from preprocessing.errors import PrepError


def check_writable(path: str, option: str = "--out", example: str = "pums.h5") -> None:
    """Raise PrepError unless a file can be created next to ``path``.

    Creates and removes a probe file (permission bits alone say nothing for
    root, nor for read-only file systems). A missing directory is an error,
    never created: mpidp's one rule for every output (docs/lifecycle.md).
    ``example`` is the file name the message suggests where ``path`` is a
    directory.
    """
    if not str(path).strip():  # os.path.isdir("") is False, and "" would be moved into place
        raise PrepError(f"{option} is empty; give a file name, e.g. {option} {example}")
    directory = os.path.dirname(os.path.abspath(path)) or "."
    problem = kernels.files.not_an_output_file(path)
    if problem is not None:
        why, directory = problem
        raise PrepError(f"{path}: {why}; give a file name for {option}, e.g. "
                        f"{os.path.join(path, example)}" if directory else
                        f"{path}: {why}; {option} names a file that is "
                        f"{kernels.files.RENAMED_OVER}: give a file name")
    if not os.path.isdir(directory):
        what = "is not a directory" if os.path.exists(directory) else "does not exist"
        raise PrepError(f"{path}: cannot write the output: {directory} {what}")
    try:
        probe_directory(directory)
    except OSError as exc:
        raise PrepError(f"{path}: cannot write the output: {exc.strerror} "
                        f"(in {directory})") from None


def check_not_input(path: str, inputs: dict[str, str | None]) -> None:
    """Raise PrepError when the output ``path`` is one of the files the command
    reads (``{what: path}``, as messages name it; None: not given): the
    finished output would be renamed over it, replacing the user's input."""
    what = kernels.files.same_as(path, inputs)
    if what is not None:
        raise PrepError(f"{path}: --out is {what}; writing the output would replace it: "
                        "give the output another name")
    # a folder of inputs (MNIST's idx files): none of its files either, but an
    # HDF5 file there (an earlier output) may be replaced as anywhere
    if os.path.isfile(path) and not h5format.is_hdf5(path):
        folders = {what: given for what, given in inputs.items()
                   if given and os.path.isdir(given)}
        what = kernels.files.same_as(os.path.dirname(os.path.abspath(path)), folders)
        if what is not None:
            raise PrepError(f"{path}: --out is a file in {what}; writing the output would "
                            "replace it: give the output another name")
    if os.path.isfile(path) and os.path.getsize(path) and not h5format.is_prepared(path):
        # an earlier output of prep has its format attribute; this is someone's data
        what = "an HDF5 file of another tool" if h5format.is_hdf5(path) else "not an HDF5 file"
        raise PrepError(f"{path}: --out exists and is {what} (no earlier output of mpidp "
                        "prep); writing the output would replace it: give the output another "
                        "name, or remove the file first")


def probe_directory(directory: str | os.PathLike) -> None:
    """Create and remove a hidden file in ``directory`` (permission bits say
    nothing for root, nor for a read-only file system); raises the OSError."""
    probe = os.path.join(directory, f".mpidp-probe-{uuid.uuid4().hex[:8]}")
    os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    os.unlink(probe)


def temporary_name(path: str) -> str:
    """A fresh hidden name in the directory of ``path``."""
    directory, base = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{base}.mpidp-tmp-{uuid.uuid4().hex[:8]}")


def discard(temporary: str | None) -> None:
    """Remove a temporary file if it exists (any rank may call it)."""
    if temporary:
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass


def commit(temporary: str, path: str) -> None:
    """Rename the finished temporary file to its final name (one rank;
    :func:`kernels.files.move_into_place`, which removes it on failure)."""
    try:
        kernels.files.move_into_place(temporary, path)
    except OSError as exc:
        raise PrepError(f"{path}: cannot move the finished file into place: "
                        f"{exc.strerror}") from None
