"""`mpidp prep --format mnist|cifar10` as a user runs it, and the image file it writes.

The prepared file is format version 4 (uint8 pixels, per-channel statistics
as attributes); the engine normalises on load. Every bad input is one
`mpidp: error:` line, exit 2, and no file (final or temporary) left behind.
The real MNIST test set (../shared/data/mnist) goes through prep and a short
training run end to end.
"""
from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import h5py
import numpy as np
import pytest

from image_files import cifar10_tar, idx_bytes, learnable, mnist_dir, prepare
from launcher import mpidp
from preprocessing import h5format
from preprocessing.h5format import FormatError, read_info


def _real_mnist() -> Path:
    env = os.environ.get("MPIDP_MNIST_DIR")
    path = Path(env) if env else Path(__file__).resolve().parents[2] / "shared/data/mnist"
    if not (path / "t10k-images-idx3-ubyte.gz").is_file():
        pytest.skip(f"the real MNIST test set is not in {path} (set MPIDP_MNIST_DIR)")
    return path


def _rows(path: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    with h5py.File(path, "r") as f:
        return {s: (f[f"{s}/X"][:], f[f"{s}/y"][:]) for s in h5format.SPLITS if s in f}


def _same_multiset(got: tuple[np.ndarray, np.ndarray], images: np.ndarray,
                   labels: np.ndarray) -> None:
    """The rows are the given images with their labels, in some order."""
    want = np.concatenate([labels[:, None], images.reshape(len(images), -1)], axis=1)
    have = np.concatenate([got[1][:, None].astype(np.uint8), got[0]], axis=1)
    assert have.shape == want.shape
    key = lambda a: a[np.lexsort(a.T[::-1])]  # noqa: E731
    assert np.array_equal(key(have), key(want))


# one rank and an odd count in make test; 2 and 4 ranks with make test-long
@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.long), 3,
                                   pytest.param(4, marks=pytest.mark.long)])
def test_both_formats_prepare_under_mpiexec(tmp_path, ranks):
    """Official layouts in, version-4 files out: the official splits kept (train
    shuffled, val moved from it), pixels and labels intact, statistics of the
    training pixels, and the same bytes whatever the number of ranks."""
    source = mnist_dir(tmp_path / "mnist", n_train=300, n_test=60)
    out = tmp_path / "m.h5"
    done = mpidp(ranks, "prep", "--format", "mnist", str(source), "--out", str(out),
                 "--val-fraction", "0.1", "--seed", "3")
    assert done.returncode == 0, done.stderr
    assert "mpidp prep: wrote" in done.stdout and "train 270, val 30, test 60" in done.stdout
    info = read_info(str(out))
    assert info.image_shape == (1, 28, 28) and info.n_features == 784 and not info.households
    rows = _rows(out)
    assert all(X.dtype == np.uint8 for X, _ in rows.values())
    train_images, train_labels = learnable(300, (1, 28, 28), 5)
    test_images, test_labels = learnable(60, (1, 28, 28), 4)
    joined = tuple(np.concatenate([rows["train"][i], rows["val"][i]]) for i in (0, 1))
    _same_multiset(joined, train_images, train_labels)
    _same_multiset(rows["test"], test_images, test_labels)
    pixels = rows["train"][0] / 255.0
    assert info.channel_mean[0] == pytest.approx(pixels.mean(), rel=1e-9)
    assert info.channel_std[0] == pytest.approx(pixels.std(), rel=1e-9)

    tar = cifar10_tar(tmp_path / "cifar-10-binary.tar.gz", per_batch=20)
    out10 = tmp_path / "c.h5"
    done = mpidp(ranks, "prep", "--format", "cifar10", str(tar), "--out", str(out10),
                 "--val-fraction", "0", "--compression", "gzip")
    assert done.returncode == 0, done.stderr
    info = read_info(str(out10))
    assert info.image_shape == (3, 32, 32) and info.rows == {"train": 100, "test": 20}
    assert len(info.channel_mean) == 3
    test_images, test_labels = learnable(20, (3, 32, 32), 5)
    _same_multiset(_rows(out10)["test"], test_images, test_labels)
    if ranks > 1:  # the same bytes as one rank writes
        single = tmp_path / "c1.h5"
        assert mpidp(1, "prep", "--format", "cifar10", str(tar), "--out", str(single),
                     "--val-fraction", "0").returncode == 0
        many = _rows(out10)
        for split, (X, y) in _rows(single).items():
            assert np.array_equal(X, many[split][0])
            assert np.array_equal(y, many[split][1])


def _bad_mnist(folder: Path, case: str) -> Path:
    source = mnist_dir(folder, n_train=0, n_test=20)
    images = source / "t10k-images-idx3-ubyte.gz"
    data = gzip.decompress(images.read_bytes())
    if case == "magic":
        images.write_bytes(gzip.compress(idx_bytes(0x804, (20, 28, 28), data[16:])))
    elif case == "counts":
        images.write_bytes(gzip.compress(idx_bytes(0x803, (19, 28, 28), data[16:-784])))
    elif case == "short":
        images.write_bytes(gzip.compress(data[:-5]))
    return source


