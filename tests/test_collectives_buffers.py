"""torch tensors and device arrays through the same allreduce.

No GPU here, so the device path runs the production code (CupyOps,
CupySpace, the staging and direct runners, the CUDA-aware switch) against a
stand-in for CuPy whose "device memory" is host memory and whose kernels and
copies are *queued on a stream and only land when the stream is
synchronized*. A missing synchronize before MPI reads device memory
therefore gives a wrong sum here, as it would on a GPU. Only the real CUDA
calls and a CUDA-aware transfer are left to the test marked ``gpu``.
"""
import itertools
import warnings
import types

import numpy as np
import pytest
import torch

import collectives
from collectives.core import device
from collectives.runtime import MPI


# ----------------------------------------------------------------- torch ---

@pytest.mark.mpi(min_size=1)
def test_torch_cpu_tensor_reduced_in_place_without_copy(comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    for algorithm in collectives.names():
        tensor = torch.arange(37, dtype=torch.float32) * (rank + 1)
        pointer = tensor.data_ptr()
        out = collectives.allreduce(tensor, comm, algorithm)
        assert out is tensor and tensor.data_ptr() == pointer
        expected = torch.arange(37, dtype=torch.float32) * sum(range(1, size + 1))
        assert torch.equal(tensor, expected), algorithm


@pytest.mark.mpi(min_size=1)
def test_torch_tensor_whose_storage_is_swapped_is_rebound(comm):
    size = comm.Get_size()
    tensor = torch.ones(16, dtype=torch.float64)
    collectives.allreduce(tensor, comm, "ring")
    tensor.set_(torch.full((16,), 2.0, dtype=torch.float64))  # new storage, same object
    collectives.allreduce(tensor, comm, "ring")
    assert torch.equal(tensor, torch.full((16,), 2.0 * size, dtype=torch.float64))


@pytest.mark.mpi(min_size=1)
def test_torch_tensor_that_requires_grad(comm):
    weights = torch.ones(8, requires_grad=True)
    with torch.no_grad():
        collectives.allreduce(weights, comm, "native")
    assert torch.equal(weights.detach(), torch.full((8,), float(comm.Get_size())))


def test_non_contiguous_tensor_is_refused():
    with pytest.raises(collectives.UnsupportedBuffer, match="contiguous tensor .*x.contiguous"):
        collectives.allreduce(torch.ones(4, 4).t().reshape(-1)[::2], MPI.COMM_SELF)


@pytest.mark.parametrize("algorithm", ["ring", "auto"])
def test_tensor_made_strided_in_place_after_a_call_is_refused(algorithm):
    """``as_strided_`` keeps the object, its data pointer and its length: the
    repeated call's fast path reduced the first 8 elements of the storage
    (writing over storage[1, 3, 5, 7]) instead of refusing, as a fresh call does."""
    storage = torch.zeros(16)
    tensor = storage[:8]
    tensor.fill_(1)
    collectives.allreduce(tensor, MPI.COMM_SELF, algorithm)
    storage.copy_(torch.arange(16.0))
    tensor.as_strided_((8,), (2,))
    with pytest.raises(collectives.UnsupportedBuffer, match=r"contiguous tensor .*strides \(2,\)"):
        collectives.allreduce(tensor, MPI.COMM_SELF, algorithm)
    assert torch.equal(storage, torch.arange(16.0))  # nothing written
    tensor.as_strided_((8,), (1,))  # contiguous again: accepted
    collectives.allreduce(tensor, MPI.COMM_SELF, algorithm)
    assert torch.equal(tensor, torch.arange(8.0))


@pytest.mark.parametrize("algorithm", ["ring", "auto"])
def test_array_given_new_strides_in_place_after_a_call_is_refused(algorithm):
    """The same for a numpy array whose ``strides`` are set after a first call."""
    storage = np.arange(16.0)
    array = storage[:8]
    collectives.allreduce(array, MPI.COMM_SELF, algorithm)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # numpy 2.4 deprecates it
        array.strides = (16,)
    with pytest.raises(collectives.UnsupportedBuffer, match="contiguous array"):
        collectives.allreduce(array, MPI.COMM_SELF, algorithm)
    collectives.forget()


# ------------------------------------------------------- fake CUDA world ---

class FakeStream:
    """Work queued here runs only when the stream is synchronized."""

    handles = itertools.count(1000)

    def __init__(self):
        self.ptr = next(self.handles)
        self.pending = []
        self.synchronizations = 0
        STREAMS[self.ptr] = self

    def enqueue(self, work):
        self.pending.append(work)

    def synchronize(self):
        for work in self.pending:
            work()
        self.pending.clear()
        self.synchronizations += 1


STREAMS: dict[int, FakeStream] = {}


class FakeDeviceArray:
    """Host memory posing as device memory (a CUDA array interface, no buffer protocol)."""

    def __init__(self, memory: np.ndarray, stream: "FakeStream | None"):
        self.memory = memory  # what a kernel or MPI sees
        self.stream = stream  # the producer's stream, reported to consumers

    @property
    def __cuda_array_interface__(self):
        m = self.memory
        return {"shape": m.shape, "typestr": m.dtype.str, "version": 3,
                "strides": None if m.flags.c_contiguous else m.strides,
                "data": (m.__array_interface__["data"][0], False),
                "stream": None if self.stream is None else self.stream.ptr}

    dtype = property(lambda self: self.memory.dtype)
    shape = property(lambda self: self.memory.shape)
    size = property(lambda self: self.memory.size)
    ndim = property(lambda self: self.memory.ndim)

    def __len__(self):
        return len(self.memory)

    def __getitem__(self, index):
        return FakeDeviceArray(self.memory[index], self.stream)

    def __setitem__(self, index, value):  # a device-to-device copy kernel
        source = value.memory if isinstance(value, FakeDeviceArray) else value
        target = self.memory
        CURRENT[0].enqueue(lambda: target.__setitem__(index, source))

    def reshape(self, *shape):
        return FakeDeviceArray(self.memory.reshape(*shape), self.stream)

    # CuPy's host transfers, as CupyOps uses them
    def get(self, out, blocking=True):
        CURRENT[0].synchronize()  # a blocking copy waits for the current stream
        out[...] = self.memory

    def set(self, host):
        memory, data = self.memory, np.array(host)
        CURRENT[0].enqueue(lambda: memory.__setitem__(Ellipsis, data))


CURRENT = [None]  # the current stream, as cupy.cuda.get_current_stream() returns


def fake_cupy():
    """The parts of the cupy and cupyx modules that collectives.core.device uses."""
    def ufunc(name):
        def launch(a, b, out):
            CURRENT[0].enqueue(lambda: getattr(np, name)(a.memory, b.memory, out=out.memory))
        return launch

    def elementwise(inputs, outputs, body, name):  # CuPy's ElementwiseKernel: the host rule
        from collectives.core.combine import canonicalize, host_combiner

        op = name.split("_")[1]

        def launch(a, b, out):
            def run():
                if op == "canonical":
                    canonicalize(out.memory)
                else:
                    host_combiner(op, out.memory.dtype)(a.memory, b.memory, out.memory)
            CURRENT[0].enqueue(run)
        return launch

    pinned = []
    runtime = types.SimpleNamespace(
        streamSynchronize=lambda ptr: STREAMS[ptr].synchronize(),
        deviceSynchronize=lambda: [s.synchronize() for s in STREAMS.values()])
    cupy = types.SimpleNamespace(
        asarray=lambda obj: obj,
        empty=lambda n, dtype: FakeDeviceArray(np.full(n, -99, dtype), None),
        add=ufunc("add"), maximum=ufunc("maximum"), minimum=ufunc("minimum"),
        ElementwiseKernel=elementwise,
        cuda=types.SimpleNamespace(runtime=runtime, get_current_stream=lambda: CURRENT[0]))
    cupyx = types.SimpleNamespace(
        empty_pinned=lambda shape, dtype: pinned.append(shape) or np.empty(shape, dtype))
    return cupy, cupyx, pinned


@pytest.fixture
def fake_gpu(monkeypatch):
    """Registers CupyOps over the fake CuPy for FakeDeviceArray."""
    cupy, cupyx, pinned = fake_cupy()
    CURRENT[0] = FakeStream()
    device.register_device_ops(FakeDeviceArray, device.CupyOps(cupy, cupyx))
    yield types.SimpleNamespace(pinned=pinned)
    device.unregister_device_ops(FakeDeviceArray)
    collectives.forget()


def produced_on_a_stream(values: np.ndarray) -> FakeDeviceArray:
    """A device array whose contents a kernel is still writing (stream not synced)."""
    producer = FakeStream()
    array = FakeDeviceArray(np.full(values.shape, -1, values.dtype), producer)
    producer.enqueue(lambda: array.memory.__setitem__(Ellipsis, values))
    return array


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("cuda_aware", ["0", "1"], ids=["staged", "cuda-aware"])
def test_device_array_waits_for_its_stream_and_is_reduced(comm, fake_gpu, monkeypatch,
                                                          cuda_aware):
    monkeypatch.setenv("MPIDP_CUDA_AWARE", cuda_aware)
    rank, size = comm.Get_rank(), comm.Get_size()
    for algorithm in collectives.names():
        for op, n in (("sum", 2 * size + 3), ("max", 1)):
            values = np.arange(n, dtype=np.float32) + 10 * rank
            array = produced_on_a_stream(values)
            collectives.allreduce(array, comm, algorithm, op)
            if size == 1:  # nothing to reduce: no staging, no wait for the device
                assert array.stream.synchronizations == 0, algorithm
                array.stream.synchronize()
                np.testing.assert_array_equal(array.memory, values, err_msg=algorithm)
                continue
            expected = (np.arange(n, dtype=np.float32) * size + 10 * sum(range(size))
                        if op == "sum" else values - 10 * rank + 10 * (size - 1))
            np.testing.assert_array_equal(array.memory, expected, err_msg=algorithm)
            assert array.stream.synchronizations == 1


@pytest.mark.mpi(min_size=1)
def test_staging_buffer_is_pinned_allocated_once_and_reused(comm, fake_gpu, monkeypatch):
    monkeypatch.setenv("MPIDP_CUDA_AWARE", "0")
    size = comm.Get_size()
    first = produced_on_a_stream(np.ones(50, np.float64))
    second = produced_on_a_stream(np.full(50, 2.0))
    for _ in range(3):
        for array in (first, second):
            collectives.allreduce(array, comm, "ring")
    CURRENT[0].synchronize()
    for array in (first, second):
        array.stream.synchronize()
    # one pinned staging buffer for the signature (none for one rank: nothing to reduce)
    assert fake_gpu.pinned == ([] if size == 1 else [(50,)])
    np.testing.assert_array_equal(first.memory, np.full(50, size ** 3))
    np.testing.assert_array_equal(second.memory, np.full(50, 2.0 * size ** 3))


@pytest.mark.mpi(min_size=1)
def test_cuda_aware_mpi_gets_the_device_pointer_itself(comm, fake_gpu, monkeypatch):
    """No staging buffer when MPI is CUDA-aware."""
    monkeypatch.setenv("MPIDP_CUDA_AWARE", "1")
    array = produced_on_a_stream(np.ones(8, np.int64))
    collectives.allreduce(array, comm, "native")
    assert fake_gpu.pinned == []
    array.stream.synchronize()
    np.testing.assert_array_equal(array.memory, np.full(8, comm.Get_size()))


def test_device_array_must_be_flat_and_contiguous(fake_gpu):
    flat = FakeDeviceArray(np.zeros((2, 3), np.float32), None)
    with pytest.raises(collectives.UnsupportedBuffer, match="1-D"):
        collectives.allreduce(flat, MPI.COMM_SELF)
    odd = FakeDeviceArray(np.zeros(4, np.int16), None)
    with pytest.raises(collectives.UnsupportedBuffer, match="int16"):
        collectives.allreduce(odd, MPI.COMM_SELF)


def test_device_array_made_strided_after_a_call_is_refused(fake_gpu):
    """A device buffer whose memory keeps its address but takes other strides
    (a torch CUDA tensor's ``as_strided_``) is refused as on a first call."""
    storage = np.zeros(16, np.float32)
    array = FakeDeviceArray(storage[:8], None)
    collectives.allreduce(array, MPI.COMM_SELF, "ring")
    array.memory = storage[::2]  # the same data pointer and length, strides (8,)
    with pytest.raises(collectives.UnsupportedBuffer, match="contiguous device array"):
        collectives.allreduce(array, MPI.COMM_SELF, "ring")


def test_device_array_without_cupy_says_what_to_install():
    class Foreign:
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "version": 3,
                                    "data": (0, False), "strides": None}

    try:
        import cupy  # noqa: F401
    except ImportError:
        with pytest.raises(collectives.UnsupportedBuffer, match=r"mpidp\[cuda12\]"):
            collectives.allreduce(Foreign(), MPI.COMM_SELF)
    else:
        pytest.skip("CuPy is installed: the message for its absence cannot be shown")


def _real_gpu_reason() -> str | None:
    try:
        import cupy
    except ImportError:
        return "needs CuPy (pip install 'mpidp[cuda12]') and a CUDA GPU"
    if not cupy.is_available():
        return "CuPy is installed but finds no CUDA GPU/driver"
    return None


@pytest.mark.gpu
@pytest.mark.mpi(min_size=1)
@pytest.mark.skipif(_real_gpu_reason() is not None, reason=str(_real_gpu_reason()))
@pytest.mark.parametrize("algorithm", collectives.names())
def test_cupy_array_on_a_real_gpu(comm, algorithm):
    import cupy

    rank, size = comm.Get_rank(), comm.Get_size()
    with cupy.cuda.Stream(non_blocking=True):
        array = cupy.arange(1001, dtype=cupy.float32) + rank  # queued on this stream
        collectives.allreduce(array, comm, algorithm)
        expected = cupy.arange(1001, dtype=cupy.float32) * size + sum(range(size))
        assert bool((array == expected).all())
