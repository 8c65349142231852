"""The order and the split of a prepared file do not tell which household is
which SERIALNO when a household secret keys them.

The attacker of these tests holds the prepared file (its ``seed``,
``test_fraction`` and ``val_fraction`` attributes, the blocks of rows of
equal household key) and the list of serial numbers with each household's
kept persons (what a housing file's NP gives), but not the secret. Before
the fix, SplitMix64 of the stored seed and SERIALNO decided both the split
and the order, and recomputing them named every block of every split.
"""
import argparse
import zipfile

import h5py
import numpy as np
import pytest

from collectives.runtime import MPI
from preprocessing import households, shuffle
from preprocessing.pipeline import prepare
from preprocessing.prep import add_arguments, make_settings
from test_prep_pipeline import pums_zips, reference_keyed_draw

#: Lines of Delaware's 2018 person file read (about 1,500 households).
LINES = 3000
SECRET = bytes(range(100, 132))
SEED = 0  # the default, stored in the file


@pytest.fixture(scope="module")
def delaware(tmp_path_factory):
    """(path of the first LINES records of Delaware, household id per record,
    AGEP per record)."""
    with zipfile.ZipFile(pums_zips() / "csv_pde.zip") as archive:
        text = archive.read("psam_p10.csv").decode()
    lines = text.splitlines(keepends=True)[:LINES + 1]
    path = tmp_path_factory.mktemp("order") / "psam_p10.csv"
    path.write_text("".join(lines))
    header = lines[0].rstrip().split(",")
    serial, age = header.index("SERIALNO"), header.index("AGEP")
    fields = [line.rstrip("\n").split(",") for line in lines[1:]]
    ids = np.array([int(f[serial][:4]) * 10**8 + (f[serial][4:6] == "GQ") * 10**7
                    + int(f[serial][6:]) for f in fields], dtype=np.int64)
    return path, ids, np.array([int(f[age]) for f in fields])


