"""Household keys: a keyed hash of SERIALNO per row, never the serial itself.

``mpidp prep`` stores one uint64 per row (``/s/household``, contract in
:mod:`preprocessing.h5format`) so that ``mpidp train --privacy-unit
household`` can keep a household's persons together, sample households and
clip each household's gradient. The key is a pseudo-random function of the
household id under a secret: AES-256 (FIPS 197, through the ``cryptography``
package, i.e. OpenSSL) of the 16-byte block (id as 8 little-endian bytes,
``mpidp-hh``), keyed with SHA-256 of a personalisation and the secret, its
first 8 bytes read as a little-endian uint64. Rows of one household share a
key, and without the secret nobody can tell from a key which SERIALNO it
belongs to, even with the list of serial numbers at hand (the key hides the
serial, not the rows: their values can still be matched to the file they
came from). One AES call encrypts every id of a split at once (a per-id
hash in Python cost a tenth of prep's time). The
secret is random per run of prep and never stored, unless the user gives one
(``--household-secret FILE``) to get the same keys again, e.g. for files
that must agree with each other (made by one version of mpidp: the file's
``household_key`` attribute says how its keys were made). Keep such a file
as private as the data.

A given secret also keys the split and the order of the households
(:func:`order_key`, :func:`keyed_draw`; used by :mod:`preprocessing.shuffle`):
were they SplitMix64 of the seed (stored in the file) and SERIALNO alone,
anyone with the list of serial numbers (a housing file) could recompute
which household each block of rows is. A secret prep draws itself
(:class:`DrawnSecret`) keys the household keys only, so that a run without
``--household-secret`` keeps giving the same rows for the same seed; its
order then tells which block of rows is which SERIALNO
(docs/privacy.md, "The household key").
"""
from __future__ import annotations

import hashlib
import secrets

import numpy as np

from kernels.files import not_a_file
from preprocessing.errors import PrepError

#: Bytes of a fresh secret (and the most a given one keeps).
SECRET_BYTES = 32
#: Personalisation of the AES key: keys of mpidp households, nothing else.
_PERSON = b"mpidp-household"
#: The second half of every block (domain separation of the ids).
_TAG = int.from_bytes(b"mpidp-hh", "little")
#: Personalisation of the key of the split and the order (a given secret only).
_ORDER = b"mpidp-household-order"
#: The second half of the blocks of each keyed draw (:func:`keyed_draw`): a
#: household's id, or a record's (file * 2^40 + line).
PURPOSES = {"household": b"mpidp-ho", "record": b"mpidp-rw"}


class DrawnSecret(bytes):
    """A secret :func:`new_secret` drew for one run of prep (never stored).

    It keys the household keys only: the split and the order stay those of
    the seed (:func:`order_key` gives None), so that a run without
    ``--household-secret`` gives the same rows for the same seed, as before.
    """


def new_secret() -> DrawnSecret:
    """A fresh random secret (rank 0 draws it; the ranks share it)."""
    return DrawnSecret(secrets.token_bytes(SECRET_BYTES))


#: The longest file read as a secret (a secret is 32 bytes; longer ones are hashed).
MAX_SECRET_FILE = 1 << 20


def read_secret(path: str) -> bytes:
    """The secret in ``path``: its bytes, at least 16 (hashed down when longer
    than :data:`SECRET_BYTES`).

    Raises:
        PrepError: unreadable, a device or pipe (``/dev/urandom`` has no end:
            it was read until memory ran out), longer than
            :data:`MAX_SECRET_FILE`, or too short to be a secret.
    """
    special = not_a_file(path)
    if special is not None:
        raise PrepError(f"--household-secret {path} is {special}, not a file: keep the secret "
                        "in a file (e.g. head -c 32 /dev/urandom > FILE)")
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_SECRET_FILE + 1)
    except OSError as exc:
        raise PrepError(f"--household-secret {path}: cannot read it ({exc.strerror or exc})"
                        ) from None
    if len(data) > MAX_SECRET_FILE:
        raise PrepError(f"--household-secret {path}: more than {MAX_SECRET_FILE:,} bytes, "
                        "not a secret (32 random bytes are: head -c 32 /dev/urandom > FILE)")
    if len(data) < 16:
        raise PrepError(f"--household-secret {path}: {len(data)} bytes; a secret needs at "
                        "least 16 (e.g. head -c 32 /dev/urandom > FILE)")
    return data if len(data) <= SECRET_BYTES else hashlib.sha256(data).digest()


