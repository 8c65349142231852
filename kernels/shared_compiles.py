"""Processes that share Numba's disk cache compile each kernel once, not once each.

A kernel decorated ``@numba.njit(cache=True)`` compiles on its first call
in a process unless its machine code is in the disk cache
(``NUMBA_CACHE_DIR``). Processes that start together on a fresh cache (the
ranks of a first job, the test suite's workers and the jobs its tests
launch) all miss it, and each compiles the same kernel for the same types,
seconds of CPU apiece for the fused step: on a node with more ranks than
cores they take turns on the cores for work only one of them needed to do.

:func:`cached_njit` is ``numba.njit(cache=True, ...)`` whose compilation
for a given signature, on a miss of the disk cache, takes an exclusive
lock beside the cache's files (one lock file per function, signature and
target, ``*.compile-lock``). The first process compiles and saves; the others wait
on the lock (sleeping, not spinning) and then find the machine code in the
cache and load it. A kernel found in the cache is loaded without the lock.
A process that dies releases its lock with it (``flock``); a wait longer
than :data:`WAIT_S` (a holder stopped, not dead) gives up and compiles
anyway, so a lock can cost time but never hang a job. Where the cache
folder cannot hold a lock file, or Numba's cache object lacks what is read
here (its folder, file name and ``load_overload``; a later Numba may rename
them, which tests/test_kernels_shared_compiles.py would show), the kernel
compiles as plain Numba would.

Within one process Numba's own compiler lock serialises compilations; a
lock this process already holds is not taken again (a thread compiling a
kernel that another thread's kernel calls would otherwise wait on itself).
"""
from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import Callable

import numba
from numba.core import sigutils

# Before the first @njit: Numba's target (the vector width) is fixed by it.
from kernels import files, numba_target  # noqa: F401

#: Seconds a process waits for another one's compilation before it compiles
#: the kernel itself (far above any kernel's compilation time).
WAIT_S = 300.0
#: Seconds between two tries of a held lock.
POLL_S = 0.05
#: Suffix of the lock files, beside the cache's index and data files.
SUFFIX = ".compile-lock"

#: The paths of the locks this process holds.
_held: set[str] = set()
_held_guard = threading.Lock()
#: Per thread, a stack of the compilations in progress, each with the locks
#: its cache misses took.
_local = threading.local()


def lock_path(dispatcher, sig) -> Path | None:
    """The lock file of ``dispatcher``'s compilation for argument types
    ``sig`` and this process's target (CPU name and features, as in the
    cache's own key: processes compiling for other targets, such as the
    vector-width measurement's children, do not wait on each other), or
    None where it has no disk cache."""
    cache = getattr(dispatcher, "_cache", None)
    folder = getattr(cache, "_cache_path", None)
    base = getattr(getattr(cache, "_impl", None), "filename_base", None)
    if not folder or not base:
        return None  # NullCache: nothing on disk to share
    args, _ = sigutils.normalize_signature(sig)
    try:
        target = dispatcher.targetctx.codegen().magic_tuple()
    except AttributeError:
        target = ()
    digest = hashlib.sha256(str((tuple(args), target)).encode()).hexdigest()[:16]
    return Path(folder) / f"{base}.{digest}{SUFFIX}"


class _Lock:
    """A held lock file (:func:`acquire`), until :meth:`release`."""

    def __init__(self, key: str, handle) -> None:
        self.key, self.handle = key, handle

    def release(self) -> None:
        with _held_guard:
            _held.discard(self.key)
        files.unlock(self.handle)


def acquire(path: Path | None, wait_s: float) -> _Lock | None:
    """Take ``path``'s lock, waiting up to ``wait_s`` seconds; None where it
    was not taken: no path, a file that cannot be made, a lock this process
    holds already, or the wait ran out."""
    if path is None:
        return None
    key = str(path)
    with _held_guard:
        if key in _held:
            return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = files.lock(path, wait_s, POLL_S)
    except OSError:
        return None
    if handle is None:
        return None
    with _held_guard:
        _held.add(key)
    return _Lock(key, handle)


def share_compiles(dispatcher):
    """Make ``dispatcher`` (a ``cache=True`` Numba dispatcher) compile each
    signature under its lock file (module docstring); returns it. A
    dispatcher without a disk cache is returned unchanged.

    The lock is taken only on a miss of the disk cache, so loading a
    compiled kernel waits for nobody: Numba's compilation first asks the
    cache (``load_overload``); on a miss the lock is taken and the cache
    asked again (another process may have saved it meanwhile), and the lock
    is released when the compilation (and its save) is over."""
    cache = getattr(dispatcher, "_cache", None)
    if getattr(cache, "_cache_path", None) is None or not hasattr(cache, "load_overload"):
        return dispatcher
    compile_alone: Callable = dispatcher.compile
    load_alone: Callable = cache.load_overload

    def load_overload(sig, target_context):
        found = load_alone(sig, target_context)
        scopes = getattr(_local, "scopes", None)
        if found is not None or not scopes:
            return found
        lock = acquire(lock_path(dispatcher, sig), WAIT_S)
        if lock is None:
            return None
        scopes[-1].append(lock)
        return load_alone(sig, target_context)

    def compile(sig):
        scopes = _local.__dict__.setdefault("scopes", [])
        scopes.append([])
        try:
            return compile_alone(sig)
        finally:
            for lock in scopes.pop():
                lock.release()

    cache.load_overload = load_overload
    dispatcher.compile = compile
    return dispatcher


def cached_njit(function=None, **options):
    """``numba.njit(cache=True, **options)`` whose compilations are shared
    between the processes using the same cache (module docstring). Use as
    ``@cached_njit`` or ``@cached_njit(parallel=True, ...)``."""
    def decorate(f):
        return share_compiles(numba.njit(cache=True, **options)(f))

    return decorate if function is None else decorate(function)
