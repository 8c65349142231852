"""The SPMD steps of ``mpidp prep``: every rank calls :func:`prepare`.

::

    settings (rank 0 checks inputs, output, --like; broadcast)
    parse    each rank parses its pieces (byte ranges / whole zip members)
    number   allgather of piece sizes -> each record's file and line
    clean    drop + count per reason; --max-invalid-share check per file
    split    household hash -> train/val/test (keyed by --household-secret where one
             is given); exact global statistics (allreduce)
    shuffle  random key per household and per record (keyed alike), distributed bucket sort
             (Alltoallv): households in random order, each one's rows together;
             keyed hash of each household (the /s/household keys); a person
             (SERIALNO, SPORDER) found twice is refused
    write    rank 0 creates the file; every rank encodes and writes its rows;
             rank 0 adds the attributes and renames the file into place

Errors a user can fix are raised as :class:`PrepError` on the rank that
finds them and agreed on at the end of each step (:func:`agree`), so every
rank stops with the same one-line message instead of a rank aborting alone.
The write step is :mod:`preprocessing.write_step`.
"""
from __future__ import annotations

import hashlib
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from collectives import MPI
from preprocessing import encoding as enc, groups as group_attributes, h5format, h5write, \
    households, shuffle
from preprocessing.agreement import agree
from preprocessing.cleaning import Cleaner, Cleaned, code_dtype, reason_names
from preprocessing.dictionary import Codebook
from preprocessing.errors import PrepError, where
from preprocessing.inputs import (DAMAGED, TWICE, InputFile, first_record_fields,
                                  first_undecodable_line)
from preprocessing.parse import MAX_PERSON, PERSON, BlockParser, first_unnumbered, serial_text
from preprocessing.ranges import Piece, Tail, iter_blocks, plan_hashing, plan_pieces
from preprocessing.tasks import Task
from preprocessing.write_step import attributes, group_field, write_output

#: Why prep refuses a (SERIALNO, SPORDER) found twice: it cannot tell one
#: person given twice from files that number their households alike.
REPEATED = ("the same person given twice (a state as its CSV and as its zip, overlapping "
            "extracts), whose epsilon per person would not hold, or files that number their "
            "households alike (mpidp synth numbers them from 0000001 whatever --seed: write "
            "one file with more --rows); give each SERIALNO and SPORDER once")


@dataclass
class Settings:
    """Everything every rank needs to know before parsing (rank 0 builds it)."""

    inputs: list[InputFile]
    sources: dict[int, dict[str, str]]  # file index -> task variable -> CSV column
    task: Task
    codebook: Codebook
    out: str
    seed: int = 0
    test_fraction: float = 0.2
    val_fraction: float = 0.0  # share of the training households in /val (0: no /val)
    max_invalid_share: float = 0.05
    compression: h5write.Compression = field(default_factory=h5write.Compression)
    like: str | None = None
    like_encoding: str | None = None
    layout: str = "onehot"  # categorical columns (--encoding): onehot or codes
    quiet: bool = False
    check_fields: bool = False  # count every line's fields (--check-fields)
    # key of the household hash (never written); one given (not a households.DrawnSecret)
    # also keys the split and the order: households.order_key
    household_secret: bytes = b""


@dataclass
class Report:
    """What :func:`prepare` did (identical on every rank)."""

    records: int  # lines read, less the empty ones
    kept: int
    train: int
    test: int
    n_features: int
    drop_counts: dict[str, int]
    seconds: float
    out_bytes: int
    steps: dict[str, float] = field(default_factory=dict)
    per_rank: list = field(default_factory=list)  # [hash s, read s, bytes] per rank
    val: int | None = None  # rows of /val, None when the file has none
    empty_lines: int = 0
    label_counts: tuple[int, ...] = ()  # kept records per class, all splits


# -- read: parse and clean, block by block ---------------------------------------

@dataclass
class Part:
    """One block of records: how many, what cleaning made of them, and the
    first kept record without a person number (index in the block, its
    SPORDER text: :func:`preprocessing.parse.first_unnumbered`), if any."""

    n: int
    cleaned: Cleaned
    unnumbered: tuple[int, str] | None = None


