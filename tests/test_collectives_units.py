"""Pure logic of the collectives: chunking, schedules, auto's thresholds, records."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collectives import auto, consistency
from collectives.context import chunk_bounds, split
from collectives.recursive_doubling import schedule


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
    roles = {r: schedule(r, size) for r in range(size)}
    pof2 = 1 << (size.bit_length() - 1)
    assert sum(role == "out" for role, _ in roles.values()) == size - pof2
    for r, (role, partners) in roles.items():
        if role == "out":
            assert roles[r + 1][0] == "host" and partners == []
            continue
        assert len(partners) == pof2.bit_length() - 1
        for step, q in enumerate(partners):
            assert roles[q][1][step] == r  # my partner's partner at this step is me


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
    from collectives.plans import placement_of

    assert placement_of(size, oversubscribed, pair, group) == placement
    assert placement in auto.PLACEMENTS
