"""Hostile image files (issue 41, items 5-8): the corpus of tests/hostile_images.py replayed.

Each case is a file built in the test, small, that made ``mpidp prep`` use
memory nobody filled, allocate or inflate what a header claimed, accept a
corrupt archive, or ignore a stop. Every one must now be one ImageFormatError
line naming the file (the command: exit 2, no traceback, nothing left), and
where the attack was memory, the reader's peak (tracemalloc, which counts
Python's and numpy's allocations) must stay far below what the file claims.
docs/security.md says what each case was and what the readers guarantee.
"""
from __future__ import annotations

import pickle
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import hostile_images as H
from preprocessing.images import ImageFormatError, read_cifar10, safe_pickle
from preprocessing.images.safe_pickle import load_arrays

BATCHES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
MiB = 1 << 20


def refused(call, *fragments: str) -> str:
    """``call()`` must raise one ImageFormatError line holding every fragment."""
    with pytest.raises(ImageFormatError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


def peak_of(call) -> int:
    """Peak bytes traced (Python and numpy allocations) while ``call()`` runs;
    an ImageFormatError it raises is expected and swallowed."""
    tracemalloc.start()
    try:
        call()
    except ImageFormatError:
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def batch(n: int, seed: int) -> tuple[np.ndarray, list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 3072), dtype=np.uint8), rng.integers(0, 10, n).tolist()


