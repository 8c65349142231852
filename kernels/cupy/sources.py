"""The CUDA C sources in ``kernels/cupy/`` and the entry points Python launches.

One ``.cu`` file per op; every ``extern "C"`` kernel in it is named here,
once per element type. The CuPy kernels (``kernels/cupy/<op>.py``) look their
functions up through :func:`entry`, so a name that is not listed here cannot
be launched, and the tests compile every file (nvcc, sm_80 and sm_90,
warnings as errors) and check that it exports exactly these names, with no
double precision in the float32 entries unless :data:`FLOAT64_BY_DESIGN`
says why. Importing this module imports nothing CUDA.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

#: Directory of the ``.cu`` files (installed as package data).
SOURCE_DIR = Path(__file__).resolve().parent

#: ``.cu`` file stem -> kernel stems; each is exported as ``<stem>_f32`` and ``<stem>_f64``.
ENTRY_POINTS: dict[str, tuple[str, ...]] = {
    "clip_rows": ("clip_fused_rows", "clip_row_sq_norms", "clip_factors", "clip_scale_rows"),
    "relu_backward": ("relu_backward",),
    "softmax_xent": ("softmax_xent",),
    "gaussian": ("philox_normal_add", "philox_normal_add_at"),
    "sgd_update": ("sgd_update",),
}

#: Kernels whose float32 entry uses double precision deliberately, and why.
FLOAT64_BY_DESIGN: dict[str, str] = {
    "philox_normal_add": "the Box-Muller transform runs in double (53-bit uniforms, "
                         "the CPU noise kernel's precision); one sample per parameter per step",
    "philox_normal_add_at": "the same kernel, its counter read from device memory "
                            "(the CUDA graph's step)",
}

_SUFFIX = {np.dtype(np.float32): "f32", np.dtype(np.float64): "f64"}


def source_path(stem: str) -> Path:
    """Path of ``kernels/cupy/<stem>.cu``; KeyError for a stem not in :data:`ENTRY_POINTS`."""
    if stem not in ENTRY_POINTS:
        raise KeyError(f"no CUDA source {stem!r}; sources are {', '.join(ENTRY_POINTS)}")
    return SOURCE_DIR / f"{stem}.cu"


def entry_names(stem: str) -> list[str]:
    """Every ``extern "C"`` entry point that ``<stem>.cu`` must export."""
    return [f"{kernel}_{suffix}" for kernel in ENTRY_POINTS[stem]
            for suffix in _SUFFIX.values()]


def entry(stem: str, kernel: str, dtype) -> str:
    """The entry-point name of ``kernel`` (listed under ``stem``) for ``dtype``.

    Raises:
        KeyError: the kernel is not listed, or the dtype has no entry point.
    """
    if kernel not in ENTRY_POINTS[stem]:
        raise KeyError(f"{stem}.cu exports no kernel {kernel!r}")
    try:
        return f"{kernel}_{_SUFFIX[np.dtype(dtype)]}"
    except (KeyError, TypeError):
        raise KeyError(f"{kernel}: no entry point for dtype {dtype}; the CUDA kernels take "
                       "float32 or float64") from None