@dataclass
class Parsed:
    """A piece read by this rank: its blocks in order, and the end of file seen."""

    piece: Piece
    parts: list[Part]
    tail: Tail

    @property
    def n(self) -> int:
        return sum(part.n for part in self.parts)


def _in_order(work, blocks, threads: int, progress) -> list:
    """``work(block)`` for each block, ``threads`` at a time, results in order
    (polars and numpy release the GIL); at most ``threads + 1`` blocks in memory."""
    def tick(result, size: int):
        if progress is not None:
            progress.update(size)
        return result

    if threads <= 1:
        return [tick(work(b), len(b)) for b in blocks]
    results = []
    with ThreadPoolExecutor(threads) as pool:
        pending: deque = deque()
        for block in blocks:
            pending.append((pool.submit(work, block), len(block)))
            if len(pending) > threads:
                future, size = pending.popleft()
                results.append(tick(future.result(), size))
        while pending:
            future, size = pending.popleft()
            results.append(tick(future.result(), size))
    return results


def read_pieces(settings: Settings, pieces: list[Piece], threads: int, progress=None,
                observe=None) -> list[Parsed]:
    """Parse and clean this rank's pieces, one block of lines at a time (the
    typed columns of a block are dropped as soon as it is cleaned).

    Args:
        observe: ``observe(input, offset, block)`` sees every block of a
            plain file as it is read (the hasher uses it).
    """
    parsed, workers = [], {}
    for piece in pieces:
        inp = settings.inputs[piece.file]
        sources = settings.sources[piece.file]
        key = (inp.header, tuple(sorted(sources.items())))
        if key not in workers:
            parser = BlockParser(inp.header, sorted(set(sources.values())), "SERIALNO",
                                 check_fields=settings.check_fields,
                                 person=PERSON if PERSON in inp.header else None)
            cleaner = Cleaner(settings.task, settings.codebook, sources)

            def work(block: bytes, parser=parser, cleaner=cleaner) -> Part:
                columns = parser.parse(block)
                cleaned = cleaner.clean(columns)
                return Part(columns.n, cleaned, first_unnumbered(columns, cleaned.reason == 0))

            workers[key] = work
        if piece.seq == 0:
            check_first_record(inp, settings.check_fields)
        tail = Tail()
        see = (lambda offset, block, inp=inp: observe(inp, offset, block)) if observe else None
        try:
            parts = _in_order(workers[key], iter_blocks(inp, piece, tail, observe=see),
                              threads, progress)
        except DAMAGED as exc:  # a zip member's CRC, a gzip stream cut short, ...
            raise PrepError(f"{inp.name}: cannot decompress ({exc}); a damaged or "
                            "incomplete download?") from None
        except OSError as exc:
            raise PrepError(f"{inp.name}: cannot read: {exc}") from None
        except Exception as exc:  # polars: a structure it cannot read at all
            if type(exc).__module__.startswith("polars"):
                raise PrepError(_unreadable(inp, str(exc))) from None
            raise
        parsed.append(Parsed(piece, parts, tail))
    return parsed


def check_first_record(inp: InputFile, check_fields: bool) -> None:
    """Raise PrepError when the file's first record has another number of
    fields than its header: the header and the records do not match (or
    every line ends with a comma), so no line can be read right. A longer
    first line with ``check_fields`` is one of the lines that check drops.
    Later lines with the wrong number of fields are the cleaning's
    (``field_count``), wherever the blocks are cut."""
    try:
        first = first_record_fields(inp)
    except (OSError, *DAMAGED):
        return  # reading the blocks says what is wrong with the file
    width = len(inp.header)
    if first is None or first[1] == width or (check_fields and first[1] > width):
        return
    line, fields = first
    hint = ("the header ends with a comma" if inp.header[-1] == "" else
            "the lines end with a comma" if fields == width + 1 else
            "the header and the records do not match")
    raise PrepError(f"{where(inp.name, line)}: the line has {fields} fields, the header "
                    f"{width} ({hint}); every line must have the header's fields")


