"""Input files: what the user passed, checked before any parsing starts.

A PUMS person file comes as ``psam_pNN.csv`` (``ssYYpXX.csv`` before 2017),
inside the Census Bureau's ``csv_pXX.zip``, or gzip-compressed
(``psam_pNN.csv.gz``). :func:`inspect_inputs` opens each one, finds its CSV
(every CSV member of a zip becomes one input), reads its header line and
checks the things that make a file unusable as a whole: missing, unreadable,
empty, not a zip, a zip without a CSV, compressed in a format prep does not
read, a header that is not comma-separated. Each problem is a
:class:`~preprocessing.errors.PrepError` naming the file. Whether the header
has the columns a task needs is checked by the caller
(:func:`require_columns`), which knows the task.
"""
from __future__ import annotations

import gzip
import os
import zipfile
import zlib
from dataclasses import dataclass
from typing import BinaryIO

import kernels.files
from preprocessing.errors import PrepError, where
from preprocessing.parse import is_empty_line

#: The longest header line accepted (the 2018 person header is 1.9 kB).
MAX_HEADER_BYTES = 1 << 20
_OTHER_DELIMITERS = {";": "semicolons", "\t": "tabs", "|": "vertical bars"}
_UTF8_BOM = b"\xef\xbb\xbf"
_GZIP_MAGIC = b"\x1f\x8b"
#: Compressed formats prep does not read, by their first bytes.
_OTHER_COMPRESSION = {b"BZh": ("bzip2", "bunzip2 -k"), b"\xfd7zXZ\x00": ("xz", "unxz -k"),
                      b"\x28\xb5\x2f\xfd": ("zstd", "unzstd"), b"7z\xbc\xaf": ("7-Zip", "7z x")}
#: What reading a damaged archive raises (zip CRC and structure, gzip, zlib, truncation).
DAMAGED = (zipfile.BadZipFile, gzip.BadGzipFile, zlib.error, EOFError)
#: Why an input given twice is refused.
TWICE = ("its people would be in the data twice, so a run's epsilon per person would "
         "not hold; pass it once")
#: Why prep refuses a person found twice in its inputs.
TWICE_PEOPLE = ("those people would be in the data twice, so a run's epsilon per person "
                "would not hold; give each person once (a state as its CSV or its zip, not "
                "both; extracts that do not overlap)")


@dataclass(frozen=True)
class InputFile:
    """One CSV to read: a plain file, or one CSV member of a zip.

    Attributes:
        index: position among all inputs (part of every row's identity).
        path: the path as the user gave it.
        member: the CSV's name inside the zip, or None for a plain or gzip file.
        size: bytes of CSV text (uncompressed size for a zip member; for a
            gzip file an estimate, see :func:`_gzip_size`).
        header: the column names of the first line, upper-cased (PUMS names
            are) unless that would make two of them equal.
        data_start: byte offset of the first record in the CSV text.
    """

    index: int
    path: str
    member: str | None
    size: int
    header: tuple[str, ...]
    data_start: int
    gzip: bool = False

    @property
    def name(self) -> str:
        """How messages name it: ``path`` or ``path:member``."""
        return f"{self.path}:{self.member}" if self.member else self.path

    @property
    def splittable(self) -> bool:
        """Plain files can be read in byte ranges; a zip member or a gzip file
        only as a whole, from its start."""
        return self.member is None and not self.gzip

    def open(self) -> BinaryIO:
        """A binary stream of the CSV text, positioned at its start."""
        if self.gzip:
            return gzip.open(self.path, "rb")
        if self.member is None:
            return open(self.path, "rb", buffering=0)
        archive = zipfile.ZipFile(self.path)
        stream = archive.open(self.member)
        stream._mpidp_archive = archive  # keep the archive open with the stream
        return stream


def _looks_like_a_record(fields: tuple[str, ...]) -> bool:
    """Whether a first line holds values rather than names: most of its fields
    are numbers or empty (a PUMS record), where every column name is a word."""
    values = sum(1 for f in fields if not f or f.lstrip("+-").replace(".", "", 1).isdigit())
    return len(fields) > 1 and values * 2 > len(fields)


