"""Parse blocks of PUMS CSV lines into typed numpy columns with polars.

Only the columns a task needs are converted (polars skips the others while
scanning the line), directly as 32-bit integers. A block that holds
non-numeric text in one of those columns makes polars fail; that block is
parsed again as text, and every unparseable value is flagged (and its text
kept for the error message) instead of failing the run: such records are
dropped and counted by the cleaning step. A whole number written as a
decimal (``16.0``: pandas writes an integer column with a blank as floats)
is that integer, not an error.

``SERIALNO`` is read as text and turned into an integer household id, and
``SPORDER`` (the person's number in the household), where the file has it,
as the person's number: together they name one person, which is how prep
finds a person given twice (:func:`preprocessing.pipeline.check_people_once`).
SPORDER is read as the task's columns are (``2.0`` is 2); one that is blank,
not a whole number, or outside 1 to :data:`MAX_PERSON` is flagged
(``Columns.person_bad``): prep refuses a kept record without a person number
(:func:`first_unnumbered`) rather than skip the check for it.

A line whose number of fields differs from the header's (two records glued
by a lost newline, a line cut short or padded) cannot be trusted: its values
may sit in the wrong columns. polars does not see it when the needed columns
parse: it stops reading a line after the last needed column, which is what
makes parsing fast. With ``check_fields`` every block's commas and newlines
are counted (``bytes.count``: a large share of prep's time, hence opt-in),
a block whose totals do not add up is split into lines to flag the wrong
ones (``Columns.wrong_fields``, dropped first of all by the cleaning step),
and a block that polars cannot parse because of such lines is parsed again
with their extra fields ignored. Without it, a short line is caught only
when a needed column that may not be blank is empty, and extra fields are
ignored or, where polars trips on them, reported as a CSV error. polars
takes a block's number of fields from its first line, so that line is
handed over with the header's (:func:`_first_line_fitted`): a block reads
the same wherever ranks and block sizes cut the file; the file's first
record is checked against the header before any block is read
(:func:`preprocessing.pipeline.check_first_record`).

The text path also reads values without the spaces around them (``, 40``),
as polars' integer parser already does for leading spaces, so a block reads
the same whichever path it takes.

Quoting is off: PUMS files never quote, and a stray quote must not swallow
the following lines (every line is exactly one record, which is what makes
line numbers in messages right).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

#: The column that numbers the persons of a household (with SERIALNO, a person).
PERSON = "SPORDER"
#: The largest SPORDER prep tells apart (one byte per record; 2018's largest is 20).
MAX_PERSON = 255
#: How many bad texts per column are kept for messages.
_KEEP_EXAMPLES = 3
#: Household ids of the old all-digit SERIALNO format (before 2017) are
#: offset so they can never equal a new-format id.
_OLD_SERIAL_OFFSET = 1 << 62


@dataclass
class Columns:
    """Typed columns of consecutive records.

    Attributes:
        n: number of records (lines).
        values: column -> int32 codes (blank and bad entries hold 0).
        blank: column -> bool, the field was empty.
        bad: column -> bool, the field held text that is not an integer (or,
            for ``SERIALNO``, not a serial number).
        examples: column -> [(record index, text)] of the first bad fields.
        household: int64 household id from SERIALNO (-1 where bad or blank).
        person: int32 SPORDER, the person's number in the household, as read
            (0 where blank, not a whole number, or the file has no SPORDER
            column).
        person_bad: bool, the file has a SPORDER column and the record's is
            blank, not a whole number, or outside 1 to :data:`MAX_PERSON`.
        person_text: record index -> the text of a SPORDER that is blank
            (``""``) or not a whole number (for messages).
        empty: bool, the line holds nothing but commas and spaces.
        wrong_fields: bool, the line does not have the header's number of
            fields (its values are unreliable).
        field_counts: int, fields on each line (only filled in for a block
            with such a line; else empty).
        header_fields: the header's number of fields (0 when not needed).
    """

    n: int
    values: dict[str, np.ndarray]
    blank: dict[str, np.ndarray]
    bad: dict[str, np.ndarray]
    examples: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    household: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    person: np.ndarray | None = None
    person_bad: np.ndarray | None = None
    person_text: dict[int, str] = field(default_factory=dict)
    empty: np.ndarray | None = None
    wrong_fields: np.ndarray | None = None
    field_counts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    header_fields: int = 0

    def __post_init__(self) -> None:
        if self.wrong_fields is None:
            self.wrong_fields = np.zeros(self.n, dtype=bool)
        if self.person is None:
            self.person = np.zeros(self.n, dtype=np.int32)
        if self.person_bad is None:
            self.person_bad = np.zeros(self.n, dtype=bool)
        if self.empty is None:
            self.empty = np.zeros(self.n, dtype=bool)


def fields_per_line(data: bytes) -> np.ndarray:
    """Number of comma-separated fields on each line of ``data`` (no quoting;
    a final line without a newline counts)."""
    raw = np.frombuffer(data, dtype=np.uint8)
    ends = np.flatnonzero(raw == ord("\n"))
    if raw.size and raw[-1] != ord("\n"):
        ends = np.append(ends, raw.size)
    commas_before = np.searchsorted(np.flatnonzero(raw == ord(",")), ends)
    return np.diff(commas_before, prepend=0) + 1


def _stripped(pl, name: str):
    """A text column without the spaces around its values ("" is null)."""
    s = pl.col(name).str.strip_chars()
    return pl.when(s != "").then(s)


def _household_expr(pl, name: str, strip: bool = False):
    """SERIALNO text -> int64 household id; null when it is not a serial.

    ``2018HU0001234`` -> 2018*10^8 + 1234, ``2018GQ0001234`` -> 2018*10^8 +
    10^7 + 1234; the all-digit form of older files -> its value + 2^62.
    ``strip``: read it without the spaces around it.
    """
    s = _stripped(pl, name) if strip else pl.col(name)
    year = s.str.slice(0, 4).cast(pl.Int64, strict=False)
    kind = s.str.slice(4, 2)
    number = s.str.slice(6).cast(pl.Int64, strict=False)
    ok_len = s.str.len_bytes() == 13
    new = (pl.when(ok_len & (kind == "HU")).then(year * 10**8 + number)
           .when(ok_len & (kind == "GQ")).then(year * 10**8 + 10**7 + number))
    old = s.cast(pl.Int64, strict=False) + _OLD_SERIAL_OFFSET
    return pl.coalesce(new, pl.when(old >= _OLD_SERIAL_OFFSET).then(old)).alias(name)


def is_empty_line(line: bytes) -> bool:
    """Whether ``line`` holds nothing but commas and spaces (a CR included): no
    record, counted as ``empty_line`` (a double-spaced file, blank lines)."""
    return not line.strip(b" ,\r\t")


def _find_empty_lines(data: bytes, columns: Columns, serial: str) -> None:
    """Set ``columns.empty`` for lines with nothing but commas and spaces; only
    lines whose needed fields (``serial`` among them) are all blank are looked
    at (polars makes one record of every line, an empty one included)."""
    if not columns.blank[serial].any():
        return
    candidates = np.flatnonzero(np.logical_and.reduce(list(columns.blank.values())))
    if not candidates.size:
        return
    lines = data.split(b"\n")
    for i in candidates:
        columns.empty[i] = is_empty_line(lines[i])


def _first_line_fitted(data: bytes, width: int) -> bytes:
    """``data`` with its first line given the header's ``width`` fields, for
    polars: it takes the number of fields of a block from its first line,
    schema or not, and fails on a block that starts with a shorter line (or,
    without ``truncate_ragged_lines``, a longer one), while it reads such
    lines further down as records (missing fields null, extra ones ignored).
    Fitted, a block reads the same wherever the ranks or the block size cut
    the file. An empty line (a blank line after the header, a double-spaced
    file) becomes ``width`` empty fields; a short line is padded with empty
    fields; a long one loses its extra fields. The line stays one record
    (record numbers stay line numbers), and what :func:`_find_empty_lines`
    and ``check_fields`` see is the original."""
    end = data.find(b"\n")
    first = data if end < 0 else data[:end]
    commas = first.count(b",")
    if not data or commas == width - 1:
        return data
    cr = b"\r" if first.endswith(b"\r") else b""
    body = first[:len(first) - len(cr)]
    if is_empty_line(first):
        fitted = b"," * (width - 1)
    elif commas < width - 1:
        fitted = body + b"," * (width - 1 - commas)
    else:
        fitted = b",".join(body.split(b",")[:width])
    return fitted + cr + (b"" if end < 0 else data[end:])


def _whole_decimals(pl, text, bad: np.ndarray, ints: np.ndarray) -> None:
    """Take ``16.0`` (or ``1e3``) as the integer it is: pandas writes an integer
    column that has a blank as floats. Clears ``bad`` and fills ``ints`` where
    a bad text is a finite whole number in the int32 range."""
    number = text.cast(pl.Float64, strict=False).fill_null(np.nan).to_numpy()
    with np.errstate(invalid="ignore"):
        whole = bad & np.isfinite(number) & (number == np.floor(number)) \
            & (np.abs(number) < 2.0**31)
    ints[whole] = number[whole].astype(np.int32)
    bad &= ~whole


def serial_text(household: int) -> str:
    """The SERIALNO that :func:`_household_expr` turned into ``household``."""
    if household >= _OLD_SERIAL_OFFSET:
        return str(household - _OLD_SERIAL_OFFSET)
    year, number = divmod(household, 10**8)
    kind = "GQ" if number >= 10**7 else "HU"
    return f"{year:04d}{kind}{number % 10**7:07d}"


class BlockParser:
    """Parses blocks of one file's records (one header, one column choice).

    Args:
        header: the file's column names, in order.
        int_columns: columns to convert to integers.
        serial: the household serial column (``SERIALNO``).
        person: the person number column (``SPORDER``), or None when the
            file has none.
        check_fields: count every block's fields (see the module docstring).
    """

    def __init__(self, header: tuple[str, ...], int_columns: list[str], serial: str,
                 check_fields: bool = False, person: str | None = None) -> None:
        import polars as pl  # deferred: after prep set POLARS_MAX_THREADS (read at import)

        self.pl = pl
        self.header = header
        self.int_columns = list(dict.fromkeys(int_columns))
        self.serial = serial
        self.check_fields = check_fields
        self.person = person
        self.fast_schema = {c: pl.String for c in header}
        self.fast_schema.update({c: pl.Int32 for c in self.int_columns})
        if person is not None:
            self.fast_schema[person] = pl.Int32
        self.text_schema = {c: pl.String for c in header}

    def _scan(self, data: bytes, schema: dict, ragged: bool = False):
        extra = {"truncate_ragged_lines": True, "extra_columns": "ignore"} if ragged else {}
        return self.pl.scan_csv(data, has_header=False, schema=schema, quote_char=None,
                                raise_if_empty=False, **extra)

    def parse(self, data: bytes) -> Columns:
        """Parse whole lines of CSV text (no header) into :class:`Columns`."""
        pl = self.pl
        person = [] if self.person is None else [pl.col(self.person).alias("__person")]
        readable = _first_line_fitted(data, len(self.header))
        try:
            frame = self._scan(readable, self.fast_schema).select(
                *[pl.col(c) for c in self.int_columns if c != self.serial],
                _household_expr(pl, self.serial),
                pl.col(self.serial).is_null().alias("__serial_blank"),
                *person,
            ).collect()
            # a SERIALNO that is not a serial: read the block as text, to keep
            # its text for the message, or read it without spaces around it
            slow = bool((frame.get_column(self.serial).is_null()
                         & ~frame.get_column("__serial_blank")).any())
        except (pl.exceptions.ComputeError, pl.exceptions.SchemaError,
                pl.exceptions.ShapeError):
            slow = True
        if slow:
            frame = self._scan(readable, self.text_schema, ragged=self.check_fields).select(
                *[_stripped(pl, c).alias(c) for c in self.int_columns if c != self.serial],
                pl.col(self.serial).alias("__serial_text"),
                _household_expr(pl, self.serial, strip=True),
                _stripped(pl, self.serial).is_null().alias("__serial_blank"),
                *([] if self.person is None else [_stripped(pl, self.person).alias("__person")]),
            ).collect()
        columns = self._columns(frame, slow)
        _find_empty_lines(data, columns, self.serial)
        if self.check_fields:
            self._check_field_counts(data, columns)
        return columns

    def _check_field_counts(self, data: bytes, columns: Columns) -> None:
        width = len(self.header)
        lines = data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)
        if data.count(b",") == (width - 1) * lines:
            return  # every line is right, or errors cancel out (caught per column)
        counts = fields_per_line(data)
        if counts.size != columns.n:  # cannot happen: polars makes one row per line
            raise ValueError(f"{counts.size} lines but {columns.n} records in a block")
        columns.wrong_fields = counts != width
        columns.field_counts = counts
        columns.header_fields = width

    def _columns(self, frame, slow: bool) -> Columns:
        pl = self.pl
        n = frame.height
        values, blank, bad, examples = {}, {}, {}, {}
        for name in self.int_columns:
            if name == self.serial:
                continue
            col = frame.get_column(name)
            if slow:
                as_int = col.cast(pl.Int32, strict=False)
                is_bad = (as_int.is_null() & col.is_not_null()).to_numpy()
                ints = as_int.fill_null(0).to_numpy().astype(np.int32)
                if is_bad.any():
                    _whole_decimals(pl, col, is_bad, ints)
                if is_bad.any():
                    rows = np.flatnonzero(is_bad)[:_KEEP_EXAMPLES]
                    examples[name] = [(int(i), col[int(i)]) for i in rows]
                bad[name] = is_bad
                blank[name] = col.is_null().to_numpy() & ~is_bad
                values[name] = ints
                continue
            bad[name] = np.zeros(n, dtype=bool)
            blank[name] = col.is_null().to_numpy()
            values[name] = col.fill_null(0).to_numpy().astype(np.int32, copy=False)
        household = frame.get_column(self.serial)
        serial_blank = frame.get_column("__serial_blank").to_numpy()
        serial_bad = household.is_null().to_numpy() & ~serial_blank
        if serial_bad.any():  # only read as text (parse() makes sure)
            text = frame.get_column("__serial_text")
            rows = np.flatnonzero(serial_bad)[:_KEEP_EXAMPLES]
            examples[self.serial] = [(int(i), text[int(i)]) for i in rows]
        blank[self.serial] = serial_blank
        bad[self.serial] = serial_bad
        person, person_bad, person_text = None, None, {}
        if self.person is not None:
            person, person_bad, person_text = self._person_numbers(
                frame.get_column("__person"), slow)
        return Columns(n=n, values=values, blank=blank, bad=bad, examples=examples,
                       household=household.fill_null(-1).to_numpy(), person=person,
                       person_bad=person_bad, person_text=person_text)

    def _person_numbers(self, col, slow: bool) -> tuple[np.ndarray, np.ndarray, dict]:
        """(SPORDER as read, not a person number, texts of the blank ones and
        of those that are not whole numbers) of the ``__person`` column: int32
        on the fast path, the stripped text on the slow one, read as the task's
        columns are."""
        pl = self.pl
        blank = col.is_null().to_numpy()
        text = dict.fromkeys(np.flatnonzero(blank).tolist(), "")
        if slow:
            as_int = col.cast(pl.Int32, strict=False)
            ints = as_int.fill_null(0).to_numpy().astype(np.int32)
            odd = (as_int.is_null() & col.is_not_null()).to_numpy()
            if odd.any():
                _whole_decimals(pl, col, odd, ints)
                text.update({int(i): col[int(i)] for i in np.flatnonzero(odd)})
        else:
            ints, odd = col.fill_null(0).to_numpy().astype(np.int32), np.zeros(len(col), bool)
        bad = blank | odd | (ints < 1) | (ints > MAX_PERSON)
        return np.where(odd, 0, ints).astype(np.int32), bad, text


def first_unnumbered(columns: Columns, among: np.ndarray) -> tuple[int, str] | None:
    """(record index, SPORDER as written, "" for a blank) of the first record
    of ``among`` (bool per record: the kept ones) whose SPORDER is not a
    person number (``columns.person_bad``), or None."""
    rows = np.flatnonzero(columns.person_bad & among)
    if not rows.size:
        return None
    i = int(rows[0])
    return i, columns.person_text.get(i, str(columns.person[i]))