def _unreadable(inp: InputFile, polars_message: str) -> str:
    """The message for a file polars cannot parse: lines with other numbers of
    fields than the header in words, else polars' first line."""
    fewer, more = "n_missing" in polars_message, "n_extra" in polars_message
    if "invalid utf-8" in polars_message.lower():
        try:
            line = first_undecodable_line(inp)
        except (OSError, *DAMAGED):
            line = None
        if line is not None:
            return (f"{where(inp.name, line)}: bytes that are not UTF-8 text (a damaged "
                    "file, or one saved in another encoding: save it as UTF-8)")
    if not (fewer or more):
        return f"{inp.name}: cannot parse as CSV: {polars_message.splitlines()[0]}"
    return (f"{inp.name}: a line has {'fewer' if fewer else 'more'} fields than the header's "
            f"{len(inp.header)}; --check-fields finds such lines (and drops them, up to "
            "--max-invalid-share)")


def row_offsets(comm, parsed: list[Parsed]) -> dict[tuple[int, int], int]:
    """(file, seq) -> number of records of that file before the piece."""
    mine = [(p.piece.file, p.piece.seq, p.n) for p in parsed]
    every = sorted(x for part in comm.allgather(mine) for x in part)
    offsets, running = {}, {}
    for file, seq, n in every:
        offsets[(file, seq)] = running.get(file, 0)
        running[file] = running.get(file, 0) + n
    return offsets


def check_truncation(settings: Settings, parsed: list[Parsed],
                     offsets: dict[tuple[int, int], int]) -> None:
    """A file that ends in the middle of a record is incomplete: fatal."""
    for p in parsed:
        if p.tail.ends_with_newline or not p.tail.last_line:
            continue
        inp = settings.inputs[p.piece.file]
        fields = p.tail.last_line.count(b",") + 1
        if fields < len(inp.header):
            line = offsets[(p.piece.file, p.piece.seq)] + p.n + 1
            raise PrepError(f"{where(inp.name, line)}: the last line is cut short "
                            f"({fields} of {len(inp.header)} fields): the file is "
                            "incomplete; download it again")


def check_person_numbers(comm, settings: Settings, parsed: list[Parsed], offsets) -> None:
    """Raise PrepError on every rank where a kept record's SPORDER is blank,
    not a whole number, or outside 1 to 255: with its person number unknown,
    a person given twice could not be found (:func:`check_people_once`), so
    the file is refused rather than prepared without the check. Names the
    first such line of the first such file, whatever the ranks; collective."""
    mine = [(p.piece.file, first + part.unnumbered[0] + 2, part.unnumbered[1])
            for p in parsed for first, part in _parts(p, offsets)
            if part.unnumbered is not None]  # (file, line, SPORDER text)
    found = [f for f in comm.allgather(min(mine, default=None)) if f is not None]
    if not found:
        return
    file, line, text = min(found)
    value = "blank" if text == "" else repr(text)
    raise PrepError(f"{where(settings.inputs[file].name, line)}: SPORDER is {value}, not a "
                    f"person number (a whole number from 1 to {MAX_PERSON}), so a person "
                    "given twice could not be found; write each person's number as the "
                    "Census Bureau's files do, or leave the SPORDER column out to prepare "
                    "the file without that check", collective=True)


def _parts(p: Parsed, offsets) -> Iterator[tuple[int, Part]]:
    """(number in its file of the block's first record, block) of a piece."""
    first = offsets[(p.piece.file, p.piece.seq)]
    for part in p.parts:
        yield first, part
        first += part.n


# -- clean -----------------------------------------------------------------

def describe(reason: str, column: str, text: str) -> str:
    """A record's problem in words."""
    kind = reason.split(":", 1)[0]
    if reason == "field_count":
        return f"the line has {text}"
    if reason == "invalid:SERIALNO":
        return f"SERIALNO {text!r} is not a PUMS serial number"
    if kind == "non_numeric":
        return f"{column} is {text!r}, not a number"
    if kind == "blank":
        return f"{column} is blank, which the data dictionary does not allow"
    return f"{column} = {text} is not a code of the 2018 data dictionary"


