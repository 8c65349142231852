"""mpidp synth: the official format, dictionary ranges, age-consistent blanks,
a learnable ESR, and damage that prep drops."""
import argparse

import numpy as np
import polars as pl
import pytest

from collectives.runtime import MPI
from preprocessing import dictionary, synth
from preprocessing.pipeline import prepare
from preprocessing.prep import add_arguments, make_settings

ROWS = 6000


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    path = tmp_path_factory.mktemp("synth") / "synth.csv"
    synth.write(str(path), ROWS, seed=9)
    return path


@pytest.fixture(scope="module")
def frame(synthetic) -> pl.DataFrame:
    return pl.read_csv(synthetic, infer_schema=False)


def test_official_header_and_shape(synthetic, frame):
    book = dictionary.load()
    assert synthetic.read_text().splitlines()[0] == ",".join(book.header)
    assert frame.width == 286 and frame.height == ROWS


def test_every_field_is_a_code_of_the_dictionary(frame):
    book = dictionary.load()
    for name in book.header:
        variable, text = book[name], frame[name]
        if not variable.blank_allowed:
            assert text.null_count() == 0, name
        present = text.drop_nulls()
        if variable.strings and not variable.ranges:
            ok = [any(lo <= v <= hi and len(v) == len(lo) for lo, hi in variable.strings)
                  for v in present.to_list()]
            assert all(ok), name
            continue
        numbers = present.cast(pl.Int64, strict=False)
        digits = numbers.is_not_null()
        assert variable.valid(numbers.filter(digits).to_numpy()).all(), name
        if not variable.strings:
            assert digits.all(), name
        if not variable.numeric or name == "SPORDER":  # zero-padded codes
            assert (present.filter(digits).str.len_chars() == variable.width).all(), name


def test_blanks_follow_age_as_in_the_dictionary(frame):
    age = frame["AGEP"].cast(pl.Int64).to_numpy()
    for name, below in (("ESR", 16), ("MIL", 17), ("SCHL", 3), ("DREM", 5), ("MIG", 1),
                        ("PINCP", 15), ("WKHP", 16), ("COW", 16)):
        blank = frame[name].is_null().to_numpy()
        assert blank[age < below].all(), name
    for name, below in (("ESR", 16), ("MIL", 17), ("SCHL", 3), ("DREM", 5), ("MIG", 1)):
        assert not frame[name].is_null().to_numpy()[age >= below].any(), name
    assert np.array_equal(frame["OCCP"].is_null().to_numpy(), frame["COW"].is_null().to_numpy())


def test_marginals_look_like_the_real_files(frame):
    age = frame["AGEP"].cast(pl.Int64)
    assert 0.14 < float((age < 16).mean()) < 0.21  # real: 0.175
    assert 0.47 < float((frame["SEX"] == "2").mean()) < 0.54
    serial = frame["SERIALNO"]
    assert serial.str.contains(r"^2018(HU|GQ)\d{7}$").all()
    assert 0.02 < float((serial.str.slice(4, 2) == "GQ").mean()) < 0.08
    first = frame.filter(pl.col("SPORDER") == "01")
    assert first.height == serial.n_unique()
    hu_first = first.filter(pl.col("SERIALNO").str.slice(4, 2) == "HU")
    assert (hu_first["RELP"] == "00").all()
    assert (hu_first["AGEP"].cast(pl.Int64) >= 15).all()  # as in the real files


