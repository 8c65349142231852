"""The CUDA kernels, verified without a GPU (the GPU runs are in test_gpu_real.py).

* Numba ``@cuda.jit`` kernels run under Numba's CUDA simulator, in a
  subprocess (``NUMBA_ENABLE_CUDASIM=1`` must not leak into other tests), and
  match the CPU kernels and naive references (tests/scripts/gpu_simulator_cases.py).
* The CuPy kernels' Python side launches against a fake CuPy that checks
  every argument against the ``.cu`` signatures and emulates the kernel, in a
  subprocess (tests/scripts/gpu_fake_cupy_cases.py).
* Every Numba CUDA kernel compiles to PTX for sm_80 and sm_90
  (``numba.cuda.compile_ptx`` with the CUDA toolkit's libNVVM), with no
  float64 in its float32 version unless declared, no warp intrinsics (the
  simulator has none, so it could not have run them), and assembles with
  ptxas without spills.
* Every ``.cu`` file compiles with nvcc for sm_80 and sm_90, all warnings
  as errors, and exports exactly the entry points Python names.

Without nvcc or libNVVM the compile checks skip and say what to install.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kernels import registry
from kernels.cupy import sources as cuda_sources

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "scripts"
ARCHS = ((8, 0), (9, 0))
DTYPES = (np.float32, np.float64)
#: PTX instructions the CUDA simulator does not have.
WARP_INTRINSICS = ("shfl.sync", "vote.sync", "match.sync", "redux.sync", "activemask")
NUMBA_CUDA_MODULES = sorted(fn.__module__ for fn in registry.kernels_of("numba_cuda").values())


def _pytest_subprocess(script: str, **env) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    environment.update(env)
    environment["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), str(ROOT / "tests"), environment.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest",
         "-p", "no:mpi", str(SCRIPTS / script)],
        capture_output=True, text=True, timeout=300, env=environment, cwd=str(ROOT))


_WITHOUT_ROW_STACK = """
import numpy as np
del np.row_stack  # numpy 2.5 removed it; the registry here serves numpy <= 2.4
{shim}
import importlib
importlib.import_module("numba.cuda.np.arrayobj")  # what numba-cuda's first compile imports
assert not hasattr(np, "row_stack"), "the shim must leave numpy as it was"
print("overloads loaded")
"""


@pytest.mark.parametrize("shim", [True, False])
def test_numba_cuda_loads_its_array_overloads_under_a_numpy_without_row_stack(shim):
    """numba-cuda 0.30.4 names np.row_stack, which numpy 2.5 removed; its first
    compile then failed on every GPU machine with numpy 2.5 (kernels/numba_cuda
    lends it for the import). Without the shim the same script must fail, or
    this test would not catch the bug where it exists."""
    pytest.importorskip("numba_cuda", reason="numba-cuda is not installed (the test extra "
                        "installs it)")
    code = _WITHOUT_ROW_STACK.format(shim="import kernels.numba_cuda" if shim else "")
    environment = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=str(ROOT), env=environment)
    if shim:
        assert done.returncode == 0 and "overloads loaded" in done.stdout, done.stderr[-3000:]
        return
    from kernels.numba_cuda import _needs_row_stack  # noqa: F401  (importable)
    source = importlib.util.find_spec("numba.cuda.np.arrayobj").origin
    if "np.row_stack" not in Path(source).read_text(encoding="utf-8"):
        pytest.skip("this numba-cuda no longer names np.row_stack: remove the shim")
    assert done.returncode != 0 and "row_stack" in done.stderr


def test_numba_cuda_kernels_match_the_cpu_under_the_simulator():
    result = _pytest_subprocess("gpu_simulator_cases.py", NUMBA_ENABLE_CUDASIM="1")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert re.search(r"\d+ passed", result.stdout) and "skipped" not in result.stdout


def test_cupy_kernels_launch_as_their_cu_signatures_say():
    result = _pytest_subprocess("gpu_fake_cupy_cases.py")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert re.search(r"\d+ passed", result.stdout) and "skipped" not in result.stdout


# ------------------------------------------------------------------ PTX (Numba)
def _cuda_tool(name: str) -> str | None:
    """``name`` (nvcc, ptxas) on PATH, else in $CUDA_HOME/bin or /usr/local/cuda/bin."""
    found = shutil.which(name)
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / name).exists():
            return str(Path(home) / "bin" / name)
    return None


@pytest.fixture(scope="module")
def compile_ptx():
    """``numba.cuda.compile_ptx``, or a skip saying why it cannot run here."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"):
        pytest.skip("NUMBA_ENABLE_CUDASIM is set in this process: PTX needs the real CUDA "
                    "target (the simulator tests run in their own process)")
    from numba import cuda, float32

    def probe(x):
        x[0] = float32(1)

    try:
        cuda.compile_ptx(probe, (float32[:],), cc=(8, 0))
    except Exception as exc:  # noqa: BLE001 - any failure: no NVVM here
        pytest.skip(f"numba.cuda.compile_ptx cannot run here ({type(exc).__name__}: "
                    f"{str(exc).strip().splitlines()[0][:200]}); it needs libNVVM from a CUDA "
                    "toolkit (nvcc) or the wheels of pip install 'numba-cuda[cu13]'")
    return cuda.compile_ptx


