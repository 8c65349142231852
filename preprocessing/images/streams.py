"""Bounded reading of stored files: the readers never trust a claimed size.

Every size an image file claims (an idx header's count, a tar member's size,
the inflated length of a compressed stream) is checked against a bound the
reader knows before anything of that size is allocated or inflated, and a
stream is read to its end, so that a compressed stream's own check (gzip's
CRC-32 and length, bzip2's and xz's checks) runs before its bytes are used.

* :func:`open_stored` opens a file to read (one line on failure).
* :func:`not_regular` says what stands at a path that is not a regular file.
* :class:`Hashing` hashes the bytes as stored while a reader reads them.
* :func:`decompressed` picks the decompressor a stream's magic bytes name.
* :class:`Capped` ends a stream that inflates beyond a bound.
* :func:`read_exact` reads a known number of bytes into memory it fills.
* :func:`count_rest` counts what is left of a stream, up to a bound, without
  keeping it.
"""
from __future__ import annotations

import bz2
import errno
import gzip
import hashlib
import io
import lzma
import os
import stat
import zlib
from pathlib import Path
from typing import BinaryIO

from preprocessing.images.errors import ImageFormatError, one_line, printable

#: Errors a damaged compressed stream raises while it is read (gzip's
#: BadGzipFile and a bad bzip2 stream are OSErrors; a cut stream an EOFError).
DAMAGED = (OSError, EOFError, zlib.error, lzma.LZMAError)
#: Size of the pieces a stream is read in when its bytes are not kept.
PIECE = 1 << 20

_MAGIC = ((b"\x1f\x8b", "gzip"), (b"BZh", "bzip2"), (b"\xfd7zXZ\x00", "xz"))


def open_stored(path: Path) -> io.BufferedReader:
    """``path`` opened for reading.

    Raises:
        ImageFormatError: it cannot be opened (``path: cannot be read (...)``).
    """
    try:
        return open(path, "rb")  # noqa: SIM115 - the caller closes it
    except OSError as exc:
        raise ImageFormatError(f"{path}: cannot be read ({one_line(exc)})") from None


#: What a non-regular file is, by its type bits.
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def not_regular(path: Path) -> str | None:
    """What stands at ``path`` when something does but it is not a regular file
    (or a symbolic link to one): ``a directory``, ``a FIFO (named pipe)``, ``a
    symbolic link loop``, ``a character device (a symbolic link to
    /dev/zero)``, ...; None when it is a regular file or nothing is there.

    A reader that opened a FIFO would wait for a writer forever, and one that
    read a device would read without end: the readers refuse these by name.
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if not os.path.islink(path):
            return None
        return f"a broken symbolic link (to {_target(path)})"
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a symbolic link loop"
        return f"not examinable ({one_line(exc.strerror or exc)})"
    if stat.S_ISREG(mode):
        return None
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    return kind + (f" (a symbolic link to {_target(path)})" if os.path.islink(path) else "")


def _target(path: Path) -> str:
    try:
        return printable(os.readlink(path))
    except OSError:
        return "?"


class Hashing(io.RawIOBase):
    """A readable stream that passes ``inner``'s bytes through and hashes them
    (sha256 of exactly the bytes read so far: :attr:`sha256`)."""

    def __init__(self, inner: BinaryIO) -> None:
        super().__init__()
        self.inner = inner
        self.hash = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self.inner.read(len(buffer))
        buffer[:len(data)] = data
        self.hash.update(data)
        return len(data)

    @property
    def sha256(self) -> str:
        return self.hash.hexdigest()


def compression(head: bytes) -> str | None:
    """The compression whose magic bytes start ``head`` (``gzip``, ``bzip2``,
    ``xz``), or None."""
    return next((name for magic, name in _MAGIC if head.startswith(magic)), None)


def decompressed(raw: io.BufferedReader) -> tuple[BinaryIO, str | None]:
    """(the inflated stream, the compression's name or None) of ``raw``, by its
    first bytes. The stream checks its compression's integrity when it is read
    to its end (gzip: CRC-32 and length of every member; bzip2: block and
    stream CRCs; xz: the check of every block)."""
    kind = compression(raw.peek(6)[:6])
    if kind == "gzip":
        return gzip.GzipFile(fileobj=raw, mode="rb"), kind
    if kind == "bzip2":
        return bz2.BZ2File(raw, mode="rb"), kind
    if kind == "xz":
        return lzma.LZMAFile(raw, mode="rb"), kind
    return raw, None


class Capped(io.RawIOBase):
    """``inner`` read through, until more than ``cap`` bytes came out of it.

    Reading past the cap raises :class:`ImageFormatError` naming ``where``
    and saying it inflates beyond ``what``: the stream is refused instead of
    inflated on. :attr:`count` is the number of bytes read so far.
    """

    def __init__(self, inner: BinaryIO, cap: int, where: str, what: str) -> None:
        super().__init__()
        self.inner, self.cap, self.where, self.what = inner, cap, where, what
        self.count = 0

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0:
            size = self.cap + 1 - self.count
        data = self.inner.read(min(size, self.cap + 1 - self.count))
        self.count += len(data)
        if self.count > self.cap:
            raise ImageFormatError(f"{self.where}: inflates to more than {self.cap:,} bytes, "
                                   f"beyond {self.what}; refused before inflating the rest")
        return data

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)


def read_exact(stream: BinaryIO, size: int) -> bytearray:
    """Up to ``size`` bytes of ``stream``, fewer only at its end, in a buffer of
    exactly the bytes read: allocated once (``size`` is a bound the caller
    checked) and filled in pieces, so no second copy is made."""
    buffer = bytearray(size)
    filled = 0
    with memoryview(buffer) as view:
        while filled < size:
            got = stream.readinto(view[filled:filled + PIECE])
            if not got:
                break
            filled += got
    if filled < size:
        del buffer[filled:]
    return buffer


def count_rest(stream: BinaryIO, bound: int) -> tuple[int, bool]:
    """(bytes left in ``stream``, whether it ended) reading at most ``bound``
    bytes in pieces that are not kept."""
    count = 0
    while count < bound:
        piece = stream.read(min(PIECE, bound - count))
        if not piece:
            return count, True
        count += len(piece)
    return count, not stream.read(1)