def test_esr_depends_on_the_features(frame):
    adults = frame.filter(pl.col("AGEP").cast(pl.Int64) >= 16).with_columns(
        (pl.col("ESR") == "1").alias("employed"),
        (pl.col("AGEP").cast(pl.Int64) // 10).alias("decade"),
        pl.col("SCHL").cast(pl.Int64).alias("schl"))
    base = float(adults["employed"].mean())
    # Predicting with the employment rate of each (decade, degree, disability)
    # cell beats the majority class by a wide margin: the label is learnable.
    cells = adults.group_by(["decade", pl.col("schl") >= 21, "DIS"]).agg(
        pl.col("employed").mean().alias("rate"), pl.len().alias("n"))
    accuracy = float((cells["rate"].map_elements(lambda r: max(r, 1 - r),
                                                  return_dtype=pl.Float64) * cells["n"]).sum()
                     / adults.height)
    assert accuracy > max(base, 1 - base) + 0.1
    prime = adults.filter(pl.col("decade").is_between(3, 4))
    old = adults.filter(pl.col("decade") >= 7)
    assert float(prime["employed"].mean()) > float(old["employed"].mean()) + 0.4


def test_same_seed_same_file_other_seed_other_file(tmp_path, synthetic):
    again = tmp_path / "again.csv"
    synth.write(str(again), ROWS, seed=9)
    assert again.read_bytes() == synthetic.read_bytes()
    other = tmp_path / "other.csv"
    synth.write(str(other), 50, seed=10)
    assert other.read_text().splitlines()[1] != synthetic.read_text().splitlines()[1]


def _prep(path, out) -> dict:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([str(path), "--out", str(out), "--max-invalid-share", "0.5"])
    report = prepare(MPI.COMM_SELF, make_settings(args), threads=1)
    return {"kept": report.kept, "drops": report.drop_counts}


def test_damaged_lines_are_all_dropped_by_prep(tmp_path, synthetic):
    damaged = tmp_path / "damaged.csv"
    count = synth.write(str(damaged), ROWS, seed=9, corrupt_fraction=0.05)
    clean_lines = synthetic.read_text().splitlines()
    bad_lines = damaged.read_text().splitlines()
    changed = [i for i, (a, b) in enumerate(zip(clean_lines, bad_lines)) if a != b]
    assert len(changed) == count and 0.03 * ROWS < count < 0.07 * ROWS
    clean = _prep(synthetic, tmp_path / "clean.h5")
    dirty = _prep(damaged, tmp_path / "dirty.h5")
    # Which of the changed lines did the clean run keep? (adults, all valid)
    header = clean_lines[0].split(",")
    age = header.index("AGEP")
    kept_before = sum(int(clean_lines[i].split(",")[age]) >= 16 for i in changed)
    assert dirty["kept"] == clean["kept"] - kept_before
    invalid = sum(v for k, v in dirty["drops"].items() if k != "universe")
    assert invalid >= count - (len(changed) - kept_before)
    assert {k.split(":")[0] for k in dirty["drops"]} >= {"non_numeric", "invalid", "blank"}


def test_synth_command_writes_the_file(tmp_path):
    from engine.cli import main

    out = tmp_path / "s.csv"
    assert main(["synth", "--rows", "123", "--out", str(out), "--quiet"]) == 0
    assert len(out.read_text().splitlines()) == 124
    assert main(["synth", "--rows", "0", "--out", str(out), "--quiet"]) == 0
    assert len(out.read_text().splitlines()) == 1


def test_synth_into_a_directory_suggests_a_csv_name(tmp_path, capsys):
    from engine.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["synth", "--rows", "3", "--out", str(tmp_path), "--quiet"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"is a directory; give a file name for --out, e.g. {tmp_path / 'persons.csv'}" \
        in err, err  # it said pums.h5, prep's output, for a CSV
    assert list(tmp_path.iterdir()) == []


def test_synth_writes_gzip_for_a_gz_name(tmp_path):
    """`--out s.csv.gz` wrote plain CSV under that name, which prep then
    refused as a damaged file: now gzip, the same lines as the plain file."""
    import gzip

    from engine.cli import main

    plain, packed = tmp_path / "s.csv", tmp_path / "psam_p98.csv.GZ"
    for out in (plain, packed):
        assert main(["synth", "--rows", "40", "--out", str(out), "--quiet", "--seed", "3"]) == 0
    with gzip.open(packed, "rb") as stream:
        assert stream.read() == plain.read_bytes()
    first = packed.read_bytes()
    assert main(["synth", "--rows", "40", "--out", str(packed), "--quiet", "--seed", "3"]) == 0
    assert packed.read_bytes() == first  # no time in its header: same seed, same bytes


@pytest.mark.parametrize("name, what", [("s10.zip", "a zip archive (.zip)"),
                                        ("s10.csv.BZ2", "bzip2 (.bz2)"),
                                        ("s10.csv.xz", "xz (.xz)")])
def test_synth_refuses_a_compressed_name_it_does_not_write(tmp_path, capsys, name, what):
    from engine.cli import main

    out = tmp_path / name
    with pytest.raises(SystemExit) as exit_:
        main(["synth", "--rows", "10", "--out", str(out), "--quiet"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (f"mpidp: error: --out {out}: mpidp synth writes CSV, or "
                                       f"gzip for a name ending in .gz, not {what}: name it "
                                       ".csv or .csv.gz\n")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("rows", [10_000_000_000, synth.MAX_ROWS + 1])
def test_synth_refuses_too_many_rows_up_front(tmp_path, capsys, rows):
    """`--rows 10000000000` wrote ~16 GB (22 M rows) before the household
    numbers ran out: now refused before anything is written."""
    from engine.cli import main

    out = tmp_path / "big.csv"
    with pytest.raises(SystemExit) as exit_:
        main(["synth", "--rows", str(rows), "--out", str(out), "--quiet"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (
        f"mpidp: error: --rows {rows:,}: mpidp synth writes at most 22,000,000 rows "
        "(households are numbered with 7 digits, up to 9,999,999); ask for fewer\n")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="at most 22,000,000 rows"):
        synth.write(str(out), rows)  # the library call too
    assert list(tmp_path.iterdir()) == []


def test_the_row_limit_fits_the_households_serial_numbers_hold():
    """MAX_ROWS against the persons 9,999,999 households hold, computed here
    from the committed tables: well within (many standard deviations), yet
    close to all of it."""
    from preprocessing import synth_tables

    t = synth_tables.load()
    sizes = np.array(t["household_sizes"], dtype=np.float64)
    p = sizes[:, 1] / sizes[:, 1].sum()
    mean, square = (p * sizes[:, 0]).sum(), (p * sizes[:, 0] ** 2).sum()
    g = t["gq_share"]
    gq = g * mean / (1 - g + g * mean)  # share of households that are group quarters (of 1)
    per_household = (1 - gq) * mean + gq
    spread = np.sqrt((1 - gq) * square + gq - per_household ** 2)
    capacity, sd = 9_999_999 * per_household, np.sqrt(9_999_999) * spread
    assert synth.MAX_HOUSEHOLDS == 9_999_999
    assert synth.MAX_ROWS <= capacity - 50 * sd and synth.MAX_ROWS >= 0.98 * capacity


def test_the_late_household_check_remains_a_backstop():
    generator = synth.Generator(0)
    generator.households = synth.MAX_HOUSEHOLDS - 2
    with pytest.raises(ValueError, match="7-digit serial numbers; write at most 22,000,000"):
        generator.batch(50)
