"""Household keys: a keyed hash of SERIALNO per row, never the serial itself.

``mpidp prep`` stores one uint64 per row (``/s/household``, contract in
:mod:`preprocessing.h5format`) so that ``mpidp train --privacy-unit
household`` can keep a household's persons together, sample households and
clip each household's gradient. The key is BLAKE2b with an 8-byte digest,
keyed with a 32-byte secret (RFC 7693's keyed mode, a pseudo-random
function): rows of one household share a key, and without the secret nobody
can tell which SERIALNO a key belongs to, even with the public PUMS file at
hand. The secret is random per run of prep and never stored, unless the user
gives one (``--household-secret FILE``) to get the same keys again, e.g. for
files that must agree with each other. Keep such a file as private as the
data.
"""
from __future__ import annotations

import secrets

import numpy as np

from preprocessing.errors import PrepError

#: Bytes of the secret (BLAKE2b's largest key).
SECRET_BYTES = 32
#: BLAKE2b's personalisation: keys of mpidp households, nothing else.
_PERSON = b"mpidp-household"


def new_secret() -> bytes:
    """A fresh random secret (rank 0 draws it; the ranks share it)."""
    return secrets.token_bytes(SECRET_BYTES)


def read_secret(path: str) -> bytes:
    """The secret in ``path``: its bytes, at least 16 (hashed down when longer
    than :data:`SECRET_BYTES`).

    Raises:
        PrepError: unreadable, or too short to be a secret.
    """
    import hashlib

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


def household_keys(ids: np.ndarray, secret: bytes) -> np.ndarray:
    """The uint64 key of each household id (int64, from SERIALNO: see
    :mod:`preprocessing.parse`), one hash per distinct id.

    Args:
        ids: int64 ``[n]``, any order, repeats allowed.
        secret: the run's secret (:func:`new_secret` or :func:`read_secret`).

    Returns:
        uint64 ``[n]``: equal ids get equal keys.
    """
    import hashlib

    ids = np.asarray(ids, dtype=np.int64)
    if ids.size == 0:
        return np.zeros(0, dtype=np.uint64)
    unique, inverse = np.unique(ids, return_inverse=True)
    # The keyed state is made once and copied per id (a keyed start costs a
    # whole compression of the key block).
    keyed = hashlib.blake2b(digest_size=8, key=secret, person=_PERSON)
    raw = memoryview(unique.astype("<i8").tobytes())
    digests = bytearray(8 * unique.size)
    for i in range(unique.size):
        h = keyed.copy()
        h.update(raw[8 * i:8 * i + 8])
        digests[8 * i:8 * i + 8] = h.digest()
    keys = np.frombuffer(bytes(digests), dtype="<u8").astype(np.uint64)
    return keys[inverse.reshape(-1)]
