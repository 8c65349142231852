"""Streaming copies into the shared pair, and the per-call choice between them and cached ones.

Serial: the streaming copy kernel against numpy, the chooser's rules, the
setting, and rank 0's decision word. On ranks 0 and 1 (a pair sharing
memory): every setting gives exact results through the ring and recursive
doubling, the streaming path really runs on both ranks when asked, and
ranks copying differently (per call, or one streaming and one not) agree.
"""
import numpy as np
import pytest

import collectives
from collectives.channels import copy_mode, shm_pair, streaming
from collectives.channels.copy_mode import CACHED, DECISION, STREAMING, Chooser, PairChoices, PairCopyMode
from collectives.errors import AllreduceError
from collectives.core.plans import comm_state

needs_streaming = pytest.mark.skipif(not streaming.available(),
                                     reason="streaming stores need x86-64 and Numba")


@needs_streaming
@pytest.mark.parametrize("length", [0, 1, 7, 8, 9, 4095, 65536 + 3])
@pytest.mark.parametrize("offset", [0, 1, 4])
def test_streaming_copy_equals_the_source(length, offset):
    rng = np.random.default_rng(length + offset)
    source = rng.integers(0, 256, length + offset, dtype=np.uint8)[offset:]
    window = np.zeros(length + 64, dtype=np.uint8)
    target = window[8:8 + length]
    streaming.streaming_copy(target, source)()
    np.testing.assert_array_equal(target, source)
    assert not window[:8].any() and not window[8 + length:].any(), "wrote outside the target"


