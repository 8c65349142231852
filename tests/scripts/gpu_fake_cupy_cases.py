"""The CuPy kernels' Python side, without CuPy or a GPU: a fake CuPy checks every launch.

Run by tests/test_gpu_kernels.py in a subprocess (the fake must not leak).
Not collected by the normal suite. The fake ``cupy`` module compiles
nothing: ``RawModule.get_function(name)`` parses the ``extern "C"``
signature of ``name`` from the ``.cu`` source it was given, and each launch

* checks the arguments against it, one by one (a pointer must be a
  ``numpy.uint64``, ``long long`` a ``numpy.int64``, ``float`` a
  ``numpy.float32``...: a wrong scalar type is garbage on a real GPU);
* checks the launch shape (block reductions need a power of two <= 256
  threads, grid y <= 65535) and that it runs inside torch's current stream
  (``ExternalStream``) on the tensor's device;
* then runs a numpy emulation of the kernel on the host memory the pointers
  address (CPU tensors stand in for device memory), covering only the
  indices the grid and block would cover.

So the wrappers' arithmetic on shapes, strides and launch grids is checked
against the CPU kernels; what remains GPU-only is the CUDA C itself (compiled
by nvcc in tests/test_gpu_kernels.py, run by ``make test-gpu``).
"""
import ctypes
import re
import sys
import types

import numpy as np
import pytest
import torch

from kernel_inputs import cpu_clip_rows, random_layers  # tests/, on PYTHONPATH
from kernels import registry
from kernels.common import philox
from kernels.cupy import sources as cuda_sources

# ---------------------------------------------------------------- the fake CuPy
C_TYPES = {"long long": np.int64, "unsigned long long": np.uint64, "int": np.int32,
           "float": np.float32, "double": np.float64}
LAUNCHES: list[dict] = []
CURRENT = {"stream": None, "device": None}


def parse_signatures(code: str) -> dict[str, list[str]]:
    """``extern "C"`` kernel name -> C types of its parameters ('T*' for pointers)."""
    out = {}
    for name, params in re.findall(r"__global__\s+void\s+(\w+)\s*\(([^)]*)\)", code):
        types_ = []
        for param in params.split(","):
            words = param.replace("const", "").split()
            if "*" in param:
                types_.append("T*")
            else:
                types_.append(" ".join(words[:-1]))
        out[name] = types_
    return out


def host(ptr, count, dtype):
    """A numpy view of ``count`` elements of host memory at address ``ptr``."""
    dtype = np.dtype(dtype)
    if count == 0:
        return np.empty(0, dtype)
    buf = (ctypes.c_char * (count * dtype.itemsize)).from_address(int(ptr))
    return np.frombuffer(buf, dtype=dtype)


def rows(ptr, k, ld, d, dtype):
    """A k x d view with leading dimension ``ld`` at ``ptr``."""
    flat = host(ptr, (k - 1) * ld + d if k else 0, dtype)
    itemsize = np.dtype(dtype).itemsize
    return np.lib.stride_tricks.as_strided(flat, (k, d), (ld * itemsize, itemsize))


def covered_2d(grid, block, k, d):
    """Rows and columns a 2-D launch covers (rows grid-strided)."""
    assert block[0] * block[1] <= 1024 and grid[1] <= 65535
    cols = min(d, grid[0] * block[0])
    return k, cols


def _pow2_block(block):
    n = block[0]
    assert n <= cuda_sources_max() and n & (n - 1) == 0, f"block {n}: not a power of two <= 256"
    return n


def cuda_sources_max():
    text = cuda_sources.source_path("clip_rows").read_text()
    return int(re.search(r"#define MPIDP_MAX_THREADS (\d+)", text).group(1))


