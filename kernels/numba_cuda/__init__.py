"""Numba CUDA kernels (``@numba.cuda.jit``): on GPUs, the choice after CuPy.

Each ``<op>.py`` is the twin of ``kernels/cupy/<op>.cu`` (same algorithm,
same launch shapes from :mod:`kernels.common.cuda_shapes`). Kernels take
torch CUDA tensors through zero-copy views and launch on torch's current
stream (:mod:`kernels.numba_cuda.launch`). The same code runs under Numba's
CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, CPU tensors standing in for
device memory): that is how the tests run it without a GPU, so it uses no
warp intrinsics, which the simulator lacks.

Importing a kernel module imports Numba's CUDA target (``numba-cuda``, extra
``mpidp[cuda12]`` or ``[cuda13]``); the registry does so only when a CUDA
device is asked for.
"""
from __future__ import annotations

import importlib.util

import numpy as np


def _needs_row_stack() -> bool:
    """Whether numba-cuda's array overloads name ``np.row_stack``, which numpy 2.5
    removed: numba-cuda 0.30.4 (the newest on 2026-11-27) registers an
    overload for it when its CUDA target first compiles, and fails there
    with ``AttributeError: module 'numpy' has no attribute 'row_stack'``."""
    if hasattr(np, "row_stack"):
        return False
    try:
        spec = importlib.util.find_spec("numba.cuda.np.arrayobj")
    except (ImportError, ValueError):
        return False  # no numba-cuda (Numba's own CUDA target, or the simulator)
    if spec is None or not spec.origin:
        return False
    try:
        with open(spec.origin, encoding="utf-8") as source:
            return "np.row_stack" in source.read()
    except OSError:
        return False


def _load_array_overloads() -> None:
    """Import numba-cuda's array overloads with ``np.row_stack`` lent for the
    import only (as ``np.vstack``, which numpy documented it to be), so they
    register; numpy is left as it was. Applied only where the installed
    numba-cuda still names ``row_stack`` under a numpy without it, and
    removed when numba-cuda stops naming it (docs/gpus.md)."""
    np.row_stack = np.vstack
    try:
        importlib.import_module("numba.cuda.np.arrayobj")
    finally:
        del np.row_stack


if _needs_row_stack():
    _load_array_overloads()
