"""Streaming copies: bytes stored into shared memory past this core's caches.

An ordinary copy leaves the bytes in the writing core's caches, where a
reader on a core sharing a last-level cache finds them fast. A virtual
machine's host may run two vCPUs on cores that share no cache (another
chiplet): each line the peer reads must then be fetched from the writer's
cache, several times slower. Non-temporal stores (``movnti``) write the
bytes to memory, bypassing and evicting cached copies, and the reader
streams them from there, at a speed that does not depend on where the
cores are. Which copy wins therefore depends on where the host runs the
ranks, and that changes while a job runs:
:mod:`collectives.channels.copy_mode` chooses, call by call (figures in
docs/design/cached-or-streaming-copies.md).

Non-temporal stores are weakly ordered even on x86-64, so the kernel ends
with ``sfence``: the bytes are visible to other cores before any later
store, in particular the counter that publishes them. NumPy cannot issue
either instruction; the kernel is a Numba loop whose stores carry LLVM's
``!nontemporal`` hint (compiled on first use and cached).
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np

from collectives.runtime import x86_64


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether streaming copies can be made here (x86-64 with Numba importable; local)."""
    if not x86_64():
        return False
    try:
        import numba  # noqa: F401
        import llvmlite  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not here"
        return False
    return True


@functools.lru_cache(maxsize=None)
def _kernel() -> Callable[[np.ndarray, np.ndarray], None]:
    """The compiled word loop ``kernel(dst, src)``: uint64 arrays of equal length."""
    from collectives.channels.streaming_kernel import stream_words

    words = np.zeros(1, dtype=np.uint64)
    stream_words(words, words)  # compile (or load from the cache) now, not inside a call
    return stream_words


def streaming_copy(dst: np.ndarray, src: np.ndarray) -> Callable[[], None]:
    """A runner copying ``src`` into ``dst`` with non-temporal stores.

    ``dst`` and ``src`` are 1-D contiguous uint8 arrays of equal length;
    ``dst`` should be 8-byte aligned (shared-memory slots are), ``src`` may
    start anywhere. The views are made here, once: ``run()`` allocates
    nothing. When it returns, every byte is visible to other cores before
    any store that follows (the kernel's ``sfence``; the last ``len % 8``
    bytes go through an ordinary copy after it, which x86 keeps in order).
    Raises ValueError for mismatched arguments.
    """
    if dst.dtype != np.uint8 or src.dtype != np.uint8 or dst.ndim != 1 or src.ndim != 1 \
            or dst.shape != src.shape:
        raise ValueError(f"streaming_copy needs two 1-D uint8 arrays of one length, got "
                         f"{dst.dtype}{dst.shape} and {src.dtype}{src.shape}")
    kernel = _kernel()
    body = src.size - src.size % 8
    words_dst: Any = dst[:body].view(np.uint64)
    words_src: Any = src[:body].view(np.uint64)
    tail_dst, tail_src = memoryview(dst[body:]), memoryview(src[body:])
    if body == src.size:
        return functools.partial(kernel, words_dst, words_src)

    def run() -> None:
        kernel(words_dst, words_src)
        tail_dst[:] = tail_src

    return run
