"""Reading: byte-range plans, line-aligned blocks, polars block parsing."""
import zipfile

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from preprocessing.inputs import inspect_inputs, require_columns
from preprocessing.errors import PrepError
from preprocessing.parse import BlockParser, first_unnumbered
from preprocessing.ranges import Tail, _water_fill, iter_blocks, plan_pieces


def _write_csv(path, lines: list[str], header="A,B,SERIALNO,C") -> None:
    path.write_text(header + "\n" + "".join(line + "\n" for line in lines))


@settings(max_examples=40, deadline=None)
@given(loads=st.lists(st.integers(0, 1000), min_size=1, max_size=6),
       extra=st.integers(0, 5000))
def test_water_fill_evens_out_the_loads(loads, extra):
    shares = _water_fill(loads, extra)
    assert sum(shares) == extra and min(shares) >= 0
    totals = [a + b for a, b in zip(loads, shares)]
    # The ranks that got bytes end level (up to rounding), and every rank
    # that got none was already at or above that level.
    filled = [t for t, s in zip(totals, shares) if s > 0]
    if filled:
        assert max(filled) - min(filled) <= 2
        assert all(t >= max(filled) - 2 for t, s in zip(totals, shares) if s == 0)


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(0, 40), min_size=0, max_size=60),
       size=st.integers(1, 5), block=st.integers(1, 64))
def test_pieces_cover_every_line_exactly_once(tmp_path_factory, lengths, size, block):
    path = tmp_path_factory.mktemp("ranges") / "f.csv"
    lines = [f"{i}," + "x" * n for i, n in enumerate(lengths)]
    _write_csv(path, lines, header="ID,TEXT")
    [inp] = inspect_inputs([str(path)])
    pieces = plan_pieces([inp], size)
    assert {p.rank for p in pieces} <= set(range(size))
    text = b""
    for piece in pieces:  # already in file order
        for data in iter_blocks(inp, piece, Tail(), block_bytes=block):
            assert data.endswith(b"\n")
            text += data
    assert text.decode() == "".join(line + "\n" for line in lines)


def test_zip_members_are_whole_pieces_on_the_least_loaded_rank(tmp_path):
    for name, rows in (("a", 50), ("b", 10)):
        csv = tmp_path / f"{name}.csv"
        _write_csv(csv, [f"{i},1,2018HU{i:07d},3" for i in range(rows)])
        with zipfile.ZipFile(tmp_path / f"{name}.zip", "w") as archive:
            archive.write(csv, f"psam_{name}.csv")
    plain = tmp_path / "c.csv"
    _write_csv(plain, [f"{i},1,2018HU{i:07d},3" for i in range(30)])
    inputs = inspect_inputs([str(tmp_path / "a.zip"), str(tmp_path / "b.zip"), str(plain)])
    assert [i.member for i in inputs] == ["psam_a.csv", "psam_b.csv", None]
    pieces = plan_pieces(inputs, 2)
    by_file = {i: [p for p in pieces if p.file == i] for i in range(3)}
    assert len(by_file[0]) == 1 and len(by_file[1]) == 1
    assert by_file[0][0].rank != by_file[1][0].rank
    tail = Tail()
    text = b"".join(iter_blocks(inputs[0], by_file[0][0], tail, block_bytes=100))
    assert text.count(b"\n") == 50 and tail.ends_with_newline


