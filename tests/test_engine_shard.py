"""Each rank reads its own contiguous shard; bad files are clear errors."""
import numpy as np
import pytest

from engine.bench import synthetic
from engine.errors import DataError
from engine.shard import _rows_buffer, read_info, read_shard, shard_range


def test_shard_ranges_partition_and_balance():
    for n in (0, 1, 5, 17, 100):
        for size in (1, 2, 3, 4):
            ranges = [shard_range(n, size, r) for r in range(size)]
            assert ranges[0][0] == 0 and ranges[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            lengths = [hi - lo for lo, hi in ranges]
            assert max(lengths) - min(lengths) <= 1


def _mapping_flags(address: int) -> set:
    """VmFlags of this process's mapping that contains ``address`` (Linux)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    raise AssertionError("no mapping holds the buffer")


def test_large_shard_buffer_is_private_and_asks_for_huge_pages():
    """A shared anonymous map never gets transparent huge pages (it is shmem):
    the buffer that sampled rows are gathered from must be a private map
    advised MADV_HUGEPAGE ("hg"), not shared ("sh")."""
    import mmap
    import os

    thp = "/sys/kernel/mm/transparent_hugepage/enabled"
    if not os.path.exists("/proc/self/smaps") or not hasattr(mmap, "MADV_HUGEPAGE") \
            or not os.path.exists(thp) or "[never]" in open(thp).read():
        pytest.skip("needs Linux /proc and transparent huge pages (not 'never')")
    X = _rows_buffer(200_000, 101)  # 81 MB: above the huge-page threshold
    X[::1000] = 1.0
    flags = _mapping_flags(X.ctypes.data)
    assert "hg" in flags and "sh" not in flags
    small = _rows_buffer(10, 3)
    assert small.shape == (10, 3) and small.dtype == np.float32


@pytest.mark.mpi(min_size=1)
def test_shards_concatenate_to_the_file(comm, shared_tmp):
    import h5py

    path = str(shared_tmp / "d.h5")
    if comm.Get_rank() == 0:
        synthetic.write(path, rows=103, features=7, test_rows=5, seed=3)
    comm.Barrier()
    info = read_info(path, comm)
    shard = read_shard(info, "train", comm, min_rows_per_rank=1)
    assert shard.X.shape[1] == 8 and np.all(shard.X[:, -1] == 1.0)
    parts = comm.allgather((shard.offset, shard.X[:, :-1], shard.y))
    with h5py.File(path, "r") as f:
        X, y = f["train/X"][:], f["train/y"][:]
    assert np.array_equal(np.concatenate([p[1] for p in parts]), X)
    assert np.array_equal(np.concatenate([p[2] for p in parts]), y)
    test = read_shard(info, "test", comm)  # 5 rows over up to 4 ranks: fine for eval
    assert comm.allreduce(test.n_local) == 5


def _bad(tmp_path, **kw):
    return synthetic.write(tmp_path / "bad.h5", rows=20, features=4, **kw)


def test_bad_files_are_clear_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        read_info(str(tmp_path / "missing.h5"))
    (tmp_path / "text.h5").write_text("not hdf5")
    with pytest.raises(DataError, match="not a readable HDF5"):
        read_info(str(tmp_path / "text.h5"))
    with pytest.raises(DataError, match="format="):
        read_info(_bad(tmp_path, attrs={"format": "other"}))
    with pytest.raises(DataError, match="format_version"):
        read_info(_bad(tmp_path, attrs={"format_version": 99}))
    with pytest.raises(DataError, match="n_classes"):
        read_info(_bad(tmp_path, attrs={"n_classes": None}))
    with pytest.raises(DataError, match="feature_names"):
        read_info(_bad(tmp_path, attrs={"feature_names": '["a"]'}))


def test_wrong_shapes_and_values(tmp_path):
    import h5py

    from collectives.runtime import MPI

    path = _bad(tmp_path)
    with h5py.File(path, "a") as f:
        del f["test/y"]
    with pytest.raises(DataError, match="missing /test"):
        read_info(path)
    path = _bad(tmp_path)
    with h5py.File(path, "a") as f:
        f["train/y"][3] = 5
    info = read_info(path)
    with pytest.raises(DataError, match=r"/train/y\[3\] = 5"):
        read_shard(info, "train", MPI.COMM_SELF)
    path = _bad(tmp_path)
    with h5py.File(path, "a") as f:
        f["train/X"][7, 1] = np.nan
    with pytest.raises(DataError, match="row 7"):
        read_shard(read_info(path), "train", MPI.COMM_SELF)
