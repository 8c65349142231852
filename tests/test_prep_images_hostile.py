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

import bz2
import gzip
import io
import lzma
import pickle
import signal
import sys
import tarfile
import tracemalloc
import weakref
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest

import hostile_images as H
from image_files import idx_bytes, mnist_dir
from launcher import SCRIPTS, mpidp, run_mpi
from preprocessing.images import ImageFormatError, read_cifar10, read_mnist
from preprocessing.images import cifar10, safe_pickle
from preprocessing.images.safe_pickle import load_arrays
from preprocessing.images.streams import decompressed, open_stored
from preprocessing.images.tar import TarReader

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


def test_more_rows_than_a_batch_has_are_refused(tmp_path):
    pixels = np.zeros((10_001, 3072), np.uint8)
    data = pickle.dumps({b"data": pixels, b"labels": [0] * 10_001}, protocol=4)
    refused(lambda: read_cifar10(python_dir(tmp_path, {"data_batch_1": data})),
            "data_batch_1", "0 < n <= 10,000", "(10001, 3072)")


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


# ----------------------------------------------- item 7: decompression bombs (MNIST)

def mnist_with(tmp_path: Path, images_gz: bytes) -> Path:
    """A test pair whose images file is ``images_gz`` (labels: one 0)."""
    write(tmp_path / "t10k-images-idx3-ubyte.gz", images_gz)
    write(tmp_path / "t10k-labels-idx1-ubyte.gz", gzip.compress(idx_bytes(0x801, (1,), b"\0")))
    return tmp_path


@pytest.mark.parametrize("header, says", [
    pytest.param(idx_bytes(0x0, (1, 28, 28), b""), "0x00000000", id="bad-magic"),  # the issue's
    pytest.param(idx_bytes(0x803, (1, 28, 28), bytes(784)), "more than 1048576 trailing bytes",
                 id="trailing"),
    pytest.param(idx_bytes(0x803, (10_001, 28, 28), b""), "at most 10,000 images",
                 id="count-over-official"),
    pytest.param(idx_bytes(0x803, (0xFFFFFFFF, 28, 28), b""), "claiming 4,294,967,295",
                 id="count-2**32-1"),
])
def test_an_mnist_gzip_bomb_is_refused_before_it_inflates(tmp_path, header, says):
    """Was: every byte inflated first (a 1 MB .gz reached 2.1 GB, a traceback
    under a memory limit). Here 64 MiB of zeros follow the header; the reader
    reads the header, or the announced bytes and one more."""
    source = mnist_with(tmp_path, H.deflate_bomb(header, 64))
    assert (source / "t10k-images-idx3-ubyte.gz").stat().st_size < 100_000
    peak = peak_of(lambda: refused(lambda: read_mnist(source), "t10k-images-idx3-ubyte.gz",
                                   says))
    assert peak < 4 * MiB


def test_a_train_file_may_claim_the_official_count_but_not_more(tmp_path):
    write(tmp_path / "train-images-idx3-ubyte", idx_bytes(0x803, (60_001, 28, 28), b""))
    write(tmp_path / "train-labels-idx1-ubyte", idx_bytes(0x801, (60_001,), b""))
    refused(lambda: read_mnist(tmp_path), "train-images-idx3-ubyte", "at most 60,000 images")
    write(tmp_path / "train-images-idx3-ubyte", idx_bytes(0x803, (60_000, 28, 28), b""))
    refused(lambda: read_mnist(tmp_path), "expected 47040000 bytes", "truncated")


# ------------------------------------------- item 7: decompression bombs (CIFAR tar)

def test_a_cifar_member_larger_than_a_batch_is_refused_before_it_is_read(tmp_path):
    """Was: members of 40,000 records in a 600 KB .tar.gz were 200,050 images
    (3.7 GB peak, exit 0). The size in the member's header is checked first."""
    members = binary_members(big={"data_batch_4": 10_001})
    archive = write(tmp_path / "c.tar.gz", H.tar_gz(members, "cifar-10-batches-bin/"))
    assert archive.stat().st_size < 200_000
    peak = peak_of(lambda: refused(lambda: read_cifar10(archive),
                                   "c.tar.gz:cifar-10-batches-bin/data_batch_4.bin",
                                   "at most 10,000 records", "10,001 records",
                                   "before reading it"))
    assert peak < 4 * MiB


