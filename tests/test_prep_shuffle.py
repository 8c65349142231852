"""Household split, SplitMix64 keys, the distributed sort and rebalancing."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from preprocessing import shuffle


def test_splitmix64_matches_the_reference_outputs():
    # SplitMix64 seeded with 0: the first outputs of the published generator
    # (Steele, Lea & Flood 2014; Vigna's splitmix64.c).
    out = shuffle.draw(np.uint64(0), np.arange(3, dtype=np.uint64))
    assert [hex(int(x)) for x in out] == ["0xe220a8397b1dcdaf", "0x6e789e6aa1b965f4",
                                          "0x6c45d188009454f"]


def test_mix_is_a_bijection_on_a_sample():
    z = np.arange(1 << 16, dtype=np.uint64) * np.uint64(0x10001)
    assert len(np.unique(shuffle.mix(z))) == len(z)


def test_households_stay_together_and_the_share_is_right():
    rng = np.random.default_rng(0)
    households = rng.integers(0, 50_000, size=200_000)
    in_test = shuffle.test_households(households, seed=5, test_fraction=0.2)
    # Same household, same side, whatever the order the records come in.
    order = rng.permutation(len(households))
    again = shuffle.test_households(households[order], seed=5, test_fraction=0.2)
    assert np.array_equal(again, in_test[order])
    per_household = {}
    for h, t in zip(households.tolist(), in_test.tolist()):
        assert per_household.setdefault(h, t) == t
    share = np.mean(list(per_household.values()))
    assert abs(share - 0.2) < 0.01
    other = shuffle.test_households(households, seed=6, test_fraction=0.2)
    assert not np.array_equal(other, in_test)
    assert not shuffle.test_households(households, 5, 0.0).any()


def test_val_is_a_share_of_the_training_households_and_test_does_not_move():
    households = np.arange(40_000)
    split = shuffle.split_households(households, seed=5, test_fraction=0.2, val_fraction=0.1)
    in_test = shuffle.test_households(households, seed=5, test_fraction=0.2)
    assert np.array_equal(split == shuffle.TEST, in_test)  # the same test split
    val = np.mean(split[split != shuffle.TEST] == shuffle.VAL)
    assert abs(val - 0.1) < 0.01  # of the training households, not of all
    assert not shuffle.split_households(households, 5, 0.0, 0.0).any()
    assert (shuffle.split_households(households, 5, 1.0, 0.0) == shuffle.TEST).all()
    only_val = shuffle.split_households(households, 5, 0.0, 0.3)
    assert set(np.unique(only_val)) == {shuffle.TRAIN, shuffle.VAL}


def test_shuffle_keys_are_distinct_and_uniform():
    keys = np.concatenate([shuffle.shuffle_keys(1, f, np.arange(100_000)) for f in range(3)])
    assert len(np.unique(keys)) == len(keys)
    buckets = np.bincount(shuffle.bucket_of(keys, 4), minlength=4)
    assert np.all(np.abs(buckets / len(keys) - 0.25) < 0.01)
    assert not np.array_equal(shuffle.shuffle_keys(2, 0, np.arange(10)),
                              shuffle.shuffle_keys(1, 0, np.arange(10)))


def _records(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    records = np.empty(n, dtype=[("v", np.int32), ("key", np.uint64)])
    records["v"] = rng.integers(0, 1 << 30, n)
    records["key"] = shuffle.draw(np.uint64(seed), rng.integers(0, 1 << 40, n).astype(
        np.uint64))
    return records


@pytest.mark.mpi(min_size=1)
def test_sort_across_ranks_is_a_global_sort(comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    mine = _records(1000 + 37 * rank, seed=rank)  # uneven sizes
    received, order = shuffle.sort_across_ranks(mine, "key", comm)
    local = received[order]
    everything = np.concatenate(comm.allgather(mine))
    expected = np.sort(everything, order="key")
    pieces = comm.allgather(local)
    assert np.array_equal(np.concatenate(pieces), expected)
    # Balanced in expectation: no rank far from n/p.
    assert abs(len(local) - len(everything) / size) < 0.25 * len(everything) / size + 50


@pytest.mark.mpi(min_size=1)
def test_rebalance_moves_rows_to_target_ranges(comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    counts = [5 + 11 * r for r in range(size)]
    offset = sum(counts[:rank])
    total = sum(counts)
    mine = np.arange(offset, offset + counts[rank], dtype=np.int64)
    starts = [min(total, 8 * r) for r in range(size)] + [total]
    got = shuffle.rebalance(mine, offset, starts, comm)
    assert got.tolist() == list(range(starts[rank], starts[rank + 1]))


@pytest.mark.mpi(min_size=1)
def test_exchange_with_empty_ranks(comm):
    rank, size = comm.Get_rank(), comm.Get_size()
    mine = np.arange(10, dtype=np.int64) + 100 * rank if rank == 0 else np.zeros(0, np.int64)
    got = shuffle.exchange(mine, np.full(len(mine), size - 1, dtype=np.int64), comm)
    assert got.tolist() == (list(range(10)) if rank == size - 1 else [])


@st.composite
def _households(draw):
    """Consecutive households (ids need not be sorted), SPORDER 0..255 each."""
    ids = draw(st.lists(st.integers(0, 40), min_size=1, max_size=30))
    rows = []
    for household in ids:
        people = draw(st.lists(st.sampled_from([0, 1, 2, 3, 63, 64, 200, 255]),
                               min_size=1, max_size=6))
        rows += [(household, person, draw(st.integers(0, 2))) for person in people]
    return rows


@settings(max_examples=300)
@given(_households())
def test_repeated_people_counts_every_second_copy(rows):
    """Against a per-record loop: a record repeats a person when an earlier
    record of the same consecutive household has its SPORDER (0: unknown)."""
    from preprocessing.pipeline import repeated_people

    part = np.zeros(len(rows), dtype=[("__hh", np.int64), ("__sp", np.uint8),
                                      ("__file", np.uint16)])
    for i, row in enumerate(rows):
        part[i] = row
    seen, expected = set(), 0
    for i, (household, person, _) in enumerate(rows):
        if i and household != rows[i - 1][0]:
            seen = set()
        if person and person in seen:
            expected += 1
        seen.add(person)
    count, example = repeated_people(part)
    assert count == expected
    if expected:
        household, person, a, b = example
        twins = [f for h, p, f in rows if (h, p) == (household, person)]
        assert person and len(twins) >= 2 and (a, b) == tuple(twins[:2])
    else:
        assert example is None
