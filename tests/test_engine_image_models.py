"""The built-in image models: their sizes, their refusals, exact per-example
clipping through the per-layer rules, and short DP and non-private runs on
every rank count."""
from __future__ import annotations

import hashlib
import warnings
from pathlib import Path

import pytest
import torch

import engine
from engine.dp.naive import naive_clipped_sum
from engine.dp.rules import SlowPathWarning
from engine.errors import ConfigError
from engine import models
from engine.nn import image_models
from engine.dp.module_engine import ModuleEngine
from image_files import cifar10_tar, mnist_dir, prepare


@pytest.mark.parametrize("name, shape, count", [
    ("mnist-small", (1, 28, 28), 396_466), ("mnist-large", (1, 28, 28), 2_605_156),
    ("resnet20", (3, 32, 32), 272_474)])
def test_sizes_are_the_documented_ones(name, shape, count):
    model = image_models.build(name, shape, 10)
    assert sum(p.numel() for p in model.parameters()) == count
    assert model(torch.zeros(2, shape[0] * shape[1] * shape[2])).shape == (2, 10)
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


@pytest.mark.parametrize("name, shape, n_features, says", [
    ("resnet20", (), 99, "holds tabular rows"),
    ("mnist-small", (1, 3, 3), 9, "at least 4x4"),
    ("mnist-large", (1, 28, 28), 700, "does not match"),
])
def test_a_model_that_does_not_fit_the_file_is_refused(name, shape, n_features, says):
    with pytest.raises(ConfigError, match=says) as info:
        models.resolve(name, (), n_features, 10, 0, torch.device("cpu"),
                       image_shape=shape, path="x.h5")
    assert info.value.collective and "\n" not in str(info.value)


@pytest.mark.parametrize("name, shape", [("mnist-small", (1, 8, 8)),
                                         ("mnist-large", (1, 6, 6)),
                                         ("resnet20", (3, 8, 8))])
@pytest.mark.parametrize("way", [None, "unfold", "grouped"])
def test_per_layer_clipping_equals_the_per_example_loop(name, shape, way):
    """Every layer has a rule (no torch.func fallback) and the clipped sum is the
    naive loop's, with the residual additions of resnet20 and both conv ways."""
    from engine.dp.rules.conv import Chooser

    torch.manual_seed(0)
    model = image_models.build(name, shape, 10).double()
    k, width = 9, shape[0] * shape[1] * shape[2]
    x = torch.randn(k, width + 1, dtype=torch.float64)
    x[:, -1] = 1
    y = torch.randint(0, 10, (k,))
    n = sum(p.numel() for p in model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowPathWarning)
        engine_ = ModuleEngine(model, torch.zeros(n, dtype=torch.float64), (x[:4], y[:4]), 10)
    assert engine_.rule == "per-layer rules"
    engine_.load(x, y, torch.arange(k))
    Chooser.forced = way
    try:
        loss, clipped = engine_.clipped_sum(k, 0.5)
    finally:
        Chooser.forced = None
    want, want_loss, want_clipped = naive_clipped_sum(model, x[:, :-1], y, 0.5)
    assert torch.allclose(engine_.grad, want, rtol=1e-9, atol=1e-11)
    assert loss == pytest.approx(want_loss) and clipped == want_clipped


@pytest.fixture(scope="module")
def image_files(tmp_path_factory):
    """An MNIST-shaped and a CIFAR-shaped prepared file, small, on every rank."""
    from collectives import MPI

    comm = MPI.COMM_WORLD
    root = Path(comm.bcast(str(tmp_path_factory.mktemp("img")) if comm.Get_rank() == 0
                           else None))
    if comm.Get_rank() == 0:
        mnist_dir(root / "mnist", n_train=96, n_test=32)
        cifar10_tar(root / "c.tar.gz", per_batch=12)
    comm.Barrier()
    return {fmt: prepare(comm, fmt, source, root / f"{fmt}.h5")
            for fmt, source in (("mnist", root / "mnist"), ("cifar10", root / "c.tar.gz"))}


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name, fmt, dp", [("mnist-small", "mnist", True),
                                           ("mnist-small", "mnist", False),
                                           ("mnist-large", "mnist", False),
                                           ("resnet20", "cifar10", True)])
