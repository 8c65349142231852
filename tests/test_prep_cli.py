"""`mpiexec -n 2 mpidp prep` as a user runs it: bad inputs, a good run, the benchmark.

Each bad input must give one line `mpidp: error: <file>[, line N]: ...`, exit
code 2, and leave no file (final or temporary) behind.
"""
import gzip
import json
import lzma
import os
import stat
import zipfile
from pathlib import Path

import h5py
import numpy as np
import pytest

from launcher import mpidp


def _header() -> str:
    from preprocessing import dictionary

    return ",".join(dictionary.load().header)


def _good_lines(n: int) -> list[str]:
    from preprocessing import synth

    generator = synth.Generator(seed=4)
    return generator.lines(generator.batch(n)).to_list()


@pytest.fixture(scope="module")
def good_csv(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("good") / "psam_p99.csv"
    path.write_text(_header() + "\n" + "\n".join(_good_lines(400)) + "\n")
    return path


def _bad_inputs(folder: Path, good: Path) -> dict[str, tuple[Path, str]]:
    """name -> (input path, the start of the expected message after 'error: ')."""
    text = good.read_text()
    lines = text.splitlines(keepends=True)
    cases = {}
    cases["missing"] = (folder / "missing.csv", "{p}: no such file")
    empty = folder / "empty.csv"
    empty.write_text("")
    cases["empty"] = (empty, "{p}: the file is empty")
    extract = folder / "extract.csv"
    extract.write_text("SERIALNO,AGEP,SEX\n2018HU0000001,40,1\n")
    cases["columns"] = (extract, "{p}, line 1: the header lacks SCHL")
    truncated = folder / "truncated.csv"
    truncated.write_text("".join(lines[:-1]) + lines[-1][:200])
    cases["truncated"] = (truncated, f"{{p}}, line {len(lines)}: the last line is cut short")
    semicolons = folder / "semicolons.csv"
    semicolons.write_text(text.replace(",", ";"))
    cases["delimiter"] = (semicolons, "{p}, line 1: the columns are separated by semicolons")
    garbage = folder / "garbage.csv"
    age = _header().split(",").index("AGEP")
    bad = [",".join(f if i != age else "forty" for i, f in enumerate(line.split(",")))
           for line in lines[1:]]
    garbage.write_text(lines[0] + "".join(bad))
    cases["non_numeric"] = (garbage, "{p}, line 2: AGEP is 'forty', not a number; 400 of 400")
    quoted = folder / "quoted.csv"  # pandas' to_csv(quoting=csv.QUOTE_ALL)
    quoted.write_text("".join(",".join(f'"{f}"' for f in line.rstrip("\n").split(",")) + "\n"
                              for line in lines))
    cases["quoted"] = (quoted, '{p}, line 1: the column names are in quotes ("RT", "SERIALNO"')
    no_csv = folder / "docs.zip"
    with zipfile.ZipFile(no_csv, "w") as archive:
        archive.writestr("ACS2018_PUMS_README.pdf", b"%PDF-1.4")
    cases["zip_without_csv"] = (no_csv, "{p}: the zip archive holds no .csv file")
    damaged = folder / "damaged.zip"  # a download with bytes changed in transit
    with zipfile.ZipFile(damaged, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("psam_p99.csv", text)
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2:len(data) // 2 + 64] = bytes(64)
    damaged.write_bytes(bytes(data))
    cases["damaged_zip"] = (damaged, "{p}:psam_p99.csv: cannot decompress (")
    cut_gzip = folder / "cut.csv.gz"  # an interrupted download
    whole = gzip.compress(text.encode())
    cut_gzip.write_bytes(whole[:len(whole) // 2])
    cases["cut_gzip"] = (cut_gzip, "{p}: cannot decompress (Compressed file ended before "
                                   "the end-of-stream marker was reached); a damaged or "
                                   "incomplete download?")
    xz = folder / "psam_p99.csv.xz"
    xz.write_bytes(lzma.compress(text.encode()))
    cases["xz"] = (xz, "{p}: the file is xz-compressed; mpidp prep reads CSV files, their "
                       "gzip (.gz) and the Census zips: decompress it first (unxz -k {p})")
    width = len(lines[0].split(","))
    for name, head, line_end, fields, why in (
            ("header_comma", ",", "", (width, width + 1), "the header ends with a comma"),
            ("lines_comma", "", ",", (width + 1, width), "the lines end with a comma")):
        path = folder / f"{name}.csv"
        path.write_text(lines[0].rstrip("\n") + head + "\n"
                        + "".join(line.rstrip("\n") + line_end + "\n" for line in lines[1:]))
        cases[name] = (path, f"{{p}}, line 2: the line has {fields[0]} fields, the header "
                             f"{fields[1]} ({why}); every line must have the header's fields")
    latin = folder / "latin.csv"  # one byte that is no UTF-8, in the third record's SERIALNO
    latin.write_bytes("".join(lines[:3]).encode() + b"\xe9" + "".join(lines[3:]).encode())
    cases["not_utf8"] = (latin, "{p}, line 4: bytes that are not UTF-8 text (a damaged file, "
                                "or one saved in another encoding: save it as UTF-8)")
    # the first record is the first line that is not empty (lines 2 and 3 here)
    blank_first = folder / "blank_first.csv"
    blank_first.write_text(lines[0] + "\n , \n" + "".join(
        line.rsplit(",", 1)[0] + "\n" for line in lines[1:]))
    cases["blank_first"] = (blank_first, f"{{p}}, line 4: the line has {width - 1} fields, the "
                                         f"header {width} (the header and the records do not "
                                         "match); every line must have the header's fields")
    no_header = folder / "no_header.csv"  # the header line lost (tail -n +2)
    no_header.write_text("".join(lines[1:]))
    cases["no_header"] = (no_header, "{p}, line 1: the first line is a record, not the header")
    return cases


def _check_failure(result, expected: str, folder: Path) -> None:
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1, result.stderr
    assert errors[0].startswith("mpidp: error: " + expected), errors[0]
    assert not list(folder.glob("*.h5")) and not list(folder.glob(".*mpidp-tmp*"))


def _prepare(argv: list[str]):
    """`mpidp prep argv` run in this process (1 rank); its report."""
    import argparse

    from collectives.runtime import MPI
    from preprocessing.pipeline import prepare
    from preprocessing.prep import add_arguments, make_settings

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return prepare(MPI.COMM_SELF, make_settings(parser.parse_args(argv)), threads=1)


def _error_in_process(argv: list[str]) -> str:
    """The PrepError message of `mpidp prep argv` run in this process (1 rank)."""
    from preprocessing.errors import PrepError

    with pytest.raises(PrepError) as error:
        _prepare(argv)
    return str(error.value)


@pytest.mark.parametrize("case", ["missing", "empty", "columns", "truncated", "delimiter",
                                  "quoted", "non_numeric", "zip_without_csv",
                                  "damaged_zip", "cut_gzip", "xz", "header_comma",
                                  "lines_comma", "blank_first", "not_utf8", "no_header"])
def test_bad_input_is_one_clear_error_and_no_output(tmp_path, good_csv, case):
    path, expected = _bad_inputs(tmp_path, good_csv)[case]
    message = _error_in_process([str(good_csv), str(path), "--out", str(tmp_path / "o.h5")])
    assert message.startswith(expected.format(p=path)), message
    assert "\n" not in message
    assert not list(tmp_path.glob("*.h5")) and not list(tmp_path.glob(".*mpidp-tmp*"))


def test_an_output_over_an_input_is_refused_and_the_input_kept(tmp_path, good_csv):
    """--out naming an input (or a link to it), the --like file, or a file of an
    input folder (MNIST's idx files) would have been renamed over it."""
    from preprocessing import atomic
    from preprocessing.errors import PrepError

    data = tmp_path / "psam_p97.csv"
    data.write_bytes(good_csv.read_bytes())
    (tmp_path / "link.csv").symlink_to(data)
    for out in (data, tmp_path / "link.csv"):
        message = _error_in_process([str(data), "--out", str(out)])
        assert message == (f"{out}: --out is the input {data}; writing the output would "
                           "replace it: give the output another name"), message
    assert data.read_bytes() == good_csv.read_bytes()
    like = tmp_path / "like.h5"
    _prepare([str(data), "--out", str(like), "--quiet"])
    message = _error_in_process([str(data), "--out", str(like), "--like", str(like)])
    assert message.startswith(f"{like}: --out is --like {like}; writing the output"), message
    folder = tmp_path / "mnist"
    folder.mkdir()
    idx = folder / "t10k-images-idx3-ubyte.gz"
    idx.write_bytes(b"not read: refused first")
    with pytest.raises(PrepError, match=f"^{idx}: --out is a file in the input {folder}"):
        atomic.check_not_input(str(idx), {f"the input {folder}": str(folder)})
    assert idx.read_bytes() == b"not read: refused first"
    earlier = folder / "mnist.h5"  # an earlier output there is replaced as anywhere
    with h5py.File(earlier, "w") as f:
        f.attrs["format"] = "mpidp"
    atomic.check_not_input(str(earlier), {f"the input {folder}": str(folder)})
    other = tmp_path / "other.h5"  # another tool's HDF5 file is someone's data
    with h5py.File(other, "w") as f:
        f["experiment"] = np.arange(10)
    with pytest.raises(PrepError, match="--out exists and is an HDF5 file of another tool"):
        atomic.check_not_input(str(other), {})


def test_an_output_over_someone_elses_file_or_a_device_is_refused(tmp_path, good_csv):
    """The output is renamed over ``--out``: a file that is not an earlier
    output (HDF5), a device (/dev/null, replaced itself as root) or a named pipe
    is refused before any work; ``dir/`` names a directory, not a file."""
    kept = tmp_path / "results.csv"
    kept.write_text("someone's results\n")
    fifo = tmp_path / "pipe.h5"
    os.mkfifo(fifo)
    for out, expected in (
            (kept, f"{kept}: --out exists and is not an HDF5 file (no earlier output of "
                   "mpidp prep); writing the output would replace it"),
            (os.devnull, f"{os.devnull}: is a character device, not a file; --out names"),
            (fifo, f"{fifo}: is a named pipe (FIFO), not a file; --out names"),
            (f"{tmp_path / 'new'}/", f"{tmp_path / 'new'}/: names a directory (ends with /); "
                                     f"give a file name for --out, e.g. {tmp_path}/new/pums.h5")):
        message = _error_in_process([str(good_csv), "--out", str(out)])
        assert message.startswith(expected), message
    assert kept.read_text() == "someone's results\n" and stat.S_ISFIFO(fifo.stat().st_mode)
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode)
    (tmp_path / "empty.h5").touch()  # an empty file (touched) holds nothing to lose
    _prepare([str(good_csv), "--out", str(tmp_path / "empty.h5"), "--quiet"])


@pytest.mark.parametrize("universe, expected", [
    ("SERIALNO>1", "--universe: SERIALNO has non-numeric codes, which mpidp does not read"),
    ("SOCP==1", "--universe: SOCP has non-numeric codes, which mpidp does not read"),
    ("AGEQ>=1", "--universe: AGEQ is not a column of the 2018 person file"),
    ("", "--universe '' has no condition: leave --universe out for the task's universe "
         "(AGEP>=16), or give conditions (every record: --universe AGEP>=0)"),
    (",", "--universe ',' has no condition")])
def test_a_universe_mpidp_cannot_read_is_refused_naming_the_option(tmp_path, good_csv,
                                                                   universe, expected):
    """Text-coded columns were read as numbers (SERIALNO: a KeyError from deep
    inside; SOCP: blamed on the data file's lines); an empty value fell back to
    the task's universe without a word."""
    message = _error_in_process([str(good_csv), "--out", str(tmp_path / "o.h5"),
                                 "--universe", universe])
    assert message.startswith(expected), message
    assert not list(tmp_path.iterdir())


def test_an_input_given_twice_is_refused(tmp_path, good_csv):
    """By name, through a link, or as a copy (the same sha256, known once the
    inputs are read): its people would be in the data twice."""
    copy = tmp_path / "copy.csv"
    copy.write_bytes(good_csv.read_bytes())
    (tmp_path / "link.csv").symlink_to(good_csv)
    out = str(tmp_path / "o.h5")
    twice = "its people would be in the data twice, so a run's epsilon per person would not hold"
    assert _error_in_process([str(good_csv), str(good_csv), "--out", out]) == \
        f"{good_csv} is given twice: {twice}; pass it once"
    assert _error_in_process([str(good_csv), str(tmp_path / "link.csv"), "--out", out]) == \
        f"{good_csv} and {tmp_path / 'link.csv'} are the same file: {twice}; pass it once"
    message = _error_in_process([str(good_csv), str(copy), "--out", out])
    assert message.startswith(f"{good_csv} and {copy} have the same contents (sha256 "), message
    assert message.endswith(f"{twice}; pass it once")
    assert not list(tmp_path.glob("*.h5")) and not list(tmp_path.glob(".*mpidp-tmp*"))


def test_check_fields_names_the_first_line_with_extra_fields(tmp_path, good_csv):
    lines = good_csv.read_text().splitlines(keepends=True)
    ragged = tmp_path / "ragged.csv"
    ragged.write_text(lines[0] + "".join(line.rstrip("\n") + ",7\n" for line in lines[1:]))
    width = len(_header().split(","))
    message = _error_in_process([str(good_csv), str(ragged), "--out", str(tmp_path / "o.h5"),
                                 "--check-fields"])
    assert message.startswith(f"{ragged}, line 2: the line has {width + 1} fields, the "
                              f"header {width}; 400 of 400"), message
    assert not list(tmp_path.glob("*.h5")) and not list(tmp_path.glob(".*mpidp-tmp*"))


def test_a_byte_order_mark_is_no_part_of_the_header(tmp_path, good_csv):
    """A file saved as "CSV UTF-8" (Excel) starts with a UTF-8 byte-order mark:
    prepared as the same file without it, row for row."""
    marked = tmp_path / "psam_p98.csv"
    marked.write_bytes(b"\xef\xbb\xbf" + good_csv.read_bytes())
    for path, out in ((good_csv, "plain.h5"), (marked, "marked.h5")):
        _prepare([str(path), "--out", str(tmp_path / out), "--quiet"])
    with h5py.File(tmp_path / "plain.h5") as plain, h5py.File(tmp_path / "marked.h5") as marked:
        for split in ("train", "test"):
            assert np.array_equal(plain[split]["X"][()], marked[split]["X"][()])
            assert np.array_equal(plain[split]["y"][()], marked[split]["y"][()])


@pytest.mark.parametrize("where", [0, 10, 398])
def test_glued_records_are_dropped_and_counted(tmp_path, good_csv, where):
    """--check-fields: two records glued on one line (a lost newline): that
    line is dropped, named in the counts, and every other record is kept as
    without it."""
    from collectives.runtime import MPI
    from preprocessing.pipeline import prepare
    from preprocessing.prep import add_arguments, make_settings
    import argparse

    lines = good_csv.read_text().splitlines()
    i = where + 1
    glued = lines[:i] + [lines[i] + "," + lines[i + 1]] + lines[i + 2:]
    without = lines[:i] + lines[i + 2:]
    reports = {}
    for name, content in (("glued", glued), ("without", without)):
        path = tmp_path / f"psam_{name}.csv"
        path.write_text("\n".join(content) + "\n")
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        args = parser.parse_args([str(path), "--out", str(tmp_path / f"{name}.h5"), "--quiet",
                                  "--check-fields"])
        reports[name] = prepare(MPI.COMM_SELF, make_settings(args), threads=1)
    assert reports["glued"].drop_counts["field_count"] == 1
    assert reports["glued"].records == reports["without"].records + 1
    assert reports["glued"].kept == reports["without"].kept
    assert "field_count" not in reports["without"].drop_counts


def test_bad_input_under_mpiexec_exits_2_with_one_line(tmp_path, good_csv):
    """The truncated last line is found by the last rank only; every rank
    stops with the same error, printed once."""
    path, expected = _bad_inputs(tmp_path, good_csv)["truncated"]
    result = mpidp(2, "prep", str(good_csv), str(path), "--out", str(tmp_path / "o.h5"),
                   timeout=120)
    _check_failure(result, expected.format(p=path), tmp_path)


@pytest.mark.parametrize("out", ["missing_dir/x.h5", "a_file/x.h5", "."])
def test_unwritable_output_is_one_clear_error(tmp_path, good_csv, out):
    (tmp_path / "a_file").write_text("")
    target = tmp_path / out
    message = _error_in_process([str(good_csv), "--out", str(target)])
    assert message.startswith(f"{target}"), message
    assert not list(tmp_path.rglob("*.h5"))


def test_good_run_prints_a_summary_and_writes_the_file(tmp_path, good_csv):
    out = tmp_path / "out.h5"
    result = mpidp(2, "prep", str(good_csv), "--out", str(out), "--seed", "2", timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"mpidp prep: wrote {out} (")
    assert "400 records from 1 file" in result.stdout
    with h5py.File(out, "r") as handle:
        rows = {s: handle[f"{s}/X"].shape[0] for s in ("train", "val", "test")}
        assert handle.attrs["seed"] == 2
    n = sum(rows.values())
    assert (f" {n:,} (train {rows['train']:,}, val {rows['val']:,}, test "
            f"{rows['test']:,};") in result.stdout
    assert sorted(os.listdir(tmp_path)) == ["out.h5"]


def test_bench_prep_runs_and_prints_ratios(tmp_path):
    result = mpidp(1, "bench", "prep", "--rows", "3000", "--repeat", "1", "--ranks", "2",
                   "--cache", str(tmp_path), "--json", str(tmp_path / "bench.json"),
                   timeout=300)
    assert result.returncode == 0, result.stderr
    for name in ("polars (1 process)", "mpidp prep, 2 ranks"):
        assert name in result.stdout
    assert "vs polars" in result.stdout and (tmp_path / "bench.json").exists()
    made = json.loads((tmp_path / "bench.json").read_text())["provenance"]
    assert made["command"].startswith("mpidp bench prep --rows 3000 --repeat 1 --ranks 2 ")
    assert made["date"] and made["machine"]["cores"] >= 1
    assert list(tmp_path.glob("synth-pums-2018-3000-seed1.csv"))
    # where the time goes, for both pipelines: their own steps, and each rank's parse
    assert "where the time goes" in result.stdout
    steps = json.loads((tmp_path / "bench.json").read_text())["median_steps"]
    assert {"start", "read", "encode+write"} <= set(steps["polars (1 process)"])
    two = steps["mpidp prep, 2 ranks"]
    assert {"start", "parse", "shuffle", "parse rank 0", "parse rank 1", "sha256 rank 0"} <= \
        set(two) and all(v >= 0 for v in two.values())
    # the ratio the speed guard compares, from the round's own times
    doc = json.loads((tmp_path / "bench.json").read_text())
    polars, ours = doc["seconds"]["polars (1 process)"][0], doc["seconds"]["mpidp prep, 2 ranks"][0]
    assert doc["vs_polars_2_ranks"] == pytest.approx(polars / ours)
    assert doc["vs_polars_2_ranks_spread"] == [doc["vs_polars_2_ranks"]] * 2
    assert "mpidp prep at 2 rank(s), polars' time over it: " in result.stdout


def test_bench_prep_ratios_are_medians_of_per_round_ratios():
    from preprocessing.bench import paired_ratios

    times = {"polars (1 process)": [2.0, 3.0, 2.0], "mpidp prep, 1 rank": [4.0, 3.0, 2.0],
             "mpidp prep, 2 ranks": [1.0, 3.0, 4.0]}
    got = paired_ratios(times)
    assert got["vs_polars_1_ranks"] == 1.0 and got["vs_polars_1_ranks_spread"] == [0.5, 1.0]
    assert got["vs_polars_2_ranks"] == 1.0 and got["vs_polars_2_ranks_spread"] == [0.5, 2.0]
    assert got["speedup_1_to_2_ranks"] == 1.0  # 4/1, 3/3, 2/4: per round, not 3/3 of medians
    assert got["speedup_1_to_2_ranks_spread"] == [0.5, 4.0]
    assert paired_ratios({"mpidp prep, 2 ranks": [1.0]}) == {}  # nothing to pair


@pytest.mark.parametrize("argv, message", [
    (["--ranks", "0"], "--ranks '0': expected comma-separated positive integers"),
    (["--ranks", "two"], "--ranks 'two': expected comma-separated positive integers"),
    (["--rows", "0"], "--repeat and --rows must be at least 1"),
    (["--input", "missing.csv"], "--input missing.csv: no such file"),
    # --cache and --rows describe the synthetic file: with --input they were
    # silently ignored
    (["--input", "x.csv", "--cache", "c"], "^--cache would be ignored with --input x.csv: "
     "they describe the synthetic file; drop it$"),
    (["--input", "x.csv", "--rows", "5", "--cache", "c"], "^--rows, --cache would be ignored"),
])
def test_bench_prep_refuses_bad_options(argv, message):
    from engine.cli import build_parser
    from preprocessing.errors import PrepError

    args = build_parser().parse_args(["bench", "prep", *argv])
    with pytest.raises(PrepError, match=message):
        args._run(args)


@pytest.mark.parametrize("below", ["", "sub/folder"])
def test_bench_prep_refuses_a_cache_that_is_a_file_in_one_line(tmp_path, monkeypatch, below):
    """--cache naming a file (or a path through one) ended in mkdir's
    FileExistsError traceback; now one line before any run."""
    from engine.cli import build_parser
    from preprocessing import bench
    from preprocessing.errors import PrepError

    monkeypatch.setattr(bench, "_checked", lambda argv: pytest.fail(f"ran {argv}"))
    existing = tmp_path / "cache"
    existing.write_text("not a folder")
    cache = existing / below if below else existing
    args = build_parser().parse_args(["bench", "prep", "--rows", "2000", "--ranks", "1",
                                      "--repeat", "1", "--cache", str(cache)])
    with pytest.raises(PrepError) as refused:
        args._run(args)
    what = "it is" if not below else f"{existing} is"
    assert str(refused.value) == (f"--cache {cache}: {what} not a folder; give a folder for "
                                  "the synthetic file (made if missing)")
    assert refused.value.collective and refused.value.exit_code == 2


def test_bench_prep_reports_a_failing_run_in_one_line(tmp_path):
    """A file prep refuses (a header, no records): the failing run's last words,
    no traceback."""
    header_only = tmp_path / "psam_p98.csv"
    header_only.write_text(_header() + "\n")
    result = mpidp(1, "bench", "prep", "--input", str(header_only), "--repeat", "1",
                   "--ranks", "1", "--no-reference", timeout=300)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("mpidp: error:")]
    assert len(errors) == 1 and "mpidp prep" in errors[0] and "failed with exit code 2" \
        in errors[0], result.stderr
    assert "Traceback" not in result.stderr


def _prep_in_process(argv: list[str]):
    """`mpidp prep argv` in this process (1 rank); returns its Report."""
    import argparse

    from collectives.runtime import MPI
    from preprocessing.pipeline import prepare
    from preprocessing.prep import add_arguments, make_settings

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return prepare(MPI.COMM_SELF, make_settings(parser.parse_args([*argv, "--quiet"])),
                   threads=1)


def test_val_split_takes_whole_households_from_the_training_split(tmp_path, good_csv):
    """--val-fraction (default 0.1) moves a share of the *training* households to
    /val: the test split is the one a file without val has, and no household
    is on two sides."""
    from preprocessing.h5format import read_info

    secret = tmp_path / "secret"
    secret.write_bytes(bytes(range(32)))
    common = [str(good_csv), "--seed", "2", "--household-secret", str(secret)]
    report = _prep_in_process([*common, "--out", str(tmp_path / "v.h5")])
    _prep_in_process([*common, "--out", str(tmp_path / "none.h5"), "--val-fraction", "0"])
    _prep_in_process([*common, "--out", str(tmp_path / "half.h5"), "--val-fraction", "0.5"])
    info = read_info(str(tmp_path / "v.h5"))
    assert info.splits == ("train", "val", "test") and report.val == info.rows["val"] > 0
    assert not read_info(str(tmp_path / "none.h5")).has_val  # 0: no /val at all
    with h5py.File(tmp_path / "v.h5", "r") as v, h5py.File(tmp_path / "none.h5", "r") as n, \
            h5py.File(tmp_path / "half.h5", "r") as h:
        assert v.attrs["val_fraction"] == 0.1 and n.attrs["val_fraction"] == 0.0
        keys = {s: v[f"{s}/household"][:] for s in ("train", "val", "test")}
        for split, k in keys.items():
            starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
            assert len(np.unique(k)) == len(starts), split  # each household consecutive
        assert not set(keys["val"]) & set(keys["train"])
        assert not set(keys["val"]) & set(keys["test"])
        households = json.loads(v.attrs["households"])
        assert households == {s: len(np.unique(k)) for s, k in keys.items()}
        share = households["val"] / (households["val"] + households["train"])
        assert 0.03 < share < 0.2
        half = json.loads(h.attrs["households"])
        assert 0.35 < half["val"] / (half["val"] + half["train"]) < 0.65
        for other in (n, h):  # the same test split, row for row
            assert np.array_equal(v["test/household"][:], other["test/household"][:])
            assert np.array_equal(v["test/y"][:], other["test/y"][:])
            # AGEP is standardised with the training rows' statistics, val excluded
            assert json.loads(v.attrs["feature_names"])[0] == "AGEP"
            assert np.array_equal(v["test/X"][:, 1:], other["test/X"][:, 1:])
        # train + val of the file with val are the training rows of the one without
        assert sorted(n["train/household"][:]) == sorted(np.r_[keys["train"], keys["val"]])
        assert "val" not in n


def test_a_file_only_for_scoring_and_bad_fractions(tmp_path, good_csv):
    """--test-fraction 1: every row in test, no train rows and no val split;
    fractions that cannot work are one clear error, and nothing is written."""
    from preprocessing.h5format import read_info

    first = str(tmp_path / "first.h5")
    _prep_in_process([str(good_csv), "--out", first])
    score = str(tmp_path / "score.h5")
    report = _prep_in_process([str(good_csv), "--out", score, "--test-fraction", "1",
                               "--like", first])
    info = read_info(score)
    assert info.rows == {"train": 0, "test": report.kept} and report.val is None
    assert report.kept == sum(read_info(first).rows.values())
    for argv, expected in (
            (["--test-fraction", "1", "--val-fraction", "0.1"],
             "--val-fraction 0.1 with --test-fraction 1: a file only for scoring"),
            (["--val-fraction", "1"], "--val-fraction 1.0: must be in [0, 1)"),
            (["--test-fraction", "1.5"], "--test-fraction 1.5: must be in [0, 1]"),
            (["--val-fraction", "0.0001"], "--val-fraction 0.0001 put none of the"),
            (["--test-fraction", "0.5", "--val-fraction", "0.99999"],
             "--test-fraction 0.5 and --val-fraction 0.99999 left no household for "
             "training (val "),
            # said first: the val split's refusal named a cause --val-fraction cannot fix
            (["--test-fraction", "0.999"], "--test-fraction 0.999 and --val-fraction 0.1 "
             "left no household for training")):
        out = tmp_path / "bad" / "o.h5"
        out.parent.mkdir(exist_ok=True)
        message = _error_in_process([str(good_csv), "--out", str(out), *argv])
        assert message.startswith(expected), message
        assert "\n" not in message
        assert not list(out.parent.iterdir())  # no output, no temporary file


def test_a_file_of_the_2019_survey_is_prepared_with_a_note(tmp_path, good_csv):
    """RELP became RELSHIPP (other codes) in 2019: such a file is read through
    the recode, and the summary says so, naming the file."""
    from preprocessing.tasks import RELSHIPP_TO_RELP

    back = {relp: code for code, relp in sorted(RELSHIPP_TO_RELP.items(), reverse=True)}
    lines = good_csv.read_text().splitlines()
    header = lines[0].split(",")
    at, serial = header.index("RELP"), header.index("SERIALNO")
    header[at] = "RELSHIPP"
    rows = []
    for line in lines[1:]:
        fields = line.split(",")
        fields[at] = str(back.get(int(fields[at]), 36)) if fields[at].strip() else fields[at]
        fields[serial] = "2019" + fields[serial][4:]  # other people than good_csv's
        rows.append(",".join(fields))
    newer = tmp_path / "psam_p98.csv"
    newer.write_text(",".join(header) + "\n" + "\n".join(rows) + "\n")
    out = tmp_path / "out.h5"
    result = mpidp(1, "prep", str(good_csv), str(newer), "--out", str(out), timeout=120)
    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stdout.splitlines() if line.lstrip().startswith("note")]
    assert notes == ["  note    psam_p98.csv: RELP read from RELSHIPP (the 2019 survey and "
                     "later), recoded to the 2018 codes; not exact: no roomer or boarder "
                     "(2018 code 11), spouses and partners of either sex merged"], result.stdout


#: RELP (2018) -> RELSHIPP (2019), from the two years' dictionaries (not from
#: tasks.RELSHIPP_TO_RELP, the map under test): 11 roomer or boarder became 36.
RELP_TO_RELSHIPP = {0: 20, 1: 21, 2: 25, 3: 26, 4: 27, 5: 28, 6: 29, 7: 30, 8: 31, 9: 32,
                    10: 33, 11: 36, 12: 34, 13: 22, 14: 35, 15: 36, 16: 37, 17: 38}


def test_a_universe_on_relp_of_a_2019_file_keeps_the_2018_files_rows(tmp_path, good_csv):
    """public_coverage has no RELP feature: --universe RELP==0 on a 2019 file
    (RELSHIPP) was refused ('the header lacks RELP ... not housing files').
    On 2 ranks it keeps the 2018 file's persons with RELP 0, counted here from
    the CSV, the same rows in the same splits, and notes the recode."""
    import csv

    with open(good_csv, newline="") as handle:
        records = list(csv.DictReader(handle))
    heads = sum(1 for r in records if r["RELP"].strip() and int(r["RELP"]) == 0)
    assert 0 < heads < len(records)
    lines = good_csv.read_text().splitlines()
    header = lines[0].split(",")
    at = header.index("RELP")
    header[at] = "RELSHIPP"
    rows = []
    for line in lines[1:]:
        fields = line.split(",")
        if fields[at].strip():
            fields[at] = str(RELP_TO_RELSHIPP[int(fields[at])])
        rows.append(",".join(fields))
    newer = tmp_path / "psam_p98.csv"
    newer.write_text(",".join(header) + "\n" + "\n".join(rows) + "\n")
    secret = tmp_path / "secret"
    secret.write_bytes(bytes(range(32)))
    out = {}
    for name, source in (("2018", good_csv), ("2019", newer)):
        out[name] = tmp_path / f"{name}.h5"
        result = mpidp(2, "prep", str(source), "--out", str(out[name]), "--task",
                       "public_coverage", "--universe", "RELP==0", "--household-secret",
                       str(secret), timeout=120)
        assert result.returncode == 0, result.stderr
        kept = [line.split() for line in result.stdout.splitlines()
                if line.lstrip().startswith("kept")]
        assert kept and kept[0][1] == f"{heads:,}", result.stdout
    assert "  note    psam_p98.csv: RELP read from RELSHIPP (the 2019 survey and later), " \
        "recoded to the 2018 codes" in result.stdout
    with h5py.File(out["2018"], "r") as old, h5py.File(out["2019"], "r") as new:
        for split in ("train", "val", "test"):
            for part in ("X", "y", "household"):
                assert np.array_equal(old[f"{split}/{part}"][:], new[f"{split}/{part}"][:])


def test_a_person_file_without_a_column_is_not_called_a_housing_file(tmp_path, good_csv):
    lines = good_csv.read_text().splitlines()
    at = lines[0].split(",").index("PUBCOV")
    rows = [",".join(f for i, f in enumerate(line.split(",")) if i != at) for line in lines]
    extract = tmp_path / "extract.csv"
    extract.write_text("\n".join(rows) + "\n")
    message = _error_in_process([str(extract), "--out", str(tmp_path / "o.h5"), "--task",
                                 "public_coverage"])
    assert message.startswith(f"{extract}, line 1: the header lacks PUBCOV (it has "), message
    assert message.endswith("); a person file without it (an extract, or a survey year that "
                            "names it otherwise): pass full ACS PUMS person files "
                            "(psam_pNN.csv), or a task or --universe that does not read it")
    housing = tmp_path / "psam_h98.csv"
    housing.write_text("RT,SERIALNO,NP,TYPE\nH,2018HU0000001,2,1\n")
    message = _error_in_process([str(housing), "--out", str(tmp_path / "o.h5")])
    assert message.endswith("; pass ACS PUMS person files (psam_pNN.csv), not housing files "
                            "or extracts"), message


def test_a_file_without_sporder_is_prepared_with_a_note(tmp_path, good_csv):
    """Without SPORDER a person given twice cannot be found: the summary says
    so for that file, and only for it."""
    import argparse

    from preprocessing.prep import add_arguments, make_settings, unchecked_notes

    lines = good_csv.read_text().replace(",2018HU", ",2017HU").replace(",2018GQ", ",2017GQ")
    lines = lines.splitlines()  # other people than good_csv's
    at = lines[0].split(",").index("SPORDER")
    rows = [",".join(f for i, f in enumerate(line.split(",")) if i != at) for line in lines]
    extract = tmp_path / "extract.csv"
    extract.write_text("\n".join(rows) + "\n")
    argv = [str(good_csv), str(extract), "--out", str(tmp_path / "o.h5")]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert unchecked_notes(make_settings(parser.parse_args(argv))) == [
        "  note    extract.csv: no SPORDER column, so a person given twice (overlapping "
        "extracts, a state's zip and its CSV) cannot be found there; make sure each person "
        "is in the inputs once"]
    assert _prepare(argv).kept == 2 * _prepare([str(good_csv), "--out",
                                                 str(tmp_path / "p.h5")]).kept


def test_a_file_written_by_pandas_prepares_as_the_original(tmp_path, good_csv):
    """pandas writes an integer column with a blank as floats (SCHL "16.0"):
    the same rows as the file it read."""
    import pandas as pd

    frame = pd.read_csv(good_csv, dtype={"SERIALNO": str, "NAICSP": str, "SOCP": str})
    assert frame["SCHL"].dtype == float  # blank for children: written as 16.0
    written = tmp_path / "psam_p99.csv"
    frame.to_csv(written, index=False)
    assert ",16.0," in written.read_text()
    _assert_same_rows(tmp_path, good_csv, written)


def test_a_gzipped_file_prepares_as_the_original(tmp_path, good_csv):
    """psam_pNN.csv.gz: read as one stream, the same rows in the same order;
    beside the CSV it was made from, its people are there twice."""
    packed = tmp_path / "psam_p99.csv.gz"
    packed.write_bytes(gzip.compress(good_csv.read_bytes()))
    _assert_same_rows(tmp_path, good_csv, packed)
    message = _error_in_process([str(good_csv), str(packed), "--out", str(tmp_path / "c.h5")])
    assert message.startswith(f"{good_csv} and {packed} both hold person "), message


def _assert_same_rows(folder: Path, original: Path, other: Path, in_order=True) -> None:
    """``other`` prepares to the same arrays as ``original`` (one secret); in
    the same order where its records are on the same lines (a record's line
    is part of its shuffle key)."""
    secret = folder / "secret"
    secret.write_bytes(bytes(32))
    files = []
    for source, name in ((original, "a.h5"), (other, "b.h5")):
        _prepare([str(source), "--out", str(folder / name), "--household-secret",
                  str(secret)])
        files.append(h5py.File(folder / name, "r"))
    for split in ("train", "test"):
        a, b = ([np.column_stack([f[f"{split}/X"][:], f[f"{split}/y"][:],
                                  f[f"{split}/household"][:].view(np.float64)])
                 for f in files])
        if not in_order:
            a, b = np.unique(a, axis=0), np.unique(b, axis=0)
        np.testing.assert_array_equal(a, b, err_msg=split)


def test_empty_lines_are_skipped_not_invalid(tmp_path, good_csv):
    """A file double-spaced (a blank line after the header, blank lines at the
    end) is the same file: its empty lines are no records, and no share of
    invalid ones, however many ranks cut it into blocks."""
    header, *rows = good_csv.read_text().splitlines()
    spaced = tmp_path / "psam_p99.csv"
    spaced.write_text(header + "\n\n" + "\n\n".join(rows) + "\n\n,,,\n")
    _assert_same_rows(tmp_path, good_csv, spaced, in_order=False)
    empty = 1 + len(rows) - 1 + 2  # after the header, between the rows, then "" and ",,,"
    arrays = []
    for ranks in (1, 2, 3):
        out = tmp_path / f"c{ranks}.h5"
        result = mpidp(ranks, "prep", str(spaced), "--out", str(out), timeout=120)
        assert result.returncode == 0, result.stderr
        assert f"{len(rows):,} records from 1 file" in result.stdout
        assert f"; {empty:,} empty lines skipped" in result.stdout
        with h5py.File(out, "r") as handle:
            assert json.loads(handle.attrs["sources"])[0]["rows"] == len(rows)
            assert json.loads(handle.attrs["drop_counts"])["empty_line"] == empty
            arrays.append([handle[name][:] for name in ("train/X", "train/y", "test/X")])
    for other in arrays[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(arrays[0], other))


def test_column_names_in_lower_case_are_the_pums_names(tmp_path, good_csv):
    """Some R and SQL exports lower-case the header: matched without case."""
    header, rest = good_csv.read_text().split("\n", 1)
    lower = tmp_path / "psam_p99.csv"
    lower.write_text(header.lower() + "\n" + rest)
    _assert_same_rows(tmp_path, good_csv, lower)


def test_a_task_name_typo_is_one_line_with_the_closest_name(tmp_path, good_csv):
    result = mpidp(1, "prep", str(good_csv), "--out", str(tmp_path / "o.h5"), "--task",
                   "incme", timeout=60)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert errors == ["mpidp: error: --task incme: no such task (did you mean income?); the "
                      "tasks are employment, income, public_coverage, mobility, travel_time, "
                      "income_poverty_ratio, health_insurance (or define one with "
                      "--task-file)"], result.stderr
    assert "usage:" not in result.stderr and not list(tmp_path.glob("*.h5"))
    task_file = mpidp(1, "prep", str(good_csv), "--out", str(tmp_path / "o.h5"), "--task",
                      "commute.toml", timeout=60)  # a task file, given to the wrong option
    assert task_file.returncode == 2
    assert task_file.stderr.startswith("mpidp: error: --task commute.toml: no such task "
                                       "(did you mean --task-file commute.toml?); the tasks "
                                       "are "), task_file.stderr


def test_bench_prep_reads_the_steps_a_timed_run_prints():
    from preprocessing.bench import parse_steps

    text = ("mpidp prep: wrote x (1 MB) in 2.0 s on 2 ranks\n"
            "  steps   parse 1.50, shuffle 0.25, encode+write 0.15\n"
            "  rank 0   parsed and cleaned 320 MB in 1.07 s, then 0.40 s to finish its sha256\n"
            "  rank 1   parsed and cleaned 595 MB in 1.49 s, then 0.00 s to finish its sha256\n")
    steps = parse_steps(text, 2.5)
    assert steps == {"parse": 1.5, "shuffle": 0.25, "encode+write": 0.15,
                     "parse rank 0": 1.07, "sha256 rank 0": 0.40, "parse rank 1": 1.49,
                     "sha256 rank 1": 0.0, "start": pytest.approx(0.6)}
    assert parse_steps("reference: 10 rows in 1.00 s\n  steps   read 0.50, split 0.10\n",
                       1.2) == {"read": 0.5, "split": 0.1, "start": pytest.approx(0.6)}
    assert parse_steps("no timings here", 1.0) == {}


def test_like_an_image_file_is_refused_in_one_line(tmp_path, good_csv):
    """--like naming an image file (no encoding attribute) was a KeyError
    traceback from h5py, exit 1 (MPI_Abort at 2 ranks)."""
    from collectives.runtime import MPI
    from image_files import mnist_dir, prepare

    images = prepare(MPI.COMM_SELF, "mnist", mnist_dir(tmp_path / "mnist", 20, 10),
                     tmp_path / "m.h5")
    out = tmp_path / "o.h5"
    message = _error_in_process([str(good_csv), "--out", str(out), "--like", str(images)])
    assert message == (f"--like {images} holds mnist images; these are PUMS rows: give "
                       "--like a PUMS file prepared by mpidp prep")
    assert not out.exists()


def test_bench_prep_keeps_its_file_in_mpidps_cache_folder(tmp_path, monkeypatch):
    """Without --cache: $MPIDP_CACHE, else $XDG_CACHE_HOME/mpidp like every other
    cache of mpidp (it wrote ~/.cache/mpidp whatever XDG_CACHE_HOME said, and
    took an empty MPIDP_CACHE for a folder)."""
    from preprocessing.bench import default_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    for unset in ("", None):
        if unset is None:
            monkeypatch.delenv("MPIDP_CACHE", raising=False)
        else:
            monkeypatch.setenv("MPIDP_CACHE", unset)
        assert default_cache() == str(tmp_path / "xdg" / "mpidp")
    monkeypatch.setenv("MPIDP_CACHE", str(tmp_path / "mine"))
    assert default_cache() == str(tmp_path / "mine")


def test_like_a_file_whose_label_differs_is_refused_and_eval_says_so(tmp_path, good_csv):
    """Two task files of one name and another label: --like took the second
    (only the name and features were compared) and eval scored an income
    model against health-coverage labels, exit 0."""
    from preprocessing.h5format import read_info

    task = 'name = "earner"\nlabel = "{}"\n[features]\nAGEP = "numeric"\nSEX = "categorical"\n'
    (tmp_path / "a.toml").write_text(task.format("PINCP > 30000"))
    (tmp_path / "b.toml").write_text(task.format("HICOV == 2"))
    train = tmp_path / "train.h5"
    _prepare([str(good_csv), "--task-file", str(tmp_path / "a.toml"), "--out", str(train)])
    out = tmp_path / "other.h5"
    message = _error_in_process([str(good_csv), "--task-file", str(tmp_path / "b.toml"),
                                 "--like", str(train), "--out", str(out)])
    assert message == (f"{train} labels its rows PINCP>30000, this task HICOV==2: a model "
                       "of one would be scored against the other's labels; give the task "
                       "file the --like file was prepared with")
    assert not out.exists()
    _prepare([str(good_csv), "--task-file", str(tmp_path / "b.toml"), "--out", str(out)])
    trained = read_info(str(train)).summary()  # what a model's checkpoint records
    assert read_info(str(out)).encoded_unlike(trained) == \
        "its rows are labelled HICOV==2, the model's PINCP>30000"
    assert read_info(str(train)).encoded_unlike(trained) == ""


def test_secrets_and_task_files_that_are_devices_huge_or_bom_marked(tmp_path, good_csv):
    """--household-secret /dev/urandom was read until memory ran out (then an
    out-of-memory line naming --hidden); a task file saved with a UTF-8
    byte-order mark was "not a valid TOML file" at line 1, column 1."""
    import os

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # a pipe, not /dev/*: what a device is to the check
    out = str(tmp_path / "o.h5")
    assert _error_in_process([str(good_csv), "--household-secret", str(fifo), "--out", out]) \
        == (f"--household-secret {fifo} is a named pipe (FIFO), not a file: keep the secret in "
            "a file (e.g. head -c 32 /dev/urandom > FILE)")
    huge = tmp_path / "huge"
    huge.write_bytes(b"x" * ((1 << 20) + 1))
    assert _error_in_process([str(good_csv), "--household-secret", str(huge), "--out", out]
                             ).startswith(f"--household-secret {huge}: more than 1,048,576")
    assert _error_in_process([str(good_csv), "--task-file", str(fifo), "--out", out]) == \
        f"--task-file {fifo} is a named pipe (FIFO), not a TOML file"
    bom = tmp_path / "bom.toml"
    bom.write_bytes(b'\xef\xbb\xbfname = "bom"\r\nlabel = "ESR == 1"\r\n[features]\r\n'
                    b'AGEP = "numeric"\r\n')
    report = _prepare([str(good_csv), "--task-file", str(bom), "--out", out])
    assert report is not None and os.path.exists(out)


def test_a_test_fraction_that_leaves_the_test_split_empty_is_refused(tmp_path, good_csv):
    """As an empty validation split is: --test-fraction 0.0001 wrote "test 0"
    silently, and the file had nothing to score."""
    out = tmp_path / "o.h5"
    message = _error_in_process([str(good_csv), "--test-fraction", "0.0001", "--out", str(out)])
    assert message.startswith("--test-fraction 0.0001 put none of the ") and \
        "households in the test split: too few households" in message, message
    assert not out.exists()
