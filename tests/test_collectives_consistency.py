"""Ranks that call allreduce differently get an error, never a hang or garbage;
the repeated call costs no collective and no allocation.

Every mismatch test runs on its own duplicate (or two-rank split) of
COMM_WORLD, so what it leaves behind cannot disturb later tests.
"""
import tracemalloc

import numpy as np
import pytest

import collectives
from collectives.auto import tuning
from collectives.core import dispatch
from collectives.errors import (AllreduceMismatch, UnknownAlgorithm, UnknownOp,
                                UnsupportedBuffer)
from collectives.runtime import MPI

P2P_ALGORITHMS = ["naive", "recursive_doubling", "ring", "rabenseifner"]


@pytest.fixture
def fresh(comm):
    """A duplicate of COMM_WORLD with no allreduce history."""
    private = comm.Dup()
    yield private
    collectives.forget()
    private.Free()


@pytest.fixture
def pair(comm):
    """Ranks 0 and 1 in a communicator of their own (None on the other ranks)."""
    color = 0 if comm.Get_rank() < 2 else MPI.UNDEFINED
    two = comm.Split(color, comm.Get_rank())
    yield None if two == MPI.COMM_NULL else two
    collectives.forget()
    if two != MPI.COMM_NULL:
        two.Free()


def arguments(rank: int, differ: str) -> tuple[np.ndarray, str, str]:
    odd = rank == 0  # rank 0 disagrees with the others
    n = 11 if odd and differ == "length" else 10
    dtype = np.int32 if odd and differ == "dtype" else np.float32
    op = "max" if odd and differ == "op" else "sum"
    algorithm = "ring" if odd and differ == "algorithm" else "recursive_doubling"
    return np.ones(n, dtype), algorithm, op


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("differ", ["length", "dtype", "op", "algorithm"])
def test_first_call_mismatch_is_an_error_on_every_rank(fresh, differ):
    buf, algorithm, op = arguments(fresh.Get_rank(), differ)
    with pytest.raises(AllreduceMismatch, match=f"differ in {differ}") as caught:
        collectives.allreduce(buf, fresh, algorithm, op)
    assert caught.value.collective and caught.value.exit_code == 2
    assert "ranks 0:" in str(caught.value) and "ranks 1" in str(caught.value)
    # The check completed on every rank: the communicator is still usable.
    good = np.full(4, fresh.Get_rank(), dtype=np.int64)
    collectives.allreduce(good, fresh, "ring")
    assert (good == sum(range(fresh.Get_size()))).all()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("other_length", [11, 1000], ids=["shorter", "truncated"])
def test_cached_signatures_called_out_of_order_raise(pair, other_length):
    """Both signatures were checked before; the tags tell the calls apart. The
    communicator then refuses further calls (ranks may be out of step)."""
    if pair is None:
        pytest.skip("ranks 0 and 1 only")
    for algorithm in P2P_ALGORITHMS:
        comm = pair.Dup()
        a, b = np.ones(10, np.float32), np.ones(other_length, np.float32)
        collectives.allreduce(a, comm, algorithm)
        collectives.allreduce(b, comm, algorithm)
        mine = a if comm.Get_rank() == 0 else b
        with pytest.raises(AllreduceMismatch, match="every rank must make the same sequence") \
                as caught:
            collectives.allreduce(mine, comm, algorithm)
        assert not caught.value.collective, algorithm  # found by this rank alone
        with pytest.raises(collectives.AllreduceError, match="use a new communicator"):
            collectives.allreduce(a, comm, algorithm)


@pytest.mark.mpi(min_size=2)
def test_new_signature_while_the_peer_waits_in_native(pair):
    """MPI_Allreduce cannot see our check; the one-sided counter can."""
    if pair is None:
        pytest.skip("ranks 0 and 1 only")
    from collectives.core.plans import comm_state

    cached = np.ones(10, np.float32)
    collectives.allreduce(cached, pair, "native")
    if pair.Get_rank() == 0:
        with pytest.raises(AllreduceMismatch, match="blocked in blind call"):
            collectives.allreduce(np.ones(12, np.float32), pair, "native")
        # By default the job would be aborted here; with abort_on_error off
        # (as in these tests) rank 0 leaves the communicator and releases
        # rank 1 from MPI_Allreduce, with scratch data.
        assert comm_state(pair).peers.blind_calls[1] == 1  # gone: a call failed
    else:  # released by a call that is not its own: the order check says so
        with pytest.raises(AllreduceMismatch, match="waited in MPI_Allreduce for rank 0, "
                           "which never made this call .a call of its own failed") as caught:
            collectives.allreduce(cached, pair, "native")
        assert not caught.value.collective
        assert np.isnan(cached).all()  # no result, and none of rank 0's numbers