def emulate(name, grid, block, a):
    stem, suffix = name.rsplit("_", 1)
    ft = np.float32 if suffix == "f32" else np.float64
    if stem == "clip_row_sq_norms":
        _pow2_block(block)
        k = grid[0]
        A = rows(a[0], k, a[1], a[2], ft)
        G = rows(a[3], k, a[4], a[5], ft)
        sq = host(a[6], k, ft)
        p = ((A.astype(np.float64) ** 2).sum(1) * (G.astype(np.float64) ** 2).sum(1)).astype(ft)
        sq[:] = sq + p if a[7] else p
    elif stem == "clip_fused_rows":
        _pow2_block(block)
        k, layers, C = grid[0], int(a[24]), a[25]
        assert 1 <= layers <= 4
        pairs = [(rows(a[6 * l], k, a[6 * l + 1], a[6 * l + 2], ft),
                  rows(a[6 * l + 3], k, a[6 * l + 4], a[6 * l + 5], ft)) for l in range(layers)]
        p = sum((A.astype(np.float64) ** 2).sum(1) * (G.astype(np.float64) ** 2).sum(1)
                for A, G in pairs).astype(ft)
        norms = np.sqrt(p)
        f = np.where(norms > C, C / norms, 1).astype(ft)
        host(a[26], k, ft)[:] = p
        host(a[27], k, ft)[:] = f
        for _, G in pairs:
            G *= f[:, None]
    elif stem == "sgd_update":
        n = int(a[3])
        covered = min(n, grid[0] * block[0])  # the kernel strides; the fake checks coverage
        params, velocity, grad = host(a[0], n, ft), host(a[1], n, ft), host(a[2], n, ft)
        velocity[:] = (a[6] * velocity + a[4] * grad).astype(ft)
        params[:] = (params - a[5] * velocity).astype(ft)
        assert covered == n or grid[0] == 4096
    elif stem == "clip_factors":
        assert grid == (1,)
        _pow2_block(block)
        k = int(a[1])
        sq, factors = host(a[0], k, ft), host(a[3], k, ft)
        norms = np.sqrt(sq)
        factors[:] = np.where(norms > a[2], a[2] / norms, 1).astype(ft)
        host(a[4], 1, np.int32)[0] = int((norms > a[2]).sum())
    elif stem == "clip_scale_rows":
        k, d = int(a[2]), int(a[3])
        rk, cd = covered_2d(grid, block, k, d)
        G = rows(a[0], k, a[1], d, ft)
        G[:rk, :cd] *= host(a[4], k, ft)[:rk, None]
    elif stem == "relu_backward":
        k, d = int(a[4]), int(a[5])
        rk, cd = covered_2d(grid, block, k, d)
        G, O = rows(a[0], k, a[1], d, ft), rows(a[2], k, a[3], d, ft)
        G[:rk, :cd] = np.where(O[:rk, :cd] > 0, G[:rk, :cd], 0)
    elif stem == "softmax_xent":
        k, c = int(a[6]), int(a[7])
        n = min(k, grid[0] * block[0])
        Z = rows(a[0], k, a[1], c, ft)[:n].astype(np.float64)
        y = host(a[2], k, np.int64)[:n]
        lse = Z.max(1) + np.log(np.exp(Z - Z.max(1, keepdims=True)).sum(1))
        grad = np.exp(Z - lse[:, None])
        grad[np.arange(n), y] -= 1
        rows(a[3], k, a[4], c, ft)[:n] = grad
        host(a[5], k, ft)[:n] = lse - Z[np.arange(n), y]
    elif stem == "philox_normal_add_at":
        n = int(a[1])
        covered = min(n, 4 * grid[0] * block[0])
        words = host(a[5], 2, np.int64).astype(np.uint64)
        counter = (int(words[0]) | (int(words[1]) << 64)) + int(a[6])
        philox.add_reference(host(a[0], n, ft)[:covered], float(a[2]), counter,
                             (int(a[3]), int(a[4])))
    elif stem == "philox_normal_add":
        n = int(a[1])
        covered = min(n, 4 * grid[0] * block[0])
        counter = int(a[5]) | (int(a[6]) << 64)
        philox.add_reference(host(a[0], n, ft)[:covered], float(a[2]), counter,
                             (int(a[3]), int(a[4])))
    else:
        raise AssertionError(f"no emulation for {name}")