@pytest.mark.parametrize("case, args, message", [
    ("magic", ["--format", "mnist", "{src}"], "magic"),
    ("counts", ["--format", "mnist", "{src}"], "holds 19 images"),
    ("short", ["--format", "mnist", "{src}"], "bytes"),
    ("ok", ["--format", "mnist", "{src}", "--task", "income"], "--task applies to PUMS"),
    ("ok", ["--format", "mnist", "{src}", "{src}"], "reads one directory"),
    ("ok", ["--format", "mnist", "{src}", "--test-fraction", "1.5"], "--test-fraction 1.5"),
    ("empty", ["--format", "cifar10", "{src}"], "cs.toronto.edu"),
    ("empty", ["--format", "mnist", "{src}"], "yann.lecun.com"),
])
def test_bad_image_inputs_are_one_line_and_leave_nothing(tmp_path, case, args, message):
    source = tmp_path / "src"
    if case == "empty":
        source.mkdir()
    else:
        _bad_mnist(source, case)
    out = tmp_path / "out" / "x.h5"
    out.parent.mkdir()
    done = mpidp(2, "prep", *[a.format(src=source) for a in args], "--out", str(out))
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mpidp: error: "), done.stderr
    assert message in lines[0], lines[0]
    assert list(out.parent.iterdir()) == []


def test_test_fraction_is_refused_when_the_official_test_split_is_there(tmp_path):
    source = mnist_dir(tmp_path / "mnist", n_train=40, n_test=10)
    done = mpidp(1, "prep", "--format", "mnist", str(source), "--out", str(tmp_path / "x.h5"),
                 "--test-fraction", "0.3")
    assert done.returncode == 2 and "official test images" in done.stderr
    assert not (tmp_path / "x.h5").exists()


def test_a_scoring_file_like_the_training_file_shares_its_statistics(tmp_path):
    """--like: a file only for scoring normalises with the training file's channel
    statistics, so its fingerprint matches (mpidp eval accepts it); --like of a
    tabular file or of other images is refused in one line."""
    train = tmp_path / "train.h5"
    assert mpidp(1, "prep", "--format", "mnist", str(mnist_dir(tmp_path / "a", 60, 20)),
                 "--out", str(train)).returncode == 0
    score = tmp_path / "score.h5"
    other = mnist_dir(tmp_path / "b", n_train=0, n_test=30, seed=9)
    done = mpidp(2, "prep", "--format", "mnist", str(other), "--out", str(score),
                 "--test-fraction", "1", "--like", str(train))
    assert done.returncode == 0, done.stderr
    a, b = read_info(str(train)), read_info(str(score))
    assert (b.channel_mean, b.channel_std, b.fingerprint) == \
        (a.channel_mean, a.channel_std, a.fingerprint)
    assert b.rows == {"train": 0, "test": 30}
    cifar = tmp_path / "c.h5"
    assert mpidp(1, "prep", "--format", "cifar10",
                 str(cifar10_tar(tmp_path / "c.tar.gz", per_batch=4)), "--out",
                 str(cifar)).returncode == 0
    done = mpidp(1, "prep", "--format", "mnist", str(other), "--out", str(tmp_path / "x.h5"),
                 "--test-fraction", "1", "--like", str(cifar))
    assert done.returncode == 2 and "holds cifar10 images of 3x32x32" in done.stderr
    assert not (tmp_path / "x.h5").exists()


def test_image_file_checks(tmp_path):
    """A version-4 file must say how to unflatten and normalise its pixels, and
    a tabular version cannot hold uint8 pixels."""
    source = mnist_dir(tmp_path / "mnist", n_train=0, n_test=30)
    good = tmp_path / "m.h5"
    assert mpidp(1, "prep", "--format", "mnist", str(source), "--out", str(good),
                 "--val-fraction", "0").returncode == 0
    for name, value, says in [("image_shape", "[1, 28, 27]", "do not describe"),
                              ("channel_std", "[0.0]", "do not describe"),
                              ("channel_mean", "not json", "JSON lists"),
                              ("format_version", 2, "must be float")]:
        bad = tmp_path / f"bad-{name}.h5"
        bad.write_bytes(good.read_bytes())
        with h5py.File(bad, "a") as f:
            f.attrs[name] = value
        with pytest.raises(FormatError, match=says):
            read_info(str(bad))


