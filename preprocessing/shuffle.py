"""Household split and global shuffle, independent of the number of ranks.

Both rest on SplitMix64 (Steele, Lea, Flood, "Fast splittable pseudorandom
number generators", OOPSLA 2014): the i-th output of the generator seeded
with ``s`` is ``mix(s + (i + 1) * GAMMA)``, where ``mix`` is a bijection of
64-bit integers. Every record gets its random numbers from its *identity*
(its household, or its input file and line), never from the rank that reads
it, so the output cannot depend on how the input was split over the ranks.

* **Split.** A household goes to the test split when the uniform number
  u drawn from ``(seed, household id)`` is below ``test_fraction`` t: all
  its members land on the same side, with no communication. Of the others,
  it goes to the validation split when ``u < t + v (1 - t)`` for
  ``val_fraction`` v: a share v of the training households, drawn from the
  same number, so the test split is the same with or without one.
* **Shuffle, households kept together.** A household gets the key
  ``mix(s' + (h + 1) * GAMMA)`` from its id h (:func:`household_keys`), and
  record ``(file f, row i)`` the key ``mix(s + (id + 1) * GAMMA)`` with
  ``id = f * 2^40 + i`` (:func:`shuffle_keys`, distinct for distinct
  records). Records are sorted by (household key, household id, record key):
  households in a random-looking order, each household's persons
  consecutive (in a random order among themselves), no ties. The sort is
  distributed (a bucket sort on the household key): rank ``r`` receives the
  keys in ``[r, r+1) * 2^64 / p`` with one ``Alltoallv``, so a household
  lands whole on one rank, then sorts them locally, so that rank ``r`` holds
  one contiguous stretch of the final order.

**With a household secret** (``--household-secret``) the same three numbers
(split, household key, record key) are instead a keyed pseudo-random
function: AES-256 of the id under a key derived from the seed and the
secret, the two halves of one block per household for the first two, one
block per record for the third (``key``: :data:`KEYED`,
:func:`preprocessing.households.order_key` and
:func:`~preprocessing.households.keyed_draw`). SplitMix64 of the seed,
which the file stores, is public: given the list of serial numbers (a
housing file) anyone could recompute which side each household is on and
which block of rows it is. Everything else above holds as it is.
"""
from __future__ import annotations

import numpy as np

from collectives import MPI
from preprocessing import households as keyed

GAMMA = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
#: Rows per input file must stay below this (ids are file * 2^40 + row).
ROWS_PER_FILE = 1 << 40


def mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, elementwise on uint64 (a bijection)."""
    z = np.asarray(z, dtype=np.uint64).copy()
    z ^= z >> np.uint64(30)
    z *= _M1
    z ^= z >> np.uint64(27)
    z *= _M2
    z ^= z >> np.uint64(31)
    return z


def stream_seed(seed: int, purpose: str) -> np.uint64:
    """A 64-bit seed for one use (``"split"``, ``"shuffle"``) of the user's seed."""
    salt = int.from_bytes(purpose.encode()[:8].ljust(8, b"\0"), "little")
    value = mix(np.array([(seed * 0x9E3779B97F4A7C15 + salt) % (1 << 64)], np.uint64))
    return value[0]


def draw(seed: np.uint64, ids: np.ndarray) -> np.ndarray:
    """The ``ids``-th outputs of SplitMix64 seeded with ``seed`` (uint64)."""
    with np.errstate(over="ignore"):
        state = seed + (ids.astype(np.uint64) + np.uint64(1)) * GAMMA
    return mix(state)


def to_unit(bits: np.ndarray) -> np.ndarray:
    """uint64 -> float64 uniform in [0, 1) (top 53 bits)."""
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


#: Which keyed block (:func:`preprocessing.households.keyed_draw`) and which
#: of its two 64-bit halves gives each use's number under a secret: the split
#: and the household's key are one block per household, the record key one
#: per record.
KEYED = {"split": ("household", 0), "house": ("household", 1), "shuffle": ("record", 0)}


def _bits(seed: int, purpose: str, ids: np.ndarray, key: bytes | None) -> np.ndarray:
    """uint64 per id for one use (``"split"``, ``"house"``, ``"shuffle"``):
    SplitMix64 of the seed, or AES under ``key`` where one is given (:data:`KEYED`)."""
    if key is None:
        return draw(stream_seed(seed, purpose), ids)
    block, half = KEYED[purpose]
    return np.ascontiguousarray(keyed.keyed_draw(key, ids, block)[:, half])


def _household_ids(household: np.ndarray) -> np.ndarray:
    return household.astype(np.int64).view(np.uint64)


def test_households(household: np.ndarray, seed: int, test_fraction: float,
                    key: bytes | None = None) -> np.ndarray:
    """Boolean per record: its household is in the test split.

    Args:
        key: the AES key of a household secret
            (:func:`preprocessing.households.order_key`), or None for
            SplitMix64 of ``seed``.
    """
    if test_fraction <= 0:
        return np.zeros(household.shape, dtype=bool)
    u = to_unit(_bits(seed, "split", _household_ids(household), key))
    return u < test_fraction


#: Split codes of :func:`split_households`.
TRAIN, VAL, TEST = 0, 1, 2


def _sides(u: np.ndarray, test_fraction: float, val_fraction: float) -> np.ndarray:
    """Split code per uniform number ``u`` (module docstring, "Split")."""
    split = np.zeros(u.shape, dtype=np.uint8)
    if val_fraction > 0:
        split[u < test_fraction + val_fraction * (1.0 - test_fraction)] = VAL
    if test_fraction > 0:
        split[u < test_fraction] = TEST
    return split


