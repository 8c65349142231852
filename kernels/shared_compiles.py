"""Processes that share Numba's disk cache compile each kernel once, not once each.

A kernel decorated ``@numba.njit(cache=True)`` compiles on its first call
in a process unless its machine code is in the disk cache
(``NUMBA_CACHE_DIR``). Processes that start together on a fresh cache (the
ranks of a first job, the test suite's workers and the jobs its tests
launch) all miss it, and each compiles the same kernel for the same types,
seconds of CPU apiece for the fused step: on a node with more ranks than
cores they take turns on the cores for work only one of them needed to do.

:func:`cached_njit` is ``numba.njit(cache=True, ...)`` whose compilation
for a given signature takes an exclusive lock beside the cache's files
first (one lock file per function and signature, ``*.compile-lock``). The
first process compiles and saves; the others wait on the lock (sleeping,
not spinning) and then find the machine code in the cache and load it.
A process that dies releases its lock with it (``flock``); a wait longer
than :data:`WAIT_S` (a holder stopped, not dead) gives up and compiles
anyway, so a lock can cost time but never hang a job. Where the cache
folder cannot hold a lock file, or Numba's cache object lacks the two
attributes read here (its folder and file name; a later Numba may rename
them, which tests/test_kernels_shared_compiles.py would show), the kernel
compiles as plain Numba would.

Within one process Numba's own compiler lock serialises compilations; a
lock this process already holds is not taken again (a thread compiling a
kernel that another thread's kernel calls would otherwise wait on itself).
"""
from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import numba
from numba.core import sigutils

# Before the first @njit: Numba's target (the vector width) is fixed by it.
from kernels import numba_target  # noqa: F401

#: Seconds a process waits for another one's compilation before it compiles
#: the kernel itself (far above any kernel's compilation time).
WAIT_S = 300.0
#: Seconds between two tries of a held lock.
POLL_S = 0.05
#: Suffix of the lock files, beside the cache's index and data files.
SUFFIX = ".compile-lock"

_held: dict[str, int] = {}
_held_guard = threading.Lock()


def lock_path(dispatcher, sig) -> Path | None:
    """The lock file of ``dispatcher``'s compilation for argument types
    ``sig``, or None where it has no disk cache."""
    cache = getattr(dispatcher, "_cache", None)
    folder = getattr(cache, "_cache_path", None)
    base = getattr(getattr(cache, "_impl", None), "filename_base", None)
    if not folder or not base:
        return None  # NullCache: nothing on disk to share
    args, _ = sigutils.normalize_signature(sig)
    digest = hashlib.sha256(str(tuple(args)).encode()).hexdigest()[:16]
    return Path(folder) / f"{base}.{digest}{SUFFIX}"


@contextlib.contextmanager
def _exclusive(path: Path | None, wait_s: float) -> Iterator[bool]:
    """Hold ``path``'s lock for the block; yields whether it was taken (not
    when the file cannot be made, when this process holds it already, or
    after ``wait_s`` seconds of waiting)."""
    key = None if path is None else str(path)
    with _held_guard:
        mine = key is not None and key in _held
    if key is None or mine:
        yield False
        return
    import fcntl

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a")
    except OSError:
        yield False
        return
    with handle:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                taken = True
                break
            except OSError:
                if time.monotonic() >= deadline:
                    taken = False
                    break
                time.sleep(POLL_S)
        if taken:
            with _held_guard:
                _held[key] = _held.get(key, 0) + 1
        try:
            yield taken
        finally:
            if taken:
                with _held_guard:
                    _held[key] -= 1
                    if not _held[key]:
                        del _held[key]
                fcntl.flock(handle, fcntl.LOCK_UN)


def share_compiles(dispatcher):
    """Make ``dispatcher`` (a ``cache=True`` Numba dispatcher) compile each
    signature under its lock file (module docstring); returns it. A
    dispatcher without a disk cache is returned unchanged."""
    if getattr(getattr(dispatcher, "_cache", None), "_cache_path", None) is None:
        return dispatcher
    compile_alone: Callable = dispatcher.compile

    def compile(sig):
        args, _ = sigutils.normalize_signature(sig)
        if tuple(args) in dispatcher.overloads:  # compiled or loaded in this process
            return compile_alone(sig)
        with _exclusive(lock_path(dispatcher, sig), WAIT_S):
            return compile_alone(sig)  # loads what another process saved meanwhile

    dispatcher.compile = compile
    return dispatcher


def cached_njit(function=None, **options):
    """``numba.njit(cache=True, **options)`` whose compilations are shared
    between the processes using the same cache (module docstring). Use as
    ``@cached_njit`` or ``@cached_njit(parallel=True, ...)``."""
    def decorate(f):
        return share_compiles(numba.njit(cache=True, **options)(f))

    return decorate if function is None else decorate(function)
