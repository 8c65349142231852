"""Hostile image files: the corpus of issue 41 (items 5-8), built in the test.

Every file here is small (a few hundred kilobytes at most) and built from
the format's own rules, so the suite replays each attack on every run
without storing binaries. The issue's original sizes are the same builders
with larger arguments (``docs/security.md`` says which).

* **Pickles** (CIFAR-10 python version) are written opcode by opcode, as an
  attacker would, in protocol 2 (the official files' protocol):
  :func:`strided_batch` calls ``numpy.ndarray`` with a 1-byte buffer and zero
  strides, :func:`unbuilt_batch` reconstructs an array and never gives it its
  contents (its BUILD state).
* **Compressed streams**: :func:`gzip_bomb` inflates far beyond its size
  (gzip members of zeros, concatenated: a valid gzip file);
  :func:`tar_gz` writes a tar archive of members and compresses it;
  :func:`with_bad_crc` and :func:`with_bad_header` damage a finished one.
"""
from __future__ import annotations

import gzip
import io
import struct
import tarfile
import zlib

#: Bytes of one CIFAR-10 image row (3 planes of 32x32).
PIXELS = 3072
_MiB = 1 << 20


# ------------------------------------------------------------- pickle opcodes

def _bytes(value: bytes) -> bytes:
    """BINSTRING: Python 2's str, read as bytes (``encoding="bytes"``)."""
    return b"T" + struct.pack("<I", len(value)) + value


def _text(value: str) -> bytes:
    """BINUNICODE."""
    data = value.encode()
    return b"X" + struct.pack("<I", len(data)) + data


def _int(value: int) -> bytes:
    """BININT, or LONG1 for values outside 32 bits."""
    if -(1 << 31) <= value < (1 << 31):
        return b"J" + struct.pack("<i", value)
    data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(data)]) + data


def _tuple(*items: bytes) -> bytes:
    return b"(" + b"".join(items) + b"t"


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _batch(data: bytes, labels: bytes) -> bytes:
    """A protocol-2 pickle of ``{b"data": data, b"labels": labels}`` (opcodes given)."""
    return (b"\x80\x02}(" + _bytes(b"data") + data + _bytes(b"labels") + labels + b"u.")


def _strided(shape: tuple[int, ...]) -> bytes:
    """``numpy.ndarray(shape, "u1", b"\\0", 0, (0,) * len(shape))``: every element
    the same one byte, however many the shape claims."""
    return (_global("numpy", "ndarray")
            + _tuple(_tuple(*map(_int, shape)), _text("u1"), _bytes(b"\0"), _int(0),
                     _tuple(*[_int(0)] * len(shape)))
            + b"R")


def strided_batch(rows: int) -> bytes:
    """A python-version batch of ``rows`` images (and labels) that holds one byte:
    about 120 bytes whatever ``rows`` is."""
    return _batch(_strided((rows, PIXELS)), _strided((rows,)))


def _unbuilt(shape: tuple[int, ...], dtype: str) -> bytes:
    """``_reconstruct(ndarray, shape, dtype)`` with no BUILD after it: numpy
    allocates the array and nothing ever fills it."""
    return (_global("numpy.core.multiarray", "_reconstruct")
            + _tuple(_global("numpy", "ndarray"), _tuple(*map(_int, shape)), _text(dtype))
            + b"R")


def _built(values: bytes, shape: tuple[int, ...], dtype: str = "u1") -> bytes:
    """An array as numpy pickles it: ``_reconstruct`` then BUILD with the bytes."""
    return (_global("numpy.core.multiarray", "_reconstruct")
            + _tuple(_global("numpy", "ndarray"), _tuple(_int(0)), _bytes(b"b")) + b"R"
            + _tuple(_int(1), _tuple(*map(_int, shape)),
                     _global("numpy", "dtype") + _tuple(_text(dtype), _int(0), _int(1)) + b"R"
                     + _tuple(_int(3), _text("|"), b"N", b"N", b"N", _int(-1), _int(-1),
                              _int(0)) + b"b",
                     b"\x89", _bytes(values))
            + b"b")