def _header_from(stream: BinaryIO, name: str) -> tuple[tuple[str, ...], int]:
    head = stream.read(MAX_HEADER_BYTES)
    if not head:
        raise PrepError(f"{name}: the file is empty; expected a PUMS person file "
                        "(a header line, then one line per person)")
    end = head.find(b"\n")
    if end < 0:
        if len(head) == MAX_HEADER_BYTES:
            raise PrepError(f"{where(name, 1)}: no line end in the first "
                            f"{MAX_HEADER_BYTES >> 20} MiB; this is not a CSV file")
        end = len(head)
    # a UTF-8 byte-order mark (a file saved by Excel as "CSV UTF-8") is no part of the
    # first name; the records' offsets stay those of the whole file
    first = len(_UTF8_BOM) if head.startswith(_UTF8_BOM) else 0
    try:
        text = head[first:end].decode("ascii").rstrip("\r")
    except UnicodeDecodeError:
        raise PrepError(f"{where(name, 1)}: the header is not plain text; this is not "
                        "a PUMS CSV file (a binary or compressed file?)") from None
    columns = tuple(c.strip() for c in text.split(","))
    if len(columns) > 1 and all(len(c) > 1 and c[0] == c[-1] == '"' for c in columns):
        raise PrepError(f"{where(name, 1)}: the column names are in quotes ({columns[0]}, "
                        f"{columns[1]}, ...); PUMS files never quote, and mpidp prep reads "
                        "every line as one record with quoting off: write the file without "
                        "quotes (pandas: to_csv(..., quoting=csv.QUOTE_MINIMAL))")
    if len(columns) == 1:
        for delimiter, what in _OTHER_DELIMITERS.items():
            if text.count(delimiter) >= 2:
                raise PrepError(f"{where(name, 1)}: the columns are separated by {what}, "
                                "not commas; PUMS files are comma-separated (save the "
                                "file as CSV with ',' as the delimiter)")
    if _looks_like_a_record(columns):
        raise PrepError(f"{where(name, 1)}: the first line is a record, not the header "
                        f"({columns[0]!r}, {columns[1]!r}, ...: values, not column names); "
                        "the file's header line is missing (a PUMS file starts with the "
                        "column names: RT,SERIALNO,...)")
    if len(set(columns)) != len(columns):
        dups = sorted({c for c in columns if columns.count(c) > 1})
        raise PrepError(f"{where(name, 1)}: duplicate column names in the header: "
                        f"{', '.join(dups[:5])}")
    # names are matched without case (a tool that lower-cases them, as some R and
    # SQL exports do): the records are read by position, under these names
    upper = tuple(c.upper() for c in columns)
    return (upper if len(set(upper)) == len(upper) else columns), min(end + 1, len(head))


def first_undecodable_line(inp: InputFile) -> int | None:
    """The number of the first line after the header that is not UTF-8, or None
    (for a message: it reads the whole file)."""
    with inp.open() as stream:
        stream.read(inp.data_start)
        for number, line in enumerate(stream, start=2):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError:
                return number
    return None


def first_record_fields(inp: InputFile) -> tuple[int, int] | None:
    """(line number, comma-separated fields) of the first record: the first line
    after the header that is not empty (nothing but commas and spaces); None
    where there is none within the first MiB."""
    with inp.open() as stream:
        stream.read(inp.data_start)
        text = stream.read(MAX_HEADER_BYTES)
    lines = text.split(b"\n")
    for number, line in enumerate(lines[:-1], start=2):  # the last may be cut short
        if not is_empty_line(line):
            return number, line.count(b",") + 1
    return None


def _inspect_zip(path: str, first_index: int) -> list[InputFile]:
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        raise PrepError(f"{path}: not a valid zip archive (damaged or incomplete "
                        "download?)") from None
    with archive:
        members = [m for m in archive.infolist()
                   if not m.is_dir() and m.filename.lower().endswith(".csv")]
        if not members:
            names = ", ".join(m.filename for m in archive.infolist()[:5]) or "nothing"
            raise PrepError(f"{path}: the zip archive holds no .csv file (it holds "
                            f"{names}); pass the person-file zip csv_pXX.zip")
        found = []
        for offset, member in enumerate(sorted(members, key=lambda m: m.filename)):
            label = f"{path}:{member.filename}"
            try:
                with archive.open(member) as stream:
                    header, data_start = _header_from(stream, label)
            except (*DAMAGED, OSError) as exc:
                raise PrepError(f"{label}: cannot decompress ({exc})") from None
            found.append(InputFile(first_index + offset, path, member.filename,
                                   member.file_size, header, data_start))
        return found


