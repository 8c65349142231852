"""Which kernel back-ends this process can use, and why not when it cannot.

Local, import-light probes (nothing is compiled or launched): used by
``mpidp info`` and by the engine to pick a kernel implementation.
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Backend:
    """One kernel back-end: its name, whether it is usable, and a detail."""

    name: str
    usable: bool
    detail: str


def _version(module_name: str) -> str | None:
    try:
        module = importlib.import_module(module_name)
    except Exception:  # noqa: BLE001 - any import failure means "absent"
        return None
    return getattr(module, "__version__", "unknown")


def cuda_simulator_enabled() -> bool:
    """True when Numba's CUDA simulator replaces the GPU (``NUMBA_ENABLE_CUDASIM=1``)."""
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


def numba_cpu() -> Backend:
    version = _version("numba")
    if version is None:
        return Backend("numba-cpu", False, "numba is not installed")
    import numba

    return Backend("numba-cpu", True,
                   f"numba {version}, {numba.config.NUMBA_NUM_THREADS} threads, "
                   f"threading layer '{numba.config.THREADING_LAYER}'")


def numba_cuda() -> Backend:
    if _version("numba") is None:
        return Backend("numba-cuda", False, "numba is not installed")
    if cuda_simulator_enabled():
        return Backend("numba-cuda", False, "replaced by the CUDA simulator "
                       "(NUMBA_ENABLE_CUDASIM=1)")
    try:
        from numba import cuda

        if cuda.is_available():
            return Backend("numba-cuda", True, f"{len(cuda.gpus)} GPU(s)")
        return Backend("numba-cuda", False, "no CUDA driver or GPU found")
    except Exception as exc:  # noqa: BLE001 - report, never crash the probe
        return Backend("numba-cuda", False, f"{type(exc).__name__}: {exc}")


def cuda_simulator() -> Backend:
    if _version("numba") is None:
        return Backend("cuda-simulator", False, "numba is not installed")
    if cuda_simulator_enabled():
        return Backend("cuda-simulator", True, "NUMBA_ENABLE_CUDASIM=1 (tests only: slow)")
    return Backend("cuda-simulator", False, "off (set NUMBA_ENABLE_CUDASIM=1 to enable)")


def cupy() -> Backend:
    version = _version("cupy")
    if version is None:
        return Backend("cupy", False, "cupy is not installed (extra: mpidp[cuda12])")
    import cupy as cp

    try:
        if cp.is_available():
            return Backend("cupy", True,
                           f"cupy {version}, {cp.cuda.runtime.getDeviceCount()} GPU(s)")
    except Exception as exc:  # noqa: BLE001
        return Backend("cupy", False, f"cupy {version}: {type(exc).__name__}: {exc}")
    return Backend("cupy", False, f"cupy {version}: no usable GPU")


def probe_all() -> list[Backend]:
    """Every back-end, CPU first."""
    return [numba_cpu(), numba_cuda(), cuda_simulator(), cupy()]