def aes_key(secret: bytes) -> bytes:
    """The 32-byte AES key of a secret of any length: SHA-256 of the
    personalisation and the secret."""
    return hashlib.sha256(_PERSON + bytes(secret)).digest()


def household_keys(ids: np.ndarray, secret: bytes) -> np.ndarray:
    """The uint64 key of each household id (int64, from SERIALNO: see
    :mod:`preprocessing.parse`): AES-256 of (id, ``mpidp-hh``) under a key
    derived from ``secret`` (module docstring), truncated to 64 bits.

    Args:
        ids: int64 ``[n]``, any order, repeats allowed.
        secret: the run's secret (:func:`new_secret` or :func:`read_secret`).

    Returns:
        uint64 ``[n]``: equal ids get equal keys.
    """
    ids = np.asarray(ids, dtype=np.int64)
    return _encrypt(aes_key(secret), ids.astype("<i8").view("<u8"), _TAG)[:, 0].copy()


def order_key(secret: bytes, seed: int) -> bytes | None:
    """The AES-256 key of the split and the order of the households under a
    given secret: SHA-256 of ``mpidp-household-order``, the seed (8 bytes,
    little-endian) and the secret.

    Returns:
        The 32-byte key; None for no secret (``b""``) or one prep drew
        itself (:class:`DrawnSecret`): the seed alone decides the split and
        the order then (SplitMix64, :mod:`preprocessing.shuffle`).
    """
    if not secret or isinstance(secret, DrawnSecret):
        return None
    seed_bytes = (int(seed) % (1 << 64)).to_bytes(8, "little")
    return hashlib.sha256(_ORDER + seed_bytes + bytes(secret)).digest()


def keyed_draw(key: bytes, ids: np.ndarray, purpose: str) -> np.ndarray:
    """Two uint64 per id, a pseudo-random function of (key, purpose, id):
    AES-256 under ``key`` (:func:`order_key`) of the block (id as 8
    little-endian bytes, the purpose's tag in :data:`PURPOSES`), its bytes
    0-7 and 8-15 each read as a little-endian integer. Without the key
    nobody can compute or predict them; distinct ids are distinct blocks,
    so two of them share a value only as two random numbers would.

    Args:
        ids: uint64 (or int64, read as its bits) ``[n]``.
        purpose: ``"household"`` or ``"record"``.

    Returns:
        uint64 ``[n, 2]``.
    """
    ids = np.asarray(ids)
    words = ids.astype("<i8").view("<u8") if ids.dtype.kind == "i" else ids.astype("<u8")
    return _encrypt(key, words, int.from_bytes(PURPOSES[purpose], "little"))


def _encrypt(key: bytes, words: np.ndarray, tag: int) -> np.ndarray:
    """AES-256-ECB under ``key`` of each block (word, tag), in one call for
    all of them, as uint64 ``[n, 2]`` (each half read little-endian)."""
    # deferred: only prep encrypts
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    if words.size == 0:
        return np.zeros((0, 2), dtype=np.uint64)
    blocks = np.empty((words.size, 2), dtype="<u8")
    blocks[:, 0] = words
    blocks[:, 1] = tag
    out = np.empty(blocks.nbytes + 16, dtype=np.uint8)  # update_into wants a block spare
    cipher = Cipher(algorithms.AES(key), modes.ECB()).encryptor()
    done = cipher.update_into(blocks.reshape(-1).view(np.uint8), out)
    cipher.finalize()
    return out[:done].view("<u8").reshape(-1, 2).astype(np.uint64)