def inspect_inputs(paths: list[str]) -> list[InputFile]:
    """Open every input and read its header (no records are parsed).

    Args:
        paths: CSV files and zip archives, in the order given by the user.

    Returns:
        One :class:`InputFile` per CSV, indices 0, 1, ... in that order.

    Raises:
        PrepError: a path is missing, unreadable, empty, a damaged zip or a
            zip without a CSV, its header is not comma-separated, or it names
            a file given before (by any spelling or link).
    """
    if not paths:
        raise PrepError("no input files; pass PUMS person files (psam_pNN.csv) or "
                        "their zips (csv_pXX.zip)")
    inputs: list[InputFile] = []
    for i, path in enumerate(paths):
        if not os.path.exists(path):
            raise PrepError(f"{path}: no such file")
        earlier = kernels.files.same_as(path, {p: p for p in paths[:i]})
        if earlier is not None:
            what = (f"{path} is given twice" if earlier == path
                    else f"{earlier} and {path} are the same file")
            raise PrepError(f"{what}: {TWICE}")
        if os.path.isdir(path):
            raise PrepError(f"{path}: is a directory; pass the CSV or zip files in it")
        if not os.access(path, os.R_OK):
            raise PrepError(f"{path}: permission denied (cannot read the file)")
        if zipfile.is_zipfile(path):
            inputs.extend(_inspect_zip(path, len(inputs)))
            continue
        if path.lower().endswith(".zip"):
            raise PrepError(f"{path}: not a valid zip archive (damaged or incomplete "
                            "download?)")
        with open(path, "rb") as stream:
            magic = stream.read(8)
        if magic.startswith(_GZIP_MAGIC):
            inputs.append(_inspect_gzip(path, len(inputs)))
            continue
        _refuse_other_compression(path, magic)
        size = os.path.getsize(path)
        with open(path, "rb") as stream:
            header, data_start = _header_from(stream, path)
        inputs.append(InputFile(len(inputs), path, None, size, header, data_start))
    return inputs


def _refuse_other_compression(path: str, magic: bytes) -> None:
    for start, (what, command) in _OTHER_COMPRESSION.items():
        if magic.startswith(start):
            raise PrepError(f"{path}: the file is {what}-compressed; mpidp prep reads CSV "
                            f"files, their gzip (.gz) and the Census zips: decompress it "
                            f"first ({command} {path})")


def _gzip_size(path: str) -> int:
    """The uncompressed size of a gzip file, for balancing and progress only:
    its trailer's size modulo 4 GiB (of the last member), raised by 4 GiB
    steps to at least the compressed size."""
    compressed = os.path.getsize(path)
    with open(path, "rb") as stream:
        stream.seek(max(0, compressed - 4))
        size = int.from_bytes(stream.read(4), "little")
    while size < compressed:
        size += 1 << 32
    return size


def _inspect_gzip(path: str, index: int) -> InputFile:
    try:
        with gzip.open(path, "rb") as stream:
            header, data_start = _header_from(stream, path)
    except (*DAMAGED, OSError) as exc:
        raise PrepError(f"{path}: cannot decompress ({exc}); a damaged or incomplete "
                        "download?") from None
    return InputFile(index, path, None, _gzip_size(path), header, data_start, gzip=True)


#: Columns of a PUMS person file that a housing file lacks (SPORDER, the person's
#: number in the household; AGEP, the age).
PERSON_COLUMNS = frozenset({"SPORDER", "AGEP"})


def require_columns(inp: InputFile, needed: dict[str, tuple[str, ...]]) -> dict[str, str]:
    """Pick, for each needed variable, the first of its columns in the header.

    Args:
        needed: variable -> acceptable column names in order of preference
            (e.g. ``{"RELP": ("RELP", "RELSHIPP")}``).

    Returns:
        variable -> the column name found.

    Raises:
        PrepError: some variable has none of its columns in the header; the
            message tells a person file (one with :data:`PERSON_COLUMNS`: a column
            of another survey year, or an extract) from a housing file or another
            table.
    """
    present = set(inp.header)
    chosen, missing = {}, []
    for variable, options in needed.items():
        column = next((c for c in options if c in present), None)
        if column is None:
            missing.append(" or ".join(options))
        else:
            chosen[variable] = column
    if missing:
        shown = ", ".join(inp.header[:6]) + (", ..." if len(inp.header) > 6 else "")
        it = "it" if len(missing) == 1 else "them"
        fix = ("pass ACS PUMS person files (psam_pNN.csv), not housing files or extracts"
               if not PERSON_COLUMNS & present else
               f"a person file without {it} (an extract, or a survey year that names {it} "
               f"otherwise): pass full ACS PUMS person files (psam_pNN.csv), or a task or "
               f"--universe that does not read {it}")
        raise PrepError(f"{where(inp.name, 1)}: the header lacks {', '.join(missing)} "
                        f"(it has {len(inp.header)} columns: {shown}); {fix}")
    return chosen