@needs_streaming
def test_streaming_copy_rejects_mismatched_arrays():
    with pytest.raises(ValueError, match="uint8"):
        streaming.streaming_copy(np.zeros(8, np.uint8), np.zeros(9, np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        streaming.streaming_copy(np.zeros(2, np.float32), np.zeros(2, np.float32))


def test_setting_reads_the_environment(monkeypatch):
    monkeypatch.delenv("MPIDP_ALLREDUCE_STREAMING", raising=False)
    assert copy_mode.setting() == "auto"
    for text, expected in (("on", "on"), ("OFF", "off"), ("1", "on"), ("0", "off"),
                           (" auto ", "auto")):
        monkeypatch.setenv("MPIDP_ALLREDUCE_STREAMING", text)
        assert copy_mode.setting() == expected
    monkeypatch.setenv("MPIDP_ALLREDUCE_STREAMING", "sometimes")
    with pytest.raises(AllreduceError, match="auto, on or off"):
        copy_mode.setting()


def run_calls(chooser: Chooser, seconds: dict, calls: int) -> list[int]:
    """Feed ``calls`` calls whose duration depends on the mode; the modes used."""
    used = []
    for _ in range(calls):
        mode = chooser.next_mode()
        used.append(mode)
        chooser.record(mode, seconds[mode])
    return used


def test_chooser_switches_to_the_faster_mode_and_trials_within_budget():
    chooser = Chooser(CACHED, first_gap=3, min_gap=8, max_gap=128, budget=0.05)
    used = run_calls(chooser, {CACHED: 4.0, STREAMING: 1.0}, 200)
    assert used[:3] == [CACHED] * 3 and used[3] == STREAMING, "first trial on the 4th call"
    assert chooser.mode == STREAMING and chooser.switches == 1
    # Cached was 4x slower: trials of it every (4 - 1) / 0.05 = 60 calls.
    trials = [i for i, mode in enumerate(used) if mode == CACHED and i > 3]
    assert trials == [64, 125, 186]
    time_on_trials = 3.0 * len(trials) / (len(used) - 4)
    assert time_on_trials < 0.06


def test_chooser_keeps_a_mode_that_wins_trials_and_caps_the_gap():
    chooser = Chooser(CACHED, min_gap=8, max_gap=16, budget=0.05)
    used = run_calls(chooser, {CACHED: 1.0, STREAMING: 10.0}, 100)
    assert chooser.mode == CACHED and chooser.switches == 0
    trials = [i for i, mode in enumerate(used) if mode == STREAMING]
    assert trials[0] == 3 and all(b - a == 17 for a, b in zip(trials, trials[1:]))


def test_chooser_reacts_to_a_lasting_slowdown_not_to_one_slow_call():
    chooser = Chooser(CACHED, first_gap=80)
    for _ in range(5):
        chooser.record(CACHED, 1.0)
    chooser.record(CACHED, 3.0)  # one slow call: noise
    assert chooser.next_mode() == CACHED
    chooser.record(CACHED, 1.0)
    chooser.record(CACHED, 3.0)
    chooser.record(CACHED, 3.0)  # two in a row: the host changed something
    assert chooser.next_mode() == STREAMING
    chooser.record(STREAMING, 1.5)
    assert chooser.mode == STREAMING
    assert chooser.ratio == pytest.approx(2.0)  # cached 3.0 against streaming 1.5


def test_chooser_takes_a_much_faster_call_as_the_new_estimate():
    chooser = Chooser(CACHED)
    chooser.record(CACHED, 4.0)
    chooser.record(CACHED, 1.0)
    assert chooser.estimate[CACHED] == 1.0
    chooser.record(CACHED, 1.1)
    assert chooser.estimate[CACHED] == pytest.approx(0.75 * 1.0 + 0.25 * 1.1)


@needs_streaming
def test_rank_0_publishes_each_calls_mode_and_rank_1_only_reads():
    head = memoryview(bytearray(64)).cast("q")
    shared = PairChoices()
    deciding = PairCopyMode(head, 0, tag=21, choice="on", shared=shared)
    following = PairCopyMode(head, 1, tag=21, choice="on", shared=PairChoices())
    deciding.begin()
    assert head[DECISION] == deciding.streaming_word == 2 * 21 + 1
    head[DECISION] = 7
    following.begin()
    following.end(1.0)
    assert head[DECISION] == 7 and following.chooser is None
    off = PairCopyMode(head, 0, tag=21, choice="auto", shared=shared)
    off.begin()  # a new automatic plan starts cached, the pair's default
    assert head[DECISION] == 2 * 21 and shared.calls == [1, 1]
    off.end(1.0)
    assert shared.mode == off.chooser.mode == CACHED  # each call's outcome is the pair's
    shared.mode = STREAMING  # as if the pair's last choice had been to stream
    inherited = PairCopyMode(head, 0, tag=5, choice="auto", shared=shared)
    assert inherited.chooser.mode == STREAMING and inherited.chooser.countdown == 3


# ---------------------------------------------------------------- on ranks 0 and 1

def pair_of(comm):
    """Ranks 0 and 1 of ``comm`` as a communicator (None on the others)."""
    from mpi4py import MPI

    two = comm.Split(0 if comm.Get_rank() < 2 else MPI.UNDEFINED, comm.Get_rank())
    return None if two == MPI.COMM_NULL else two


def count_streaming_copies(monkeypatch) -> list[int]:
    """Wrap every streaming copy runner built from now on; [runs] counts their calls."""
    runs = [0]
    original = streaming.streaming_copy

    def counted(dst, src):
        run = original(dst, src)

        def counting() -> None:
            runs[0] += 1
            run()

        return counting

    monkeypatch.setattr(streaming, "streaming_copy", counted)
    return runs


def reduce_and_check(two, algorithm: str, calls: int = 3) -> None:
    """Exact sums of small integers through ``two``, several lengths and dtypes."""
    rank = two.Get_rank()
    for dtype in (np.float32, np.float64, np.int32, np.float16, np.int64):
        for n in (1, 301, 40_001):
            index = np.arange(n)
            expected = ((index % 13) + (index % 13 + 1)).astype(dtype)
            for call in range(calls):
                buf = (index % 13 + rank).astype(dtype)
                collectives.allreduce(buf, two, algorithm)
                np.testing.assert_array_equal(buf, expected,
                                              err_msg=f"{algorithm} {dtype} n={n} call {call}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("setting", ["on", "off", "auto"])
@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling"])
def test_every_setting_reduces_exactly_through_the_pair(comm, setting, algorithm, monkeypatch):
    two = pair_of(comm)
    if two is None:
        pytest.skip("ranks 0 and 1 only")
    try:
        if not streaming.available():
            pytest.skip("streaming stores need x86-64 and Numba")
        pair = comm_state(two).channel_named("shm-pair")
        assert pair is not None, "ranks 0 and 1 on one node share a pair"
        monkeypatch.setenv("MPIDP_ALLREDUCE_STREAMING", setting)
        monkeypatch.setattr(shm_pair, "STREAMING_MIN_PIECE_BYTES", 64)  # small buffers stream too
        runs = count_streaming_copies(monkeypatch)
        reduce_and_check(two, algorithm)
        if pair.sleep:  # more ranks than cores (3-4 ranks here): the bytes never change core
            assert runs[0] == 0, "ranks sharing a core streamed"
        elif setting == "on":
            assert runs[0] > 0, "no streaming copy ran"
        elif setting == "off":
            assert runs[0] == 0
    finally:
        collectives.forget()
        two.Free()


@pytest.mark.mpi(min_size=2)
def test_ranks_copying_differently_still_agree(comm, monkeypatch):
    """Rank 0 streams and rank 1 never does; then rank 0 alternates the mode
    every call (rank 1 follows its word, late by a copy at times)."""
    two = pair_of(comm)
    if two is None:
        pytest.skip("ranks 0 and 1 only")
    rank = two.Get_rank()
    try:
        # With more ranks than cores the pair would sleep and never stream: it spins here.
        comm_state(two).channel_named("shm-pair").sleep = False  # before any plan: plans bind the waiting mode
        monkeypatch.setattr(shm_pair, "STREAMING_MIN_PIECE_BYTES", 64)
        monkeypatch.setenv("MPIDP_ALLREDUCE_STREAMING", "on" if rank == 0 else "off")
        for algorithm in ("ring", "recursive_doubling"):
            reduce_and_check(two, algorithm)
        collectives.forget(two)

        class Alternating(Chooser):
            def next_mode(self) -> int:
                self.mode = 1 - self.mode
                return self.mode

        monkeypatch.setattr(copy_mode, "Chooser", Alternating)
        monkeypatch.setenv("MPIDP_ALLREDUCE_STREAMING", "auto")
        runs = count_streaming_copies(monkeypatch)
        for algorithm in ("ring", "recursive_doubling"):
            reduce_and_check(two, algorithm, calls=6)
        assert runs[0] > 0, f"rank {rank} never streamed while rank 0 alternated"
        choices = comm_state(two).channel_named("shm-pair").choices
        if rank == 0:
            assert choices.calls[CACHED] > 0 and choices.calls[STREAMING] > 0
    finally:
        collectives.forget()
        two.Free()