def test_a_gzip_file_is_one_stream_and_a_line_without_end_is_refused(tmp_path, monkeypatch):
    """A .csv.gz is read whole, from its start, like a zip member; a stream
    that never ends a line (a decompression bomb) fails at the line limit
    instead of filling the memory."""
    import gzip

    from preprocessing import ranges

    path = tmp_path / "g.csv.gz"
    lines = [f"{i},1,2018HU{i:07d},3" for i in range(40)]
    path.write_bytes(gzip.compress(("A,B,SERIALNO,C\n" + "\n".join(lines) + "\n").encode()))
    [inp] = inspect_inputs([str(path)])
    assert inp.gzip and not inp.splittable and inp.header == ("A", "B", "SERIALNO", "C")
    assert inp.size == len("\n".join(lines)) + 16  # the trailer's size: exact below 4 GiB
    [piece] = plan_pieces([inp], 3)
    text = b"".join(iter_blocks(inp, piece, Tail(), block_bytes=50))
    assert text.decode() == "\n".join(lines) + "\n"
    bomb = tmp_path / "bomb.csv.gz"
    bomb.write_bytes(gzip.compress(b"A,B\n" + b"x" * 5000))
    [inp] = inspect_inputs([str(bomb)])
    monkeypatch.setattr(ranges, "MAX_STREAM_LINE", 1000)
    with pytest.raises(PrepError,
                       match=r"bomb.csv.gz: a line longer than 1,000 bytes; this is not"):
        list(iter_blocks(inp, plan_pieces([inp], 1)[0], Tail(), block_bytes=100))