def test_a_cifar_archive_inflating_past_its_bound_is_cut_off(tmp_path, monkeypatch):
    """Members the reader skips still cost inflating: the archive stops at
    ARCHIVE_MAX (lowered here to 1 MiB so that the case stays small)."""
    monkeypatch.setattr(cifar10, "ARCHIVE_MAX", MiB)
    members = {"readme.html": bytes(2 * MiB), **binary_members()}
    archive = write(tmp_path / "c.tar.gz", H.tar_gz(members, "cifar-10-batches-bin/"))
    refused(lambda: read_cifar10(archive), "c.tar.gz: inflates to more than 1,048,576 bytes",
            "before inflating the rest")


@pytest.mark.parametrize("kind, size, says", [
    pytest.param(b"x", 1 << 40, "pax headers of at most 65,536 bytes", id="pax"),
    pytest.param(b"L", 1 << 30, "GNU long name headers of at most 65,536 bytes", id="longname"),
    pytest.param(b"0", 3073 << 30, "at most 10,000 records", id="member"),
])
def test_tar_headers_claiming_huge_sizes_cost_nothing(tmp_path, kind, size, says):
    name = "cifar-10-batches-bin/data_batch_1.bin" if kind == b"0" else "././@LongLink"
    archive = write(tmp_path / "c.tar.gz", gzip.compress(H.raw_header(name, size, kind)))
    assert peak_of(lambda: refused(lambda: read_cifar10(archive), says)) < 2 * MiB


def test_an_archive_of_many_members_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(cifar10, "MAX_MEMBERS", 20)
    members = {f"empty{i}": b"" for i in range(21)}
    archive = write(tmp_path / "c.tar", H.tar_bytes(members, ""))
    refused(lambda: read_cifar10(archive), "more than 20 members")


# ----------------------------------------------- item 8: corrupt CIFAR archives

def cifar_tar() -> bytes:
    return H.tar_bytes(binary_members(records=3), "cifar-10-batches-bin/")


def test_a_flipped_byte_in_a_batch_fails_the_crc(tmp_path):
    """Was: accepted with the wrong pixels (exit 0); tarfile never reads the
    gzip trailer. Now the stream is read to its end and its CRC checked."""
    tar = cifar_tar()
    offset = H.header_offset(tar, "cifar-10-batches-bin/data_batch_1.bin") + 512 + 100
    archive = write(tmp_path / "c.tar.gz", H.with_bad_crc(tar, offset))
    refused(lambda: read_cifar10(archive), "c.tar.gz", "CRC check failed", "corrupt")


@pytest.mark.parametrize("member", ["data_batch_3.bin", "test_batch.bin"])
def test_a_damaged_header_is_corruption_not_missing_batches(tmp_path, member):
    """Was: tarfile ended its iteration at the damaged header, and the reader
    said the later batches were missing."""
    tar = cifar_tar()
    archive = write(tmp_path / "c.tar.gz",
                    H.with_bad_header(tar, "cifar-10-batches-bin/" + member))
    offset = H.header_offset(tar, "cifar-10-batches-bin/" + member)
    message = refused(lambda: read_cifar10(archive), f"damaged header at byte {offset:,}",
                      "corrupt")
    assert "missing" not in message


