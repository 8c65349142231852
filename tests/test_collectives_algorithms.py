"""Every all-reduce algorithm against an independent reference, on 1-4 ranks.

Each rank's contribution is a deterministic function of (rank, index), so
every rank can compute all p contributions and reduce them with numpy (the
reference) without communicating. Integer-valued data make every sum exact
in every dtype, so float results must match exactly too; a separate test
uses random floats and compares with a tolerance. The result must also be
bit-identical on all ranks (gathered and compared as bytes).
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import collectives
from collectives.core.context import SUPPORTED_DTYPES

ALGORITHMS = collectives.names()
OPS = {"sum": np.add, "max": np.maximum, "min": np.minimum}


def contribution(rank: int, n: int, dtype, salt: int = 0) -> np.ndarray:
    index = np.arange(n, dtype=np.int64)
    return ((index * 131 + rank * 31 + salt * 7) % 17 - 8).astype(dtype)


def reference(size: int, n: int, dtype, op: str, salt: int = 0) -> np.ndarray:
    parts = [contribution(q, n, np.int64, salt) for q in range(size)]
    return OPS[op].reduce(np.stack(parts), axis=0).astype(dtype) if n else np.empty(0, dtype)


def lengths(size: int) -> list[int]:
    """0, shorter than p, p + 1 (not divisible), and a few hundred."""
    return sorted({0, 1, max(1, size - 1), size + 1, 301})


def assert_identical_on_all_ranks(comm, data: bytes) -> None:
    everyone = comm.allgather(data)
    assert all(d == everyone[0] for d in everyone), "results differ between ranks"


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_exact_result_every_dtype_op_and_length(comm, algorithm):
    rank, size = comm.Get_rank(), comm.Get_size()
    results = []
    for dtype in SUPPORTED_DTYPES:
        for op in OPS:
            for n in lengths(size):
                buf = contribution(rank, n, dtype, salt=n)
                out = collectives.allreduce(buf, comm, algorithm, op)
                assert out is buf
                np.testing.assert_array_equal(buf, reference(size, n, dtype, op, salt=n),
                                              err_msg=f"{algorithm} {dtype} {op} n={n}")
                results.append(buf.tobytes())
    assert_identical_on_all_ranks(comm, b"".join(results))


@pytest.mark.mpi(min_size=1)
def test_random_floats_close_to_float64_reference_and_identical(comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    n = 1000
    parts = [np.random.default_rng(q).standard_normal(n) for q in range(size)]
    results = []
    for algorithm in ALGORITHMS:
        for dtype, rtol in ((np.float32, 1e-5), (np.float64, 1e-12), (np.float16, 2e-2)):
            buf = parts[rank].astype(dtype)
            collectives.allreduce(buf, comm, algorithm)
            want = np.sum([p.astype(dtype).astype(np.float64) for p in parts], axis=0)
            np.testing.assert_allclose(buf.astype(np.float64), want, rtol=rtol,
                                       atol=rtol * size * 4, err_msg=f"{algorithm} {dtype}")
            results.append(buf.tobytes())
    assert_identical_on_all_ranks(comm, b"".join(results))


@pytest.mark.mpi(min_size=1)
def test_pieces_when_messages_exceed_the_segment(comm, monkeypatch):
    """A tiny segment makes every algorithm cut its messages into pieces."""
    monkeypatch.setenv("MPIDP_ALLREDUCE_SEGMENT", "256")
    rank, size = comm.Get_rank(), comm.Get_size()
    private = comm.Dup()  # a fresh communicator: plans made with this segment
    try:
        for algorithm in ALGORITHMS:
            for n in (97, 331):
                buf = contribution(rank, n, np.float32)
                collectives.allreduce(buf, private, algorithm)
                np.testing.assert_array_equal(buf, reference(size, n, np.float32, "sum"))
    finally:
        collectives.forget()
        private.Free()


@pytest.mark.mpi(min_size=1)
def test_buffers_larger_than_the_shared_slot_go_through_in_chunks(comm, monkeypatch):
    """Two ranks on a node exchange through the shared pair's slots of
    SLOT_BYTES (recursive doubling: the whole buffer; ring: halves); a larger
    buffer goes through piece by piece (an odd number of exchanges, so
    consecutive calls start on alternate slots). Small slots here; one buffer
    just over the real 4 MiB slot on a communicator made before the patch."""
    from collectives.channels import shm_pair
    from collectives.channels.shm_pair import SharedPair

    rank, size = comm.Get_rank(), comm.Get_size()
    planned = []
    original = SharedPair.plan
    monkeypatch.setattr(SharedPair, "plan",
                        lambda self, ctx, schedule_of: planned.append(ctx.description)
                        or original(self, ctx, schedule_of))
    for algorithm in ("recursive_doubling", "ring"):
        big = contribution(rank, 2 * (shm_pair.SLOT_BYTES // 8) + 5, np.float64)
        collectives.allreduce(big, comm, algorithm)
        np.testing.assert_array_equal(big, reference(size, big.size, np.float64, "sum"))
    monkeypatch.setattr(shm_pair, "SLOT_BYTES", 4096)
    private = comm.Dup()  # its window is made with the small slots
    try:
        for step in range(3):
            for n, dtype in ((2 * 1024 + 7, np.float32), (3 * 1024 + 1, np.int64),
                             (1024, np.int32), (3, np.float64), (1, np.float32)):
                for algorithm in ("recursive_doubling", "ring"):
                    buf = contribution(rank, n, dtype, salt=step)
                    collectives.allreduce(buf, private, algorithm)
                    np.testing.assert_array_equal(buf, reference(size, n, dtype, "sum",
                                                                 salt=step))
                    assert_identical_on_all_ranks(private, buf.tobytes())
    finally:
        collectives.forget()
        private.Free()
    if size == 2:  # on one node: every plan of both went through the shared pair
        assert {d.split("'")[1] for d in planned} == {"recursive_doubling", "ring"}
        assert len(planned) == 2 + 2 * 5
    else:
        assert planned == []


@pytest.mark.mpi(min_size=3)
def test_ranks_on_one_node_ring_through_the_shared_group_in_segments(comm, monkeypatch):
    """Three or more ranks on one node: the ring goes through the node's shared
    window, one segment of the buffer per pass. With 64-byte slots (patched),
    buffers take many passes, every slot is reused many times within a call
    and across calls, and chunks are empty (n < p) or uneven; one buffer just
    over the real segment size runs on the unpatched communicator."""
    from collectives.channels import shm_group
    from collectives.channels.shm_group import SharedGroup
    from collectives.core.plans import comm_state

    rank, size = comm.Get_rank(), comm.Get_size()
    planned = []
    original = SharedGroup.plan
    monkeypatch.setattr(SharedGroup, "plan", lambda self, ctx, schedule_of:
                        planned.append(ctx.n) or original(self, ctx, schedule_of))
    big = contribution(rank, 2 * (shm_group.SEGMENT_BYTES // 8) + 9, np.float64)  # a new plan
    collectives.allreduce(big, comm, "ring")
    np.testing.assert_array_equal(big, reference(size, big.size, np.float64, "sum"))
    assert comm_state(comm).channel_named("shm-group") is not None  # mpiexec on one machine
    monkeypatch.setattr(shm_group, "SEGMENT_BYTES", 64 * size)
    private = comm.Dup()  # its window is made with the small slots
    calls = [(2 * 1024 + 7, np.float32), (3 * 1024 + 1, np.int64), (1024, np.int32),
             (size - 1, np.float64), (1, np.float32), (0, np.float64), (16 * size, np.int32)]
    try:
        for step in range(3):
            for n, dtype in calls:
                buf = contribution(rank, n, dtype, salt=step)
                collectives.allreduce(buf, private, "ring", "max" if step == 2 else "sum")
                np.testing.assert_array_equal(
                    buf, reference(size, n, dtype, "max" if step == 2 else "sum", salt=step))
                assert_identical_on_all_ranks(private, buf.tobytes())
        group = comm_state(private).channel_named("shm-group")
        assert group.slot_bytes == 64
        passes = sum(-(-n // (64 // np.dtype(dtype).itemsize * size)) for n, dtype in calls)
        assert group.steps == 3 * 2 * (size - 1) * passes  # every step published, none twice
    finally:
        collectives.forget()
        private.Free()
    assert sorted(set(planned)) == sorted({big.size} | {n for n, _ in calls})


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sleep", [True, False], ids=["asleep", "spinning"])
def test_shared_memory_waits_asleep_and_spinning(comm, sleep, monkeypatch):
    """Ranks on one node wait for each other in shared memory by sleeping on a
    futex (node oversubscribed) or spinning (a core each); which one a run
    uses depends on the machine's cores, so both are forced here. A sleeper
    also wakes every 10 ms to look for a peer that is not coming; with that
    made 5 s, a lost wake-up would cost 5 s: the publisher's wake must do it."""
    import time

    from collectives.channels import shm_window
    from collectives.core.plans import comm_state

    monkeypatch.setattr(shm_window, "CHECK_EVERY", 5.0)  # both channels wait with wait_until
    rank, size = comm.Get_rank(), comm.Get_size()
    private = comm.Dup()
    start = time.monotonic()
    try:
        state = comm_state(private)
        channel = state.shared
        assert channel is not None  # mpiexec on one machine
        channel.sleep = sleep  # before any plan: plans bind the waiting mode
        for step in range(3):
            for n in (0, 1, size + 1, 5000):
                for algorithm in ("ring", "recursive_doubling"):
                    buf = contribution(rank, n, np.int64, salt=step)
                    collectives.allreduce(buf, private, algorithm)
                    np.testing.assert_array_equal(
                        buf, reference(size, n, np.int64, "sum", salt=step))
        assert time.monotonic() - start < 3.0, "a rank slept through its peer's publication"
    finally:
        collectives.forget()
        private.Free()


