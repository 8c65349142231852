"""Privacy figures already computed on this host, kept in a file between runs.

A DP run's rank 0 calibrates its noise multiplier (or computes the budget of a
given one) and reports epsilon at every epoch. Each answer is a deterministic
function of a few numbers, yet costs dp-accounting's import (scipy's signal
module with it) and PLD compositions (figures: docs/privacy.md, "Kept
between runs"). :func:`remembered` keeps those answers in
``privacy-figures.json`` in mpidp's cache folder (``$XDG_CACHE_HOME/mpidp``,
else ``~/.cache/mpidp``; ``MPIDP_PRIVACY_CACHE_FILE`` names another file,
``none`` turns it off), so a run that repeats a plan — the same rate, steps, delta and target or noise —
answers without importing dp-accounting at all.

An answer is only reused by the code that would compute it again: the file
carries a stamp of the accounting code (the source of :mod:`engine.dp.pld`
and :mod:`engine.dp.accountant`) and of the versions of dp-accounting, numpy
and scipy, and a file with another stamp is ignored and then replaced.
Errors are never kept (each is raised again by computing), a file that
cannot be read or written is ignored (it is a cache), and so is one that
another user owns or may write (:func:`_trusted`); writes replace the
file atomically, merging with what other processes kept meanwhile; the
file keeps at most :data:`MAX_FIGURES` answers, the oldest dropped first.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import math
import os
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import kernels.files

#: The cache file's name in mpidp's cache folder, and the variable that overrides it.
FILE_NAME, FILE_VARIABLE = "privacy-figures.json", "MPIDP_PRIVACY_CACHE_FILE"
#: Answers kept at most.
MAX_FIGURES = 2048
#: The modules whose source decides the answers.
_SOURCES = ("pld.py", "accountant.py")
_LIBRARIES = ("dp-accounting", "numpy", "scipy")

F = TypeVar("F", bound=Callable[..., Any])


_off = 0  # open off() blocks


@contextlib.contextmanager
def off() -> Iterator[None]:
    """``with off():`` every answer is computed and none kept (what a benchmark
    of the accounting itself times)."""
    global _off
    _off += 1
    try:
        yield
    finally:
        _off -= 1


def cache_path() -> Path | None:
    """The cache file, or None (``MPIDP_PRIVACY_CACHE_FILE=none``, inside
    :func:`off`, or where the accounting source cannot be read for the stamp)."""
    if _off:
        return None
    path = kernels.files.cache_file(FILE_NAME, FILE_VARIABLE)
    return None if path is None or stamp() is None else path


@functools.lru_cache(maxsize=1)
def stamp() -> str | None:
    """What the answers depend on besides their arguments: a digest of the
    accounting modules' source and the libraries' versions (None where the
    source cannot be read: no answer is kept then)."""
    digest = hashlib.sha256()
    here = Path(__file__).parent
    for name in _SOURCES:
        try:
            digest.update((here / name).read_bytes())
        except OSError:
            return None
    for library in _LIBRARIES:
        try:
            digest.update(f"{library} {metadata.version(library)}\n".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{library} absent\n".encode())
    return digest.hexdigest()[:32]


def _trusted(info: os.stat_result) -> bool:
    """Whether a file's answers may be believed: it is this user's and nobody
    else may write it (an answer planted by another user would understate a
    run's epsilon)."""
    return info.st_uid == os.geteuid() and not info.st_mode & 0o022


def _read(path: Path) -> dict[str, Any]:
    """The answers in ``path`` with the current stamp (empty if none, another
    stamp, or unreadable)."""
    try:
        with open(path, "rb") as f:
            if not _trusted(os.fstat(f.fileno())):
                return {}
            data = json.loads(f.read())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("stamp") != stamp():
        return {}
    figures = data.get("figures")
    return figures if isinstance(figures, dict) else {}


_loaded: dict[str, dict[str, Any]] = {}  # path -> its answers, read once a process


def lookup(key: str) -> Any | None:
    """The answer kept under ``key``, or None."""
    path = cache_path()
    if path is None:
        return None
    figures = _loaded.get(str(path))
    if figures is None:
        figures = _loaded[str(path)] = _read(path)
    return figures.get(key)


def keep(key: str, value: Any) -> None:
    """Add ``key``'s answer to the file (merged with the file's current
    answers, atomically; errors ignored)."""
    path = cache_path()
    if path is None:
        return
    figures = _read(path)
    figures.pop(key, None)
    figures[key] = value
    for old in list(figures)[:max(0, len(figures) - MAX_FIGURES)]:
        del figures[old]
    _loaded[str(path)] = figures
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # a random tag: processes on other hosts may share the folder and a pid
        kernels.files.replace_file(path, json.dumps({"stamp": stamp(), "figures": figures}),
                                   mode=0o644, tag=os.urandom(6).hex())
    except OSError:
        pass


def _storable(values: Any) -> bool:
    """Whether ``values`` is a list of finite numbers or None, as kept in the file."""
    return isinstance(values, list) and all(
        v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)
                      and math.isfinite(v)) for v in values)


def remembered(name: str, encode: Callable[[Any], list[float | None]] = lambda x: [float(x)],
               decode: Callable[[list], Any] = lambda v: float(v[0])) -> Callable[[F], F]:
    """Decorate a deterministic function of numbers and strings whose answer
    ``encode`` turns into a list of finite floats (or None) and ``decode``
    back; its answers are kept in the cache file under ``name`` and the
    arguments (defaults filled in, floats by their exact ``repr``).

    A kept answer that is not such a list (a damaged file) is ignored and
    computed again. Exceptions pass through and are not kept.
    """
    def wrap(compute: F) -> F:
        signature = inspect.signature(compute)

        @functools.wraps(compute)
        def cached(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            key = f"{name}{tuple(bound.arguments.values())!r}"
            kept = lookup(key)
            if _storable(kept):
                try:
                    return decode(kept)
                except (TypeError, ValueError, IndexError):
                    pass
            value = compute(*args, **kwargs)
            encoded = encode(value)
            if _storable(encoded):
                keep(key, encoded)
            return value
        return cached  # type: ignore[return-value]
    return wrap