def _blocks(parsed: list[Parsed], offsets) -> Iterator[tuple[Parsed, int, Cleaned]]:
    """(piece, number in its file of the block's first record, cleaned block)."""
    for p in parsed:
        for first, part in _parts(p, offsets):
            yield p, first, part.cleaned


def count_reasons(comm, settings: Settings, parsed: list[Parsed],
                  offsets) -> tuple[np.ndarray, list]:
    """Global per-file reason counts ``[files, reasons]`` and, per file, the
    first invalid record as ``(line, reason, column, text)``; collective."""
    reasons = reason_names(settings.task)
    counts = np.zeros((len(settings.inputs), len(reasons)), dtype=np.int64)
    firsts: list = [None] * len(settings.inputs)
    for p, first, c in _blocks(parsed, offsets):
        counts[p.piece.file] += np.bincount(c.reason, minlength=len(reasons))
        if c.first_bad is not None:
            row, column, text = c.first_bad
            found = (first + row + 2, reasons[int(c.reason[row])], column, text)
            if firsts[p.piece.file] is None or found < firsts[p.piece.file]:
                firsts[p.piece.file] = found
    total = np.zeros_like(counts)
    comm.Allreduce(counts, total, op=MPI.SUM)
    merged: list = [None] * len(settings.inputs)
    for theirs in comm.allgather(firsts):
        for i, found in enumerate(theirs):
            if found is not None and (merged[i] is None or found < merged[i]):
                merged[i] = found
    return total, merged


def records_per_file(counts: np.ndarray, reasons: list[str]) -> np.ndarray:
    """Records of each file in :func:`count_reasons`' ``[files, reasons]``
    counts: its lines, less the empty ones (no records)."""
    return counts.sum(axis=1) - counts[:, reasons.index("empty_line")]


def check_invalid_share(settings: Settings, counts: np.ndarray, firsts: list) -> None:
    reasons = reason_names(settings.task)
    universe = reasons.index("universe")
    per_file = records_per_file(counts, reasons)
    for inp in settings.inputs:
        row = counts[inp.index]
        records = int(per_file[inp.index])
        invalid = records - int(row[0]) - int(row[universe])
        if records and invalid / records > settings.max_invalid_share:
            line, reason, column, text = firsts[inp.index]
            raise PrepError(
                f"{where(inp.name, line)}: {describe(reason, column, text)}; "
                f"{invalid:,} of {records:,} records ({invalid / records:.1%}) are invalid, "
                f"more than --max-invalid-share {settings.max_invalid_share:g}")


# -- split, statistics, shuffle ---------------------------------------------

def record_dtype(task: Task, codebook: Codebook, files: int = 1) -> np.dtype:
    """One kept record as it travels between ranks: the compact code of every
    feature, the label, the split (:data:`preprocessing.shuffle.TRAIN`, ``VAL``
    or ``TEST``), the household's shuffle key, the household
    id, the record's own shuffle key and (filled after the shuffle) the
    household's keyed hash, the int16 code of each group attribute
    (:func:`group_field`), the index of its input file (of ``files``) and its
    SPORDER (uint8, 0 where not known; ~68 bytes)."""
    fields = [(f.name, code_dtype(f, codebook)) for f in task.features]
    fields += [(group_field(a.name), group_attributes.DTYPE) for a in task.groups()]
    return np.dtype(fields + [("__y", np.int8), ("__split", np.uint8), ("__key", np.uint64),
                              ("__hh", np.int64), ("__row", np.uint64),
                              ("__hkey", np.uint64),
                              ("__file", np.uint16 if files <= 1 << 16 else np.uint32),
                              ("__sp", np.uint8)])