@pytest.mark.mpi(min_size=2)
def test_new_signature_while_the_peer_runs_a_cached_ring(pair):
    if pair is None:
        pytest.skip("ranks 0 and 1 only")
    cached = np.ones(10, np.float32)
    collectives.allreduce(cached, pair, "ring")
    mine = np.ones(12, np.float32) if pair.Get_rank() == 0 else cached
    with pytest.raises(AllreduceMismatch):
        collectives.allreduce(mine, pair, "ring")


@pytest.mark.mpi(min_size=1)
def test_repeated_call_takes_the_fast_path(comm, monkeypatch):
    buf = np.ones(1000, np.float32)
    collectives.allreduce(buf, comm, "ring")
    slow_calls = []
    real_slow = dispatch._allreduce_slow
    monkeypatch.setattr(dispatch, "_allreduce_slow",
                        lambda *a: slow_calls.append(a) or real_slow(*a))
    for _ in range(5):
        collectives.allreduce(buf, comm, "ring")
    assert slow_calls == []
    collectives.allreduce(buf, comm, "native")  # other arguments: slow path once
    collectives.allreduce(buf, comm, "native")
    assert len(slow_calls) == 1


@pytest.mark.mpi(min_size=1)
def test_repeated_call_allocates_nothing(comm):
    for algorithm in collectives.names():
        buf = np.ones(20_000, np.float32)  # 80 kB: one copy per call would show
        # auto first tries every candidate (each builds its plan once).
        for _ in range(3 if algorithm != "auto" else 3 * len(tuning.CANDIDATES) + 8):
            collectives.allreduce(buf, comm, algorithm)
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(20):
                collectives.allreduce(buf, comm, algorithm)
            peak = tracemalloc.get_traced_memory()[1] - before
        finally:
            tracemalloc.stop()
        assert peak < 16_000, f"{algorithm}: {peak} bytes allocated during 20 calls"


@pytest.mark.mpi(min_size=1)
def test_a_new_buffer_of_a_known_signature_needs_no_new_check(comm, monkeypatch):
    from collectives.core import consistency

    first = np.ones(64, np.float64)
    collectives.allreduce(first, comm, "recursive_doubling")
    checks = []
    monkeypatch.setattr(consistency, "exchange_records",
                        lambda *a, **k: checks.append(a) or pytest.fail("checked again"))
    second = np.ones(64, np.float64)
    collectives.allreduce(second, comm, "recursive_doubling")
    assert (second == comm.Get_size()).all() and checks == []


@pytest.mark.parametrize("make, error", [
    (lambda: np.ones((2, 3), np.float32), UnsupportedBuffer),
    (lambda: np.ones(10, np.float32)[::2], UnsupportedBuffer),
    (lambda: np.ones(3, np.complex64), UnsupportedBuffer),
    (lambda: np.ones(3, np.dtype(">f4")), UnsupportedBuffer),
    (lambda: np.ones(3, np.int16), UnsupportedBuffer),
    (lambda: [1.0, 2.0], UnsupportedBuffer),
], ids=["2-D", "strided", "complex", "big-endian", "int16", "list"])
def test_unusable_buffers_are_refused(make, error):
    with pytest.raises(error) as caught:
        collectives.allreduce(make(), MPI.COMM_SELF, "ring")
    assert caught.value.exit_code == 2


@pytest.mark.parametrize("dtype", ["bfloat16", "bool", "uint8", "complex64"])
def test_an_unsupported_torch_dtype_is_refused_with_the_supported_ones(dtype):
    torch = pytest.importorskip("torch")
    with pytest.raises(UnsupportedBuffer) as caught:
        collectives.allreduce(torch.ones(4, dtype=getattr(torch, dtype)), MPI.COMM_SELF)
    assert str(caught.value).startswith(
        f"allreduce does not support dtype torch.{dtype}; use one of torch.float16, "
        "torch.float32, torch.float64, torch.int32, torch.int64")


