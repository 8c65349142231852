"""A tar reader for a few known members, whose every claimed size is bounded.

``tarfile`` trusts an archive in ways a hostile one exploits: it reads an
extended header (pax, a GNU long name) whole into memory at the size the
header claims, follows a chain of GNU sparse extension blocks or a pax
sparse map as long as the archive goes on, keeps every member's header in a
list, ends its iteration silently at a damaged header (a corrupt archive
then looks like one with missing members), and never reads a compressed
stream to its end (gzip's CRC is not checked). This reader reads the tar
stream in order and:

* checks every header's checksum; a damaged one is an error naming its byte
  offset, not the end of the archive;
* reads an extended header (pax ``x`` and ``g``, GNU long names ``L`` and
  ``K``) only up to :data:`META_MAX` bytes; applies the pax keys ``path``
  and ``size`` and the GNU long name to the next member, as tar does;
* reports every member (name, size, whether it is a regular file: sparse
  files, links and devices are not) and hands over the bytes of those the
  caller asks for, ``size`` bytes that the caller bounded first; the others
  are skipped in pieces, never kept (an old GNU sparse member's map blocks
  too, one at a time);
* ends at the end-of-archive marker (a zero block) and then reads the rest
  of the stream to its end, requiring zeros, so that the compressed
  stream's own check (gzip's CRC-32) runs.

Formats: ustar (with its name prefix), GNU and pax, as GNU tar, bsdtar and
Python's ``tarfile`` write them. Example::

    reader = TarReader(stream, "cifar.tar.gz")
    for member in reader:
        if member.regular and member.name == wanted and member.size <= bound:
            data = reader.read(member)
    reader.finish()
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import BinaryIO, Iterator

from preprocessing.images.errors import ImageFormatError
from preprocessing.images.streams import PIECE, read_exact

BLOCK = 512
#: The largest extended header (pax, GNU long name) read into memory.
META_MAX = 64 << 10
#: Type flags of regular files (``"0"``, the old ``"\0"``, contiguous ``"7"``).
REGULAR = (b"0", b"\0", b"7")
_EXTENDED = {b"x": "pax", b"g": "pax global", b"L": "GNU long name", b"K": "GNU long link"}
#: The old GNU sparse type, whose header may be followed by map blocks.
_OLD_SPARSE = b"S"


@dataclass(frozen=True)
class Member:
    """One member: its name (``./`` removed), size, whether it is a regular
    file, and the byte offset of its header in the archive."""

    name: str
    size: int
    regular: bool
    offset: int


class TarReader:
    """Iterate the members of the tar stream ``stream`` (see module docstring);
    ``where`` names the archive in every error, and ``advice`` ends the
    message of a corrupt one."""

    def __init__(self, stream: BinaryIO, where: str, advice: str = "") -> None:
        self.stream, self.where, self.advice = stream, where, advice
        self.offset = 0  # bytes of the tar stream consumed
        self._pending: Member | None = None  # the member whose data is next
        self._ended = False

    def __iter__(self) -> Iterator[Member]:
        name: str | None = None
        size: int | None = None
        sparse = False
        while True:
            self._skip_pending()
            start = self.offset
            block = self._take(BLOCK)
            if len(block) == 0:
                if start == 0:
                    self._corrupt("an empty file")
                self._ended = True  # the stream ended without the marker: accepted
                return
            if len(block) < BLOCK:
                self._corrupt(f"a header cut short at byte {start:,}")
            if block.count(0) == BLOCK:
                self._ended = True
                return
            kind, header_name, header_size = self._header(block, start)
            extended = kind == _OLD_SPARSE and block[482]
            while extended:  # old GNU sparse maps: blocks between header and data
                more = self._take(BLOCK)
                if len(more) < BLOCK:
                    self._corrupt(f"a sparse map cut short at byte {self.offset:,}")
                extended = more[504]
            if kind in _EXTENDED:
                if header_size > META_MAX:
                    raise ImageFormatError(
                        f"{self.where}: expected {_EXTENDED[kind]} headers of at most "
                        f"{META_MAX:,} bytes, found one of {header_size:,} bytes at byte "
                        f"{start:,}; refused before reading it")
                data = self._data(header_size)
                if kind == b"x":
                    keys = self._pax(data, start)
                    name = keys.get("path", name)
                    if "size" in keys:
                        size = self._number(keys["size"], start, "pax size")
                    sparse = sparse or any(k.startswith("GNU.sparse.") for k in keys)
                elif kind == b"L":
                    name = data.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
                continue
            member = Member(
                name=(name if name is not None else header_name).removeprefix("./"),
                size=size if size is not None else header_size,
                regular=kind in REGULAR and not sparse and not header_name.endswith("/"),
                offset=start)
            name, size, sparse = None, None, False
            self._pending = member
            yield member

    def read(self, member: Member) -> bytearray:
        """The bytes of ``member``, the one just yielded (the caller bounded its
        size), in memory of their size; its padding is consumed."""
        if self._pending is not member:
            raise ValueError("read() takes the member just yielded")
        self._pending = None
        return self._data(member.size)

    def finish(self) -> None:
        """After the members: require zeros to the end of the stream (reading it
        all, so a compressed stream's check runs)."""
        self._skip_pending()
        if not self._ended:
            raise ValueError("finish() after the members were all read")
        while piece := self.stream.read(PIECE):
            if piece.count(0) != len(piece):
                self._corrupt(f"data after the end-of-archive marker (near byte "
                              f"{self.offset:,}; a damaged header, or members after the end)")
            self.offset += len(piece)

    # -- the stream ---------------------------------------------------------------

    def _take(self, size: int) -> bytearray:
        data = read_exact(self.stream, size)
        self.offset += len(data)
        return data

    def _data(self, size: int) -> bytearray:
        """``size`` bytes of member data and the padding to the next block."""
        data = self._take(size)
        padding = -size % BLOCK
        if len(data) < size or len(self._take(padding)) < padding:
            self._corrupt(f"member data cut short (the archive ends at byte {self.offset:,})")
        return data

    def _skip_pending(self) -> None:
        """Skip the data of the member yielded last, unless it was read."""
        if self._pending is None:
            return
        left = self._pending.size + (-self._pending.size % BLOCK)
        self._pending = None
        while left:
            piece = self.stream.read(min(PIECE, left))
            if not piece:
                self._corrupt(f"member data cut short (the archive ends at byte "
                              f"{self.offset:,})")
            left -= len(piece)
            self.offset += len(piece)

    # -- headers ------------------------------------------------------------------

    def _header(self, block: bytearray, start: int) -> tuple[bytes, str, int]:
        """(type flag, name, size) of a header block whose checksum is right."""
        stored = self._number(block[148:156], start, "checksum")
        rest = block[:148] + block[156:]
        unsigned = sum(rest) + 8 * 32  # the checksum field counts as eight spaces
        signed = unsigned - 256 * sum(1 for b in rest if b >= 128)  # old tars summed chars
        if stored not in (unsigned, signed):
            self._corrupt(f"a damaged header at byte {start:,} (checksum {stored} where the "
                          f"header sums to {unsigned})")
        name = _text(block[0:100])
        if bytes(block[257:263]) == b"ustar\0" and block[345]:  # POSIX: a name prefix
            name = _text(block[345:500]) + "/" + name
        return bytes(block[156:157]), name, self._number(block[124:136], start, "size")

    def _number(self, field: bytes | bytearray | str, start: int, what: str) -> int:
        """A header's octal number (or GNU base-256), or a pax decimal number."""
        if isinstance(field, str):
            text, base = field, 10
        elif field[:1] in (b"\x80", b"\xff"):  # GNU base-256, big-endian
            value = int.from_bytes(field[1:], "big")
            return -value if field[:1] == b"\xff" else value
        else:
            text, base = bytes(field).split(b"\0", 1)[0].decode("ascii", "replace").strip(), 8
        try:
            value = int(text or "0", base)
        except ValueError:
            value = -1
        if value < 0:
            self._corrupt(f"a damaged header at byte {start:,} (its {what} field is not a "
                          f"number)")
        return value

    def _pax(self, data: bytearray, start: int) -> dict[str, str]:
        """The records ``"LENGTH KEY=VALUE\\n"`` of a pax header."""
        keys, pos = {}, 0
        while pos < len(data) and data[pos]:
            space = data.find(b" ", pos, pos + 24)
            length = int(data[pos:space]) if space > pos and data[pos:space].isdigit() else 0
            record = data[pos:pos + length]
            if length <= space - pos or len(record) < length or not record.endswith(b"\n") \
                    or b"=" not in record:
                self._corrupt(f"a damaged pax header at byte {start:,}")
            key, value = bytes(record[space - pos + 1:-1]).split(b"=", 1)
            keys[key.decode("utf-8", "replace")] = value.decode("utf-8", "surrogateescape")
            pos += length
        return keys

    def _corrupt(self, what: str) -> None:
        raise ImageFormatError(f"{self.where}: expected a readable tar archive, found {what}; "
                               f"the file is not one or is corrupt"
                               + (f"; {self.advice}" if self.advice else ""))


def _text(field: bytes | bytearray) -> str:
    return bytes(field).split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