def build_records(settings: Settings, parsed: list[Parsed], offsets,
                  dtype: np.dtype) -> np.ndarray:
    """This rank's kept records: codes, label, split, household and shuffle keys
    (SplitMix64 of the seed, or keyed by a given secret: :mod:`preprocessing.shuffle`)."""
    n = sum(len(part.cleaned.label) for p in parsed for part in p.parts)
    records = np.empty(n, dtype=dtype)
    key = households.order_key(settings.household_secret, settings.seed)
    at = 0
    for p, first, c in _blocks(parsed, offsets):
        k = len(c.label)
        part = records[at:at + k]
        for feature in settings.task.features:
            part[feature.name] = c.codes[feature.name]
        for name, codes in c.groups.items():
            part[group_field(name)] = codes
        part["__y"] = c.label
        part["__split"], part["__key"] = shuffle.split_and_household_keys(
            c.household, settings.seed, settings.test_fraction, settings.val_fraction, key)
        rows = first + np.flatnonzero(c.reason == 0)
        part["__hh"] = c.household
        part["__row"] = shuffle.shuffle_keys(settings.seed, p.piece.file, rows, key)
        part["__hkey"] = 0
        part["__file"] = p.piece.file
        part["__sp"] = np.where((c.person > 0) & (c.person <= MAX_PERSON), c.person, 0)
        at += k
    return records


def global_sums(comm, settings: Settings, records: np.ndarray) -> dict[str, tuple]:
    """Exact (count, sum, sum of squares) of each numeric feature over the
    training split (without the validation rows), added over the ranks."""
    train = records[records["__split"] == shuffle.TRAIN]
    mine = {f.name: enc.local_sums(train[f.name]) for f in settings.task.features
            if f.kind == "numeric"}
    totals = {}
    for name in mine:
        parts = comm.allgather(mine[name])
        totals[name] = tuple(sum(p[i] for p in parts) for i in range(3))
    return totals


# -- write -----------------------------------------------------------------

class Hasher:
    """sha256 of the input files; file ``path`` is hashed by rank ``owner[path]``.

    A plain file's bytes that this rank parses anyway are hashed as they are
    read (:meth:`observe`, while they are contiguous from the file's start);
    :meth:`finish` reads and hashes whatever is left.
    """

    def __init__(self, inputs: list[InputFile], owner: dict[str, int], rank: int) -> None:
        self.digests: dict[str, str] = {}
        paths = dict.fromkeys(inp.path for inp in inputs)
        self.state = {path: hashlib.sha256() for path in paths if owner[path] == rank}
        self.done = {path: 0 for path in self.state}

    def observe(self, inp: InputFile, offset: int, block: bytes) -> None:
        path = inp.path
        if path not in self.state or not inp.splittable:
            return
        if self.done[path] == 0 and offset == inp.data_start:
            with open(path, "rb") as handle:
                self.state[path].update(handle.read(inp.data_start))
            self.done[path] = inp.data_start
        if offset == self.done[path]:
            self.state[path].update(block)
            self.done[path] += len(block)

    def finish(self) -> None:
        """Hash the rest of every file this rank owns."""
        buffer = bytearray(8 << 20)
        view = memoryview(buffer)
        for path, digest in self.state.items():
            with open(path, "rb", buffering=0) as handle:
                handle.seek(self.done[path])
                while True:
                    n = handle.readinto(view)
                    if not n:
                        break
                    digest.update(view[:n])
            self.digests[path] = digest.hexdigest()

    def gather(self, comm) -> dict[str, str]:
        """path -> sha256 hex digest, on every rank; collective."""
        merged: dict[str, str] = {}
        for part in comm.allgather(self.digests):
            merged.update(part)
        return merged


def check_distinct_contents(files: list[InputFile], digests: dict[str, str]) -> None:
    """Raise PrepError (collective: every rank holds the same ``digests``, path
    -> sha256) where two input files have the same sha256: a copy of a file
    given beside it."""
    seen: dict[str, str] = {}
    for path in dict.fromkeys(inp.path for inp in files):  # a zip's members: one file
        digest = digests.get(path)
        if digest is not None and digest in seen:
            raise PrepError(f"{seen[digest]} and {path} have the same contents (sha256 "
                            f"{digest[:12]}...): {TWICE}", collective=True)
        if digest is not None:
            seen[digest] = path


