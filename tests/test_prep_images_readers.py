"""The MNIST and CIFAR-10 readers (preprocessing.images) on small files built here.

Every file is written by the test in the official layout (idx with struct,
CIFAR-10 records byte by byte, python-version pickles with pickle.dumps), so
a round trip checks the readers against the format, not against themselves.
Each bad case must raise one ImageFormatError line naming the file. The last
test reads the real MNIST test set when it is present.
"""
from __future__ import annotations

import gzip
import hashlib
import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from image_files import idx_bytes, write_tar
from preprocessing.errors import PrepError
from preprocessing.images import ImageFormatError, ImageSet, read_cifar10, read_mnist

MNIST_URL = "http://yann.lecun.com/exdb/mnist/"
CIFAR_URL = "https://www.cs.toronto.edu/~kriz/cifar.html"
BATCHES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]


def raises_one_line(call, *fragments: str) -> ImageFormatError:
    """Run ``call``; it must raise one ImageFormatError line holding every fragment."""
    with pytest.raises(ImageFormatError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return info.value


# ---------------------------------------------------------------- MNIST files

def write(path: Path, data: bytes, gz: bool) -> Path:
    path = path.with_name(path.name + ".gz") if gz else path
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def write_mnist(root: Path, prefix: str, n: int, gz: bool = True, seed: int = 0,
                dot: bool = False) -> tuple[np.ndarray, np.ndarray, Path, Path]:
    """A pair of idx files with random pixels and labels: (images, labels, paths)."""
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, size=n, dtype=np.uint8)
    sep = "." if dot else "-"
    ipath = write(root / f"{prefix}-images{sep}idx3-ubyte",
                  idx_bytes(0x803, (n, 28, 28), images.tobytes()), gz)
    lpath = write(root / f"{prefix}-labels{sep}idx1-ubyte",
                  idx_bytes(0x801, (n,), labels.tobytes()), gz)
    return images, labels, ipath, lpath


def test_mnist_round_trip_both_splits_gzipped(tmp_path):
    train_x, train_y, tx, ty = write_mnist(tmp_path, "train", 7, seed=1)
    test_x, test_y, _, _ = write_mnist(tmp_path, "t10k", 3, seed=2)
    sets = read_mnist(tmp_path)
    assert list(sets) == ["train", "test"]
    for split, (x, y) in {"train": (train_x, train_y), "test": (test_x, test_y)}.items():
        got = sets[split]
        assert isinstance(got, ImageSet) and got.n_classes == 10 and len(got) == len(y)
        assert got.images.dtype == np.uint8 and got.images.shape == (len(y), 1, 28, 28)
        assert got.labels.dtype == np.uint8
        np.testing.assert_array_equal(got.images[:, 0], x)
        np.testing.assert_array_equal(got.labels, y)
    assert sets["train"].source == [
        {"name": tx.name, "sha256": hashlib.sha256(tx.read_bytes()).hexdigest(), "count": 7},
        {"name": ty.name, "sha256": hashlib.sha256(ty.read_bytes()).hexdigest(), "count": 7}]


def test_mnist_plain_test_split_only(tmp_path):
    x, y, ipath, _ = write_mnist(tmp_path, "t10k", 4, gz=False)
    sets = read_mnist(tmp_path)
    assert list(sets) == ["test"]
    np.testing.assert_array_equal(sets["test"].images.reshape(4, 28, 28), x)
    np.testing.assert_array_equal(sets["test"].labels, y)
    assert sets["test"].source[0]["name"] == "t10k-images-idx3-ubyte"
    assert sets["test"].images.flags.writeable and sets["test"].images.flags.c_contiguous


def test_mnist_dot_spelling(tmp_path):
    x, y, _, _ = write_mnist(tmp_path, "train", 2, gz=False, dot=True)
    sets = read_mnist(tmp_path)
    np.testing.assert_array_equal(sets["train"].images[:, 0], x)
    assert sets["train"].source[0]["name"] == "train-images.idx3-ubyte"