class FakeFunction:
    def __init__(self, name, params):
        self.name, self.params = name, params

    def __call__(self, grid, block, args, **kwargs):
        assert isinstance(grid, tuple) and isinstance(block, tuple), (grid, block)
        assert len(args) == len(self.params), \
            f"{self.name}: {len(args)} arguments for {len(self.params)} parameters"
        for i, (arg, ctype) in enumerate(zip(args, self.params)):
            want = np.uint64 if ctype == "T*" else C_TYPES[ctype]
            assert type(arg) is want, \
                f"{self.name} argument {i}: {type(arg).__name__} for C type {ctype!r}"
        LAUNCHES.append({"name": self.name, "grid": grid, "block": block,
                         "stream": CURRENT["stream"], "device": CURRENT["device"]})
        emulate(self.name, grid, block, args)


class FakeRawModule:
    def __init__(self, code, options=()):
        assert "#include" not in code  # NVRTC has no system headers
        self.signatures = parse_signatures(code)

    def get_function(self, name):
        return FakeFunction(name, self.signatures[name])


class _Context:
    def __init__(self, key, value):
        self.key, self.value = key, value

    def __enter__(self):
        self.saved = CURRENT[self.key]
        CURRENT[self.key] = self.value
        return self

    def __exit__(self, *exc):
        CURRENT[self.key] = self.saved


cupy = types.ModuleType("cupy")
cupy.RawModule = FakeRawModule
cupy.cuda = types.SimpleNamespace(
    ExternalStream=lambda ptr, device=-1: _Context("stream", ("external", ptr, device)),
    Device=lambda index=0: _Context("device", index))
sys.modules["cupy"] = cupy

import kernels.numba_cuda.clip_rows  # noqa: E402,F401  (Numba first: the preference must not care)
import kernels.cupy.launch  # noqa: E402  (after the fake is in place)

kernels.cupy.launch.HOST_TENSORS_FOR_TESTS = True


# ---------------------------------------------------------------------- tests
DTYPES = [torch.float32, torch.float64]


def tol(dtype):
    return dict(rtol=2e-6, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-12, atol=0)


def cupy_kernel(op):
    fn = registry.get(op, "cuda")
    assert fn.backend == "cupy", "the CuPy kernels come first on 'cuda'"
    return fn


@pytest.fixture(autouse=True)
def launches():
    LAUNCHES.clear()
    yield LAUNCHES
    for launch in LAUNCHES:  # every launch on torch's current stream (0 on the host)
        assert launch["stream"] == ("external", 0, 0), launch
        assert launch["device"] == 0, launch


def test_every_entry_point_the_python_side_uses_is_listed_and_exported():
    for stem in cuda_sources.ENTRY_POINTS:
        exported = parse_signatures(cuda_sources.source_path(stem).read_text())
        assert sorted(exported) == sorted(cuda_sources.entry_names(stem))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,C", [(0, 1.0), (1, 1e6), (7, 0.4), (300, 0.5)])