@pytest.mark.parametrize("damage, says", [
    ("deflate", "corrupt"), ("cut", "corrupt"), ("after-end", "after the end-of-archive"),
    ("data-cut", "cut short"),
])
def test_a_damaged_stream_is_corruption(tmp_path, damage, says):
    tar = cifar_tar()
    if damage == "deflate":
        packed = bytearray(gzip.compress(tar))
        packed[len(packed) // 2] ^= 0xFF
        data = bytes(packed)
    elif damage == "cut":
        data = gzip.compress(tar)[:-20]
    elif damage == "after-end":
        data = gzip.compress(tar + H.tar_bytes({"x": b"y"}, ""))
    else:
        last = H.header_offset(tar, "cifar-10-batches-bin/test_batch.bin")
        data = gzip.compress(tar[:last + 512 + 1000])
    archive = write(tmp_path / "c.tar.gz", data)
    refused(lambda: read_cifar10(archive), "c.tar.gz", says)


def test_a_batch_twice_or_two_versions_in_one_archive_are_refused(tmp_path):
    """tar extracts the last of two members of one name, and mpidp would have
    to guess between two complete versions: both are refused."""
    members = [("cifar-10-batches-bin/" + name, data) for name, data in binary_members().items()]
    twice = members + [("cifar-10-batches-bin/data_batch_1.bin", bytes(3073))]
    refused(lambda: read_cifar10(write(tmp_path / "a.tar", H.tar_bytes(twice, ""))),
            "data_batch_1.bin", "found it twice")
    both = members + [("data_batch_1.bin", bytes(3073))]
    refused(lambda: read_cifar10(write(tmp_path / "b.tar", H.tar_bytes(both, ""))),
            "binary version in cifar-10-batches-bin/", "binary version in the top folder")


def test_old_gnu_sparse_members_are_skipped_or_refused(tmp_path):
    """An old GNU sparse member's map blocks sit between its header and its
    data: skipped whole when the member is not wanted, refused when it is."""
    sparse = (H.raw_header("junk", 512, b"S", extended=True)
              + bytes(504) + b"\1" + bytes(7) + bytes(512)  # two map blocks, the last unflagged
              + bytes(512))  # its data
    tar = H.tar_bytes(binary_members(), "cifar-10-batches-bin/")
    sets = read_cifar10(write(tmp_path / "a.tar", sparse + tar))
    assert len(sets["train"]) == 10
    wanted = H.raw_header("cifar-10-batches-bin/data_batch_1.bin", 0, b"S") + tar
    refused(lambda: read_cifar10(write(tmp_path / "b.tar", wanted)), "data_batch_1.bin",
            "expected a regular file")


@pytest.mark.parametrize("compress", ["none", "gz", "bz2", "xz"])
@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT],
                         ids=["ustar", "gnu", "pax"])