def test_a_tensor_that_requires_grad_is_refused_in_grad_mode():
    """Written in place behind autograd's back: refused in grad mode (where
    torch refuses in-place changes of a leaf that requires grad), the tensor
    untouched; its .detach() (the same memory), or the call under no_grad
    (tests/test_collectives_buffers.py), is reduced."""
    torch = pytest.importorskip("torch")
    weight = torch.ones(5, requires_grad=True)
    with pytest.raises(UnsupportedBuffer, match="requires grad and grad mode is on"):
        collectives.allreduce(weight, MPI.COMM_SELF)
    assert weight.detach().eq(1).all()
    collectives.allreduce(weight.detach(), MPI.COMM_SELF)
    hidden = weight * 2  # not a leaf, and requires grad: refused too
    with pytest.raises(UnsupportedBuffer, match="requires grad"):
        collectives.allreduce(hidden, MPI.COMM_SELF)


@pytest.mark.mpi(min_size=1)
def test_a_torch_tensor_can_be_resized_after_forget(fresh):
    """The view the all-reduce binds does not make torch's storage
    unresizable (tensor.numpy() would, for good); resized while bound, the
    tensor is bound again (its data pointer or length changed)."""
    torch = pytest.importorskip("torch")
    t = torch.ones(1000)
    collectives.allreduce(t, fresh, "ring")
    collectives.forget(fresh)
    t.resize_(3000)
    t.fill_(1)
    collectives.allreduce(t, fresh, "ring")
    assert t.eq(fresh.Get_size()).all() and t.numel() == 3000
    t.resize_(10)
    t.fill_(2)
    collectives.allreduce(t, fresh, "ring")  # bound to 3000 elements: bound again
    assert t.eq(2 * fresh.Get_size()).all()


def test_a_call_from_another_thread_is_refused_at_thread_funneled():
    import threading

    if MPI.Query_thread() != MPI.THREAD_FUNNELED:  # collectives.runtime's choice, unless
        pytest.skip("MPI runs at another thread level here")  # oversubscribed
    caught = []

    def call() -> None:
        try:
            collectives.allreduce(np.ones(4), MPI.COMM_SELF)
        except collectives.AllreduceError as error:
            caught.append(str(error))

    worker = threading.Thread(target=call, name="worker")
    worker.start()
    worker.join()
    assert caught and caught[0].startswith(
        "allreduce called from thread 'worker', but MPI runs at MPI_THREAD_FUNNELED, where "
        "only the main thread may call it")


def test_read_only_buffer_is_refused():
    buf = np.ones(3, np.float32)
    buf.flags.writeable = False
    with pytest.raises(UnsupportedBuffer, match="read-only"):
        collectives.allreduce(buf, MPI.COMM_SELF)


def test_unknown_op_and_algorithm():
    with pytest.raises(UnknownOp, match="sum, max and min"):
        collectives.allreduce(np.ones(3), MPI.COMM_SELF, op="prod")
    with pytest.raises(UnknownOp, match="MPI.SUM, MPI.MAX, MPI.MIN"):
        collectives.allreduce(np.ones(3), MPI.COMM_SELF, op=MPI.PROD)
    buf = np.ones(3)
    assert collectives.allreduce(buf, MPI.COMM_SELF, op=MPI.MAX) is buf  # MPI ops by value
    with pytest.raises(UnknownAlgorithm, match="choose from"):
        collectives.allreduce(np.ones(3), MPI.COMM_SELF, algorithm="butterfly")


@pytest.mark.mpi(min_size=1)
def test_forget_releases_plans_and_the_next_call_is_checked_again(fresh, monkeypatch):
    from collectives.core import consistency
    from collectives.core.plans import comm_state

    buf = np.ones(100, np.float32)
    collectives.allreduce(buf, fresh, "ring")
    assert comm_state(fresh).plans
    collectives.forget(fresh)  # every rank
    assert not comm_state(fresh).plans
    checks = []
    real = consistency.exchange_records
    monkeypatch.setattr(consistency, "exchange_records",
                        lambda *a, **k: checks.append(1) or real(*a, **k))
    collectives.allreduce(buf, fresh, "ring")
    assert (buf == fresh.Get_size() ** 2).all()
    assert checks == ([1] if fresh.Get_size() > 1 else [])


