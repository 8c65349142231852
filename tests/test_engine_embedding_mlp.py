"""``--model embedding-mlp`` on files of integer category codes (issue #15):
the model, its exact clipping, training, eval, and the refusals."""
import json

import h5py
import numpy as np
import pytest
import torch

import engine
from engine.bench import synthetic
from engine.dp.clipping import LayerClipper
from engine.dp.naive import naive_clipped_sum
from engine.errors import ConfigError, DataError
from engine.nn.embedding_mlp import EmbeddingMLP
from launcher import mpidp
from preprocessing.h5format import read_info

FEATURES = 40  # 2 numeric columns and one-hot groups of 9, 24 and 5


@pytest.fixture
def files(shared_tmp, comm):
    """The same rows written one-hot and as codes."""
    onehot, codes = shared_tmp / "onehot.h5", shared_tmp / "codes.h5"
    if comm.Get_rank() == 0:
        synthetic.write(onehot, rows=1600, features=FEATURES, seed=5)
        synthetic.write(codes, rows=1600, features=FEATURES, seed=5, codes=True)
    comm.Barrier()
    return str(onehot), str(codes)


def _rows(path, split="train"):
    with h5py.File(path, "r") as f:
        return f[f"{split}/X"][:], f[f"{split}/y"][:]


def test_codes_file_holds_the_one_hot_rows(tmp_path):
    onehot = synthetic.write(tmp_path / "a.h5", rows=300, features=FEATURES, seed=1)
    codes = synthetic.write(tmp_path / "b.h5", rows=300, features=FEATURES, seed=1, codes=True)
    (wide, y1), (narrow, y2) = _rows(onehot), _rows(codes)
    np.testing.assert_array_equal(y1, y2)
    np.testing.assert_array_equal(narrow[:, :2], wide[:, :2])
    for j, (start, size) in enumerate([(2, 9), (11, 24), (35, 5)]):
        np.testing.assert_array_equal(narrow[:, 2 + j], wide[:, start:start + size].argmax(1))
    info = read_info(codes)
    assert info.code_columns == ((2, 9, "CAT0"), (3, 24, "CAT1"), (4, 5, "CAT2"))
    assert read_info(onehot).code_columns == ()


def test_embedding_mlp_clips_exactly_like_the_per_example_loop():
    torch.manual_seed(0)
    columns = [(1, 7, "A"), (3, 4, "B")]
    model = EmbeddingMLP(5, 3, columns, hidden=(6,))
    x = torch.randn(9, 5)
    x[:, 1] = torch.randint(0, 7, (9,)).float()
    x[:, 3] = torch.tensor([0, 1, 2, 3, 3, 3, 0, 0, 1]).float()  # repeated codes
    y = torch.randint(0, 3, (9,))
    assert model(x).shape == (9, 3)
    want, loss, clipped = naive_clipped_sum(model, x, y, 0.05)
    clipper = LayerClipper(model)
    got_loss, got_clipped = clipper.clipped_sum(x, y, 0.05)
    torch.testing.assert_close(clipper.grad, want, rtol=1e-5, atol=1e-6)
    assert got_clipped == clipped and got_loss == pytest.approx(loss, rel=1e-5)
    with pytest.raises(ValueError, match="at least one categorical"):
        EmbeddingMLP(5, 2, [])


@pytest.mark.mpi(min_size=1)
def test_embedding_mlp_trains_with_the_mlps_accounting(files, comm):
    onehot, codes = files
    common = dict(comm=comm, epochs=3, batch_size=100, target_epsilon=4.0, seed=2,
                  quiet=True, lr=0.01, optimizer="adam")
    run = engine.train(codes, model="embedding-mlp", hidden=(32,), **common)
    mlp = engine.train(onehot, model="mlp", hidden=(32,), **common)
    assert isinstance(run.model, EmbeddingMLP) and run.exit_code == 0
    assert run.epsilon == pytest.approx(mlp.epsilon) and run.epsilon <= 4.0
    assert run.history[-1]["test_accuracy"] > 0.6
    X, y = _rows(codes, "test")
    run.model.eval()
    with torch.no_grad():
        accuracy = (run.model(torch.from_numpy(X)).argmax(1).numpy() == y).mean()
    assert accuracy == pytest.approx(run.history[-1]["test_accuracy"], abs=1e-6)


@pytest.mark.mpi(min_size=1)
def test_a_model_that_misreads_the_layout_is_refused(files, comm):
    onehot, codes = files
    common = dict(comm=comm, epochs=1, noise_multiplier=1.0, quiet=True)
    with pytest.raises(ConfigError, match="integer codes.*--model mlp would read them"):
        engine.train(codes, **common)
    with pytest.raises(ConfigError, match="one-hot encoded; --model embedding-mlp needs"):
        engine.train(onehot, model="embedding-mlp", **common)


def test_embedding_mlp_on_images_names_the_images(tmp_path):
    """An image file was called one-hot encoded, with advice (prep --encoding
    codes) that cannot apply to it."""
    from engine.bench.synthetic_images import write_images

    path = write_images(tmp_path / "m.h5", rows=64, test_rows=16, seed=1)
    with pytest.raises(ConfigError, match=r"m.h5 holds images \(1x28x28\); --model "
                                          "embedding-mlp embeds the category codes"):
        engine.train(path, model="embedding-mlp", epochs=1, batch_size=8, noise_multiplier=1.0,
                     quiet=True)


def test_a_code_out_of_range_is_a_data_error(tmp_path):
    path = synthetic.write(tmp_path / "c.h5", rows=200, features=FEATURES, seed=3, codes=True)
    with h5py.File(path, "r+") as f:
        f["train/X"][17, 3] = 24.0  # CAT1 has codes 0..23
    with pytest.raises(DataError, match=r"X\[17, 3\] = 24 is not a code of CAT1 "
                                        r"\(an integer 0..23\)"):
        engine.train(path, model="embedding-mlp", epochs=1, batch_size=50, noise_multiplier=1.0,
                     quiet=True)


def test_embedding_mlp_from_the_command_line_and_eval(tmp_path, capsys):
    data = synthetic.write(tmp_path / "c.h5", rows=1200, features=FEATURES, seed=4, codes=True)
    run = mpidp(2, "train", "--data", data, "--model", "embedding-mlp", "--hidden", "16",
                "--epochs", "1", "--batch-size", "100", "--noise-multiplier", "1",
                "--no-progress", "--metrics", str(tmp_path / "m.jsonl"),
                "--checkpoint-dir", str(tmp_path / "run"), timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "EmbeddingMLP (embedding-mlp," in run.stdout
    last = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[-1])
    # eval in this process (2 ranks: tests/test_engine_models.py, a factory's model)
    from engine.cli import main

    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(tmp_path / "run"), "--data", data, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["accuracy"] == \
        pytest.approx(last["test_accuracy"])
    # refused before any rank trains: through the console's entry point, in this process

    onehot = synthetic.write(tmp_path / "o.h5", rows=300, features=FEATURES, seed=4)
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        main(["train", "--data", str(onehot), "--model", "embedding-mlp", "--epochs", "1",
              "--noise-multiplier", "1", "--no-progress"])
    stderr = capsys.readouterr().err
    assert stopped.value.code == 2 and "--encoding codes" in stderr
    assert "Traceback" not in stderr