def _kernel_cases():
    for module_name in NUMBA_CUDA_MODULES:
        for dtype in DTYPES:
            for kernel in importlib.import_module(module_name).signatures(dtype):
                yield pytest.param(module_name, kernel, np.dtype(dtype),
                                   id=f"{module_name.split('.')[-1]}-{kernel}-"
                                      f"{np.dtype(dtype).name}")


def test_every_numba_cuda_kernel_has_a_signature_to_check():
    assert NUMBA_CUDA_MODULES, "no Numba CUDA kernel modules registered"
    for module_name in NUMBA_CUDA_MODULES:
        module = importlib.import_module(module_name)
        for dtype in DTYPES:
            built = set(vars(module.KERNELS[np.dtype(dtype)]))
            assert built == set(module.signatures(dtype)), module_name


def _f64_instructions(ptx: str) -> list[str]:
    return [line.strip() for line in ptx.splitlines()
            if re.search(r"\.f64\b|%fd\d", line) and not line.strip().startswith("//")]


@pytest.mark.parametrize("module_name,kernel,dtype", list(_kernel_cases()))
def test_numba_cuda_kernel_compiles_to_ptx(compile_ptx, module_name, kernel, dtype, tmp_path):
    module = importlib.import_module(module_name)
    function = getattr(module.KERNELS[dtype], kernel).py_func
    signature = module.signatures(dtype)[kernel]
    ptxas = _cuda_tool("ptxas")
    for cc in ARCHS:
        ptx, _ = compile_ptx(function, signature, cc=cc)
        arch = f"sm_{cc[0]}{cc[1]}"
        assert re.search(rf"\.target\s+{arch}\b", ptx)
        used = [w for w in WARP_INTRINSICS if w in ptx]
        assert not used, f"{kernel} uses {used}: the simulator tests cannot have run that path"
        if dtype == np.float32 and kernel not in cuda_sources.FLOAT64_BY_DESIGN:
            f64 = _f64_instructions(ptx)
            assert not f64, f"float64 in the float32 {kernel} ({arch}): {f64[:5]}"
        if ptxas is None:
            continue
        path = tmp_path / f"{kernel}_{arch}.ptx"
        path.write_text(ptx)
        done = subprocess.run([ptxas, f"-arch={arch}", "--warn-on-spills", "--warning-as-error",
                               str(path), "-o", os.devnull], capture_output=True, text=True,
                              timeout=60)
        if "Unsupported .version" in done.stderr:
            continue  # NVVM newer than this ptxas: the PTX check above still stands
        assert done.returncode == 0, f"ptxas {arch} {kernel}: {done.stderr}"


# ----------------------------------------------------------------- .cu (nvcc)
def test_every_cu_file_is_listed():
    on_disk = sorted(p.stem for p in cuda_sources.SOURCE_DIR.glob("*.cu"))
    assert on_disk == sorted(cuda_sources.ENTRY_POINTS)
    for stem in on_disk:
        assert "#include" not in cuda_sources.source_path(stem).read_text(), \
            f"{stem}.cu includes a header: CuPy's NVRTC has no system headers"


def _ptx_functions(ptx: str) -> dict[str, str]:
    """Entry name -> its PTX body."""
    parts = re.split(r"(?=^\.(?:visible\s+)?\.?(?:entry|func)\s)", ptx, flags=re.M)
    out = {}
    for part in parts:
        match = re.match(r"\.(?:visible\s+)?\.?entry\s+(\w+)", part)
        if match:
            out[match.group(1)] = part
    return out


@pytest.mark.parametrize("stem", sorted(cuda_sources.ENTRY_POINTS))
def test_cu_file_compiles_with_nvcc_and_exports_its_entry_points(stem, tmp_path):
    nvcc = _cuda_tool("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found (install the CUDA toolkit, or put nvcc on PATH): "
                    f"kernels/cupy/{stem}.cu was not compiled")
    for major, minor in ARCHS:
        arch = f"sm_{major}{minor}"
        out = tmp_path / f"{stem}_{arch}.ptx"
        done = subprocess.run([nvcc, "-ptx", f"-arch={arch}", "-std=c++14", "-Werror",
                               "all-warnings", str(cuda_sources.source_path(stem)), "-o",
                               str(out)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"nvcc {arch} {stem}.cu:\n{done.stderr}"
        functions = _ptx_functions(out.read_text())
        assert sorted(functions) == sorted(cuda_sources.entry_names(stem))
        for kernel in cuda_sources.ENTRY_POINTS[stem]:
            if kernel in cuda_sources.FLOAT64_BY_DESIGN:
                continue
            f64 = _f64_instructions(functions[f"{kernel}_f32"])
            assert not f64, f"float64 in {kernel}_f32 ({arch}): {f64[:5]}"
