"""Which kernel back-ends this process can use, and why not when it cannot.

For ``mpidp info``: local probes that import an optional back-end only inside
its own probe. Where a GPU is found, a GPU back-end also compiles and
launches the registry's one-thread probe kernel (:func:`kernels.registry.check`),
since importing and seeing the GPU does not prove the first compile works.
They report; they do not choose (the registry does).
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Availability:
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


def _checked(name: str, backend: str, detail: str) -> Availability:
    """``backend`` found a GPU: usable only if its probe kernel runs."""
    from kernels import registry  # deferred: the registry imports torch

    why = registry.check(backend)
    if why is None:
        return Availability(name, True, detail)
    return Availability(name, False, f"{detail}, but {why}")


def numba_cpu() -> Availability:
    version = _version("numba")
    if version is None:
        return Availability("numba-cpu", False, "numba is not installed")
    import numba

    from kernels.numba_target import CHOICE

    return Availability("numba-cpu", True,
                        f"numba {version}, a pool of {numba.config.NUMBA_NUM_THREADS} "
                        "threads (NUMBA_NUM_THREADS), "
                        f"{_threading_layer(numba)}; "
                        f"{CHOICE.describe()}; {mlp_step_mode()}")


def _threading_layer(numba) -> str:
    """The threading layer Numba loaded (``omp``, ``tbb``, ``workqueue``), or
    the configured choice where none is loaded yet (``default``: Numba picks
    at the first parallel call)."""
    try:
        return f"threading layer '{numba.threading_layer()}'"
    except ValueError:  # not initialised: no parallel call, no set_num_threads yet
        return f"threading layer '{numba.config.THREADING_LAYER}' (not loaded yet)"


def mlp_step_mode(threads: int | None = None, runs: bool = False) -> str:
    """How a float32 MLP step runs on the CPU: in one call (the fused
    ``mlp_step``) or composed op by op, and why (for ``mpidp info`` and the
    benchmarks' headers); at ``threads`` Numba threads (default: this
    process's), whether it cuts its rows over them. ``runs``: for a report
    over runs of several thread counts (``mpidp bench scaling``), say when it
    cuts instead of whether."""
    from kernels.numba_cpu.blas import gemm_address
    from kernels.numba_cpu.mlp_step import SWITCH, row_split_parts

    if os.environ.get(SWITCH):
        return f"the MLP step composed op by op ({SWITCH} is set)"
    if not gemm_address("float32"):
        return "the MLP step composed op by op (no BLAS gemm to call in torch's build)"
    one_call = "the MLP step in one call (torch's BLAS sgemm_)"
    if runs:
        return one_call + (", its rows cut over a rank's threads when it has several"
                           if row_split_parts(2) > 1 else "")
    parts = row_split_parts(threads)
    return one_call + (f", its rows cut over {parts} threads" if parts > 1 else "")


def numba_cuda() -> Availability:
    if _version("numba") is None:
        return Availability("numba-cuda", False, "numba is not installed")
    if cuda_simulator_enabled():
        return Availability("numba-cuda", False, "replaced by the CUDA simulator "
                            "(NUMBA_ENABLE_CUDASIM=1)")
    try:
        from numba import cuda  # here, not at the top: only this probe needs the CUDA target

        if cuda.is_available():
            return _checked("numba-cuda", "numba_cuda", f"{len(cuda.gpus)} GPU(s)")
        return Availability("numba-cuda", False, "no CUDA driver or GPU found")
    except Exception as exc:  # noqa: BLE001 - report, never crash the probe
        return Availability("numba-cuda", False, f"{type(exc).__name__}: {exc}")


def cuda_simulator() -> Availability:
    if _version("numba") is None:
        return Availability("cuda-simulator", False, "numba is not installed")
    if cuda_simulator_enabled():
        return Availability("cuda-simulator", True, "NUMBA_ENABLE_CUDASIM=1 (tests only: slow)")
    return Availability("cuda-simulator", False, "off (set NUMBA_ENABLE_CUDASIM=1 to enable)")


def cupy() -> Availability:
    version = _version("cupy")
    if version is None:
        return Availability("cupy", False, "cupy is not installed (extra: mpidp[cuda12])")
    import cupy as cp  # here, not at the top: CuPy is optional (mpidp[cuda12])

    try:
        if cp.is_available():
            return _checked("cupy", "cupy",
                            f"cupy {version}, {cp.cuda.runtime.getDeviceCount()} GPU(s)")
    except Exception as exc:  # noqa: BLE001
        return Availability("cupy", False, f"cupy {version}: {type(exc).__name__}: {exc}")
    return Availability("cupy", False, f"cupy {version}: no usable GPU")


def probe_all() -> list[Availability]:
    """Every back-end, CPU first."""
    return [numba_cpu(), numba_cuda(), cuda_simulator(), cupy()]