@pytest.mark.parametrize("which, magic, expected", [
    ("images", 0x801, "0x00000803"), ("labels", 0x803, "0x00000801"),
    ("images", 0x0D03, "0x00000803")])
def test_mnist_wrong_magic(tmp_path, which, magic, expected):
    _, _, ipath, lpath = write_mnist(tmp_path, "t10k", 2, gz=False)
    path = ipath if which == "images" else lpath
    data = bytearray(path.read_bytes())
    data[:4] = struct.pack(">I", magic)
    path.write_bytes(bytes(data))
    error = raises_one_line(lambda: read_mnist(tmp_path), path.name, expected,
                            f"0x{magic:08X}")
    assert isinstance(error, PrepError) and error.exit_code == 2


def test_mnist_gzipped_file_without_gz_name(tmp_path):
    _, _, ipath, _ = write_mnist(tmp_path, "t10k", 2, gz=False)
    ipath.write_bytes(gzip.compress(ipath.read_bytes()))
    raises_one_line(lambda: read_mnist(tmp_path), ipath.name, "gzip", "0x00000803")


def test_mnist_count_mismatch(tmp_path):
    _, _, _, lpath = write_mnist(tmp_path, "train", 5)
    write(lpath.with_suffix(""), idx_bytes(0x801, (4,), bytes(4)), gz=True)
    raises_one_line(lambda: read_mnist(tmp_path), "train-labels-idx1-ubyte.gz",
                    "4 labels", "5 images")


@pytest.mark.parametrize("which", ["images", "labels"])
@pytest.mark.parametrize("delta, says", [(-1, "truncated"), (3, "3 trailing bytes")])
def test_mnist_payload_length(tmp_path, which, delta, says):
    _, _, ipath, lpath = write_mnist(tmp_path, "t10k", 3, gz=False)
    path = ipath if which == "images" else lpath
    data = path.read_bytes()
    path.write_bytes(data[:delta] if delta < 0 else data + bytes(delta))
    expected = 3 * 784 if which == "images" else 3
    raises_one_line(lambda: read_mnist(tmp_path), path.name, f"expected {expected} bytes",
                    f"found {expected + delta}", says)


def test_mnist_header_cut_short(tmp_path):
    _, _, ipath, _ = write_mnist(tmp_path, "t10k", 1, gz=False)
    ipath.write_bytes(ipath.read_bytes()[:10])
    raises_one_line(lambda: read_mnist(tmp_path), ipath.name, "16 bytes", "10 bytes")


def test_mnist_not_28x28(tmp_path):
    write_mnist(tmp_path, "t10k", 1, gz=False)
    path = tmp_path / "t10k-images-idx3-ubyte"
    path.write_bytes(idx_bytes(0x803, (1, 32, 32), bytes(1024)))
    raises_one_line(lambda: read_mnist(tmp_path), path.name, "28x28", "32x32")


def test_mnist_label_out_of_range(tmp_path):
    _, labels, _, lpath = write_mnist(tmp_path, "t10k", 6)
    bad = labels.copy()
    bad[4] = 10
    write(lpath.with_suffix(""), idx_bytes(0x801, (6,), bad.tobytes()), gz=True)
    raises_one_line(lambda: read_mnist(tmp_path), lpath.name, "0..9", "10 at index 4")