def test_clip_rows(dtype, k, C, launches):
    g = torch.Generator().manual_seed(k)
    dims = (5, 300, 3)  # a layer wider than a block: the reduction strides
    acts = [torch.cat([torch.randn(k, d, generator=g, dtype=dtype),
                       torch.ones(k, 1, dtype=dtype)], 1) for d in dims[:-1]]
    grads = [torch.randn(k, d, generator=g, dtype=dtype) * 0.1 for d in dims[1:]]
    cpu = [x.clone() for x in grads]
    f, f_cpu = torch.full((k + 1,), -1.0, dtype=dtype), torch.full((k + 1,), -1.0, dtype=dtype)
    n = cupy_kernel("clip_rows")(acts, grads, C, f)
    assert n == cpu_clip_rows()(acts, cpu, C, f_cpu)
    assert f[k] == -1.0
    assert torch.allclose(f, f_cpu, **tol(dtype))
    assert all(torch.allclose(a, b, **tol(dtype)) for a, b in zip(grads, cpu))
    if k:
        assert [x["name"][:-4] for x in launches] == ["clip_fused_rows", "clip_factors"]
        assert launches[0]["grid"] == (k,) and launches[1]["grid"] == (1,)
        assert n > 0 or C == 1e6


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layers", [1, 4, 5, 7])
def test_clip_rows_fuses_up_to_four_layers(dtype, layers, launches):
    """Up to FUSED_LAYERS layers: two launches a step; beyond: one per layer."""
    acts, grads = random_layers(9, (3, 6, 2, 5, 4, 3, 2, 4)[:layers + 1], dtype, seed=layers)
    cpu = [x.clone() for x in grads]
    norms = sum(a.double().square().sum(1) * g.double().square().sum(1)
                for a, g in zip(acts, grads)).sqrt()
    s = norms.sort().values
    C = float(s[len(s) // 2 - 1] + s[len(s) // 2]) / 2  # between two rows' norms: half clipped
    f, f_cpu = torch.empty(9, dtype=dtype), torch.empty(9, dtype=dtype)
    n = cupy_kernel("clip_rows")(acts, grads, C, f)
    assert 0 < n == cpu_clip_rows()(acts, cpu, C, f_cpu) < 9
    assert torch.allclose(f, f_cpu, **tol(dtype))
    assert all(torch.allclose(a, b, **tol(dtype)) for a, b in zip(grads, cpu))
    names = [x["name"][:-4] for x in launches]
    if layers <= 4:
        assert names == ["clip_fused_rows", "clip_factors"]
    else:
        assert names == ["clip_row_sq_norms"] * layers + ["clip_factors"] + \
            ["clip_scale_rows"] * layers


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 5, 2_000_000])  # more than 4096 blocks of 256: strided
def test_sgd_update(dtype, n, launches):
    g = torch.Generator().manual_seed(n)
    p, grad = torch.randn(n, generator=g, dtype=dtype), torch.randn(n, generator=g, dtype=dtype)
    v = torch.randn(n, generator=g, dtype=dtype)
    p_cpu, v_cpu = p.clone(), v.clone()
    cupy_kernel("sgd_update")(p, v, grad, 0.25, 0.1, 0.9)
    registry.get("sgd_update", "cpu", "numba")(p_cpu, v_cpu, grad, 0.25, 0.1, 0.9)
    assert torch.allclose(p, p_cpu, **tol(dtype)) and torch.allclose(v, v_cpu, **tol(dtype))
    assert len(launches) == (1 if n else 0)
    with pytest.raises(ValueError, match="differ in length"):
        cupy_kernel("sgd_update")(p, v[:-1] if n else torch.zeros(1, dtype=dtype), grad,
                                  1.0, 0.1, 0.9)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,d", [(0, 4), (3, 9), (530_000, 2)])  # > 65535 x 8 rows
def test_relu_backward_on_a_strided_view(dtype, k, d):
    g = torch.Generator().manual_seed(k)
    full = torch.randn(k, d + 1, generator=g, dtype=dtype).clamp_min(0)
    grad = torch.randn(k, d, generator=g, dtype=dtype)
    a, b = grad.clone(), grad.clone()
    cupy_kernel("relu_backward")(a, full[:, :d])
    registry.get("relu_backward", "cpu", "numba")(b, full[:, :d])
    assert torch.equal(a, b)


def test_relu_backward_refuses_rows_that_are_not_contiguous():
    grad = torch.zeros(4, 3)
    with pytest.raises(ValueError, match="contiguous rows"):
        cupy_kernel("relu_backward")(grad, torch.zeros(3, 4).t())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,classes", [(0, 2), (5, 3), (300, 2)])
