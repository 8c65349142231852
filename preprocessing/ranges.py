"""Which rank reads which bytes: pieces of the inputs, cut at line ends.

Every rank computes the same plan (:func:`plan_pieces`) from the input sizes
alone, without communication:

* a zip member can only be decompressed from its start, so each one is a
  single piece, given to the least-loaded rank (largest first);
* plain CSV text is split into byte ranges so that every rank ends up with
  about the same number of bytes (the ranges fill up the ranks that have
  fewer zip bytes first).

A piece owns the records (lines) that *start* inside its nominal byte range
``[start, end)``; :func:`iter_blocks` moves both ends forward to the next
line start, so consecutive pieces of one file cover every line exactly once,
whatever the number of ranks. Records are never split, and every block handed
to the parser holds whole lines (except a last line without a line end).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Iterator

from preprocessing.errors import PrepError
from preprocessing.inputs import InputFile

#: Bytes of CSV text handed to the parser at once (whole lines).
BLOCK_BYTES = 32 << 20
_PROBE = 1 << 16
#: The longest line a compressed input may hold (a PUMS line is under 4 kB):
#: a stream without line ends (a decompression bomb) fails here instead of
#: filling the memory.
MAX_STREAM_LINE = 64 << 20
#: Cost of computing the sha256 of a byte, relative to parsing and cleaning a
#: byte of CSV (a measured ratio: it only balances the ranks' shares of work).
HASH_COST = 0.3


@dataclass(frozen=True)
class Piece:
    """Records of one input whose first byte lies in ``[start, end)``.

    Attributes:
        file: index of the :class:`InputFile`.
        seq: position of the piece among the pieces of its file.
        start, end: nominal byte range in the CSV text (``end`` = the file's
            size for the last piece).
        rank: the rank that reads it.
    """

    file: int
    seq: int
    start: int
    end: int
    rank: int


def _water_fill(loads: list[int], extra: int) -> list[int]:
    """Split ``extra`` bytes over ranks so that ``loads + share`` is as even as
    possible; returns the integer shares (they sum to ``extra``)."""
    order = sorted(range(len(loads)), key=lambda r: (loads[r], r))
    level, filled = float(loads[order[0]]), 0
    remaining = float(extra)
    # Raise the water level over the least-loaded ranks one at a time.
    for k in range(1, len(order) + 1):
        nxt = loads[order[k]] if k < len(order) else float("inf")
        need = (nxt - level) * k
        if need >= remaining:
            level += remaining / k
            filled = k
            break
        remaining -= need
        level = nxt
    shares_f = [max(0.0, level - loads[r]) if i < filled else 0.0
                for i, r in enumerate(order)]
    shares = [0] * len(loads)
    acc_f, acc = 0.0, 0
    for i, r in enumerate(order):
        acc_f += shares_f[i]
        upto = extra if i == len(order) - 1 else min(extra, int(round(acc_f)))
        shares[r] = max(0, upto - acc)
        acc += shares[r]
    return shares


def plan_hashing(inputs: list[InputFile], size: int) -> tuple[dict[str, int], list[int]]:
    """Which rank computes the sha256 of each input path (largest first, to
    the least-loaded rank), and the load that puts on each rank."""
    sizes: dict[str, int] = {}
    for inp in inputs:
        if inp.path not in sizes:
            sizes[inp.path] = os.path.getsize(inp.path)
    loads = [0] * size
    owner = {}
    for path in sorted(sizes, key=lambda p: (-sizes[p], p)):
        rank = min(range(size), key=lambda r: (loads[r], r))
        owner[path] = rank
        loads[rank] += int(sizes[path] * HASH_COST)
    return owner, loads


def plan_pieces(inputs: list[InputFile], size: int,
                loads: list[int] | None = None) -> list[Piece]:
    """Assign every input's bytes to ``size`` ranks (identical on every rank).

    Args:
        loads: work each rank already has, in parsed-byte equivalents (e.g.
            hashing, :func:`plan_hashing`); the bytes are shared so that the
            totals come out even.

    Returns:
        All pieces, sorted by (file, seq); ``piece.rank`` says who reads it.
    """
    loads = list(loads) if loads is not None else [0] * size
    pieces: list[Piece] = []
    whole = sorted((inp for inp in inputs if not inp.splittable),
                   key=lambda inp: (-inp.size, inp.index))
    for inp in whole:
        rank = min(range(size), key=lambda r: (loads[r], r))
        loads[rank] += inp.size
        pieces.append(Piece(inp.index, 0, inp.data_start, inp.size, rank))
    plain = [inp for inp in inputs if inp.splittable]
    total = sum(inp.size - inp.data_start for inp in plain)
    shares = _water_fill(loads, total)
    # Lay the plain files end to end and cut that byte space into the shares,
    # rank 0's share first.
    bounds, acc = [], 0
    for rank in range(size):
        bounds.append((acc, acc + shares[rank], rank))
        acc += shares[rank]
    offset = 0
    for inp in plain:
        length = inp.size - inp.data_start
        if length == 0:  # a header and no records: one empty piece
            pieces.append(Piece(inp.index, 0, inp.data_start, inp.size, 0))
            continue
        seq = 0
        for lo, hi, rank in bounds:
            a, b = max(lo, offset), min(hi, offset + length)
            if b > a:
                pieces.append(Piece(inp.index, seq, inp.data_start + a - offset,
                                    inp.data_start + b - offset, rank))
                seq += 1
        offset += length
    return sorted(pieces, key=lambda p: (p.file, p.seq))


def _next_line_start(fd: int, pos: int, limit: int, data_start: int) -> int:
    """The first line start at or after ``pos`` (``limit`` if there is none)."""
    if pos <= data_start:
        return data_start
    at = pos - 1  # a line starts at pos when the byte before it is a line end
    while at < limit:
        window = os.pread(fd, min(_PROBE, limit - at), at)
        hit = window.find(b"\n")
        if hit >= 0:
            return at + hit + 1
        at += len(window)
    return limit


@dataclass
class Tail:
    """What the reader saw at the end of a file (for the truncation check)."""

    last_line: bytes = b""
    ends_with_newline: bool = True


def iter_blocks(inp: InputFile, piece: Piece, tail: Tail, block_bytes: int = BLOCK_BYTES,
                observe: Callable[[int, bytes], None] | None = None) -> Iterator[bytes]:
    """Yield the piece's records as blocks of whole lines.

    ``tail`` is filled in when the piece reaches the end of the file.
    ``observe(offset, block)`` is called with each block of a plain file and
    its byte offset (e.g. to hash the bytes without reading them twice).
    """
    if inp.splittable:
        yield from _iter_plain(inp, piece, tail, block_bytes, observe)
    else:
        yield from _iter_stream(inp, tail, block_bytes)


def _iter_plain(inp: InputFile, piece: Piece, tail: Tail, block_bytes: int,
                observe) -> Iterator[bytes]:
    with open(inp.path, "rb", buffering=0) as handle:
        fd = handle.fileno()
        size = os.fstat(fd).st_size
        begin = _next_line_start(fd, piece.start, size, inp.data_start)
        stop = size if piece.end >= inp.size else _next_line_start(fd, piece.end, size,
                                                                  inp.data_start)
        pos = begin
        while pos < stop:
            want = min(block_bytes, stop - pos)
            if pos + want < stop:
                # End the block at the last line end inside it.
                probe_at = max(pos, pos + want - _PROBE)
                probe = os.pread(fd, pos + want - probe_at, probe_at)
                cut = probe.rfind(b"\n")
                if cut >= 0:
                    want = probe_at + cut + 1 - pos
                else:  # a line longer than the probe: read up to its end
                    want = _next_line_start(fd, pos + want, stop, inp.data_start) - pos
            block = os.pread(fd, want, pos)
            if len(block) != want:
                raise OSError(f"{inp.name}: the file changed while it was read")
            if observe is not None:
                observe(pos, block)
            pos += want
            if pos >= size:
                _record_tail(block, tail)
            yield block


def _iter_stream(inp: InputFile, tail: Tail, block_bytes: int) -> Iterator[bytes]:
    with inp.open() as stream:
        stream.read(inp.data_start)
        carry = b""
        while True:
            chunk = stream.read(block_bytes)
            if not chunk:
                break
            data = carry + chunk if carry else chunk
            cut = data.rfind(b"\n")
            if cut < 0:
                if len(data) > MAX_STREAM_LINE:
                    raise PrepError(f"{inp.name}: a line longer than {MAX_STREAM_LINE:,} "
                                    "bytes; this is not a PUMS CSV file")
                carry = data
                continue
            carry = data[cut + 1:]
            block = data if cut == len(data) - 1 else data[:cut + 1]
            if not carry:
                _record_tail(block, tail)
            yield block
        if carry:
            _record_tail(carry, tail)
            yield carry


def _record_tail(block: bytes, tail: Tail) -> None:
    tail.ends_with_newline = block.endswith(b"\n")
    body = block[:-1] if tail.ends_with_newline else block
    tail.last_line = body[body.rfind(b"\n") + 1:]