def test_the_tar_reader_reads_what_tar_writers_write(tmp_path, compress, fmt):
    """Long member names (the ustar prefix, GNU long names, pax paths), a
    directory entry and the three compressions, against tarfile's writer."""
    folder = "d" * 60 + "/" + "e" * 50 + "/cifar-10-batches-bin/"
    members = binary_members(records=2)
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as archive:
        directory = tarfile.TarInfo("d" * 60)
        directory.type = tarfile.DIRTYPE
        archive.addfile(directory)
        for name, data in members.items():
            info = tarfile.TarInfo(folder + name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    packed = {"none": bytes, "gz": gzip.compress, "bz2": bz2.compress,
              "xz": lzma.compress}[compress](out.getvalue())
    archive_path = write(tmp_path / "c.tar", packed)
    with open_stored(archive_path) as raw:
        stream, _ = decompressed(raw)
        reader = TarReader(stream, "c.tar")
        got = {m.name: reader.read(m) for m in reader if m.regular}
        reader.finish()
    assert got == {folder + name: data for name, data in members.items()}


# ---------------------------------------------- item 8: the same file twice (MNIST)

@pytest.mark.parametrize("other", ["t10k-images-idx3-ubyte", "t10k-images.idx3-ubyte"])
def test_a_file_there_gzipped_and_not_is_refused_naming_both(tmp_path, other):
    """Was: the .gz won silently (an all-zero .gz beside the real file gave
    8,000 zero images)."""
    mnist_dir(tmp_path, n_train=0, n_test=5)
    write(tmp_path / other, idx_bytes(0x803, (5, 28, 28), bytes(5 * 784)))
    refused(lambda: read_mnist(tmp_path), "expected one test images file",
            "t10k-images-idx3-ubyte.gz", other, "will not choose")


# --------------------------------------------------- item 8: a stop while writing

def sigterm_in_a_weakref_callback() -> None:
    """Raise SIGTERM where h5py's clean-up runs Python: inside a weak reference's
    callback, where an exception cannot propagate (it is "unraisable")."""
    class Thing:
        pass

    thing = Thing()
    ref = weakref.ref(thing, lambda _: signal.raise_signal(signal.SIGTERM))
    del thing
    assert ref() is None


def test_a_stop_signal_during_the_write_ends_prep_and_leaves_nothing(tmp_path, monkeypatch):
    """Was: engine's handler raised inside h5py's weakref callbacks, the stop was
    lost and prep finished (exit 0). Now the temporary file goes at once and the
    stop is raised from the writer's own code."""
    from collectives import MPI
    from engine import stopping
    from preprocessing import h5format
    from preprocessing.h5write import Compression
    from preprocessing.images import prepare

    write_attributes = h5format.write_attributes

    def interrupted(attrs, values):
        write_attributes(attrs, values)
        sigterm_in_a_weakref_callback()

    monkeypatch.setattr(h5format, "write_attributes", interrupted)
    source = mnist_dir(tmp_path / "mnist", n_train=0, n_test=40)
    out = tmp_path / "out" / "m.h5"
    out.parent.mkdir()
    args = Namespace(format="mnist", inputs=[str(source)], out=str(out), seed=0,
                     test_fraction=None)
    before = signal.getsignal(signal.SIGTERM)
    stopping.forget_signals()
    try:
        with stopping.handled_signals(raising=True):
            with pytest.raises(stopping.Interrupted) as info:
                prepare.prepare_images(MPI.COMM_SELF, args, 0.0, Compression(), "test")
    finally:
        stopping.forget_signals()
    assert info.value.signum == signal.SIGTERM
    assert list(out.parent.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) is before  # handlers restored


def test_a_stop_during_the_write_under_mpiexec_is_one_line_and_no_file(tmp_path):
    source = mnist_dir(tmp_path / "mnist", n_train=0, n_test=40)
    out = tmp_path / "out" / "m.h5"
    out.parent.mkdir()
    done = run_mpi(2, [sys.executable, str(SCRIPTS / "prep_stop_in_write.py"),
                       "prep", "--format", "mnist", str(source), "--out", str(out)])
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"mpidp: stopped by SIGTERM (exit code {128 + signal.SIGTERM})"], done.stderr
    assert list(out.parent.iterdir()) == []


# ------------------------------------------------ the command: one line, exit 2

def _corpus_case(case: str, root: Path) -> tuple[str, Path, str]:
    """(format, source, fragment of the line) of one corpus file, written under root."""
    if case == "strided":
        return "cifar10", python_dir(root, {"data_batch_1": H.strided_batch(50_000)}), \
            "numpy.ndarray"
    if case == "bomb":
        return "mnist", mnist_with(root, H.deflate_bomb(idx_bytes(0, (1, 28, 28), b""), 16)), \
            "magic"
    tar = cifar_tar()
    offset = H.header_offset(tar, "cifar-10-batches-bin/data_batch_1.bin") + 600
    return "cifar10", write(root / "c.tar.gz", H.with_bad_crc(tar, offset)), "CRC"


@pytest.mark.parametrize("case", ["strided", "bomb", "crc"])
def test_hostile_files_end_prep_with_one_line_and_nothing_left(tmp_path, case):
    root = tmp_path / "src"
    root.mkdir()
    fmt, source, says = _corpus_case(case, root)
    out = tmp_path / "out" / "x.h5"
    out.parent.mkdir()
    done = mpidp(2, "prep", "--format", fmt, str(source), "--out", str(out))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mpidp: error: ") and says in lines[0], \
        done.stderr
    assert list(out.parent.iterdir()) == []