def test_softmax_xent(dtype, k, classes):
    g = torch.Generator().manual_seed(k)
    logits = torch.randn(k, classes, generator=g, dtype=dtype) * 3
    labels = torch.randint(0, classes, (k,), generator=g)
    grad, cpu_grad = torch.empty(k, classes, dtype=dtype), torch.empty(k, classes, dtype=dtype)
    loss = cupy_kernel("softmax_xent")(logits, labels, grad)
    cpu_loss = registry.get("softmax_xent", "cpu", "numba")(logits, labels, cpu_grad)
    assert loss == pytest.approx(cpu_loss, rel=1e-5, abs=1e-6)
    assert torch.allclose(grad, cpu_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gaussian_stream(dtype):
    stream = cupy_kernel("gaussian_stream")(np.random.SeedSequence(5), torch.device("cpu"))
    key = tuple(stream.get_state()[:2])
    buf = torch.zeros(1001, dtype=dtype)
    want = buf.numpy().copy()
    stream.add_(buf, 1.5)
    stream.add_(buf[10:20], 1.0)
    counter = philox.add_reference(want, 1.5, 0, key)
    philox.add_reference(want[10:20], 1.0, counter, key)
    assert np.array_equal(buf.numpy(), want)
    assert stream.get_state()[2] == 251 + 3


@pytest.mark.parametrize("dtype", DTYPES)
def test_device_outputs_equal_the_returned_values(dtype):
    """softmax_xent(losses=) and clip_rows(count=): what a CUDA graph's step reads."""
    g = torch.Generator().manual_seed(2)
    acts = [torch.randn(9, d, generator=g, dtype=dtype) for d in (4, 6)]
    grads = [torch.randn(9, d, generator=g, dtype=dtype) for d in (6, 2)]
    other = [x.clone() for x in grads]
    f1, f2 = torch.empty(9, dtype=dtype), torch.empty(9, dtype=dtype)
    count = torch.full((1,), -1, dtype=torch.int32)
    n = cupy_kernel("clip_rows")(acts, grads, 0.5, f1)
    assert cupy_kernel("clip_rows")(acts, other, 0.5, f2, count=count) is None
    assert int(count) == n and torch.equal(f1, f2)
    logits = torch.randn(9, 3, generator=g, dtype=dtype)
    labels = torch.randint(0, 3, (9,), generator=g)
    g1, g2 = torch.empty(9, 3, dtype=dtype), torch.empty(9, 3, dtype=dtype)
    losses = torch.empty(9, dtype=dtype)
    total = cupy_kernel("softmax_xent")(logits, labels, g1)
    assert cupy_kernel("softmax_xent")(logits, labels, g2, losses=losses) is None
    assert torch.equal(g1, g2)
    assert float(losses.double().sum()) == pytest.approx(total, rel=1e-12)
    with pytest.raises(ValueError, match="count"):
        cupy_kernel("clip_rows")(acts, other, 0.5, f2, count=torch.zeros(1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gaussian_stream_from_a_counter_in_device_memory(dtype):
    """take + add_at_ (the CUDA graph's split draw) add what add_ adds."""
    eager = cupy_kernel("gaussian_stream")(np.random.SeedSequence(9), torch.device("cpu"))
    split = cupy_kernel("gaussian_stream")(np.random.SeedSequence(9), torch.device("cpu"))
    a, b = torch.zeros(1001, dtype=dtype), torch.zeros(1001, dtype=dtype)
    counter = torch.zeros(2, dtype=torch.int64)
    for _ in range(3):
        eager.add_(a, 0.5)
        first = split.take(1001)
        counter[0], counter[1] = first & philox.MASK64, first >> 64
        split.add_at_(b, 0.5, counter)
    assert torch.equal(a, b) and eager.get_state() == split.get_state()
    # an offset of whole draws, as the secure mode's four draws use it
    counter.zero_()
    c = torch.zeros(10, dtype=dtype)
    split.add_at_(c, 1.0, counter, offset=3)
    want = np.zeros(10, dtype=c.numpy().dtype)
    philox.add_reference(want, 1.0, 3, tuple(split.get_state()[:2]))
    assert np.array_equal(c.numpy(), want)


def test_cupy_wins_whatever_the_import_order():
    import importlib

    importlib.import_module("kernels.numba_cuda.clip_rows")  # Numba's kernel imported first
    for op in registry.OPS:
        want = ["torch"] if op in registry.GENERIC_ON_GPU else ["cupy", "numba", "torch"]
        assert registry.backends(op, "cuda") == want