def test_each_model_trains_dp_and_non_private(image_files, comm, name, fmt, dp):
    """One short epoch on every rank: the ranks end with the same parameters (the
    trainer checks a digest too), finite losses, epsilon for DP runs, and the
    model mpidp eval rebuilds from the checkpoint entry scores like the run's."""
    options = dict(target_epsilon=8.0, max_grad_norm=1.0) if dp else dict(dp=False)
    run = engine.train(image_files[fmt], model=name, comm=comm, epochs=1, batch_size=16,
                       lr=0.05, quiet=True, seed=2, threads=1, **options)
    params = torch.nn.utils.parameters_to_vector(run.model.parameters()).detach()
    digests = comm.allgather(hashlib.sha256(params.numpy().tobytes()).hexdigest())
    assert len(set(digests)) == 1
    assert all(torch.isfinite(torch.tensor(r["train_loss"])) for r in run.history)
    assert (run.epsilon is not None) == dp
    from engine.shard import read_info
    info = read_info(image_files[fmt])
    entry = models.ImageModel(name, info.image_shape, info.n_classes).to_dict()
    logits = models.checkpoint_logits(entry, params, info.n_features, info.n_classes, "run")
    x = torch.randn(3, info.n_features + 1)
    run.model.eval()
    with torch.no_grad():
        assert torch.allclose(logits(x), run.model(x[:, :-1]))


def test_images_have_no_households(image_files):
    from engine.errors import DataError

    with pytest.raises(DataError, match="images, which have no households"):
        engine.train(image_files["mnist"], model="mnist-small", epochs=1, quiet=True,
                     privacy_unit="household", target_epsilon=1.0)


def test_hidden_given_to_an_image_model_is_said_to_be_unused(image_files, capsys):
    """--model mnist-small --hidden 7 trained the same model without a word
    (--model logreg said so)."""
    from engine.cli import main

    run = ["train", "--data", image_files["mnist"], "--model", "mnist-small", "--no-dp",
           "--epochs", "1", "--batch-size", "32", "--threads", "1", "--no-progress"]
    counts = []
    for extra, note in (([], False), (["--hidden", "7"], True)):
        capsys.readouterr()
        assert main([*run, *extra]) == 0
        out = capsys.readouterr().out
        assert ("note: --model mnist-small has a fixed architecture: --hidden 7 is not used"
                in out) == note, out
        counts.append(next(line for line in out.splitlines() if "parameters" in line))
    assert "396,466 parameters" in counts[0] and counts[0] == counts[1]


def test_an_image_run_says_epsilon_protects_each_image(image_files, capsys):
    """An image is its own unit (docs/images.md): the first and last lines said
    "each person (one row)" and "per person"."""
    from engine.cli import main

    assert main(["train", "--data", image_files["mnist"], "--model", "logreg",
                 "--noise-multiplier", "1", "--epochs", "1", "--batch-size", "32",
                 "--threads", "1", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "epsilon protects each image (one row)" in out and " per image (delta" in out
    assert "person" not in out, out


def test_an_empty_val_split_has_no_val_figure_at_the_end(tmp_path, capsys):
    """Five images (train 4, val 0, test 1): the last line said 'val accuracy nan'."""
    from argparse import Namespace

    from collectives import MPI
    from engine.cli import main
    from preprocessing.h5write import Compression
    from preprocessing.images.prepare import prepare_images

    mnist_dir(tmp_path / "five", n_train=0, n_test=5)
    args = Namespace(format="mnist", inputs=[str(tmp_path / "five")],
                     out=str(tmp_path / "five.h5"), seed=0, test_fraction=None)
    assert prepare_images(MPI.COMM_SELF, args, 0.1, Compression(), "t").rows["val"] == 0
    capsys.readouterr()
    assert main(["train", "--data", args.out, "--model", "mnist-small", "--epochs", "1",
                 "--target-epsilon", "1", "--delta", "1e-5", "--batch-size", "2",
                 "--select-on", "last", "--threads", "1", "--no-progress"]) == 0
    done = [line for line in capsys.readouterr().out.splitlines() if line.startswith("done:")]
    assert len(done) == 1 and "test accuracy" in done[0], done
    assert "val accuracy" not in done[0] and "nan" not in done[0], done


@pytest.mark.parametrize("classes, ok", [(200, False), (129, False), (1, False), (128, True)])
def test_synthetic_images_refuse_more_classes_than_the_labels_hold(tmp_path, capsys,
                                                                   classes, ok):
    """--classes 200 wrote int8 labels wrapped to -127..127, refused only by train."""
    from engine.bench import synthetic
    from engine.shard import read_info

    out = tmp_path / "x.h5"
    argv = ["--rows", "60", "--test-rows", "10", "--images", "1x8x8", "--classes",
            str(classes), "--out", str(out)]
    capsys.readouterr()
    assert synthetic.main(argv) == (0 if ok else 2)
    err = capsys.readouterr().err
    if ok:
        import h5py

        with h5py.File(out, "r") as f:
            assert 0 <= f["train/y"][:].min() and f["train/y"][:].max() <= 127
        assert read_info(str(out)).n_classes == 128
        return
    assert err.count("\n") == 1 and f"--classes {classes}: give 2..128" in err, err
    assert not out.exists()
    with pytest.raises(ValueError, match="give 2..128"):
        synthetic.write_images(out, (1, 8, 8), rows=6, test_rows=2, n_classes=classes)
    assert not out.exists()
