"""Household keys: a keyed hash of SERIALNO per row, never the serial itself.

``mpidp prep`` stores one uint64 per row (``/s/household``, contract in
:mod:`preprocessing.h5format`) so that ``mpidp train --privacy-unit
household`` can keep a household's persons together, sample households and
clip each household's gradient. The key is a pseudo-random function of the
household id under a secret: AES-256 (FIPS 197, through the ``cryptography``
package, i.e. OpenSSL) of the 16-byte block (id as 8 little-endian bytes,
``mpidp-hh``), keyed with SHA-256 of a personalisation and the secret, its
first 8 bytes read as a little-endian uint64. Rows of one household share a
key, and without the secret nobody can tell which SERIALNO a key belongs to,
even with the public PUMS file at hand. One AES call encrypts every id of a
split at once (a per-id hash in Python cost a tenth of prep's time). The
secret is random per run of prep and never stored, unless the user gives one
(``--household-secret FILE``) to get the same keys again, e.g. for files
that must agree with each other (made by one version of mpidp: the file's
``household_key`` attribute says how its keys were made). Keep such a file
as private as the data.
"""
from __future__ import annotations

import hashlib
import secrets

import numpy as np

from preprocessing.errors import PrepError

#: Bytes of a fresh secret (and the most a given one keeps).
SECRET_BYTES = 32
#: Personalisation of the AES key: keys of mpidp households, nothing else.
_PERSON = b"mpidp-household"
#: The second half of every block (domain separation of the ids).
_TAG = int.from_bytes(b"mpidp-hh", "little")


def new_secret() -> bytes:
    """A fresh random secret (rank 0 draws it; the ranks share it)."""
    return secrets.token_bytes(SECRET_BYTES)


def read_secret(path: str) -> bytes:
    """The secret in ``path``: its bytes, at least 16 (hashed down when longer
    than :data:`SECRET_BYTES`).

    Raises:
        PrepError: unreadable, or too short to be a secret.
    """
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError as exc:
        raise PrepError(f"--household-secret {path}: cannot read it ({exc.strerror or exc})"
                        ) from None
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
    # deferred: only prep makes household keys
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    ids = np.asarray(ids, dtype=np.int64)
    if ids.size == 0:
        return np.zeros(0, dtype=np.uint64)
    key = aes_key(secret)
    blocks = np.empty((ids.size, 2), dtype="<u8")
    blocks[:, 0] = ids.astype("<i8").view("<u8")
    blocks[:, 1] = _TAG
    cipher = Cipher(algorithms.AES(key), modes.ECB()).encryptor()
    out = np.frombuffer(cipher.update(blocks.tobytes()) + cipher.finalize(), dtype="<u8")
    return out[0::2].astype(np.uint64)
