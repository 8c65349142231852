"""Writing the HDF5 file: pwrite into allocated chunks, direct compressed chunks."""
import os

import h5py
import numpy as np
import pytest

from preprocessing import atomic, h5write
from preprocessing.errors import PrepError


def _data(n: int, f: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, f)).astype(np.float32), rng.integers(0, 2, n).astype(np.int8)


@pytest.mark.parametrize("n", [0, 1, 5000, 12345])
def test_pwrite_pieces_in_any_order_gives_the_rows(tmp_path, n):
    X, y = _data(n, 99)
    path = str(tmp_path / "f.h5")
    layout = h5write.create(path, {"train": n, "test": 3}, 99, {"a": 1},
                            h5write.Compression())
    rng = np.random.default_rng(1)
    cuts = np.unique(np.concatenate([[0, n], rng.integers(0, max(n, 1), 7)]))
    pieces = list(zip(cuts[:-1], cuts[1:]))
    rng.shuffle(pieces)
    fd = os.open(path, os.O_WRONLY)
    for a, b in pieces:
        h5write.write_rows(fd, layout, "train/X", int(a), X[a:b])
        h5write.write_rows(fd, layout, "train/y", int(a), y[a:b])
    os.close(fd)
    with h5py.File(path, "r") as handle:
        assert np.array_equal(handle["train/X"][:], X)
        assert np.array_equal(handle["train/y"][:], y)
        assert handle["train/X"].chunks == (layout.chunk_rows, 99)
        assert handle["test/X"].shape == (3, 99) and handle.attrs["a"] == 1


def test_compressed_chunks_are_what_hdf5_would_store(tmp_path):
    X, y = _data(6000, 33, seed=2)
    X[:, 5:] = np.round(X[:, 5:])  # something compressible
    path = str(tmp_path / "c.h5")
    compression = h5write.Compression.parse("gzip:6")
    layout = h5write.create(path, {"train": len(X)}, 33, {}, compression)
    rows = layout.chunk_rows
    chunks = [(i, h5write.compress_chunk(X[i * rows:(i + 1) * rows], rows, 6))
              for i in range(-(-len(X) // rows))]
    h5write.write_chunks(path, "train/X", chunks[::-1], rows)
    h5write.write_chunks(path, "train/y", [
        (i, h5write.compress_chunk(y[i * rows:(i + 1) * rows], rows, 6))
        for i in range(len(chunks))], rows)
    with h5py.File(path, "r") as handle:
        assert handle["train/X"].compression == "gzip" and handle["train/X"].shuffle
        assert np.array_equal(handle["train/X"][:], X)
        assert np.array_equal(handle["train/y"][:], y)
    assert os.path.getsize(path) < X.nbytes


def test_compression_option():
    assert h5write.Compression.parse("none") == h5write.Compression()
    assert h5write.Compression.parse("gzip") == h5write.Compression("gzip", 4)
    assert h5write.Compression.parse("gzip:9").level == 9
    for bad in ("lzf", "gzip:0", "gzip:x", "none:1"):
        with pytest.raises(ValueError):
            h5write.Compression.parse(bad)


def test_output_path_checks(tmp_path):
    atomic.check_writable(str(tmp_path / "ok.h5"))
    assert os.listdir(tmp_path) == []  # the probe is gone
    with pytest.raises(PrepError, match="is a directory"):
        atomic.check_writable(str(tmp_path))
    with pytest.raises(PrepError, match="does not exist"):
        atomic.check_writable(str(tmp_path / "no" / "x.h5"))
    (tmp_path / "file").write_text("")
    with pytest.raises(PrepError, match="is not a directory"):
        atomic.check_writable(str(tmp_path / "file" / "x.h5"))


def test_commit_replaces_and_discard_removes(tmp_path):
    final = tmp_path / "out.h5"
    final.write_text("old")
    temporary = atomic.temporary_name(str(final))
    assert os.path.dirname(temporary) == str(tmp_path)
    assert os.path.basename(temporary).startswith(".out.h5.mpidp-tmp-")
    with open(temporary, "w") as handle:
        handle.write("new")
    atomic.commit(temporary, str(final))
    assert final.read_text() == "new" and not os.path.exists(temporary)
    other = atomic.temporary_name(str(final))
    open(other, "w").close()
    atomic.discard(other)
    atomic.discard(other)  # twice is fine
    assert sorted(os.listdir(tmp_path)) == ["out.h5"]
