"""Numba CPU kernels (``@numba.njit``): the default on CPUs.

Each kernel takes CPU tensors as numpy views (zero-copy) and does in one
pass what would be several torch ops, saving torch's per-op dispatch,
which is large next to the arithmetic at the engine's layer widths. Each
provides ``kernel.bind``, so the views are made once per set of buffers
(:func:`kernels.registry.bind`). Kernels compile on first use and are
cached on disk (``NUMBA_CACHE_DIR``), one process compiling what the
processes starting with it need (:mod:`kernels.shared_compiles`).
"""

import types

# Before any kernel module decorates an @njit function: Numba's target (the
# vector width, measured per CPU) is fixed by the first decoration.
from kernels import numba_target  # noqa: F401,E402
from kernels.shared_compiles import cached_njit  # noqa: E402


def serial_twin(kernel, **options):
    """``kernel`` (a ``parallel=True`` @njit) compiled again as a plain loop (its
    ``prange`` runs as ``range``): the same numbers without the cost of
    starting a parallel region, for one thread. ``options`` are the
    kernel's other flags (``fastmath``); the twin is cached on disk, its
    compilations shared (:func:`~kernels.shared_compiles.cached_njit`). It is a copy of the
    Python function under its own name, because Numba's disk cache is keyed
    by a function's name and line, not by its flags: compiled from the same
    function, each would load whichever of the two was cached first."""
    f = kernel.py_func
    twin = types.FunctionType(f.__code__, f.__globals__, f.__name__ + "_serial",
                              f.__defaults__, f.__closure__)
    twin.__qualname__ = f.__qualname__ + "_serial"
    twin.__module__ = f.__module__
    twin.__doc__ = f"{f.__name__} without a parallel region (same numbers, one thread)."
    return cached_njit(**options)(twin)
