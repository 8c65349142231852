"""mpidp tune on image files and with image models: each space value checked as
``mpidp train`` checks it on that file, and ``hidden`` never tuned where the
model ignores it.

Serial: the command in this process on small prepared files (an MNIST-shaped
one with a val split, a tabular one), one line and exit 2 for what train
refuses, nothing written; the points that differ only in an ignored
``hidden`` merged; one short search over an image model and the MLP.
"""
from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path

import pytest

from engine.bench import synthetic
from engine.errors import ConfigError
from engine.tune import options, report, space
from image_files import mnist_dir


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """An MNIST-shaped image file with /val (60 images) and a tabular one with /val."""
    from collectives import MPI
    from preprocessing.h5write import Compression
    from preprocessing.images.prepare import prepare_images

    root = tmp_path_factory.mktemp("tune_images")
    mnist_dir(root / "mnist", n_train=0, n_test=60)
    args = Namespace(format="mnist", inputs=[str(root / "mnist")], out=str(root / "img.h5"),
                     seed=0, test_fraction=None)
    prepare_images(MPI.COMM_SELF, args, 0.25, Compression(), "test")
    table = synthetic.write(root / "tab.h5", rows=200, features=6, seed=1, val_rows=50)
    return {"image": args.out, "tabular": str(table)}


def _refused(argv: list[str], capsys) -> str:
    """``mpidp tune argv``: exit 2, one line on stderr (returned)."""
    from engine.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        main(["tune", *argv])
    err = capsys.readouterr().err
    assert stopped.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def _train_refusal(name: str, path: str) -> str:
    """What ``mpidp train --model name`` says on ``path`` (engine.models.resolve)."""
    import torch

    from engine.models import resolve
    from engine.shard import read_info

    info = read_info(path)
    with pytest.raises(ConfigError) as refused:
        resolve(name, (128, 128), info.n_features, info.n_classes, 0, torch.device("cpu"),
                code_columns=info.code_columns, path=path, image_shape=info.image_shape)
    return str(refused.value)


def test_each_model_is_refused_as_train_refuses_it_on_that_file(files, tmp_path, capsys):
    """embedding-mlp on images was told to re-prepare with --encoding codes (a PUMS
    option); an image model on a PUMS file failed at run time with exit 0."""
    out = tmp_path / "out"
    image, tabular = files["image"], files["tabular"]
    line = _refused(["--data", image, "--no-dp", "--out", str(out), "--space",
                     "model=logreg,embedding-mlp;epochs=1;batch_size=8"], capsys)
    assert line.endswith(_train_refusal("embedding-mlp", image)), line
    assert "holds images" in line and "--encoding" not in line
    line = _refused(["--data", tabular, "--no-dp", "--out", str(out), "--space",
                     "model=mnist-small,logreg;epochs=1;batch_size=8"], capsys)
    assert line.endswith(_train_refusal("mnist-small", tabular)), line
    assert "--space model=mnist-small" in line and "holds tabular rows" in line
    assert not out.exists()


def test_images_have_no_households_in_tune_as_in_train(files, tmp_path, capsys):
    """It said the file 'has no household keys; ... needs a file prepared by this
    mpidp' (it was)."""
    out = tmp_path / "out"
    line = _refused(["--data", files["image"], "--target-epsilon", "2", "--privacy-unit",
                     "household", "--out", str(out), "--space",
                     "model=logreg;epochs=1;batch_size=8"], capsys)
    assert "holds images, which have no households" in line, line
    assert "prepared by this mpidp" not in line
    assert not out.exists()


@pytest.mark.parametrize("models, says", [
    ("mnist-small", "model=mnist-small has a fixed architecture"),
    ("mnist-small,resnet20", "(as every model of the space)"),
    ("logreg", "model=logreg has no hidden layers"),
    ("mymodule:build", "is built by its factory")])
def test_hidden_with_only_models_it_does_not_shape_is_refused(files, tmp_path, capsys,
                                                              models, says):
    """Two identical models were trained (privacy spent on a setting that does
    nothing), and the command printed --hidden."""
    out = tmp_path / "out"
    line = _refused(["--data", files["image"], "--no-dp", "--out", str(out), "--space",
                     f"model={models};hidden=16|64;epochs=1;batch_size=8"], capsys)
    assert line.startswith("mpidp: error: --space hidden=16|64: ") and says in line, line
    assert "drop hidden from the space" in line
    assert not out.exists()


def test_points_alike_but_for_an_ignored_hidden_are_one_point():
    values = space.parse("model=mnist-small,mlp,logreg,embedding-mlp;hidden=16|64;lr=0.1,0.2",
                         None)
    options.check_hidden(values)  # mlp and embedding-mlp use it: accepted
    points, merged = options.without_unused_hidden(values.points())
    assert len(points) == 2 + 4 + 2 + 4 and merged == 4
    keys = [space.settings_key(0, p) for p in points]
    assert len(set(keys)) == len(keys)
    for point in points:
        assert ("hidden" in point) == (point["model"] in ("mlp", "embedding-mlp")), point
        command = report.train_command("d.h5", point, {"dp": False}, 1)
        assert ("--hidden" in command) == ("hidden" in point), command
    assert options.without_unused_hidden(space.parse("lr=0.1;hidden=8|16", None).points()) \
        == ([{"lr": 0.1, "hidden": (8,)}, {"lr": 0.1, "hidden": (16,)}], 0)  # mlp: kept


def test_a_search_over_an_image_model_and_the_mlp_trains_each_setting_once(files, tmp_path,
                                                                           capsys):
    from engine.cli import build_parser

    out = tmp_path / "out"
    args = build_parser(only="tune").parse_args([
        "tune", "--data", files["image"], "--no-dp", "--out", str(out), "--seed", "1",
        "--threads", "1", "--space", "model=mnist-small,mlp;hidden=4|8;epochs=1;batch_size=8"])
    capsys.readouterr()
    assert args._run(args) == 0
    said = capsys.readouterr().out
    assert "3 trial(s) (grid over 3 valid point(s) of 4; 1 point(s) alike but for hidden" in said
    done = json.loads((out / "tune.json").read_text())
    settings = [t["settings"] for t in done["trials"]]
    assert settings[0] == {"model": "mnist-small", "epochs": 1, "batch_size": 8}
    assert [s.get("hidden") for s in settings[1:]] == [[4], [8]]
    assert "hidden=[" not in said  # a hidden as the JSON record holds it: 4, not [4]
    assert Path(done["chosen"]["checkpoint"], "best.pt").is_file()
