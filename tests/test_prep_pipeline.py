"""mpidp prep on real PUMS files, in process, over the ranks of the test job.

Every test compares the output with an independent computation from the
raw CSV text (polars reading every column as text, categories matched by
the feature *names*), so the integer look-up tables of the pipeline are not
checked against themselves.
"""
import argparse
import hashlib
import io
import json
import os
import zipfile
from pathlib import Path

import h5py
import numpy as np
import polars as pl
import pytest

from preprocessing import h5write, households, shuffle
from preprocessing.h5format import read_info
from preprocessing.errors import PrepError
from preprocessing.pipeline import prepare
from preprocessing.prep import add_arguments, make_settings

SEED = 11


def pums_zips() -> Path:
    env = os.environ.get("MPIDP_PUMS_DIR")
    root = Path(env) if env else Path(__file__).resolve().parents[2] / "shared/data/pums"
    path = root / "acs2018_1yr_person_zips"
    if not path.is_dir():
        pytest.fail(f"real PUMS files not found in {path}; set MPIDP_PUMS_DIR to the folder "
                    "holding acs2018_1yr_person_zips/")
    return path


def _member_text(zip_path: Path) -> bytes:
    with zipfile.ZipFile(zip_path) as archive:
        return archive.read(next(n for n in archive.namelist() if n.endswith(".csv")))