def corrupt_gzip(kind: str, data: bytes) -> bytes:
    packed = bytearray(gzip.compress(data))
    if kind == "truncated":
        return bytes(packed[: len(packed) // 2])
    if kind == "not gzip":
        return b"this is not gzip" + bytes(packed)
    if kind == "crc":
        packed[-8] ^= 0xFF  # the stored CRC32
        return bytes(packed)
    packed[12:20] = b"\xff" * 8  # the deflate stream itself
    return bytes(packed)


@pytest.mark.parametrize("kind", ["truncated", "not gzip", "crc", "deflate"])
def test_mnist_corrupt_gzip(tmp_path, kind):
    _, _, ipath, _ = write_mnist(tmp_path, "train", 3)
    ipath.write_bytes(corrupt_gzip(kind, gzip.decompress(ipath.read_bytes())))
    raises_one_line(lambda: read_mnist(tmp_path), ipath.name, "gzip", MNIST_URL)


@pytest.mark.parametrize("keep, lacking, official", [
    ("images", "labels", "train-labels-idx1-ubyte"),
    ("labels", "images", "train-images-idx3-ubyte")])
def test_mnist_half_pair(tmp_path, keep, lacking, official):
    write_mnist(tmp_path, "t10k", 2)  # a complete test pair does not excuse it
    _, _, ipath, lpath = write_mnist(tmp_path, "train", 2)
    (lpath if keep == "images" else ipath).unlink()
    kept = ipath if keep == "images" else lpath
    raises_one_line(lambda: read_mnist(tmp_path), kept.name, f"not its {lacking} file",
                    official, MNIST_URL)


def test_mnist_nothing_there(tmp_path):
    (tmp_path / "readme.txt").write_text("no idx here")
    raises_one_line(lambda: read_mnist(tmp_path), str(tmp_path), "t10k-images-idx3-ubyte",
                    MNIST_URL, "train-labels-idx1-ubyte.gz", "downloads nothing")
    raises_one_line(lambda: read_mnist(tmp_path / "absent"), "absent", MNIST_URL)
    raises_one_line(lambda: read_mnist(tmp_path / "readme.txt"), "found a file")


def _not_a_file(path: Path, kind: str) -> str:
    """Put a ``kind`` (fifo, directory, loop) at ``path``; returns what the reader
    must call it."""
    if kind == "fifo":
        os.mkfifo(path)
        return "found a FIFO (named pipe)"
    if kind == "directory":
        path.mkdir()
        return "found a directory"
    path.symlink_to(path.name)  # a link to itself
    return "found a symbolic link loop"


@pytest.mark.parametrize("kind", ["fifo", "directory", "loop"])
@pytest.mark.parametrize("name", ["t10k-images-idx3-ubyte", "t10k-images-idx3-ubyte.gz"])
def test_mnist_file_that_is_not_a_regular_file(tmp_path, kind, name):
    """It was 'found the test labels file but not its images file' (a FIFO would
    block the reader once opened)."""
    write_mnist(tmp_path, "t10k", 2, gz=False)
    (tmp_path / "t10k-images-idx3-ubyte").unlink()
    says = _not_a_file(tmp_path / name, kind)
    error = raises_one_line(lambda: read_mnist(tmp_path), f"{tmp_path / name}: expected the "
                            "test images file (a regular file)", says, "put the file itself")
    assert "not its images file" not in str(error)
    if kind != "directory":  # as the directory itself: it said "found a file", or "nothing"
        raises_one_line(lambda: read_mnist(tmp_path / name),
                        "expected a directory of MNIST idx files, " + says)


def test_mnist_zero_images(tmp_path):
    (tmp_path / "t10k-images-idx3-ubyte").write_bytes(idx_bytes(0x803, (0, 28, 28), b""))
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(idx_bytes(0x801, (0,), b""))
    raises_one_line(lambda: read_mnist(tmp_path), "at least one image")


# ------------------------------------------------------------- CIFAR-10 files

def cifar_batch(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random images as a user pictures them, HWC [n, 32, 32, 3], and labels."""
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, size=(n, 32, 32, 3), dtype=np.uint8),
            rng.integers(0, 10, size=n, dtype=np.uint8))


def binary_records(hwc: np.ndarray, labels: np.ndarray) -> bytes:
    """The official record layout, spelled out: label, then R, G, B planes row-major."""
    out = bytearray()
    for image, label in zip(hwc, labels):
        out.append(int(label))
        for channel in range(3):
            out += image[:, :, channel].tobytes()  # C order: row after row
    return bytes(out)


def py2_pickle(obj) -> bytes:
    """``obj`` pickled as Python 2's cPickle wrote the official python version (protocol 2,
    byte strings as BINSTRING, arrays through numpy.core.multiarray._reconstruct)."""
    out = bytearray(b"\x80\x02")

    def emit(o) -> None:
        if isinstance(o, dict):
            out.extend(b"}(")
            for key, value in o.items():
                emit(key)
                emit(value)
            out.extend(b"u")
        elif isinstance(o, (list, tuple)):
            out.extend(b"](" if isinstance(o, list) else b"(")
            for item in o:
                emit(item)
            out.extend(b"e" if isinstance(o, list) else b"t")
        elif o is None or isinstance(o, bool):
            out.extend({None: b"N", True: b"\x88", False: b"\x89"}[o])
        elif isinstance(o, int):
            out.extend(b"J" + struct.pack("<i", o))
        elif isinstance(o, bytes):
            out.extend(b"T" + struct.pack("<I", len(o)) + o)
        else:  # a C-contiguous uint8 array
            out.extend(b"cnumpy.core.multiarray\n_reconstruct\n(cnumpy\nndarray\n")
            emit((0,))
            emit(b"b")
            out.extend(b"tR(")
            emit(1)
            emit(o.shape)
            out.extend(b"cnumpy\ndtype\n")
            emit((b"u1", 0, 1))
            out.extend(b"R")
            emit((3, b"|", None, None, None, -1, -1, 0))
            out.extend(b"b")
            emit(False)
            emit(o.tobytes())
            out.extend(b"tb")

    emit(obj)
    return bytes(out + b".")


def python_batch(hwc: np.ndarray, labels: np.ndarray, name: str, protocol: int = 4) -> bytes:
    rows = np.stack([np.concatenate([img[:, :, c].ravel() for c in range(3)]) for img in hwc])
    return pickle.dumps({b"batch_label": name.encode(), b"labels": [int(v) for v in labels],
                         b"data": rows, b"filenames": [b"x.png"] * len(labels)},
                        protocol=protocol)


SIZES = [2, 3, 1, 2, 4, 3]  # data_batch_1..5, test_batch


def cifar_files(version: str) -> tuple[dict[str, bytes], dict[str, tuple]]:
    """{file name: bytes} of the six batches, and {split: (hwc, labels)} they hold."""
    files, batches = {}, []
    for index, (batch, n) in enumerate(zip(BATCHES, SIZES)):
        hwc, labels = cifar_batch(n, seed=10 + index)
        batches.append((hwc, labels))
        if version == "binary":
            files[batch + ".bin"] = binary_records(hwc, labels)
        else:
            files[batch] = python_batch(hwc, labels, batch)
    train = tuple(np.concatenate(parts) for parts in zip(*batches[:5]))
    return files, {"train": train, "test": batches[5]}


def write_dir(root: Path, files: dict[str, bytes]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (root / name).write_bytes(data)


def check_cifar(sets: dict[str, ImageSet], expected: dict[str, tuple]) -> None:
    assert list(sets) == ["train", "test"]
    for split, (hwc, labels) in expected.items():
        got = sets[split]
        assert got.n_classes == 10 and got.images.dtype == np.uint8
        assert got.images.shape == (len(labels), 3, 32, 32)
        assert got.images.flags.c_contiguous and got.images.flags.writeable
        np.testing.assert_array_equal(got.images, hwc.transpose(0, 3, 1, 2))  # R plane first
        np.testing.assert_array_equal(got.labels, labels)
    assert [s["count"] for s in sets["train"].source] == SIZES[:5]


def test_cifar_binary_record_layout(tmp_path):
    """Byte 1 of a record is red (0, 0), byte 1 + 32 red (1, 0), byte 1 + 1024 green (0, 0)."""
    files, _ = cifar_files("binary")
    record = bytearray(3073)
    record[0], record[1], record[1 + 1], record[1 + 32] = 7, 11, 12, 13
    record[1 + 1024], record[1 + 2048], record[3072] = 21, 31, 39
    files["test_batch.bin"] = bytes(record)
    write_dir(tmp_path, files)
    test = read_cifar10(tmp_path)["test"]
    assert test.labels.tolist() == [7]
    image = test.images[0]
    assert (image[0, 0, 0], image[0, 0, 1], image[0, 1, 0]) == (11, 12, 13)
    assert (image[1, 0, 0], image[2, 0, 0], image[2, 31, 31]) == (21, 31, 39)
    assert int(image.sum()) == 11 + 12 + 13 + 21 + 31 + 39


@pytest.mark.parametrize("subdir", ["", "cifar-10-batches-bin"])
def test_cifar_binary_directory(tmp_path, subdir):
    files, expected = cifar_files("binary")
    write_dir(tmp_path / subdir, files)
    sets = read_cifar10(tmp_path)
    check_cifar(sets, expected)
    prefix = f"{subdir}/" if subdir else ""
    assert sets["train"].source[0] == {
        "name": f"{prefix}data_batch_1.bin", "count": 2,
        "sha256": hashlib.sha256(files["data_batch_1.bin"]).hexdigest()}
    assert [s["name"] for s in sets["test"].source] == [f"{prefix}test_batch.bin"]


@pytest.mark.parametrize("version, prefix, suffix", [
    ("binary", "cifar-10-batches-bin/", ".tar.gz"), ("binary", "./cifar-10-batches-bin/", ".tgz"),
    ("python", "cifar-10-batches-py/", ".tar.gz")])
def test_cifar_tar(tmp_path, version, prefix, suffix):
    files, expected = cifar_files(version)
    files = dict(reversed(list(files.items())))  # archive order is not the batch order
    files["batches.meta.txt"] = b"airplane\n"
    archive = write_tar(tmp_path / f"cifar{suffix}", files, prefix)
    sets = read_cifar10(archive)
    check_cifar(sets, expected)
    assert [s["name"] for s in sets["train"].source] == [
        f"{prefix.removeprefix('./')}data_batch_{i}{'.bin' if version == 'binary' else ''}"
        for i in range(1, 6)]
    assert list(tmp_path.iterdir()) == [archive]  # nothing extracted


@pytest.mark.parametrize("subdir", ["", "cifar-10-batches-py"])
def test_cifar_python_directory(tmp_path, subdir):
    files, expected = cifar_files("python")
    write_dir(tmp_path / subdir, files)
    check_cifar(read_cifar10(tmp_path), expected)


def test_cifar_python_version_as_python2_wrote_it(tmp_path):
    files, expected = cifar_files("python")
    for name, data in files.items():
        files[name] = py2_pickle(pickle.loads(data))
    written = files["test_batch"]
    assert b"numpy.core.multiarray" in written and b"_codecs" not in written
    write_dir(tmp_path / "cifar-10-batches-py", files)
    check_cifar(read_cifar10(tmp_path), expected)


def test_cifar_prefers_binary(tmp_path):
    binary, expected = cifar_files("binary")
    python = {name: python_batch(*cifar_batch(n, seed=99 + i), name)
              for i, (name, n) in enumerate(zip(BATCHES, SIZES))}
    write_dir(tmp_path / "cifar-10-batches-py", python)
    write_dir(tmp_path / "cifar-10-batches-bin", binary)
    sets = read_cifar10(tmp_path)
    check_cifar(sets, expected)
    assert all(s["name"].endswith(".bin") for s in sets["train"].source)


def test_cifar_complete_python_over_incomplete_binary(tmp_path):
    binary, _ = cifar_files("binary")
    python, expected = cifar_files("python")
    del binary["test_batch.bin"]
    write_dir(tmp_path / "cifar-10-batches-bin", binary)
    write_dir(tmp_path / "cifar-10-batches-py", python)
    check_cifar(read_cifar10(tmp_path), expected)


@pytest.mark.parametrize("delta", [-1, 1, -3073 * 3])  # the last: empty
def test_cifar_binary_length(tmp_path, delta):
    files, _ = cifar_files("binary")
    files["data_batch_2.bin"] = files["data_batch_2.bin"][:delta] if delta < 0 else (
        files["data_batch_2.bin"] + bytes(delta))
    write_dir(tmp_path, files)
    raises_one_line(lambda: read_cifar10(tmp_path), "data_batch_2.bin", "3073-byte records",
                    f"found {3 * 3073 + delta} bytes")


def test_cifar_binary_label_out_of_range(tmp_path):
    files, _ = cifar_files("binary")
    data = bytearray(files["test_batch.bin"])
    data[2 * 3073] = 10
    files["test_batch.bin"] = bytes(data)
    archive = write_tar(tmp_path / "c.tar.gz", files, "cifar-10-batches-bin/")
    raises_one_line(lambda: read_cifar10(archive),
                    f"{archive}:cifar-10-batches-bin/test_batch.bin", "0..9", "10 at record 2")


@pytest.mark.parametrize("bad", [10, -1, 300])
def test_cifar_python_label_out_of_range(tmp_path, bad):
    files, _ = cifar_files("python")
    hwc, labels = cifar_batch(3, seed=5)
    batch = pickle.loads(python_batch(hwc, labels, "b"))
    batch[b"labels"][1] = bad
    files["data_batch_5"] = pickle.dumps(batch)
    write_dir(tmp_path, files)
    raises_one_line(lambda: read_cifar10(tmp_path), "data_batch_5", "0..9", f"{bad} at label 1")


@pytest.mark.parametrize("drop", [["data_batch_3.bin"], ["data_batch_1.bin", "test_batch.bin"]])
def test_cifar_missing_batch(tmp_path, drop):
    files, _ = cifar_files("binary")
    for name in drop:
        del files[name]
    write_dir(tmp_path / "cifar-10-batches-bin", files)
    raises_one_line(lambda: read_cifar10(tmp_path), "missing " + ", ".join(
        f"cifar-10-batches-bin/{name}" for name in drop), "binary version", CIFAR_URL)


def test_cifar_nothing_there(tmp_path):
    raises_one_line(lambda: read_cifar10(tmp_path), "no CIFAR-10 batches", "test_batch.bin",
                    "cifar-10-binary.tar.gz", CIFAR_URL, "downloads nothing")
    raises_one_line(lambda: read_cifar10(tmp_path / "absent.tar.gz"), "absent.tar.gz", CIFAR_URL)


@pytest.mark.parametrize("kind", ["fifo", "directory", "loop"])
def test_cifar_batch_that_is_not_a_regular_file(tmp_path, kind):
    """A directory (or FIFO, or link loop) named as a batch was reported missing."""
    files, _ = cifar_files("binary")
    del files["data_batch_2.bin"]
    folder = tmp_path / "cifar-10-batches-bin"
    write_dir(folder, files)
    says = _not_a_file(folder / "data_batch_2.bin", kind)
    error = raises_one_line(lambda: read_cifar10(tmp_path),
                            f"{folder / 'data_batch_2.bin'}: expected a CIFAR-10 batch", says)
    assert "missing" not in str(error)
    if kind != "directory":  # the archive's own path: a FIFO would block once opened
        raises_one_line(lambda: read_cifar10(folder / "data_batch_2.bin"),
                        "expected a directory or a .tar.gz", says)


@pytest.mark.parametrize("content", [b"not a tar at all" * 100, b""])
def test_cifar_not_a_tar(tmp_path, content):
    path = tmp_path / "cifar-10-binary.tar.gz"
    path.write_bytes(content)
    raises_one_line(lambda: read_cifar10(path), str(path), "tar archive", CIFAR_URL)


def test_cifar_corrupt_tar_gz(tmp_path):
    files, _ = cifar_files("binary")
    archive = write_tar(tmp_path / "c.tar.gz", files, "cifar-10-batches-bin/")
    data = archive.read_bytes()
    archive.write_bytes(data[: len(data) // 2])
    raises_one_line(lambda: read_cifar10(archive), str(archive), "corrupt")


# ---------------------------------------------------------- malicious pickles

def write_sentinel(path: str) -> int:
    """The payload's callable: harmless, but it leaves a trace if it ever runs."""
    Path(path).write_text("executed")
    return 0


class Payload:
    """Unpickles as ``func(*args)``: a pickle calls whatever it names."""

    def __init__(self, func, *args) -> None:
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


@pytest.mark.parametrize("protocol, inside", [(2, False), (4, False), (4, True), (5, True)])
def test_cifar_pickle_never_executes(tmp_path, protocol, inside):
    """The payload alone, or as b'labels' of an otherwise valid batch (not at protocol 2:
    Python 3 pickles the bytes keys through _codecs.encode, refused before the payload)."""
    control, sentinel = tmp_path / "control", tmp_path / "SENTINEL"
    live = pickle.dumps(Payload(write_sentinel, str(control)), protocol=protocol)
    pickle.loads(live)
    assert control.exists()  # the payload is live under an ordinary unpickler

    files, _ = cifar_files("python")
    payload = Payload(write_sentinel, str(sentinel))
    if inside:
        hwc, labels = cifar_batch(3, seed=4)
        payload = {**pickle.loads(python_batch(hwc, labels, "b")), b"labels": payload}
    files["data_batch_4"] = pickle.dumps(payload, protocol=protocol)
    write_dir(tmp_path / "cifar-10-batches-py", files)
    raises_one_line(lambda: read_cifar10(tmp_path), "data_batch_4", "write_sentinel",
                    "something other than the expected arrays", "not executed")
    assert not sentinel.exists()


def test_cifar_pickle_os_system_refused(tmp_path):
    sentinel = tmp_path / "SENTINEL"
    files, _ = cifar_files("python")
    files["test_batch"] = pickle.dumps(Payload(os.system, f"touch {sentinel}"))
    archive = write_tar(tmp_path / "c.tar.gz", files, "cifar-10-batches-py/")
    raises_one_line(lambda: read_cifar10(archive), "test_batch", "system", "not executed")
    assert not sentinel.exists()


@pytest.mark.parametrize("mutate, says", [
    (lambda b: [b], "found list"),
    (lambda b: {k: v for k, v in b.items() if k != b"labels"}, "b'data' and b'labels'"),
    (lambda b: {**b, b"data": b[b"data"].astype(np.int16)}, "int16 array"),
    (lambda b: {**b, b"data": b[b"data"][:, :3000]}, "shape (3, 3000)"),
    (lambda b: {**b, b"data": b[b"data"].reshape(-1)}, "uint8 array [n, 3072]"),
    (lambda b: {**b, b"labels": b[b"labels"][:2]}, "expected 3 labels"),
    (lambda b: {**b, b"labels": [b"a"] * 3}, "list of ints"),
    (lambda b: {**b, b"labels": [0.5] * 3}, "list of ints"),
])
def test_cifar_pickle_structure(tmp_path, mutate, says):
    files, _ = cifar_files("python")
    hwc, labels = cifar_batch(3, seed=6)
    files["data_batch_1"] = pickle.dumps(mutate(pickle.loads(python_batch(hwc, labels, "b"))))
    write_dir(tmp_path, files)
    raises_one_line(lambda: read_cifar10(tmp_path), "data_batch_1", says)


@pytest.mark.parametrize("data", [b"", b"\x80\x04garbage", b"not a pickle"])
def test_cifar_malformed_pickle(tmp_path, data):
    files, _ = cifar_files("python")
    files["data_batch_1"] = data
    write_dir(tmp_path, files)
    raises_one_line(lambda: read_cifar10(tmp_path), "data_batch_1", "pickle")


# ----------------------------------------------------------- the real MNIST

def real_mnist_dir() -> Path:
    default = Path(__file__).resolve().parents[2] / "shared/data/mnist"
    return Path(os.environ.get("MPIDP_MNIST_DIR", default))


def test_real_mnist_test_set():
    directory = real_mnist_dir()
    if not (directory / "t10k-images-idx3-ubyte.gz").is_file():
        pytest.skip(f"no real MNIST test set at {directory} (set MPIDP_MNIST_DIR)")
    sets = read_mnist(directory)
    assert list(sets) == ["test"]
    test = sets["test"]
    assert test.images.shape == (10000, 1, 28, 28) and test.images.dtype == np.uint8
    assert np.bincount(test.labels, minlength=10).tolist() == [
        980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    assert [s["count"] for s in test.source] == [10000, 10000]
    assert test.images.max() == 255 and test.images.min() == 0
