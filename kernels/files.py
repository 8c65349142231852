"""The files every mpidp package writes: where its caches live, and how an output is replaced.

It sits at the bottom of the layering (standard library only, like the rest
of ``kernels``) so that every package uses the same two rules
(docs/contributing.md):

* **A cache file** (the all-reduce tunings, Numba's vector width, the
  privacy figures) is named by an environment variable, ``none`` meaning no
  file, else lives in mpidp's cache folder, ``$XDG_CACHE_HOME/mpidp``
  (``~/.cache/mpidp`` when ``XDG_CACHE_HOME`` is unset or empty):
  :func:`cache_file`.
* **An output is replaced atomically**: written under a hidden temporary
  name in its own directory (``.NAME.PID.tmp``), renamed over the final
  path (``os.replace``, atomic within one file system) only once complete;
  on failure the temporary file is removed and the old file, if any, is
  left intact. :func:`replace_file` writes bytes or text that way,
  :func:`replacing` hands out the temporary name to a writer that opens the
  file itself (HDF5), and :func:`move_into_place` is the rename alone, for
  a file several ranks wrote.

Processes that share a cache take turns through :func:`lock` (an exclusive
``flock`` on a lock file beside it, released by :func:`unlock` or by the
process's end).

Errors are ``OSError`` s; each caller turns them into its own message.
"""
from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from pathlib import Path
from typing import Iterator


def cache_dir() -> Path:
    """mpidp's cache folder: ``$XDG_CACHE_HOME/mpidp``, else ``~/.cache/mpidp``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mpidp"


def cache_file(name: str, variable: str) -> Path | None:
    """The cache file ``name``: the path in ``$variable`` if set (``~`` expanded),
    None where it says ``none`` (no file), else ``name`` in :func:`cache_dir`."""
    text = os.environ.get(variable, "").strip()
    if text.lower() == "none":
        return None
    if text:
        return Path(text).expanduser()
    return cache_dir() / name


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether ``a`` and ``b`` name one file: the same inode where both exist
    (a hard link, another spelling through a symbolic link), else the same
    resolved path (an output not written yet)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def same_as(path: str | os.PathLike, named: dict[str, str | os.PathLike | None]) -> str | None:
    """The first name in ``named`` (name -> path; None: not given) whose path is
    the same file as ``path`` (:func:`same_file`), else None."""
    return next((name for name, other in named.items()
                 if other and same_file(path, other)), None)


def not_a_file(path: str | os.PathLike) -> str | None:
    """What ``path`` is where it exists as neither a regular file nor a directory
    (``"a character device"`` for /dev/null, a named pipe, a socket, a block
    device), else None. An output is renamed over its path, which would replace
    the device or pipe itself (as root, /dev/null): such a path is no output."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    kinds = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"))
    return next((what for test, what in kinds if test(mode)), None)


def not_an_output_file(path: str | os.PathLike) -> tuple[str, bool] | None:
    """Why ``path`` cannot name an output file, or None: ``(why, True)`` for a
    directory (``"is a directory"``, or ``"names a directory (ends with /)"``
    for a missing one spelt so: a message then suggests a file in it), and
    ``(why, False)`` for a device, pipe or socket (``"is a character device,
    not a file"``: :func:`not_a_file`; the message says :data:`RENAMED_OVER`)."""
    if os.path.isdir(path):
        return "is a directory", True
    if names_a_directory(path):
        return f"names a directory (ends with {os.sep})", True
    special = not_a_file(path)
    return (f"is {special}, not a file", False) if special is not None else None


#: Why an output path must not be a device or pipe, as messages say it.
RENAMED_OVER = ("written under a temporary name and renamed over the path, which would "
                "replace it")


def names_a_directory(path: str | os.PathLike) -> bool:
    """Whether ``path`` is spelt as a directory (ends with a separator), which
    ``Path`` and ``abspath`` would silently drop."""
    text = os.fspath(path)
    return text.endswith(os.sep) or bool(os.altsep) and text.endswith(os.altsep)


def write_problem(path: str | os.PathLike) -> OSError | None:
    """None where a cache file can be written as ``path`` (its folder made if
    need be; a probe file written there and removed), else the OSError that
    says why not (a directory in its place: IsADirectoryError)."""
    path = Path(path)
    try:
        if path.is_dir():
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.probe-"):
            pass
    except OSError as exc:
        return exc
    return None


def temporary_name(path: str | os.PathLike, tag: str | None = None) -> Path:
    """The hidden name ``path`` is written under before it is renamed:
    ``.NAME.TAG.tmp`` in the same directory, ``TAG`` the process id unless
    given (a writer that may race with processes of other hosts, whose ids
    can be the same, passes a random one)."""
    path = Path(path)
    return path.with_name(f".{path.name}.{os.getpid() if tag is None else tag}.tmp")


def discard(temporary: str | os.PathLike | None) -> None:
    """Remove a temporary file if it is there."""
    if temporary:
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass


def move_into_place(temporary: str | os.PathLike, path: str | os.PathLike) -> None:
    """Rename the finished ``temporary`` over ``path``; on failure the temporary
    file is removed and the ``OSError`` raised."""
    try:
        os.replace(temporary, path)
    except OSError:
        try:
            discard(temporary)
        except OSError:
            pass
        raise


def _sync_directory(path: Path) -> None:
    fd = os.open(os.path.dirname(os.path.abspath(path)) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(path: str | os.PathLike, data: str | bytes, mode: int = 0o666,
                 sync_directory: bool = False, tag: str | None = None) -> None:
    """Replace ``path`` by ``data`` atomically: written to :func:`temporary_name`
    (with ``tag``), flushed to disk, renamed over ``path``; with
    ``sync_directory`` the rename is flushed too.

    Raises:
        OSError: the temporary file removed, the old ``path``, if any, intact.
    """
    path = Path(path)
    tmp = temporary_name(path, tag)
    view = memoryview(data.encode() if isinstance(data, str) else data)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        try:
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        if sync_directory:
            _sync_directory(path)
    except OSError:
        try:
            discard(tmp)
        except OSError:
            pass
        raise


@contextlib.contextmanager
def replacing(path: str | os.PathLike) -> Iterator[Path]:
    """``with replacing(path) as tmp:`` write the file ``tmp``; when the block
    ends normally ``tmp`` is renamed over ``path``, otherwise removed (the
    exception propagates, the old ``path`` intact)."""
    tmp = temporary_name(path)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        discard(tmp)


def lock(path: str | os.PathLike, wait_s: float | None = None, poll_s: float = 0.05):
    """An exclusive ``flock`` on the file ``path`` (created if missing), for the
    processes that share a cache: the open file holding it, to pass to
    :func:`unlock`, or None if ``wait_s`` seconds went by first (``None``:
    wait as long as it takes, asleep). The lock dies with its process.
    Raises OSError where the file cannot be opened."""
    import fcntl
    import time

    handle = open(path, "a")
    if wait_s is None:
        fcntl.flock(handle, fcntl.LOCK_EX)
        return handle
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return handle
        except OSError:
            if time.monotonic() >= deadline:
                handle.close()
                return None
            time.sleep(poll_s)


def unlock(handle) -> None:
    """Release a :func:`lock` and close its file."""
    import fcntl

    try:
        fcntl.flock(handle, fcntl.LOCK_UN)
    finally:
        handle.close()