def _dirty_copy(zip_path: Path, out: Path) -> dict[str, int]:
    """The zip's CSV as a plain file with damaged records every 97 lines;
    returns how many records each kind of damage should drop."""
    lines = _member_text(zip_path).decode().splitlines(keepends=True)
    header = lines[0].rstrip("\n").split(",")
    age, schl, sex = (header.index(c) for c in ("AGEP", "SCHL", "SEX"))
    expected = {"non_numeric:AGEP": 0, "invalid:SCHL": 0, "blank:SEX": 0}
    for i in range(1, len(lines), 97):
        fields = lines[i].rstrip("\n").split(",")
        adult = int(fields[age]) >= 16
        kind = (i // 97) % 3
        if kind == 0:
            fields[age] = "4O"
            expected["non_numeric:AGEP"] += 1
        elif kind == 1 and adult:
            fields[schl] = "27"
            expected["invalid:SCHL"] += 1
        elif kind == 2 and adult:
            fields[sex] = ""
            expected["blank:SEX"] += 1
        lines[i] = ",".join(fields) + "\n"
    out.write_text("".join(lines))
    return expected


@pytest.fixture
def secret_file(comm, shared_tmp) -> str:
    """A --household-secret file shared by the ranks (the same keys every run)."""
    path = shared_tmp / "household.secret"
    if comm.Get_rank() == 0:
        path.write_bytes(bytes(range(32)))
    comm.Barrier()
    return str(path)


def _settings(argv: list[str]):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return make_settings(parser.parse_args(argv))


def _run(comm, argv: list[str]):
    """prepare() on ``comm`` with a command line (rank 0 checks, broadcasts)."""
    settings = _settings(argv) if comm.Get_rank() == 0 else None
    return prepare(comm, comm.bcast(settings, root=0), threads=1, version="test")


@pytest.fixture
def inputs(comm, shared_tmp):
    """Two zips and a plain CSV (split into byte ranges) with damaged records."""
    zips = pums_zips()
    plain = shared_tmp / "psam_p44_dirty.csv"
    expected = _dirty_copy(zips / "csv_pri.zip", plain) if comm.Get_rank() == 0 else None
    expected = comm.bcast(expected, root=0)
    return [str(zips / "csv_pde.zip"), str(plain), str(zips / "csv_pnd.zip")], expected


def _raw_frame(paths: list[str]) -> pl.DataFrame:
    """Every record of the inputs, as text, with its file index and row number."""
    frames = []
    for index, path in enumerate(paths):
        data = _member_text(Path(path)) if path.endswith(".zip") else Path(path).read_bytes()
        frame = pl.read_csv(io.BytesIO(data), infer_schema=False)
        frames.append(frame.with_columns(pl.lit(index).alias("__file"),
                                         pl.int_range(pl.len()).alias("__row")))
    return pl.concat(frames)


def reference_keyed_draw(secret: bytes, seed: int, ids: np.ndarray, tag: bytes,
                         half: int = 0) -> np.ndarray:
    """The split's and the order's numbers under a given secret, as the docs
    define them (docs/preprocessing.md, step 4), from the cipher itself:
    AES-256 of (id as 8 little-endian bytes, ``tag``) keyed with SHA-256 of
    ``mpidp-household-order``, the seed (8 bytes) and the secret, bytes 0-7
    (``half`` 0) or 8-15 (``half`` 1) read as a little-endian uint64."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    key = hashlib.sha256(b"mpidp-household-order" + seed.to_bytes(8, "little")
                         + secret).digest()
    encrypt = Cipher(algorithms.AES(key), modes.ECB()).encryptor()
    out = [encrypt.update(int(i).to_bytes(8, "little") + tag)[8 * half:8 * half + 8]
           for i in np.asarray(ids).astype(np.uint64).tolist()]
    return np.array([int.from_bytes(b, "little") for b in out], dtype=np.uint64)


def reference_order(secret: bytes | None, seed: int, household: np.ndarray,
                    test_fraction: float, val_fraction: float,
                    records: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(split, household key, record key) per record of households ``household``
    and record ids ``records`` (file * 2^40 + row): SplitMix64 of the seed
    without a secret (preprocessing/shuffle.py, tested against the published
    generator), else :func:`reference_keyed_draw`."""
    if secret is None:
        split = shuffle.split_households(household, seed, test_fraction, val_fraction)
        return (split, shuffle.household_keys(seed, household),
                shuffle.draw(shuffle.stream_seed(seed, "shuffle"), records))
    unique, inverse = np.unique(household, return_inverse=True)
    u = (reference_keyed_draw(secret, seed, unique, b"mpidp-ho") >> np.uint64(11)
         ).astype(np.float64)[inverse] / 2.0**53
    split = np.where(u < test_fraction, shuffle.TEST,
                     np.where(u < test_fraction + val_fraction * (1 - test_fraction),
                              shuffle.VAL, shuffle.TRAIN)).astype(np.uint8)
    return (split, reference_keyed_draw(secret, seed, unique, b"mpidp-ho", 1)[inverse],
            reference_keyed_draw(secret, seed, records, b"mpidp-rw"))


def _expected(paths, encoding: dict, seed: int, test_fraction: float,
              secret: bytes = bytes(32), val_fraction: float = 0.1, keyed: bool = False):
    """(train X, train y, test X, test y, val X, val y, train, test and val
    household keys) computed independently from the text, the rows kept and
    each one's split (shuffle.TRAIN, VAL, TEST); ``keyed``: ``secret`` was
    given as --household-secret, so it keys the split and the order too."""
    raw = _raw_frame(paths)
    age = raw["AGEP"].cast(pl.Int64, strict=False)
    sex_ok = raw["SEX"].is_not_null()
    schl = raw["SCHL"]
    schl_ok = schl.is_null() | schl.cast(pl.Int64, strict=False).is_between(1, 24)
    keep = (age >= 16).fill_null(False) & sex_ok & schl_ok
    rows = raw.filter(keep)
    serial = rows["SERIALNO"]
    household = (serial.str.slice(0, 4).cast(pl.Int64) * 10**8
                 + (serial.str.slice(4, 2) == "GQ").cast(pl.Int64) * 10**7
                 + serial.str.slice(6).cast(pl.Int64)).to_numpy()
    files, row_numbers = rows["__file"].to_numpy(), rows["__row"].to_numpy()
    ids = files.astype(np.uint64) * np.uint64(1 << 40) + row_numbers.astype(np.uint64)
    # households in the order of their keys, each one's persons together
    split, house_keys, keys = reference_order(secret if keyed else None, seed, household,
                                              test_fraction, val_fraction, ids)
    columns = []
    for spec in encoding["features"]:
        name = spec["name"]
        if spec["kind"] == "numeric":
            values = rows[name].cast(pl.Float64).to_numpy()
            columns.append((values - spec["mean"]) / spec["std"])
        else:
            for category in spec["categories"]:
                text = rows[name]
                hit = text.is_null() if category == "blank" else (text == category)
                columns.append(hit.fill_null(False).to_numpy().astype(np.float64))
    X = np.stack(columns, axis=1).astype(np.float32)
    y = (rows["ESR"] == "1").fill_null(False).to_numpy().astype(np.int8)
    out, hashed = [], []
    # group columns, from the text: codes as written, AGEP banded by hand
    age_band = np.select([age_of < 16 for age_of in [rows["AGEP"].cast(pl.Int64).to_numpy()]]
                         + [rows["AGEP"].cast(pl.Int64).to_numpy() >= b
                            for b in (75, 65, 55, 45, 35, 25)],
                         [0, 75, 65, 55, 45, 35, 25], default=16)
    group_values = {"SEX": rows["SEX"].cast(pl.Int64).to_numpy(),
                    "RAC1P": rows["RAC1P"].cast(pl.Int64).to_numpy(),
                    "ST": rows["ST"].cast(pl.Int64).to_numpy(), "AGEP": age_band}
    groups = {}
    for name, mask in (("train", split == shuffle.TRAIN), ("test", split == shuffle.TEST),
                       ("val", split == shuffle.VAL)):
        chosen = np.flatnonzero(mask)
        order = chosen[np.lexsort((keys[chosen], household[chosen], house_keys[chosen]))]
        out += [X[order], y[order]]
        hashed.append(households.household_keys(household[order], secret))
        groups[name] = {g: values[order] for g, values in group_values.items()}
    _expected.groups = groups  # the group columns of the last call, per split
    return out + hashed, rows, split


@pytest.mark.mpi(min_size=1)
def test_real_files_match_an_independent_encoding(comm, shared_tmp, inputs, secret_file):
    paths, damaged = inputs
    out = str(shared_tmp / "pums.h5")
    report = _run(comm, [*paths, "--out", out, "--seed", str(SEED), "--household-secret",
                         secret_file])
    if comm.Get_rank() != 0:
        return
    with h5py.File(out, "r") as handle:
        attrs = dict(handle.attrs)
        got = [handle[k][:] for k in ("train/X", "train/y", "test/X", "test/y", "val/X",
                                      "val/y", "train/household", "test/household",
                                      "val/household")]
    encoding = json.loads(attrs["encoding"])
    (train_x, train_y, test_x, test_y, val_x, val_y, train_h, test_h, val_h), rows, split = \
        _expected(paths, encoding, SEED, 0.2, bytes(range(32)), keyed=True)
    # Statistics: the training split's mean and population std of AGEP (val excluded).
    train_age = rows["AGEP"].cast(pl.Float64).to_numpy()[split == shuffle.TRAIN]
    agep = encoding["features"][0]
    assert agep["mean"] == pytest.approx(train_age.mean(), rel=1e-12)
    assert agep["std"] == pytest.approx(train_age.std(), rel=1e-12)
    # Same rows, in the order of the shuffle keys.
    np.testing.assert_allclose(got[0], train_x, atol=1e-6)
    np.testing.assert_allclose(got[2], test_x, atol=1e-6)
    np.testing.assert_allclose(got[4], val_x, atol=1e-6)
    # The group columns: each row's SEX, RAC1P, ST and AGEP band, labelled.
    with h5py.File(out, "r") as handle:
        for split, expected_groups in _expected.groups.items():
            assert set(handle[f"{split}/groups"]) == set(expected_groups)
            for name, values in expected_groups.items():
                assert np.array_equal(handle[f"{split}/groups/{name}"][:], values), name
    described = json.loads(attrs["groups"])
    assert described["SEX"]["labels"] == {"1": "Male", "2": "Female"}
    assert described["ST"]["labels"]["10"] == "Delaware/DE" and not described["ST"]["feature"]
    assert described["AGEP"]["labels"]["25"] == "25-34" and described["AGEP"]["feature"]
    assert attrs["group"] == "RAC1P"
    assert np.array_equal(got[1], train_y) and np.array_equal(got[3], test_y)
    assert np.array_equal(got[5], val_y)
    assert got[0].dtype == np.float32 and got[1].dtype == np.int8
    total = len(test_y) + len(train_y) + len(val_y)
    assert 0.17 < len(test_y) / total < 0.23
    assert 0.07 < len(val_y) / (len(val_y) + len(train_y)) < 0.13  # 0.1 of training rows
    # Household keys: the keyed hash of each row's SERIALNO, households consecutive.
    assert np.array_equal(got[6], train_h) and np.array_equal(got[7], test_h)
    assert np.array_equal(got[8], val_h)
    assert got[6].dtype == np.uint64
    for keys in (got[6], got[7], got[8]):
        starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
        assert len(np.unique(keys)) == len(starts)  # no household split in two
    assert not set(got[8]) & (set(got[6]) | set(got[7]))  # nor on two sides
    assert json.loads(attrs["households"]) == {
        "train": len(np.unique(got[6])), "val": len(np.unique(got[8])),
        "test": len(np.unique(got[7]))}
    # Attributes of the contract (preprocessing/h5format.py).
    assert attrs["format"] == "mpidp" and attrs["format_version"] == 2
    assert attrs["task"] == "employment" and attrs["n_classes"] == 2
    names = json.loads(attrs["feature_names"])
    assert len(names) == got[0].shape[1] == 99 and names[0] == "AGEP"
    assert attrs["encoding_fingerprint"] == hashlib.sha256(attrs["encoding"].encode()).hexdigest()
    assert attrs["seed"] == SEED and attrs["test_fraction"] == 0.2
    assert attrs["val_fraction"] == 0.1
    assert attrs["created_by"] == "mpidp test"
    drops = json.loads(attrs["drop_counts"])
    assert {k: v for k, v in drops.items() if k != "universe"} == damaged
    raw_rows = 9123 + 10489 + 7876
    assert drops["universe"] + sum(damaged.values()) + report.kept == raw_rows
    sources = json.loads(attrs["sources"])
    assert [s["rows"] for s in sources] == [9123, 10489, 7876]
    for source, path in zip(sources, paths):
        assert source["file"] == os.path.basename(path)
        assert source["sha256"] == hashlib.sha256(Path(path).read_bytes()).hexdigest()
    assert sources[0]["member"] == "psam_p10.csv" and sources[1]["member"] is None


def _sha256(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("check", [[], ["--check-fields"]], ids=["default", "check-fields"])
def test_same_bytes_for_any_number_of_ranks(comm, shared_tmp, inputs, check, secret_file):
    """The whole job, rank 0 alone and the other ranks together all write
    byte-identical files (sizes p, 1 and p - 1: 1 to 4 over the suite), given
    the same household secret."""
    paths, _ = inputs
    rank, size = comm.Get_rank(), comm.Get_size()
    argv = [*paths, "--seed", "3", "--test-fraction", "0.25", *check,
            "--household-secret", secret_file]
    _run(comm, [*argv, "--out", str(shared_tmp / "all.h5")])
    part = comm.Split(0 if rank == 0 else 1, rank)
    name = "alone.h5" if rank == 0 else "others.h5"
    _run(part, [*argv, "--out", str(shared_tmp / name)])
    part.Free()
    comm.Barrier()
    if rank == 0:
        reference = _sha256(str(shared_tmp / "all.h5"))
        assert _sha256(str(shared_tmp / "alone.h5")) == reference
        if size > 1:
            assert _sha256(str(shared_tmp / "others.h5")) == reference


@pytest.mark.mpi(min_size=1)
def test_like_reuses_the_encoding(comm, shared_tmp):
    zips = pums_zips()
    first, second = str(shared_tmp / "de.h5"), str(shared_tmp / "nd.h5")
    _run(comm, [str(zips / "csv_pde.zip"), "--out", first])
    _run(comm, [str(zips / "csv_pnd.zip"), "--out", second, "--like", first])
    if comm.Get_rank() != 0:
        return
    with h5py.File(first, "r") as a, h5py.File(second, "r") as b:
        assert b.attrs["encoding"] == a.attrs["encoding"]
        assert b.attrs["encoding_fingerprint"] == a.attrs["encoding_fingerprint"]
        assert b.attrs["feature_names"] == a.attrs["feature_names"]
        encoding = json.loads(b.attrs["encoding"])
        got = b["train/X"][:]
    (train_x, *_), _, _ = _expected([str(zips / "csv_pnd.zip")], encoding, 0, 0.2)
    np.testing.assert_allclose(got, train_x, atol=1e-6)  # DE's mean and std, ND's rows


@pytest.mark.mpi(min_size=1)
def test_household_keys_are_random_per_run_unless_a_secret_is_given(comm, shared_tmp,
                                                                    secret_file):
    """Without --household-secret the keys differ between runs (the secret is
    drawn and forgotten) and the rows do not (the seed orders them); with it,
    keys and rows are the same every run, the rows in an order of their own
    (the secret keys the split and the order too)."""
    nd = str(pums_zips() / "csv_pnd.zip")
    names = ("r1.h5", "r2.h5", "s1.h5", "s2.h5")
    for name in names:
        extra = ["--household-secret", secret_file] if name.startswith("s") else []
        _run(comm, [nd, "--out", str(shared_tmp / name), *extra])
    if comm.Get_rank() != 0:
        return
    files = {name: h5py.File(shared_tmp / name, "r") for name in names}
    try:
        keys = {name: f["train/household"][:] for name, f in files.items()}
        assert not np.array_equal(keys["r1.h5"], keys["r2.h5"])
        assert np.array_equal(keys["s1.h5"], keys["s2.h5"])
        rows = {name: f["train/X"][:] for name, f in files.items()}
        assert np.array_equal(rows["r1.h5"], rows["r2.h5"])
        assert np.array_equal(rows["s1.h5"], rows["s2.h5"])
        assert not np.array_equal(rows["r1.h5"][:50], rows["s1.h5"][:50])
        # the same grouping of rows whatever the drawn secret
        for a, b in (("r1.h5", "r2.h5"), ("s1.h5", "s2.h5")):
            assert np.array_equal(keys[a][1:] != keys[a][:-1], keys[b][1:] != keys[b][:-1])
        serials = set()
        for line in _member_text(Path(nd)).decode().splitlines()[1:]:
            serial = line.split(",")[1]  # e.g. 2018HU0000123 -> the pipeline's id
            serials.add(int(serial[:4]) * 10**8 + (serial[4:6] == "GQ") * 10**7
                        + int(serial[6:]))
        assert not serials & set(keys["s1.h5"].astype(np.int64).tolist())  # not the serial
    finally:
        for f in files.values():
            f.close()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("compression", ["gzip:1"])
def test_compressed_output_has_the_same_rows(comm, shared_tmp, compression, secret_file):
    zips = pums_zips()
    plain, packed = str(shared_tmp / "plain.h5"), str(shared_tmp / "packed.h5")
    argv = [str(zips / "csv_pnd.zip"), str(zips / "csv_pde.zip"), "--household-secret",
            secret_file]
    _run(comm, [*argv, "--out", plain])
    _run(comm, [*argv, "--out", packed, "--compression", compression])
    if comm.Get_rank() == 0:
        with h5py.File(plain, "r") as a, h5py.File(packed, "r") as b:
            assert b["train/X"].compression == "gzip"
            for key in ("train/X", "train/y", "val/X", "val/y", "test/X", "test/y",
                        "train/household", "val/household", "test/household"):
                assert np.array_equal(a[key][:], b[key][:]), key
        assert os.path.getsize(packed) < os.path.getsize(plain) / 5


@pytest.mark.mpi(min_size=1)
def test_a_failed_write_leaves_nothing_behind(comm, shared_tmp, monkeypatch):
    zips = pums_zips()
    out = shared_tmp / "out.h5"
    if comm.Get_rank() == 0:  # an earlier output (prep replaces no other file)
        with h5py.File(out, "w") as f:
            f.attrs.update(format="mpidp", result="the previous result")
    comm.Barrier()
    last = comm.Get_size() - 1

    def failing(fd, layout, name, first_row, data):
        raise OSError(28, "No space left on device")

    if comm.Get_rank() == last:
        monkeypatch.setattr(h5write, "write_rows", failing)
    with pytest.raises(PrepError, match="out.h5: cannot write the output: No space left"):
        _run(comm, [str(zips / "csv_pnd.zip"), "--out", str(out)])
    comm.Barrier()
    if comm.Get_rank() == 0:
        assert sorted(os.listdir(shared_tmp)) == ["out.h5"]
        with h5py.File(out, "r") as f:
            assert f.attrs["result"] == "the previous result" and not list(f)


@pytest.mark.mpi(min_size=1)
def test_too_many_invalid_records_is_an_error_naming_the_line(comm, shared_tmp, inputs):
    paths, _ = inputs
    with pytest.raises(PrepError) as error:
        _run(comm, [*paths, "--out", str(shared_tmp / "x.h5"), "--max-invalid-share", "0.005"])
    assert error.value.collective
    assert str(error.value).startswith(
        f"{paths[1]}, line 2: AGEP is '4O', not a number; ")
    assert "more than --max-invalid-share 0.005" in str(error.value)
    comm.Barrier()
    assert not (shared_tmp / "x.h5").exists()


@pytest.mark.mpi(min_size=1)
def test_income_task_on_real_files(comm, shared_tmp):
    zips = pums_zips()
    out = str(shared_tmp / "income.h5")
    report = _run(comm, [str(zips / "csv_pnh.zip"), "--out", out, "--task", "income"])
    if comm.Get_rank() != 0:
        return
    raw = _raw_frame([str(zips / "csv_pnh.zip")])
    num = {c: raw[c].cast(pl.Int64) for c in ("AGEP", "PINCP", "WKHP", "PWGTP")}
    inside = ((num["AGEP"] > 16) & (num["PINCP"] > 100) & (num["WKHP"] > 0)
              & (num["PWGTP"] >= 1)).fill_null(False)
    assert report.kept == int(inside.sum())
    positive = int(((num["PINCP"] > 50000) & inside).fill_null(False).sum())
    with h5py.File(out, "r") as handle:
        assert handle.attrs["task"] == "income"
        y = np.concatenate([handle["train/y"][:], handle["val/y"][:], handle["test/y"][:]])
        names = json.loads(handle.attrs["feature_names"])
    assert int(y.sum()) == positive
    assert "OCCP=0010" in names and "WKHP=blank" in names and "POBP=006" in names


def _both_layouts(comm, shared_tmp, secret_file, zip_name: str, task: str) -> tuple[str, str]:
    """One state's file prepared for ``task`` one-hot and as codes (one secret:
    the same rows); the two paths."""
    onehot, codes = (str(shared_tmp / f"{task}_{layout}.h5") for layout in ("oh", "codes"))
    common = [str(pums_zips() / zip_name), "--task", task, "--household-secret", secret_file]
    _run(comm, [*common, "--out", onehot])
    _run(comm, [*common, "--out", codes, "--encoding", "codes"])
    return onehot, codes


@pytest.mark.mpi(min_size=1)
def test_codes_layout_holds_the_one_hot_rows_as_category_codes(comm, shared_tmp, secret_file):
    zips = pums_zips()
    onehot, codes = _both_layouts(comm, shared_tmp, secret_file, "csv_pri.zip", "income")
    if comm.Get_rank() == 0:
        with h5py.File(onehot, "r") as a, h5py.File(codes, "r") as b:
            assert (a.attrs["format_version"], b.attrs["format_version"]) == (2, 3)
            wide, narrow = a["train/X"][:], b["train/X"][:]
            np.testing.assert_array_equal(a["train/y"][:], b["train/y"][:])
            np.testing.assert_array_equal(a["train/household"][:], b["train/household"][:])
            wide_names = json.loads(a.attrs["feature_names"])
            narrow_names = json.loads(b.attrs["feature_names"])
        # every one-hot block is the code column's category; numeric columns are equal
        for j, name in enumerate(narrow_names):
            if name in wide_names:  # a numeric column or its blank flag
                np.testing.assert_array_equal(narrow[:, j], wide[:, wide_names.index(name)])
                continue
            members = [i for i, n in enumerate(wide_names) if n.split("=")[0] == name]
            assert (wide[:, members].sum(1) == 1).all()
            np.testing.assert_array_equal(narrow[:, j], wide[:, members].argmax(1))
        info = read_info(codes)
        assert [c[2] for c in info.code_columns] == ["COW", "SCHL", "MAR", "OCCP", "POBP",
                                                     "RELP", "SEX", "RAC1P"]
        assert dict((c[2], c[1]) for c in info.code_columns)["OCCP"] == sum(
            n.startswith("OCCP=") for n in wide_names)
        assert os.path.getsize(onehot) > 5 * os.path.getsize(codes)
    # --like follows the layout of the file; a contradicting --encoding is refused
    again = str(shared_tmp / "codes2.h5")
    _run(comm, [str(zips / "csv_pde.zip"), "--out", again, "--like", codes])
    if comm.Get_rank() == 0:
        assert read_info(again).code_columns == read_info(codes).code_columns
        with pytest.raises(PrepError, match="--encoding onehot differs from the layout"):
            _settings([str(zips / "csv_pde.zip"), "--out", again, "--like", codes,
                       "--encoding", "onehot"])


@pytest.mark.mpi(min_size=1)
def test_place_codes_are_numeric_and_one_hot_modulo_1024(comm, shared_tmp, secret_file):
    """travel_time's PUMA and POWPUMA: the standardised code, and the code modulo
    1024 one-hot (or one code column in the codes layout, 1024 meaning blank)."""
    onehot, codes = _both_layouts(comm, shared_tmp, secret_file, "csv_pde.zip",
                                  "travel_time")
    if comm.Get_rank() != 0:
        return
    with h5py.File(onehot, "r") as a, h5py.File(codes, "r") as b:
        wide, narrow = a["train/X"][:], b["train/X"][:]
        wide_names = json.loads(a.attrs["feature_names"])
        narrow_names = json.loads(b.attrs["feature_names"])
        spec = {f["name"]: f for f in json.loads(a.attrs["encoding"])["features"]}
    for name in ("PUMA", "POWPUMA"):
        assert spec[name]["kind"] == "numeric" and spec[name]["buckets"] == 1024
        code = np.rint(wide[:, wide_names.index(name)].astype(np.float64) * spec[name]["std"]
                       + spec[name]["mean"]).astype(int)
        block = [i for i, n in enumerate(wide_names) if n.startswith(name + "%")]
        assert len(block) == 1024
        blank = (wide[:, wide_names.index(name + "=blank")] == 1 if name + "=blank"
                 in wide_names else np.zeros(len(wide), bool))
        assert (wide[:, block].sum(1) == ~blank).all()
        np.testing.assert_array_equal(wide[~blank][:, block].argmax(1), code[~blank] % 1024)
        column = narrow[:, narrow_names.index(name + "%")]
        np.testing.assert_array_equal(column, np.where(blank, 1024, code % 1024))
    assert (narrow_names.index("PUMA%"), 1025, "PUMA%") in read_info(codes).code_columns


@pytest.mark.mpi(min_size=1)
def test_a_person_given_twice_is_refused_on_every_rank(comm, shared_tmp):
    """A state as its zip and as the CSV inside it (different sha256s), or an
    extract overlapping another file: the same (SERIALNO, SPORDER) twice."""
    zips = pums_zips()
    state = zips / "csv_pde.zip"
    plain, overlap = shared_tmp / "psam_p10.csv", shared_tmp / "overlap.csv"
    if comm.Get_rank() == 0:
        text = _member_text(state)
        plain.write_bytes(text)
        lines = text.splitlines(keepends=True)
        other = _member_text(zips / "csv_pnd.zip").splitlines(keepends=True)
        overlap.write_bytes(b"".join(lines[:1] + lines[-40:] + other[1:200]))
        age = _column(lines[0], "AGEP")  # the 40 repeated lines, less those outside the universe
        repeated = sum(int(line.split(b",")[age]) >= 16 for line in lines[-40:])
    repeated = comm.bcast(repeated if comm.Get_rank() == 0 else None, root=0)
    out = shared_tmp / "twice.h5"
    for second, copies in ((plain, None), (overlap, repeated)):
        with pytest.raises(PrepError) as error:
            _run(comm, [str(state), str(second), "--out", str(out)])
        message = str(error.value)
        assert error.value.collective, message
        assert message.startswith(f"{state}:psam_p10.csv and {second} both hold person "), message
        assert "the same person given twice (a state as its CSV and as its zip" in message
        assert "or files that number their households alike" in message
        if copies is not None:
            assert (f"({copies:,} kept records repeat the SERIALNO and SPORDER of another)"
                    in message)
    comm.Barrier()
    assert not out.exists()


def _column(header: bytes, name: str) -> int:
    return header.decode().rstrip("\n").split(",").index(name)


@pytest.mark.mpi(min_size=1)
def test_a_person_given_twice_is_found_in_a_file_written_by_pandas(comm, shared_tmp):
    """pandas writes SPORDER as floats ("2.0"): the same person twice is
    refused as in the file it read. A kept record whose SPORDER is blank or
    a fraction is refused naming its line and value (its person number
    unknown, a repeat could not be found); a dropped record's is no matter."""
    import pandas as pd

    head = _member_text(pums_zips() / "csv_pde.zip").splitlines(keepends=True)[:3001]
    header = head[0].decode().rstrip("\n").split(",")
    age, person = header.index("AGEP"), header.index("SPORDER")
    adult = next(i for i in range(1500, 3001) if int(head[i].split(b",")[age]) >= 16
                 and int(head[i].split(b",")[person]) > 1)
    child = next(i for i in range(1, 3001) if int(head[i].split(b",")[age]) < 16)
    paths = {name: shared_tmp / f"{name}.csv" for name in ("twice", "blank", "half", "child")}
    if comm.Get_rank() == 0:
        frame = pd.read_csv(io.BytesIO(b"".join(head + [head[adult]])), dtype=str)
        frame["SPORDER"] = frame["SPORDER"].astype(float)
        frame.to_csv(paths["twice"], index=False)
        for name, row, value in (("blank", adult, ""), ("half", adult, "2.5"),
                                 ("child", child, "")):
            frame = pd.read_csv(io.BytesIO(b"".join(head)), dtype=str)
            frame.loc[row - 1, "SPORDER"] = value
            frame.to_csv(paths[name], index=False)
    comm.Barrier()
    written = paths["twice"].read_text().splitlines()[1:]
    assert all(line.split(",")[person].endswith(".0") for line in written)  # pandas' floats
    serial = head[adult].decode().split(",")[header.index("SERIALNO")]
    number = int(head[adult].split(b",")[person])
    expected = {"twice": f"{paths['twice']} holds person {number} (SPORDER) of household "
                         f"{serial} twice (1 kept record repeats the SERIALNO and SPORDER "
                         "of another): the same person given twice",
                "blank": f"{paths['blank']}, line {adult + 1}: SPORDER is blank, not a "
                         "person number (a whole number from 1 to 255)",
                "half": f"{paths['half']}, line {adult + 1}: SPORDER is '2.5', not a person "
                        "number (a whole number from 1 to 255)"}
    out = shared_tmp / "o.h5"
    for name, start in expected.items():
        with pytest.raises(PrepError) as error:
            _run(comm, [str(paths[name]), "--out", str(out)])
        assert error.value.collective and str(error.value).startswith(start), str(error.value)
        assert not out.exists()
    report = _run(comm, [str(paths["child"]), "--out", str(out)])  # dropped: universe
    assert report.kept == sum(int(line.split(b",")[age]) >= 16 for line in head[1:])


@pytest.mark.mpi(min_size=1)
def test_a_household_split_over_two_files_is_not_a_repeat(comm, shared_tmp):
    """`split -l` cuts a household in two: its people are in two files, each
    once, and the file holds every one of them."""
    state = pums_zips() / "csv_pde.zip"
    parts = [shared_tmp / "part1.csv", shared_tmp / "part2.csv"]
    if comm.Get_rank() == 0:
        lines = _member_text(state).splitlines(keepends=True)
        serial = _column(lines[0], "SERIALNO")
        cut = next(i for i in range(len(lines) // 2, len(lines) - 1)
                   if lines[i].split(b",")[serial] == lines[i + 1].split(b",")[serial]) + 1
        parts[0].write_bytes(b"".join(lines[:cut]))
        parts[1].write_bytes(b"".join(lines[:1] + lines[cut:]))
    comm.Barrier()
    whole = _run(comm, [str(state), "--out", str(shared_tmp / "whole.h5")])
    split = _run(comm, [*map(str, parts), "--out", str(shared_tmp / "split.h5")])
    assert (split.records, split.kept) == (whole.records, whole.kept)