# -- the whole run -----------------------------------------------------------

class _Clock:
    """Seconds per step, on this rank's clock."""

    def __init__(self) -> None:
        self.started = self.last = time.perf_counter()
        self.steps: dict[str, float] = {}

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.steps[name] = now - self.last
        self.last = now


def split_and_shuffle(comm, records: np.ndarray, secret: bytes,
                      with_val: bool = False) -> dict[str, tuple]:
    """Distributed sort by (household key, household, record key), then each
    household's keyed hash (``__hkey``); collective.

    Returns:
        ``"train"``/``"val"``/``"test"`` (``"val"`` only ``with_val``), in the
        order they are written -> (this rank's records of the split in final
        order, the global row of the first of them, the split's global size,
        the split's global number of households).
    """
    received, order = shuffle.sort_across_ranks(records, "__key", comm, ties=("__hh", "__row"))
    split = received["__split"][order]
    codes = {"train": shuffle.TRAIN, "val": shuffle.VAL, "test": shuffle.TEST}
    names = [s for s in h5format.SPLITS if with_val or s != "val"]
    splits = {}
    for name, selection in ((n, order[split == codes[n]]) for n in names):
        part = shuffle.take(received, selection)
        part["__hkey"] = households.household_keys(part["__hh"], secret)
        # A household is whole on this rank (one bucket) and consecutive.
        starts = int(len(part) > 0) + int(np.count_nonzero(part["__hh"][1:] != part["__hh"][:-1]))
        n = np.array([len(part), starts], dtype=np.int64)
        first, total = np.zeros(2, dtype=np.int64), np.zeros(2, dtype=np.int64)
        comm.Exscan(n, first, op=MPI.SUM)
        comm.Allreduce(n, total, op=MPI.SUM)
        splits[name] = (part, int(first[0]) if comm.Get_rank() else 0, int(total[0]),
                        int(total[1]))
    return splits


def _popcount(words: np.ndarray) -> np.ndarray:
    """Set bits of each uint64 (numpy < 2 has no ``bitwise_count``)."""
    if hasattr(np, "bitwise_count"):
        return np.bitwise_count(words).astype(np.int64)
    return np.unpackbits(words.view(np.uint8).reshape(-1, 8), axis=1).sum(axis=1)


def _repeats_by_sorting(group: np.ndarray, person: np.ndarray) -> tuple[int, int | None]:
    """(repeats, index of a repeated record or None) of (group, person) pairs."""
    key = (group << 8) | person
    ordered = np.sort(key)
    repeats = ordered[1:] == ordered[:-1]
    count = int(np.count_nonzero(repeats))
    if not count:
        return 0, None
    return count, int(np.flatnonzero(key == ordered[1:][repeats][0])[0])


def repeated_people(part: np.ndarray) -> tuple[int, tuple | None]:
    """Records of ``part`` that repeat a person (the same household and
    SPORDER) of another record of ``part``, whose households are whole and
    consecutive; SPORDER 0 (not known) is never a repeat.

    SPORDER 1..63 (every real household) are counted in linear time: one bit
    per person, a household's bits ORed together, and a household has a
    repeat where it has more records than bits set. Larger ones are sorted.

    Returns:
        ``(count, example)``: example is ``(household id, SPORDER, file
        index, file index)`` of one person found twice, or None.
    """
    person = part["__sp"]
    known = np.flatnonzero(person > 0)
    if known.size < 2:
        return 0, None
    households = part["__hh"][known]
    new = np.empty(known.size, dtype=bool)
    new[0] = True
    np.not_equal(households[1:], households[:-1], out=new[1:])
    small = person[known] < 64
    every_small = bool(small.all())
    group = None if every_small else np.cumsum(new) - 1
    count, repeated = 0, None
    if small.any():
        rows = known if every_small else known[small]
        starts = np.flatnonzero(new if every_small else
                                np.concatenate([[True], np.diff(group[small]) != 0]))
        sizes = np.diff(starts, append=rows.size)
        bits = np.left_shift(np.uint64(1), person[rows].astype(np.uint64))
        missing = sizes - _popcount(np.bitwise_or.reduceat(bits, starts))
        count = int(missing.sum())
        if count:
            at = int(np.argmax(missing > 0))
            members = rows[starts[at]:starts[at] + sizes[at]]
            _, first, seen = np.unique(person[members], return_index=True, return_counts=True)
            repeated = int(members[first[np.argmax(seen > 1)]])
    if not every_small:
        more, index = _repeats_by_sorting(group[~small], person[known[~small]].astype(np.int64))
        count += more
        if repeated is None and index is not None:
            repeated = int(known[~small][index])
    if repeated is None:
        return 0, None
    twins = np.flatnonzero((part["__hh"] == part["__hh"][repeated])
                           & (person == person[repeated]))[:2]
    files = part["__file"][twins]
    return count, (int(part["__hh"][repeated]), int(person[repeated]), int(files[0]),
                   int(files[1]))