@pytest.mark.mpi(min_size=1)
def test_shard_normalises_pixels_per_channel(shared_tmp, comm):
    """Each rank's rows are (pixel / 255 - mean_c) / std_c of its own range of
    the file, with the trailing ones column; 3 channels, each its own table."""
    from engine.shard import read_shard
    from preprocessing.agreement import agree

    path = Path(shared_tmp) / "c.h5"
    tar = Path(shared_tmp) / "c.tar.gz"
    if comm.Get_rank() == 0:
        cifar10_tar(tar, per_batch=7)
    comm.Barrier()

    prepare(comm, "cifar10", tar, path)
    info = agree(comm, lambda: read_info(str(path)))
    shard = read_shard(info, "train", comm, min_rows_per_rank=1)
    raw, _ = _rows(path)["train"]
    mine = raw[shard.offset:shard.offset + shard.n_local].reshape(-1, 3, 1024) / 255.0
    want = (mine - np.array(info.channel_mean)[:, None]) / np.array(info.channel_std)[:, None]
    assert np.allclose(shard.X[:, :-1], want.reshape(shard.n_local, -1), atol=1e-6)
    assert (shard.X[:, -1] == 1).all()
    assert comm.allreduce(shard.n_local) == 35


def test_real_mnist_prepares_trains_and_evaluates(tmp_path):
    """The shared 10,000 real test images, split 8,000 / 2,000: prep, a short
    mnist-small run on 2 ranks (well above chance), and mpidp eval of its
    checkpoint agreeing with the run's test accuracy."""
    out = tmp_path / "mnist.h5"
    done = mpidp(2, "prep", "--format", "mnist", str(_real_mnist()), "--out", str(out),
                 "--val-fraction", "0")
    assert done.returncode == 0, done.stderr
    assert "train 8,000, test 2,000" in done.stdout
    metrics = tmp_path / "m.jsonl"
    done = mpidp(2, "train", "--data", str(out), "--model", "mnist-small", "--no-dp",
                 "--epochs", "1", "--batch-size", "128", "--lr", "0.05", "--threads", "1",
                 "--checkpoint-dir", str(tmp_path / "run"), "--metrics", str(metrics),
                 timeout=300)
    assert done.returncode == 0, done.stderr
    record = [json.loads(line) for line in metrics.read_text().splitlines()][-1]
    assert record["test_accuracy"] > 0.85, record
    done = mpidp(1, "eval", "--checkpoint", str(tmp_path / "run"), "--data", str(out), "--json")
    assert done.returncode == 0, done.stderr
    scored = json.loads(done.stdout)
    assert scored["accuracy"] == pytest.approx(record["test_accuracy"], abs=1e-9)


def _prepare_in_process(source: Path, out: Path, val_fraction: float,
                        test_fraction: float | None = None):
    """``mpidp prep --format mnist`` on this process alone: (its report, its summary)."""
    from argparse import Namespace

    from collectives import MPI
    from preprocessing.h5write import Compression
    from preprocessing.images.prepare import prepare_images, summary

    args = Namespace(format="mnist", inputs=[str(source)], out=str(out), seed=0,
                     test_fraction=test_fraction)
    report = prepare_images(MPI.COMM_SELF, args, val_fraction, Compression(), "test")
    return report, summary(report, args, 1)


def test_a_split_asked_for_that_comes_out_empty_is_noted(tmp_path):
    """5 images wrote 'train 4, val 0, test 1' without a word, and training on the
    file then ended with 'val accuracy nan'."""
    source = mnist_dir(tmp_path / "five", n_train=0, n_test=5)
    report, text = _prepare_in_process(source, tmp_path / "five.h5", 0.1)
    assert report.rows == {"train": 4, "val": 0, "test": 1}
    notes = [line for line in text.splitlines() if line.lstrip().startswith("note")]
    assert notes == ["  note    --val-fraction 0.1 put none of the 4 training images in the "
                     "validation split: too few images; give a larger --val-fraction, more "
                     "data, or --val-fraction 0 for a file without one"], text
    _, text = _prepare_in_process(source, tmp_path / "none.h5", 0.0)  # val not asked for
    assert "note" not in text
    one = mnist_dir(tmp_path / "one", n_train=0, n_test=1)
    report, text = _prepare_in_process(one, tmp_path / "one.h5", 0.0)
    assert report.rows == {"train": 1, "test": 0}
    assert "note    --test-fraction 0.2 put none of the 1 images in the test split" in text
    _, text = _prepare_in_process(mnist_dir(tmp_path / "both", n_train=8, n_test=4),
                                  tmp_path / "both.h5", 0.25)
    assert "note" not in text  # train 6, val 2, test 4


@pytest.mark.parametrize("val_fraction, test_fraction, says", [
    (0.0, 0.9, "--test-fraction 0.9 left none of the 1 images for training"),
    (0.6, 0.0, "--val-fraction 0.6 left none of the 1 training images for training")])
def test_fractions_that_leave_nothing_to_train_on_are_refused(tmp_path, val_fraction,
                                                              test_fraction, says):
    from preprocessing.errors import PrepError

    one = mnist_dir(tmp_path / "one", n_train=0, n_test=1)
    with pytest.raises(PrepError, match=says):
        _prepare_in_process(one, tmp_path / "x.h5", val_fraction, test_fraction)
    assert not (tmp_path / "x.h5").exists()
    report, _ = _prepare_in_process(one, tmp_path / "x.h5", 0.0, 1.0)  # only for scoring
    assert report.rows == {"train": 0, "test": 1}
