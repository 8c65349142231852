"""Pure logic of the collectives: chunking, schedules, auto's thresholds, records."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import collectives
from collectives.auto import table as auto
from collectives.core import consistency
from collectives.algorithms.recursive_doubling import roles
from collectives.channels.shm_group import _program
from collectives.channels.shm_pair import _cut, _stages
from collectives.registry import get
from collectives.schedule import (COPY, REDUCE_INCOMING_FIRST, STASH, chunk_bounds, split,
                                  validate)

SCHEDULES = [name for name in collectives.names() if get(name).schedule is not None]


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 10_000), parts=st.integers(1, 64))
def test_chunks_cover_the_range_and_differ_by_at_most_one(n, parts):
    b = chunk_bounds(n, parts)
    sizes = np.diff(b)
    assert b[0] == 0 and b[-1] == n and len(sizes) == parts
    assert sizes.min() >= 0 and sizes.max() - sizes.min() <= 1


@settings(max_examples=200, deadline=None)
@given(lo=st.integers(0, 1000), length=st.integers(0, 1000), pieces=st.integers(1, 40))
def test_split_is_consecutive(lo, length, pieces):
    ranges = split(lo, lo + length, pieces)
    assert len(ranges) == pieces and ranges[0][0] == lo and ranges[-1][1] == lo + length
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


@pytest.mark.parametrize("size", range(1, 17))
def test_recursive_doubling_schedule_pairs_up(size):
    roles_of = {r: roles(r, size) for r in range(size)}
    pof2 = 1 << (size.bit_length() - 1)
    assert sum(role == "out" for role, _ in roles_of.values()) == size - pof2
    for r, (role, partners) in roles_of.items():
        if role == "out":
            assert roles_of[r + 1][0] == "host" and partners == []
            continue
        assert len(partners) == pof2.bit_length() - 1
        for step, q in enumerate(partners):
            assert roles_of[q][1][step] == r  # my partner's partner at this step is me


def simulate(name: str, buffers: list[np.ndarray]) -> list[np.ndarray]:
    """Run every rank's schedule of ``name`` in one process (numpy, sum): what
    any channel must compute, independent of how bytes move."""
    size, n = len(buffers), buffers[0].size
    bufs = [b.copy() for b in buffers]
    schedules = [get(name).schedule(r, size, n) for r in range(size)]
    stash = [dict() for _ in range(size)]
    for k in range(len(schedules[0].rounds)):
        sent = {(a, s.peer): bufs[a][s.lo:s.hi].copy()
                for a, sched in enumerate(schedules) for s in sched.rounds[k].sends}
        for b, sched in enumerate(schedules):
            for r in sched.rounds[k].recvs:
                incoming, mine = sent[(r.peer, b)], bufs[b][r.lo:r.hi]
                if r.action == STASH:
                    stash[b][r.peer] = incoming
                elif r.action == COPY:
                    mine[...] = incoming
                elif r.action == REDUCE_INCOMING_FIRST:
                    mine[...] = incoming + mine
                else:
                    mine[...] = mine + incoming
    for b, sched in enumerate(schedules):
        if sched.stash:
            parts = [stash[b][q] if q != b else bufs[b].copy() for q in range(size)]
            total = parts[0] + parts[1]
            for part in parts[2:]:
                total = total + part
            bufs[b] = total
    return bufs


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 6, 7, 8, 12])
def test_every_schedule_obeys_the_rules_and_reduces_exactly(name, size):
    for n in (0, 1, size - 1, size, size + 1, 97):
        schedules = [get(name).schedule(r, size, n) for r in range(size)]
        validate(schedules, n)
        buffers = [np.arange(n, dtype=np.float64) * (q + 1) + q for q in range(size)]
        results = simulate(name, buffers)
        for q in range(size):
            np.testing.assert_array_equal(results[q], np.sum(buffers, axis=0),
                                          err_msg=f"{name} p={size} n={n} rank {q}")
            assert results[q].tobytes() == results[0].tobytes()


def test_validate_catches_a_broken_schedule():
    good = [get("ring").schedule(r, 3, 9) for r in range(3)]
    broken = list(good)
    broken[1] = type(good[1])(good[1].rounds[:-1])  # one round short
    with pytest.raises(AssertionError, match="numbers of rounds"):
        validate(broken, 9)


def test_channels_serve_the_shapes_they_can_run():
    """The pair serves one exchange per round with the peer (not naive's
    stash), the group ring-shaped rounds only, point-to-point everything."""
    from collectives.channels.shm_group import SharedGroup
    from collectives.channels.shm_pair import SharedPair

    pair = SharedPair.__new__(SharedPair)
    pair.peer = 1
    assert {name for name in SCHEDULES if pair.serves(get(name).schedule(0, 2, 10))} \
        == {"recursive_doubling", "ring", "rabenseifner"}
    group = SharedGroup.__new__(SharedGroup)
    group.left, group.right = 3, 1
    assert {name for name in SCHEDULES if group.serves(get(name).schedule(0, 4, 10))} \
        == {"ring"}


def test_the_pair_pipelines_a_reduce_scatter_with_its_all_gather():
    """Ring at p = 2: both rounds cut together, piece by piece (reduce, then its
    copy back); recursive doubling: one round in slot-sized pieces."""
    n = 3 << 20  # float32: 6 MiB per half
    ring = get("ring").schedule(0, 2, n).rounds
    assert [len(stage) for stage in _stages(list(ring))] == [2]
    steps = _cut(_stages(list(ring))[0], 4)
    assert len(steps) == 2 * 12  # 6 MiB halves in 512 KiB pieces
    assert [action for _, _, action in steps[:2]] == [REDUCE_INCOMING_FIRST, COPY]
    assert steps[1][0] == steps[0][1] and steps[1][1] == steps[0][0]
    rd = get("recursive_doubling").schedule(0, 2, n).rounds
    assert len(_cut(_stages(list(rd))[0], 4)) == 3  # 12 MiB in 4 MiB slots


@pytest.mark.parametrize("size", [3, 4, 5, 8])
def test_the_group_forwards_partial_sums_it_never_needs_again(size):
    """The ring's reduce-scatter partials go straight into the next slot;
    the last (the rank's own reduced chunk) and every copy do not."""
    kinds = [kind for _, _, kind, _, _ in _program(get("ring").schedule(0, size, 100).rounds)]
    assert kinds == [2] * (size - 2) + [1] + [0] * (size - 1)


def test_auto_thresholds_and_override(monkeypatch):
    monkeypatch.delenv("MPIDP_ALLREDUCE_AUTO", raising=False)
    for placement in auto.PLACEMENTS:
        table = auto.THRESHOLDS[placement]
        assert table[-1][0] is None
        for (limit, name), (_, after) in zip(table, table[1:]):
            assert auto.choose(limit, placement) == name
            assert auto.choose(limit + 1, placement) == after
    assert auto.choose(10**12, "pair") == "ring"
    monkeypatch.setenv("MPIDP_ALLREDUCE_AUTO", "naive:100, ring")
    assert auto.choose(100, "cores") == "naive" and auto.choose(101, "pair") == "ring"
    monkeypatch.setenv("MPIDP_ALLREDUCE_AUTO", "ring")
    assert auto.choose(1, "single") == "ring"


@pytest.mark.parametrize("text", ["", "warp", "ring:10", "ring,native", "native:x,ring",
                                  "auto"])
def test_bad_auto_override_is_explained(text):
    with pytest.raises(ValueError, match="MPIDP_ALLREDUCE_AUTO"):
        auto.parse_thresholds(text)


def test_mismatch_message_groups_ranks_and_names_the_field():
    names = ["ring", "native"]
    a = consistency.make_record(10, np.dtype(np.float32), "sum", "ring", "ring", 1024, 7)
    b = consistency.make_record(12, np.dtype(np.float32), "sum", "ring", "ring", 1024, 9)
    table = np.stack([a, a, b, a])
    message = consistency.mismatch_message(table, names)
    assert "differ in length" in message
    assert "ranks 0-1,3: float32[10] sum" in message and "ranks 2: float32[12]" in message
    assert consistency.mismatch_message(np.stack([a, a]), names) is None


def test_tags_are_stable_and_in_range():
    tag = consistency.signature_tag(1000, np.dtype(np.float32), "sum", "ring", 1 << 20, 32767)
    assert tag == consistency.signature_tag(1000, np.dtype(np.float32), "sum", "ring",
                                            1 << 20, 32767)
    assert consistency.FIRST_DATA_TAG <= tag < 32767
    others = {consistency.signature_tag(n, np.dtype(np.float32), "sum", "ring", 1 << 20, 2**29)
              for n in range(1000)}
    assert len(others) == 1000  # distinct signatures, distinct tags


@pytest.mark.parametrize("size, oversubscribed, pair, group, placement", [
    (1, False, False, False, "single"),
    (1, True, False, False, "single"),
    (2, False, True, False, "pair"),
    (2, False, False, False, "cores"),  # two nodes
    (4, False, False, True, "cores"),  # one node, a core each: the ring uses the group
    (4, False, False, False, "cores"),
    (2, True, True, False, "oversubscribed-pair"),
    (4, True, False, True, "oversubscribed"),
    (4, True, False, False, "oversubscribed-nodes"),
])
def test_placement_follows_the_shared_channel_and_the_cores(size, oversubscribed, pair,
                                                            group, placement):
    from collectives.core.plans import placement_of

    assert placement_of(size, oversubscribed, pair, group) == placement
    assert placement in auto.PLACEMENTS


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_native_max_min_share_one_mpi_op_per_op_and_dtype(dtype):
    """``native`` max/min on floats run a user-defined MPI operation, of which
    MPI allows few (mpi4py: 32 live): one per plan, i.e. per length, ended a
    program's 33rd length with MPI_Abort. One per (op, dtype) now, applying
    the special-value rule, freed at MPI_Finalize (free_mpi_ops)."""
    from collectives import MPI
    from collectives.core.combine import free_mpi_ops, mpi_op

    ops = {name: mpi_op(name, np.dtype(dtype), MPI) for name in ("max", "min")}
    for n in range(1, 41):  # as 40 plans of distinct lengths ask for it
        for name, want in (("max", np.maximum), ("min", np.minimum)):
            op = mpi_op(name, np.dtype(dtype), MPI)
            assert op is ops[name]
            a = np.arange(n, dtype=dtype)
            b = np.arange(n, dtype=dtype)[::-1].copy()
            expected = want(a, b)
            op.Reduce_local(a, b)
            assert np.array_equal(b, expected)
    free_mpi_ops()
    assert mpi_op("max", np.dtype(dtype), MPI) is not ops["max"]  # made anew after a free
    free_mpi_ops()