def test_tail_of_a_file_without_final_newline(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("A,B,C\n1,2,3\n4,5")
    [inp] = inspect_inputs([str(path)])
    tail = Tail()
    blocks = list(iter_blocks(inp, plan_pieces([inp], 1)[0], tail))
    assert b"".join(blocks) == b"1,2,3\n4,5"
    assert not tail.ends_with_newline and tail.last_line == b"4,5"


def test_require_columns_picks_the_first_alternative(tmp_path):
    path = tmp_path / "p.csv"
    _write_csv(path, [], header="SERIALNO,RELSHIPP,AGEP")
    [inp] = inspect_inputs([str(path)])
    assert require_columns(inp, {"RELP": ("RELP", "RELSHIPP"), "AGEP": ("AGEP",)}) == {
        "RELP": "RELSHIPP", "AGEP": "AGEP"}
    with pytest.raises(PrepError, match=r"p.csv, line 1: the header lacks ESR"):
        require_columns(inp, {"ESR": ("ESR",)})


def test_parser_fast_path_blanks_and_households():
    parser = BlockParser(("A", "SERIALNO", "B", "C"), ["A", "B"], "SERIALNO")
    cols = parser.parse(b"1,2018HU0000012,5,x\n,2018GQ0000003,,y\n7,2014000000009,8,\n")
    assert cols.n == 3
    assert cols.values["A"].tolist() == [1, 0, 7] and cols.blank["A"].tolist() == [
        False, True, False]
    assert not cols.bad["A"].any()
    assert cols.household.tolist() == [2018 * 10**8 + 12, 2018 * 10**8 + 10**7 + 3,
                                       2014000000009 + (1 << 62)]


def test_parser_flags_text_in_numeric_columns_and_bad_serials():
    parser = BlockParser(("A", "SERIALNO", "B"), ["A", "B"], "SERIALNO")
    cols = parser.parse(b"1,2018HU0000001,2\nabc,2018HU0000002,3\n4,2018XX0000003,1.5\n")
    assert cols.bad["A"].tolist() == [False, True, False]
    assert cols.bad["B"].tolist() == [False, False, True]
    assert cols.examples["A"] == [(1, "abc")] and cols.examples["B"] == [(2, "1.5")]
    assert cols.bad["SERIALNO"].tolist() == [False, False, True]
    assert cols.values["B"][:2].tolist() == [2, 3]


@pytest.mark.parametrize("serial", ["2018HU0000001", "2018GQ0999999", "2019HU1234567",
                                    "2013000012345"])
def test_serial_text_inverts_the_household_id(serial):
    from preprocessing.parse import serial_text

    parser = BlockParser(("SERIALNO", "A"), ["A"], "SERIALNO")
    household = int(parser.parse(f"{serial},1\n".encode()).household[0])
    assert serial_text(household) == serial


def test_sporder_is_the_person_number_and_unknown_is_zero():
    parser = BlockParser(("SERIALNO", "SPORDER", "A"), ["A"], "SERIALNO", person="SPORDER")
    fast = parser.parse(b"2018HU0000001,01,5\n2018HU0000001,2,5\n")
    assert fast.person.tolist() == [1, 2] and not fast.person_bad.any()
    slow = parser.parse(b"2018HU0000001,x,5\n2018HU0000001,,5\n2018HU0000001,3,5\n")
    assert slow.person.tolist() == [0, 0, 3]
    assert slow.person_bad.tolist() == [True, True, False]
    without = BlockParser(("SERIALNO", "A"), ["A"], "SERIALNO").parse(b"2018HU0000001,5\n")
    assert without.person.tolist() == [0] and not without.person_bad.any()
    assert first_unnumbered(without, np.ones(1, bool)) is None


@pytest.mark.parametrize("slow", [False, True], ids=["fast", "text"])
def test_sporder_reads_as_the_task_columns_and_a_bad_one_is_flagged(slow):
    """pandas writes SPORDER as "2.0": the person number 2. A blank, a
    fraction, text, 0 or more than 255 is no person number: flagged, with
    the text as written for the message (either path: an "x" elsewhere in
    the block sends it down the text path)."""
    parser = BlockParser(("SERIALNO", "SPORDER", "A"), ["A"], "SERIALNO", person="SPORDER")
    cells = ["2.0", " 3 ", "1e1", "", "2.5", "two", "0", "256", "-1", "255", "7"]
    if not slow:
        cells = ["2", "3", "10", "", "0", "256", "-1", "255", "7"]
    data = "".join(f"2018HU0000001,{c},{'x' if slow and i == 0 else 5}\n"
                   for i, c in enumerate(cells)).encode()
    got = parser.parse(data)
    numbers = {"2.0": 2, " 3 ": 3, "1e1": 10, "2": 2, "3": 3, "10": 10, "255": 255, "7": 7}
    assert got.person_bad.tolist() == [c not in numbers for c in cells]
    good = ~got.person_bad
    assert got.person[good].tolist() == [numbers[c] for c in cells if c in numbers]
    everyone = np.ones(len(cells), dtype=bool)
    assert first_unnumbered(got, everyone) == (3, "")  # the blank
    texts = {"2.5": "2.5", "two": "two", "0": "0", "256": "256", "-1": "-1"}
    for i, cell in enumerate(cells):
        if cell in texts:  # the first among the records asked about (the kept ones)
            only = np.zeros(len(cells), dtype=bool)
            only[i:] = True
            assert first_unnumbered(got, only) == (i, texts[cell])
    assert first_unnumbered(got, np.zeros(len(cells), dtype=bool)) is None


def test_a_whole_number_written_as_a_decimal_is_that_number():
    """pandas writes an integer column with a blank as floats ("16.0")."""
    parser = BlockParser(("SERIALNO", "A"), ["A"], "SERIALNO")
    rows = ["16.0", "16.5", "1e3", "-3.0", "inf", "nan", "", "x", "3000000000.0", "7"]
    cols = parser.parse("".join(f"2018HU0000001,{r}\n" for r in rows).encode())
    assert cols.bad["A"].tolist() == [False, True, False, False, True, True, False, True,
                                      True, False]
    assert cols.blank["A"].tolist() == [r == "" for r in rows]
    kept = ~cols.bad["A"] & ~cols.blank["A"]
    assert cols.values["A"][kept].tolist() == [16, 1000, -3, 7]
    assert [text for _, text in cols.examples["A"]] == ["16.5", "inf", "nan"]


def test_the_header_is_upper_cased_unless_names_would_collide(tmp_path):
    lower, mixed = tmp_path / "lower.csv", tmp_path / "mixed.csv"
    lower.write_text("serialno,Agep,sex\n2018HU0000001,40,1\n")
    mixed.write_text("SERIALNO,a,A\n2018HU0000001,1,2\n")
    assert inspect_inputs([str(lower)])[0].header == ("SERIALNO", "AGEP", "SEX")
    assert inspect_inputs([str(mixed)])[0].header == ("SERIALNO", "a", "A")


def test_spaces_around_values_read_the_same_on_either_path():
    """`, 40`: polars' integer parser takes a leading space; the text path
    (any block with a bad value) strips both sides, SERIALNO and SPORDER too,
    and a SERIALNO that is not a serial is shown as written."""
    parser = BlockParser(("SERIALNO", "A", "SPORDER"), ["A"], "SERIALNO", person="SPORDER")
    cols = parser.parse(b"2018HU0000001, 40, 1\n 2018HU0000002 ,41 ,02 \n2018XX0000003,7,1\n"
                        b"  ,  ,1\n")
    assert cols.values["A"].tolist()[:3] == [40, 41, 7] and not cols.bad["A"].any()
    assert cols.blank["A"].tolist() == [False, False, False, True]
    assert cols.household.tolist() == [201800000001, 201800000002, -1, -1]
    assert cols.person.tolist() == [1, 2, 1, 1]
    assert cols.bad["SERIALNO"].tolist() == [False, False, True, False]
    assert cols.blank["SERIALNO"].tolist() == [False, False, False, True]
    assert cols.examples["SERIALNO"] == [(2, "2018XX0000003")]
    fast = parser.parse(b"2018HU0000001,40,1\n2018XX0000003,7,1\n")  # no other bad value
    assert fast.examples["SERIALNO"] == [(1, "2018XX0000003")]


def test_empty_lines_are_found_and_a_line_with_data_is_not_empty():
    parser = BlockParser(("SERIALNO", "A", "B"), ["A"], "SERIALNO")
    cols = parser.parse(b"2018HU0000001,1,2\n\n,,\n , ,\r\n,,9\n2018HU0000002,3,4\n")
    assert cols.n == 6
    assert cols.empty.tolist() == [False, True, True, True, False, False]


#: Lines of a 3-field file: empty ones, short and long ones, text in a number.
ODD_LINES = [b"", b"2018HU0000001,1,2", b"  ", b",", b"2018HU0000002,3", b"\r",
             b"2018HU0000003,4,5,6", b" , ,", b"2018HU0000004", b"2018HU0000005,x,7",
             b"2018HU0000006,8,9\r", b",,,", b"2018HU0000007,10,11"]


@pytest.mark.parametrize("check_fields", [False, True])
def test_a_block_reads_the_same_wherever_it_is_cut(check_fields):
    """polars takes a block's number of fields from its first line, and failed on
    a block starting with an empty, short (or long) line that it reads as a
    record further down. A block cut at any line (ranks and the block size cut
    files anywhere) gives the records the whole block gives there."""
    parser = BlockParser(("SERIALNO", "A", "B"), ["A"], "SERIALNO", check_fields=check_fields)
    whole = parser.parse(b"\n".join(ODD_LINES) + b"\n")
    assert whole.n == len(ODD_LINES)
    assert whole.empty.tolist() == [line.strip(b" ,\r") == b"" for line in ODD_LINES]
    assert whole.wrong_fields.tolist() == [check_fields and line.count(b",") != 2
                                           for line in ODD_LINES]
    for cut in range(1, len(ODD_LINES)):
        for end in (b"\n", b""):  # the last block of a file may end without one
            part = parser.parse(b"\n".join(ODD_LINES[cut:]) + end)
            assert part.n == len(ODD_LINES) - cut, cut
            # (not wrong_fields: a part whose wrong lines' commas add up to the
            # right total is not split into lines; its other columns catch them)
            for name in ("household", "empty", "person"):
                assert getattr(part, name).tolist() == getattr(whole, name)[cut:].tolist()
            for table in ("values", "blank", "bad"):
                for column, got in getattr(part, table).items():
                    assert got.tolist() == getattr(whole, table)[column][cut:].tolist(), \
                        (cut, table, column)