@pytest.mark.mpi(min_size=1)
def test_repeated_calls_with_the_same_buffer_stay_correct(comm):
    """The fast path (same buffer, same arguments) reduces the current values."""
    rank, size = comm.Get_rank(), comm.Get_size()
    for algorithm in ALGORITHMS:
        buf = np.zeros(257, dtype=np.int64)
        for step in range(3):
            buf[...] = contribution(rank, buf.size, np.int64, salt=step)
            collectives.allreduce(buf, comm, algorithm)
            np.testing.assert_array_equal(buf, reference(size, buf.size, np.int64, "sum",
                                                         salt=step))


@pytest.mark.mpi(min_size=1)
@settings(max_examples=10, derandomize=True, deadline=None, database=None,
          phases=[Phase.explicit, Phase.generate],  # no shrinking: ranks stay in step
          suppress_health_check=list(HealthCheck))
@given(n=st.integers(0, 200), dtype=st.sampled_from(SUPPORTED_DTYPES),
       op=st.sampled_from(sorted(OPS)), algorithm=st.sampled_from(ALGORITHMS),
       salt=st.integers(0, 16))
def test_property_any_length_dtype_op_algorithm(comm, n, dtype, op, algorithm, salt):
    rank, size = comm.Get_rank(), comm.Get_size()
    buf = contribution(rank, n, dtype, salt)
    collectives.allreduce(buf, comm, algorithm, op)
    np.testing.assert_array_equal(buf, reference(size, n, dtype, op, salt))


def test_every_required_algorithm_is_registered():
    for name in ("naive", "recursive_doubling", "ring", "native", "auto"):
        assert name in collectives.names()
    for name in collectives.names():
        algorithm = collectives.get(name)
        assert algorithm.summary and algorithm.messages
        kinds = (algorithm.schedule, algorithm.plan, algorithm.choose)
        assert sum(kind is not None for kind in kinds) == 1


def test_segment_setting_is_validated(monkeypatch):
    from collectives.core.plans import DEFAULT_SEGMENT, UNLIMITED_SEGMENT, segment_bytes

    monkeypatch.setenv("MPIDP_ALLREDUCE_SEGMENT", "12")
    with pytest.raises(ValueError, match="MPIDP_ALLREDUCE_SEGMENT"):
        segment_bytes()
    monkeypatch.setenv("MPIDP_ALLREDUCE_SEGMENT", "4096")
    assert segment_bytes() == 4096
    monkeypatch.delenv("MPIDP_ALLREDUCE_SEGMENT")
    assert segment_bytes() == DEFAULT_SEGMENT
    assert segment_bytes(oversubscribed=True) == UNLIMITED_SEGMENT  # no cutting