def python_dir(root: Path, replace: dict[str, bytes], protocol: int = 4) -> Path:
    """The python version's six batches (two images each) with ``replace``'s
    files in place of some."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for i, name in enumerate(BATCHES):
        pixels, labels = batch(2, i)
        data = replace.get(name) or pickle.dumps({b"data": pixels, b"labels": labels},
                                                 protocol=protocol)
        (folder / name).write_bytes(data)
    return root


def binary_members(records: int = 2, big: dict[str, int] | None = None) -> dict[str, bytes]:
    """The six binary batches: ``records`` random records each (``big``: some
    batches as that many all-zero records, which are valid)."""
    rng = np.random.default_rng(0)
    members = {}
    for name in BATCHES:
        n = (big or {}).get(name)
        if n is not None:
            members[name + ".bin"] = bytes(n * 3073)
            continue
        labels = rng.integers(0, 10, (records, 1))
        pixels = rng.integers(0, 256, (records, 3072))
        members[name + ".bin"] = np.concatenate([labels, pixels], 1).astype(np.uint8).tobytes()
    return members


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


# ------------------------------------------ item 5: arrays over one byte (pickles)

@pytest.mark.timeout(60)
@pytest.mark.parametrize("rows", [3, 50_000, 1 << 40])
def test_a_pickle_calling_ndarray_over_one_byte_is_refused(tmp_path, rows):
    """Was: 6 such pickles of ~130 bytes gave 300,000 images (5 GB peak, exit 0);
    2**40 rows a raw _ArrayMemoryError after minutes of work."""
    source = python_dir(tmp_path, {"data_batch_2": H.strided_batch(rows)})
    assert len(H.strided_batch(rows)) < 200
    peak = peak_of(lambda: refused(lambda: read_cifar10(source), "data_batch_2",
                                   "numpy.ndarray", "not executed"))
    assert peak < 2 * MiB


def test_an_array_claiming_more_than_its_bytes_is_refused_before_allocating(tmp_path):
    source = python_dir(tmp_path, {"test_batch": H.short_built_batch(1, 1 << 40)})
    peak = peak_of(lambda: refused(lambda: read_cifar10(source), "test_batch",
                                   "claims shape (1099511627776, 3072)", "carries 3,072 bytes"))
    assert peak < 2 * MiB


# -------------------------------- item 6: arrays without their contents (pickles)

@pytest.mark.parametrize("which", ["data", "labels"])
def test_an_array_reconstructed_without_its_bytes_is_refused(tmp_path, which):
    """Was: the pixels held the prep process's heap (accepted, exit 0); for the
    labels, refusal depended on what the heap held."""
    source = python_dir(tmp_path, {"data_batch_3": H.unbuilt_batch(16, which)})
    refused(lambda: read_cifar10(source), "data_batch_3", "no BUILD state",
            "never filled")


@pytest.mark.parametrize("case, says", [
    pytest.param(b"\x80\x02cnumpy\ndtype\nX\x02\x00\x00\x00f8\x89\x88\x87R.",
                 "not an integer type", id="float-dtype"),
    pytest.param(b"\x80\x02cnumpy\ndtype\nX\x02\x00\x00\x00O8\x89\x88\x87R.",
                 "not an integer type", id="object-dtype"),
    pytest.param(pickle.dumps({i: 0 for i in range(65)}, protocol=2), "more than 64 entries",
                 id="setitems"),
    pytest.param(pickle.dumps({i: 0 for i in range(65)}, protocol=0), "more than 64 entries",
                 id="setitem"),
    pytest.param(b"(" + b"I1\nI0\n" * 65 + b"d.", "more than 64 entries", id="dict"),
    pytest.param(pickle.dumps(set(range(65)), protocol=4), "more than 64 entries", id="set"),
    pytest.param(pickle.dumps(frozenset(range(65)), protocol=4), "more than 64 entries",
                 id="frozenset"),
    pytest.param(b"I1\np4294967296\n.", "memo index of 4294967296", id="memo-index"),
    pytest.param(b"\x80\x05\x96" + (1 << 40).to_bytes(8, "little") + b"abc.", "cut short",
                 id="bytearray8-claim"),
    pytest.param(b"\x80\x05\x97.", "out-of-band", id="next-buffer"),
    pytest.param(b"\x80\x02cnumpy\nndarray\n)\x81.", "malformed", id="newobj-stand-in"),
    pytest.param(b"\x80\x02]\x94}b.", "a BUILD of list", id="build-list"),
    pytest.param(b"\x80\x02cnumpy\ndtype\nX\x02\x00\x00\x00u1\x89\x88\x87R}b.",
                 "dtype state", id="dtype-state"),
    pytest.param(b"\x80\x02c\x1b]0;x\x07\nsystem\n.", "reference to \\x1b]0;x\\x07.system",
                 id="escape-sequence"),  # a terminal escape in a name is not printed raw
])
def test_the_unpickler_admits_only_what_a_batch_needs(case, says):
    """The pickle machine's own ways to spend memory or time, or to reach past
    the stand-ins, are refused without allocating what they claim."""
    assert peak_of(lambda: refused(lambda: load_arrays(case, "b"), says)) < 2 * MiB


def test_the_admitted_dtypes_are_integer_types():
    assert all(np.dtype(code).kind in "iu" for code in safe_pickle.DTYPES)


def test_a_pickle_of_many_small_objects_stops_at_its_opcode_budget():
    """One byte (EMPTY_LIST) makes a 56-byte list: 2 MB of them would be 130 MB
    of lists (a pickle at the size bound, 2 GB). The budget stops at 250,000."""
    many = b"\x80\x02(" + b"]" * 2_000_000 + b"l."
    peak = peak_of(lambda: refused(lambda: load_arrays(many, "b"),
                                   "more than 250,000 pickle opcodes"))
    assert peak < 24 * MiB


# ------------------------------------------------------------ protocol 5 (item 8)

@pytest.mark.parametrize("protocol", [4, 5])
@pytest.mark.parametrize("order", ["C", "F"])
def test_pickles_numpy_writes_are_read_exactly(tmp_path, protocol, order):
    """Was: protocol 5 (numpy's _frombuffer) refused as "something other than
    the expected arrays". A Fortran-ordered array keeps its values; a label
    array may be any integer type and byte order. (Protocol 2 as Python 2
    wrote it: tests/test_prep_images_readers.py.)"""
    pixels, labels = batch(3, seed=7)
    data = pickle.dumps({b"data": np.asarray(pixels, order=order),
                         b"labels": np.array(labels, dtype=">i4")}, protocol=protocol)
    source = python_dir(tmp_path, {"data_batch_5": data})
    got = read_cifar10(source)["train"]
    np.testing.assert_array_equal(got.images[-3:].reshape(3, 3072), pixels)
    np.testing.assert_array_equal(got.labels[-3:], labels)


def test_out_of_band_buffers_are_refused_in_one_line(tmp_path):
    pixels, labels = batch(2, seed=1)
    buffers: list = []
    data = pickle.dumps({b"data": pixels, b"labels": labels}, protocol=5,
                        buffer_callback=buffers.append)
    assert buffers
    refused(lambda: read_cifar10(python_dir(tmp_path, {"data_batch_1": data})),
            "data_batch_1", "out-of-band", "without buffer_callback")
