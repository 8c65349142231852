"""Numba CPU kernels (``@numba.njit``): the default on CPUs.

Each kernel takes CPU tensors as numpy views (zero-copy) and does in one
pass what would be several torch ops, saving torch's per-op dispatch,
which is large next to the arithmetic at the engine's layer widths. Each
provides ``kernel.bind``, so the views are made once per set of buffers
(:func:`kernels.registry.bind`). Kernels compile on first use and are
cached on disk (``cache=True``; ``NUMBA_CACHE_DIR``).
"""

# Before any kernel module decorates an @njit function: Numba's target (the
# vector width, measured per CPU) is fixed by the first decoration.
from kernels import numba_target  # noqa: F401,E402