def test_a_communicator_that_cannot_be_used():
    with pytest.raises(collectives.AllreduceError, match="COMM_NULL: the communicator was freed"):
        collectives.allreduce(np.ones(3), MPI.COMM_NULL)
    freed = MPI.COMM_SELF.Dup()
    freed.Free()
    with pytest.raises(collectives.AllreduceError, match="was freed"):
        collectives.allreduce(np.ones(3), freed)
    with pytest.raises(collectives.AllreduceError, match="intracommunicator .* got a str"):
        collectives.allreduce(np.ones(3), "world")


@pytest.mark.mpi(min_size=2)
def test_two_ranks_on_one_node_exchange_small_buffers_through_shared_memory(pair):
    from collectives.core.plans import comm_state

    if pair is None:
        pytest.skip("ranks 0 and 1 only")
    buf = np.arange(100, dtype=np.float64) * (pair.Get_rank() + 1)
    collectives.allreduce(buf, pair, "recursive_doubling", "max")
    state = comm_state(pair)
    channel = state.channel_named("shm-pair")
    assert channel is not None  # mpiexec on one machine
    plan = state.plan(100, np.dtype(np.float64), "max", collectives.get("recursive_doubling"))
    assert plan.host_only and plan.channel is channel and channel.seq == 1
    np.testing.assert_array_equal(buf, np.arange(100) * 2.0)


@pytest.mark.mpi(min_size=2)
def test_new_signature_while_the_peer_waits_in_shared_memory(pair):
    if pair is None:
        pytest.skip("ranks 0 and 1 only")
    cached = np.ones(10, np.float32)
    collectives.allreduce(cached, pair, "recursive_doubling")
    mine = np.ones(12, np.float32) if pair.Get_rank() == 0 else cached
    with pytest.raises(AllreduceMismatch) as caught:  # both ranks find out
        collectives.allreduce(mine, pair, "recursive_doubling")
    if pair.Get_rank() == 0:  # or rank 1 raised first, and left the communicator
        assert "blocked in blind call" in str(caught.value) \
            or "rank 1 is gone from this communicator (a call of its own failed" \
            in str(caught.value)


@pytest.mark.mpi(min_size=2)
def test_shared_memory_exchange_while_the_peer_waits_in_native(pair):
    if pair is None:
        pytest.skip("ranks 0 and 1 only")
    from collectives.core.plans import comm_state

    small, other = np.ones(10, np.float32), np.ones(20, np.float32)
    collectives.allreduce(small, pair, "recursive_doubling")
    collectives.allreduce(other, pair, "native")
    if pair.Get_rank() == 0:
        with pytest.raises(AllreduceMismatch, match="blocked in blind call"):
            collectives.allreduce(small, pair, "recursive_doubling")
        assert comm_state(pair).peers.blind_calls[1] == 1  # gone, and rank 1 released
    else:  # released by a call that is not its own: the order check says so
        with pytest.raises(AllreduceMismatch, match="waited in MPI_Allreduce for rank 0"):
            collectives.allreduce(other, pair, "native")


@pytest.mark.mpi(min_size=3)
def test_new_signature_while_the_others_run_a_cached_ring_in_the_shared_group(fresh):
    """Rank 0 starts a new signature while the others wait in a cached ring in
    the node's shared window: rank 0 sees them in another blind call, they see
    its check record (a message from a rank that has not finished the ring)."""
    from collectives.core.plans import comm_state

    cached = np.ones(10, np.float32)
    collectives.allreduce(cached, fresh, "ring")
    assert comm_state(fresh).channel_named("shm-group") is not None  # mpiexec on one machine
    mine = np.ones(12, np.float32) if fresh.Get_rank() == 0 else cached
    with pytest.raises(AllreduceMismatch) as caught:
        collectives.allreduce(mine, fresh, "ring")
    if fresh.Get_rank() == 0:  # or a peer that raised first has left the communicator
        assert "blocked in blind call" in str(caught.value) \
            or "is gone from this communicator (a call of its own failed" in str(caught.value)
    elif fresh.Get_rank() == 1:  # waits on rank 0
        assert "received from rank 0 a message of a first-call signature check" \
            in str(caught.value)
    else:  # the record, or the mark of a neighbour that raised first
        assert "first-call signature check" in str(caught.value) \
            or "left the call after an error" in str(caught.value)