def split_households(household: np.ndarray, seed: int, test_fraction: float,
                     val_fraction: float = 0.0, key: bytes | None = None) -> np.ndarray:
    """uint8 per record: :data:`TRAIN`, :data:`VAL` or :data:`TEST`, by household.

    Test is exactly :func:`test_households` (the same ``key``); val is a
    share ``val_fraction`` of the remaining (training) households, from the
    same uniform number.
    """
    if test_fraction <= 0 and val_fraction <= 0:
        return np.zeros(household.shape, dtype=np.uint8)
    u = to_unit(_bits(seed, "split", _household_ids(household), key))
    return _sides(u, test_fraction, val_fraction)


def household_keys(seed: int, household: np.ndarray, key: bytes | None = None) -> np.ndarray:
    """The sort key of each record's household (uint64; equal within a
    household); ``key`` as in :func:`test_households`."""
    return _bits(seed, "house", _household_ids(household), key)


def split_and_household_keys(household: np.ndarray, seed: int, test_fraction: float,
                             val_fraction: float = 0.0,
                             key: bytes | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(split_households(...), household_keys(...))`` of the same
    arguments, with one AES call under ``key`` (both halves of a block)."""
    if key is None:
        return (split_households(household, seed, test_fraction, val_fraction),
                household_keys(seed, household))
    both = keyed.keyed_draw(key, _household_ids(household), "household")
    return (_sides(to_unit(both[:, 0]), test_fraction, val_fraction),
            np.ascontiguousarray(both[:, 1]))


def shuffle_keys(seed: int, file_index: int, rows: np.ndarray,
                 key: bytes | None = None) -> np.ndarray:
    """The sort key of each record ``rows`` (row numbers within its file);
    ``key`` as in :func:`test_households`."""
    ids = np.uint64(file_index) * np.uint64(ROWS_PER_FILE) + rows.astype(np.uint64)
    return _bits(seed, "shuffle", ids, key)


def bucket_of(keys: np.ndarray, size: int) -> np.ndarray:
    """Destination rank of each key: ``floor(key * size / 2^64)``.

    Monotone in the key, so every key on rank r is below every key on r+1.
    """
    return np.minimum((to_unit(keys) * size).astype(np.int64), size - 1)


def take(records: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``records[index]``, moving whole rows (numpy gathers a structured array
    field by field, much slower for the ~30-byte records here)."""
    if records.dtype.names is None:
        return records[index]
    rows = records.view(np.dtype((np.void, records.dtype.itemsize)))
    return rows[index].view(records.dtype)


def exchange(records: np.ndarray, dest: np.ndarray, comm) -> np.ndarray:
    """Send each record to rank ``dest[i]`` (one ``Alltoallv``); collective.

    Args:
        records: 1-D structured (or plain) array; every rank passes the same dtype.
        dest: int per record, the destination rank.

    Returns:
        The records this rank received, grouped by source rank in rank order
        (within a source, in the sender's order); ``records`` itself on one rank.
    """
    size = comm.Get_size()
    if size == 1:
        return records
    order = np.argsort(dest, kind="stable")
    sendbuf = take(records, order)
    send_counts = np.bincount(dest, minlength=size).astype(np.int64)
    recv_counts = np.empty(size, dtype=np.int64)
    comm.Alltoall(send_counts, recv_counts)
    recvbuf = np.empty(int(recv_counts.sum()), dtype=records.dtype)
    rowtype = MPI.BYTE.Create_contiguous(records.dtype.itemsize).Commit()
    try:
        send_displ = np.concatenate([[0], np.cumsum(send_counts)[:-1]])
        recv_displ = np.concatenate([[0], np.cumsum(recv_counts)[:-1]])
        comm.Alltoallv([sendbuf.view(np.uint8), (send_counts, send_displ), rowtype],
                       [recvbuf.view(np.uint8), (recv_counts, recv_displ), rowtype])
    finally:
        rowtype.Free()
    return recvbuf


def sort_across_ranks(records: np.ndarray, key_field: str, comm,
                      ties: tuple[str, ...] = ()) -> tuple[np.ndarray, np.ndarray]:
    """Sort records by a uint64 key across all ranks, then by the fields
    ``ties`` where keys are equal; collective. Records of equal key land on
    the same rank.

    Returns:
        ``(received, order)``: ``received[order]`` is this rank's stretch of
        the global order (rank r's keys all precede rank r+1's). The caller
        applies ``order`` (once, to the columns it needs).
    """
    received = exchange(records, bucket_of(records[key_field], comm.Get_size()), comm)
    if not ties:
        return received, np.argsort(received[key_field], kind="stable")
    columns = [received[name] for name in reversed(ties)] + [received[key_field]]
    return received, np.lexsort(columns)


def rebalance(records: np.ndarray, offset: int, starts: list[int], comm) -> np.ndarray:
    """Move globally ordered rows so that rank r holds rows
    ``[starts[r], starts[r+1])``; collective.

    Args:
        records: rows ``[offset, offset + len(records))`` of the global order.
        starts: ``size + 1`` non-decreasing row numbers, ``starts[-1]`` = total.
    """
    rows = offset + np.arange(len(records), dtype=np.int64)
    dest = np.searchsorted(np.asarray(starts[1:-1], dtype=np.int64), rows, side="right")
    return exchange(records, dest.astype(np.int64), comm)