def check_people_once(comm, inputs: list[InputFile], splits: dict[str, tuple]) -> None:
    """Raise PrepError on every rank where a person (household SERIALNO and
    SPORDER) is in the inputs twice: overlapping extracts, or a state given
    both as a CSV and as its zip, put one person's data in the file twice,
    and a run's epsilon per person would not hold. Files whose serial
    numbers overlap (mpidp synth's of different seeds) are refused alike:
    nothing tells them from copies, and the message says both. Collective;
    ``splits`` as :func:`split_and_shuffle` returns them (a household is
    whole in one split on one rank)."""
    count, example = 0, None
    for part, *_ in splits.values():
        found, seen = repeated_people(part)
        count += found
        example = example or seen
    total = comm.allreduce(count, op=MPI.SUM)
    if not total:
        return
    household, person, a, b = next(e for e in comm.allgather(example) if e is not None)
    one = f"person {person} (SPORDER) of household {serial_text(household)}"
    where_ = (f"{inputs[a].name} holds {one} twice" if a == b else
              f"{inputs[min(a, b)].name} and {inputs[max(a, b)].name} both hold {one}")
    repeat = "1 kept record repeats" if total == 1 else f"{total:,} kept records repeat"
    raise PrepError(f"{where_} ({repeat} the SERIALNO and SPORDER of another): {REPEATED}",
                    collective=True)