@pytest.mark.mpi(min_size=3)
def test_ring_in_the_shared_group_while_a_peer_waits_in_native(fresh):
    """Rank 0 calls a cached MPI_Allreduce while the others run a cached ring
    through the shared window: rank 1 sees rank 0 in another blind call and
    raises, marking itself failed, which rank 2 sees, and so on around the
    ring; each then joins the native call, which releases rank 0."""
    from collectives.core.plans import comm_state

    rank = fresh.Get_rank()
    ring_buf, native_buf = np.ones(10, np.float32), np.ones(20, np.float32)
    collectives.allreduce(ring_buf, fresh, "ring")
    collectives.allreduce(native_buf, fresh, "native")
    if rank != 0:
        why = "blocked in blind call" if rank == 1 else \
            "blocked in blind call|left the call after an error"
        with pytest.raises(AllreduceMismatch, match=why):
            collectives.allreduce(ring_buf, fresh, "ring")
        # Only MPI can release rank 0 (by default the job would be aborted here).
        comm_state(fresh).comm.Allreduce(MPI.IN_PLACE, native_buf)
        with pytest.raises(collectives.AllreduceError, match="use a new communicator"):
            collectives.allreduce(native_buf, fresh, "native")
    else:  # released by calls that are not the others' own: the order check says so
        with pytest.raises(AllreduceMismatch, match="in a different order"):
            collectives.allreduce(native_buf, fresh, "native")


@pytest.mark.mpi(min_size=3)
def test_a_message_from_a_rank_past_the_call_is_left_for_its_own_call(fresh):
    """Waiting in the shared window, a rank looks at the messages that arrive:
    one from a rank whose step counter shows it has finished the call belongs
    to a later call (left alone); the same message from a rank short of the
    call's end means that rank is in another call (AllreduceMismatch)."""
    import time

    from collectives.core.consistency import CHECK_TAG
    from collectives.core.plans import comm_state

    state = comm_state(fresh)
    group, rank = state.channel_named("shm-group"), fresh.Get_rank()
    ctx = state.plan(8, np.dtype(np.float32), "sum", collectives.get("ring")).ctx  # checked
    group.blind_calls[0], group.blind_calls[3] = 1, ctx.tag  # all "inside" one ring call
    end = 1000
    for finished, waited in ((True, 1), (False, 2)):
        if rank == 0:
            group.heads[0][0] = end if finished else 0
            state.comm.send("next call", dest=1, tag=CHECK_TAG)
        state.comm.Barrier()  # the message is on its way before rank 1 waits
        if rank == 1 and finished:
            group.wait(2, waited, ctx, end)  # sees the message, waits on for rank 2
            assert state.comm.recv(source=0, tag=CHECK_TAG) == "next call"
        elif rank == 1:
            with pytest.raises(AllreduceMismatch, match="received from rank 0"):
                group.wait(2, waited, ctx, end)  # rank 2 never publishes step 2
            state.comm.recv(source=0, tag=CHECK_TAG)
        elif rank == 2 and finished:
            time.sleep(0.05)  # rank 1 probes a few times meanwhile
            group.heads[2][0] = 1
        state.comm.Barrier()


@pytest.mark.mpi(min_size=3)
def test_cached_ring_signatures_out_of_order_in_the_shared_group(fresh):
    """Rank 0 runs one cached ring signature, the others another, both through
    the shared window with the same number of steps: the slot tags tell the
    calls apart (rank 0's neighbours raise), the failed rank's mark tells its
    waiting neighbours (everyone raises, nobody hangs), and the window is not
    used again."""
    a, b = np.ones(10, np.float32), np.ones(11, np.float32)
    collectives.allreduce(a, fresh, "ring")
    collectives.allreduce(b, fresh, "ring")
    mine = a if fresh.Get_rank() == 0 else b
    with pytest.raises(AllreduceMismatch, match="same sequence of calls"):
        collectives.allreduce(mine, fresh, "ring")
    with pytest.raises(collectives.AllreduceError, match="new communicator"):
        collectives.allreduce(mine, fresh, "ring")