def _prep(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    prepare(MPI.COMM_SELF, make_settings(parser.parse_args([*argv, "--quiet"])), threads=1)


def _blocks(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(key of each household block, in file order; rows of each block)."""
    starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
    return keys[starts], np.diff(np.r_[starts, len(keys)])


def _attack(handle, ids: np.ndarray, kept: np.ndarray) -> dict[str, np.ndarray]:
    """The attacker's SERIALNO id of each household block of each split: the
    split and the order recomputed from the serial numbers and the seed."""
    seed = int(handle.attrs["seed"])
    unique = np.unique(ids[kept])  # households with a kept person (NP and ages)
    split = shuffle.split_households(unique, seed, float(handle.attrs["test_fraction"]),
                                     float(handle.attrs["val_fraction"]))
    guesses = {}
    for code, name in ((shuffle.TRAIN, "train"), (shuffle.VAL, "val"), (shuffle.TEST, "test")):
        chosen = unique[split == code]
        guesses[name] = chosen[np.argsort(shuffle.household_keys(seed, chosen),
                                          kind="stable")]
    return guesses


def test_the_order_names_every_household_without_a_secret(tmp_path, delaware):
    """What the docs say the order reveals without --household-secret: the
    attack names every block (the sizes of the blocks agree throughout)."""
    path, ids, age = delaware
    out = tmp_path / "open.h5"
    _prep([str(path), "--out", str(out)])
    kept = age >= 16
    with h5py.File(out, "r") as handle:
        guesses = _attack(handle, ids, kept)
        for name, guess in guesses.items():
            _, sizes = _blocks(handle[f"{name}/household"][:])
            persons = np.array([np.count_nonzero(ids[kept] == i) for i in guess])
            assert np.array_equal(sizes, persons), name


def test_a_secret_keys_the_split_and_the_order(tmp_path, delaware):
    """With --household-secret the same attack names almost no block, and
    guesses the side of a household no better than chance; the file's order
    is the keyed one (an independent AES of the documented blocks)."""
    path, ids, age = delaware
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    out = tmp_path / "keyed.h5"
    _prep([str(path), "--out", str(out), "--household-secret", str(secret)])
    kept = age >= 16
    unique = np.unique(ids[kept])
    with h5py.File(out, "r") as handle:
        guesses = _attack(handle, ids, kept)
        truth = {}  # the test knows the secret: each block's SERIALNO id
        by_key = dict(zip(households.household_keys(unique, SECRET).tolist(), unique.tolist()))
        for name in guesses:
            block_keys, _ = _blocks(handle[f"{name}/household"][:])
            truth[name] = np.array([by_key[k] for k in block_keys.tolist()])
    total = sum(len(t) for t in truth.values())
    assert total == len(unique) > 1000
    named = sum(int(np.count_nonzero(g[:len(t)] == t[:len(g)]))
                for g, t in zip(guesses.values(), truth.values()))
    assert named < 0.02 * total, f"{named} of {total} households named"
    # the side: of the households the attacker puts in test, a share near the
    # test fraction is there (all of them were, before)
    share = np.isin(guesses["test"], truth["test"]).mean()
    assert share < 0.45, share
    # the keyed order itself, from the cipher: households by their key
    unit = (reference_keyed_draw(SECRET, SEED, unique, b"mpidp-ho") >> np.uint64(11)
            ).astype(np.float64) / 2.0**53
    order_key = reference_keyed_draw(SECRET, SEED, unique, b"mpidp-ho", half=1)
    expected_test = unique[unit < 0.2]
    assert np.array_equal(truth["test"], expected_test[np.argsort(order_key[unit < 0.2])])


def test_the_keyed_order_is_the_same_every_run_and_moves_with_the_seed(tmp_path, delaware):
    """Deterministic for the same inputs, seed and secret; another seed (or
    another secret) gives another split and order."""
    path, _, _ = delaware
    secret, other = tmp_path / "secret", tmp_path / "other"
    secret.write_bytes(SECRET)
    other.write_bytes(SECRET[::-1])
    runs = {"a": [str(secret)], "b": [str(secret)], "seed": [str(secret), "--seed", "5"],
            "other": [str(other)]}
    keys = {}
    for name, extra in runs.items():
        out = tmp_path / f"{name}.h5"
        _prep([str(path), "--out", str(out), "--household-secret", *extra])
        with h5py.File(out, "r") as handle:
            keys[name] = (handle["train/household"][:], handle["train/X"][:])
    assert all(np.array_equal(x, y) for x, y in zip(keys["a"], keys["b"]))
    # another seed: another split (other households in train) and another order
    assert set(keys["seed"][0].tolist()) != set(keys["a"][0].tolist())
    assert not np.array_equal(keys["seed"][1][:50], keys["a"][1][:50])
    assert not np.array_equal(keys["other"][1][:50], keys["a"][1][:50])


def test_only_a_given_secret_keys_the_order():
    """A secret prep drew itself keys the household keys only (the seed
    orders the rows, as before); a given one, of any length, keys both."""
    assert households.order_key(households.new_secret(), 0) is None
    assert households.order_key(b"", 0) is None
    given = households.order_key(SECRET, 3)
    assert given is not None and given != households.order_key(SECRET, 4)
    ids = np.array([0, 1, 2, -1, 2**62], dtype=np.int64)
    for purpose, tag in (("household", b"mpidp-ho"), ("record", b"mpidp-rw")):
        got = households.keyed_draw(given, ids, purpose)
        for half in (0, 1):
            assert np.array_equal(got[:, half], reference_keyed_draw(SECRET, 3, ids, tag, half))
    split, keys = shuffle.split_and_household_keys(ids, 3, 0.2, 0.1, given)
    assert np.array_equal(split, shuffle.split_households(ids, 3, 0.2, 0.1, given))
    assert np.array_equal(keys, shuffle.household_keys(3, ids, given))
    assert not np.array_equal(keys, shuffle.household_keys(3, ids))  # SplitMix64's