def unbuilt_batch(rows: int, which: str) -> bytes:
    """A python-version batch whose ``which`` (``"data"`` or ``"labels"``) array
    is reconstructed without its contents; the other is complete (zeros)."""
    if which == "data":
        return _batch(_unbuilt((rows, PIXELS), "u1"), _built(bytes(rows), (rows,)))
    return _batch(_built(bytes(rows * PIXELS), (rows, PIXELS)), _unbuilt((rows,), "i8"))


def short_built_batch(rows: int, claimed_rows: int) -> bytes:
    """A batch whose data array's BUILD claims ``claimed_rows`` rows but carries
    the bytes of ``rows``."""
    return _batch(_built(bytes(rows * PIXELS), (claimed_rows, PIXELS)),
                  _built(bytes(rows), (rows,)))


# ---------------------------------------------------------- compressed streams

def gzip_bomb(head: bytes, inflated_mib: int) -> bytes:
    """A gzip file holding ``head`` and then ``inflated_mib`` MiB of zeros: one
    member with ``head``, then the same 1 MiB member of zeros repeated (about
    1 KiB each), so building it costs one compression of 1 MiB."""
    zeros = gzip.compress(bytes(_MiB), compresslevel=9, mtime=0)
    return gzip.compress(head, mtime=0) + zeros * inflated_mib


def deflate_bomb(head: bytes, inflated_mib: int) -> bytes:
    """As :func:`gzip_bomb` but one gzip member (what ``gzip -9`` writes)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    parts = [packer.compress(head)]
    zeros = bytes(_MiB)
    parts += [packer.compress(zeros) for _ in range(inflated_mib)]
    return b"".join(parts) + packer.flush()


def tar_bytes(members: dict[str, bytes] | list[tuple[str, bytes]], prefix: str) -> bytes:
    """An uncompressed tar of ``{name: bytes}`` (or of (name, bytes) pairs, where
    a name may repeat), each named ``prefix + name``."""
    out = io.BytesIO()
    pairs = members.items() if isinstance(members, dict) else members
    with tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as archive:
        for name, data in pairs:
            info = tarfile.TarInfo(prefix + name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return out.getvalue()


def tar_gz(members: dict[str, bytes], prefix: str) -> bytes:
    """:func:`tar_bytes`, gzipped."""
    return gzip.compress(tar_bytes(members, prefix), compresslevel=6, mtime=0)


def with_bad_crc(tar: bytes, offset: int) -> bytes:
    """``tar`` gzipped after one byte at ``offset`` was flipped, but carrying the
    CRC of the original bytes: the deflate stream is valid, the check is not."""
    damaged = bytearray(tar)
    damaged[offset] ^= 0x5A
    packed = bytearray(gzip.compress(bytes(damaged), mtime=0))
    packed[-8:-4] = struct.pack("<I", zlib.crc32(tar))
    return bytes(packed)


def header_offset(tar: bytes, name: str) -> int:
    """Byte offset of the header block of the member called ``name`` in ``tar``."""
    with tarfile.open(fileobj=io.BytesIO(tar), mode="r:") as archive:
        for member in archive:
            if member.name == name:
                return member.offset
    raise KeyError(name)


def with_bad_header(tar: bytes, name: str) -> bytes:
    """``tar`` with the header of member ``name`` overwritten by garbage, gzipped
    (a valid gzip stream of a damaged archive)."""
    offset = header_offset(tar, name)
    damaged = bytearray(tar)
    damaged[offset:offset + 512] = bytes((i * 37 + 11) % 256 for i in range(512))
    return gzip.compress(bytes(damaged), mtime=0)


def raw_header(name: str, size: int, kind: bytes = b"0", extended: bool = False) -> bytes:
    """One ustar header block claiming ``size`` bytes of data (none follow),
    with a correct checksum: what an attacker writes by hand. ``extended``
    sets the old GNU sparse flag that says map blocks follow the header."""
    block = bytearray(512)
    block[482] = int(extended)
    block[0:len(name)] = name.encode()
    block[100:108] = b"0000644\0"
    block[124:136] = f"{size:011o}\0".encode() if size < 8 ** 11 else (
        b"\x80" + size.to_bytes(11, "big"))
    block[156:157] = kind
    block[257:265] = b"ustar\x0000"
    block[148:156] = b" " * 8
    block[148:156] = f"{sum(block):06o}\0 ".encode()
    return bytes(block)