def prepare(comm, settings: Settings, threads: int = 1, version: str = "") -> Report:
    """Run every step on every rank of ``comm``; collective.

    Args:
        threads: parser threads per rank (cores per rank).
        version: written into ``created_by``.

    Raises:
        PrepError: bad input, too many invalid records, no record left, or
            an output that cannot be written (raised on every rank).
    """
    clock = _Clock()
    rank, size = comm.Get_rank(), comm.Get_size()
    task = settings.task
    owner, loads = plan_hashing(settings.inputs, size)
    mine = [p for p in plan_pieces(settings.inputs, size, loads) if p.rank == rank]
    hasher = Hasher(settings.inputs, owner, rank)
    reading: list[float] = []  # this rank: seconds finishing the sha256, reading; bytes
    progress = None
    if rank == 0 and not settings.quiet and sys.stderr.isatty():
        from tqdm import tqdm  # deferred: only a terminal shows a bar

        progress = tqdm(total=sum(p.end - p.start for p in mine), unit="B", unit_scale=True,
                        desc="parsing (rank 0)", leave=False)

    def read() -> list[Parsed]:
        out = read_pieces(settings, mine, threads, progress, observe=hasher.observe)
        parsed_at = time.perf_counter()
        try:
            hasher.finish()
        except OSError as exc:
            raise PrepError(f"cannot read an input to compute its sha256: {exc}") from None
        reading.extend([time.perf_counter() - parsed_at, parsed_at - clock.started,
                        sum(p.end - p.start for p in mine)])
        return out

    try:
        parsed = agree(comm, read)
    finally:
        if progress is not None:
            progress.close()
    digests = hasher.gather(comm)
    check_distinct_contents(settings.inputs, digests)
    clock("parse")
    per_rank = comm.allgather(reading)
    offsets = row_offsets(comm, parsed)
    agree(comm, lambda: check_truncation(settings, parsed, offsets))
    counts, firsts = count_reasons(comm, settings, parsed, offsets)
    agree(comm, lambda: check_invalid_share(settings, counts, firsts))
    check_person_numbers(comm, settings, parsed, offsets)
    clock("count")
    reasons = reason_names(task)
    per_reason = counts.sum(axis=0)
    per_file = records_per_file(counts, reasons)
    if per_reason[0] == 0:
        raise PrepError(f"no record left to write: {int(per_reason.sum()):,} records read, "
                        f"all dropped ({_drops_text(reasons, per_reason, task)})",
                        collective=True)

    records = build_records(settings, parsed, offsets,
                            record_dtype(task, settings.codebook, len(settings.inputs)))
    parsed = None  # free the cleaned blocks before the shuffle
    label_counts = comm.allreduce(
        np.bincount(records["__y"], minlength=task.n_classes)[:task.n_classes])
    if settings.like_encoding is not None:
        encoding_text = settings.like_encoding
    else:
        sums = global_sums(comm, settings, records)
        encoding_text = enc.build(task, settings.codebook, sums, settings.layout).to_json()
    clock("split+stats")
    splits = split_and_shuffle(comm, records, settings.household_secret,
                               with_val=settings.val_fraction > 0)
    del records
    check_people_once(comm, settings.inputs, splits)
    clock("shuffle")
    if settings.test_fraction < 1 and splits["train"][2] == 0:
        held = ", ".join(f"{name} {splits[name][3]:,}" for name in splits if name != "train")
        raise PrepError(f"--test-fraction {settings.test_fraction:g} and --val-fraction "
                        f"{settings.val_fraction:g} left no household for training ({held} "
                        "households): give smaller fractions, or --test-fraction 1 for a "
                        "file only for scoring", collective=True)
    if "val" in splits and splits["val"][2] == 0:  # the same totals on every rank
        raise PrepError(f"--val-fraction {settings.val_fraction:g} put none of the "
                        f"{splits['train'][3]:,} training households in the validation "
                        "split: too few households; give a larger --val-fraction, more "
                        "data, or --val-fraction 0 for a file without one", collective=True)
    if settings.test_fraction > 0 and "test" in splits and splits["test"][2] == 0:
        total = sum(splits[name][3] for name in splits)
        raise PrepError(f"--test-fraction {settings.test_fraction:g} put none of the "
                        f"{total:,} households in the test split: too few households; give a "
                        "larger --test-fraction, more data, or --test-fraction 0 for a file "
                        "without one", collective=True)

    drop_counts = {name: int(per_reason[i]) for i, name in enumerate(reasons)
                   if i > 0 and (per_reason[i] or name == "universe")}
    out_bytes = write_output(
        comm, settings, encoding_text, splits,
        lambda: attributes(settings, encoding_text, drop_counts, per_file, digests, version,
                           {name: split[3] for name, split in splits.items()}), clock)
    return Report(records=int(per_file.sum()), kept=int(per_reason[0]),
                  empty_lines=int(per_reason[reasons.index("empty_line")]),
                  train=splits["train"][2], test=splits["test"][2],
                  val=splits["val"][2] if "val" in splits else None,
                  n_features=enc.Encoding.from_json(encoding_text).n_features,
                  drop_counts=drop_counts, seconds=time.perf_counter() - clock.started,
                  out_bytes=out_bytes, steps=clock.steps, per_rank=per_rank,
                  label_counts=tuple(int(c) for c in label_counts))


def _drops_text(reasons: list[str], per_reason: np.ndarray, task: Task) -> str:
    parts = []
    for i, name in enumerate(reasons):
        if i and per_reason[i]:
            label = f"universe {','.join(map(str, task.universe))}" if name == "universe" \
                else name
            parts.append(f"{label}: {int(per_reason[i]):,}")
    return "; ".join(parts) or "no records"
