"""Checkpoints and model files as untrusted input (docs/security.md#checkpoints).

Anyone can write a file with a valid digest (``engine.checkpoint.save``): what
``mpidp eval``, ``mpidp audit`` and ``mpidp train --resume`` do with one that
names code to import, that is a FIFO, that holds malformed entries, or whose
zip records would inflate beyond the file.
"""
from __future__ import annotations

import io
import json
import os
import socket
import struct
import sys
import threading
import zipfile

import numpy as np
import pytest
import torch
from torch import nn

from collectives import MPI
from engine import checkpoint as ckpt
from engine.bench import synthetic
from engine.config import TrainConfig
from engine.errors import CheckpointError
from engine.nn.mlp import MLPSpec, init_params
from engine.run import resume
from engine.shard import read_info
from launcher import mpidp

FEATURES = 6
#: A module whose import leaves a mark: the proof that nothing imported it.
MARKING = """
import os, torch
open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "IMPORTED"), "w").close()

def build(n_features, n_classes):
    return torch.nn.Sequential(torch.nn.Linear(n_features, 3), torch.nn.Tanh(),
                               torch.nn.Linear(3, n_classes))
"""
NAME = "marking_models:build"


@pytest.fixture
def data(tmp_path):
    return synthetic.write(tmp_path / "d.h5", rows=300, features=FEATURES, seed=4)


@pytest.fixture
def marking(tmp_path, monkeypatch):
    """tmp_path as the working directory, holding marking_models.py (its
    ``IMPORTED`` file says whether something imported it)."""
    (tmp_path / "marking_models.py").write_text(MARKING)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "marking_models", raising=False)
    yield tmp_path / "IMPORTED"
    sys.modules.pop("marking_models", None)


def _mlp_file(directory, source: str, **changes) -> dict:
    """A well-formed best.pt of an MLP (F-4-2) in ``directory``; ``changes``
    replace entries (a forged file: the digest stays valid)."""
    spec = MLPSpec((FEATURES, 4, 2))
    payload = {"model": spec.to_dict(), "params": init_params(spec, 7),
               "data": read_info(source).summary(), "config": {"epochs": 1, "model": "mlp"},
               "epsilon": 1.0, "step": 3, "steps_per_epoch": 3, "selected": None,
               "privacy": {"epsilon": 1.0, "includes_tuning": False}}
    payload.update(changes)
    os.makedirs(directory, exist_ok=True)
    ckpt.save(directory, payload, ckpt.BEST_NAME)
    return payload


def _factory_file(directory, data: str) -> dict:
    """A best.pt of the model marking_models:build, built here (not imported)."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(FEATURES, 3), nn.Tanh(), nn.Linear(3, 2))
    params = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    model = {"kind": "module", "name": NAME, "class": "Sequential", "n_params": params.numel(),
             "shapes": [[n, list(p.shape)] for n, p in module.named_parameters()]}
    return _mlp_file(directory, data, model=model, params=params), module


def _eval(*argv: str) -> tuple[int, str]:
    """``mpidp eval ARGV`` in this process: (exit code, stderr and stdout)."""
    from engine.cli import main

    out, err = io.StringIO(), io.StringIO()
    from contextlib import redirect_stderr, redirect_stdout
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(["eval", *argv])
        except SystemExit as stop:
            code = stop.code
    return code, err.getvalue() + out.getvalue()


def _test_rows(data: str) -> tuple[np.ndarray, np.ndarray]:
    import h5py

    with h5py.File(data, "r") as f:
        return np.asarray(f["test/X"], dtype=np.float64), np.asarray(f["test/y"])


# ---------------------------------------------------------------- code it names
def test_eval_never_imports_a_factory_the_file_alone_names(tmp_path, data, marking):
    _, module = _factory_file(tmp_path / "run", data)
    code, text = _eval("--checkpoint", str(tmp_path / "run"), "--data", data)
    assert code == 2 and "Traceback" not in text, text
    assert f"holds a model built by {NAME}, code that mpidp imports and runs only when you " \
        f"name it: if you trust that file, pass --model {NAME}" in text
    code, text = _eval("--checkpoint", str(tmp_path / "run"), "--data", data,
                       "--model", "marking_models:other")
    assert code == 2 and "(--model marking_models:other is another)" in text, text
    assert not marking.exists() and "marking_models" not in sys.modules
    # named: rebuilt, and scored as the same module computes it
    code, text = _eval("--checkpoint", str(tmp_path / "run"), "--data", data,
                       "--model", NAME, "--json")
    assert code == 0 and marking.exists(), text
    X, y = _test_rows(data)
    with torch.no_grad():
        want = module(torch.from_numpy(X[:, :FEATURES]).float()).argmax(1).numpy()
    assert json.loads(text)["accuracy"] == pytest.approx(float((want == y).mean()))


def test_eval_refuses_a_model_option_no_checkpoint_holds(tmp_path, data):
    _mlp_file(tmp_path / "run", data)
    code, text = _eval("--checkpoint", str(tmp_path / "run"), "--data", data,
                       "--model", "x:y")
    assert code == 2 and "--model x:y is no --checkpoint's model" in text, text
    code, text = _eval("--checkpoint", str(tmp_path / "run"), "--data", data,
                       "--model", "mlp")
    assert code == 2 and "built-in models need no --model" in text, text


def test_audit_refuses_a_users_model_before_importing_it(tmp_path, data, marking):
    from engine.cli import main

    _factory_file(tmp_path / "run", data)
    with pytest.raises(SystemExit) as stopped:
        main(["audit", "--checkpoint", str(tmp_path / "run"), "--data", data])
    assert stopped.value.code == 2 and not marking.exists()


def _resume_file(directory, data: str, model: str) -> None:
    spec = MLPSpec((FEATURES, 2))
    info = read_info(data)
    ckpt.save(directory, {"model": {"kind": "module", "name": model}, "params":
                          init_params(spec, 0), "config": {"model": model, "epochs": 2,
                                                              "noise_multiplier": 1.0},
                          "data": info.summary(), "seed": 1, "world_size": 1, "ranks": [{}],
                          "optimizer": {}, "history": [], "step": 2, "steps_per_epoch": 2,
                          "epsilon": 0.5})


def test_resume_imports_a_recorded_factory_only_when_named_again(tmp_path, data, marking):
    run = tmp_path / "run"
    run.mkdir()
    _resume_file(run, data, NAME)
    cfg = TrainConfig(data=data, checkpoint_dir=str(run), resume=True)
    with pytest.raises(CheckpointError, match=rf"is a run of the model {NAME}, code that mpidp "
                       rf"imports and runs only when you name it: .*resume with --model {NAME}"):
        resume.load_checkpoint(cfg, MPI.COMM_SELF, {"data", "checkpoint_dir", "resume"})
    with pytest.raises(CheckpointError, match=r"\(this command has other:f\)"):
        resume.load_checkpoint(TrainConfig(data=data, checkpoint_dir=str(run), resume=True,
                                           model="other:f"), MPI.COMM_SELF, None)
    named = TrainConfig(data=data, checkpoint_dir=str(run), resume=True, model=NAME)
    merged, payload, _ = resume.load_checkpoint(named, MPI.COMM_SELF,
                                                {"data", "checkpoint_dir", "resume", "model"})
    assert merged.model == NAME and payload["step"] == 2
    assert not marking.exists()  # the trainer imports it later, named
    resume.check_named_model("mlp", "mlp", "x")  # built-ins need nothing
    resume.check_named_model("mlp", "python", "x")


# ------------------------------------------------------------ special files
def _finishes(call, *args) -> BaseException | None:
    """Run ``call(*args)`` in a thread: what it raised (None: nothing); fails
    the test if it has not returned within 20 s (it hung on a FIFO)."""
    box: list = []

    def target():
        try:
            call(*args)
            box.append(None)
        except BaseException as exc:  # noqa: B902 - handed to the test
            box.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(20)
    assert box, f"{call.__name__}{args} hung"
    return box[0]


def test_a_fifo_device_or_socket_is_refused_before_it_is_opened(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    os.mkfifo(run / "checkpoint.pt")
    for call, path in [(ckpt.load_model, run), (ckpt.load_model, run / "checkpoint.pt"),
                       (ckpt.load, run)]:
        error = _finishes(call, path)
        assert isinstance(error, CheckpointError), error
        assert str(error) == f"{run / 'checkpoint.pt'} is a named pipe (FIFO), not a " \
            "checkpoint file: name a file written by mpidp train (checkpoint.pt, best.pt) " \
            "or its run's directory"
    assert _finishes(ckpt.file_kind, run / "checkpoint.pt") is None
    os.mkfifo(run / "best.pt")  # never passed over for checkpoint.pt
    assert "best.pt is a named pipe" in str(_finishes(ckpt.load_model, run))
    other = tmp_path / "other"
    (other / "checkpoint.pt").mkdir(parents=True)
    assert "checkpoint.pt is a directory, not a checkpoint file" in \
        str(_finishes(ckpt.load_model, other))
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(str(tmp_path / "s.pt"))
        assert "s.pt is a socket, not a checkpoint file" in \
            str(_finishes(ckpt.load_file, tmp_path / "s.pt"))


# -------------------------------------------------------- malformed contents
def _spec_params(dims) -> torch.Tensor:
    return torch.zeros(MLPSpec(tuple(dims)).n_params)


MALFORMED = [
    ({"model": None}, "model is a NoneType (None), not a dict"),
    ({"params": [1.0, 2.0]}, "params is a list ([1.0, 2.0]), not a tensor"),
    ({"params": torch.zeros(2, 19)}, "params is a torch.float32 tensor of shape [2, 19], "
     "not a flat vector of floats"),
    ({"params": torch.zeros(38, dtype=torch.int64)}, "not a flat vector of floats"),
    ({"params": torch.zeros(10)}, "model dims 6-4-2 need 38 parameters, params holds 10"),
    ({"model": {"kind": "mlp", "dims": [6, 10**9, 10**9, 2]}},
     "need 1,000,000,010,000,000,002 parameters, params holds 38"),
    ({"model": {"kind": "mlp", "dims": [6, "x", 2]}}, "model dims are a list ([6, 'x', 2]), "
     "not two or more positive widths"),
    ({"model": {"kind": "mlp", "dims": [6, 4, 2], "activation": "evil"}},
     "model activation is a str ('evil'), not one of ['relu']"),
    ({"model": {"kind": "magic", "dims": [6, 4, 2]}}, "model kind is a str ('magic')"),
    ({"params": torch.full((38,), float("nan"))}, "params holds NaN or infinite values"),
    ({"params": torch.tensor([float("inf")] + [0.0] * 37)}, "holds NaN or infinite values"),
    ({"epsilon": "lots"}, "epsilon is a str ('lots'), not a number"),
    ({"step": 1.5}, "step is a float (1.5), not a count"),
    ({"data": [1]}, "data is a list ([1]), not a dict"),
    ({"data": {"rows": "many"}}, "data rows is a str ('many'), not the rows per split"),
    ({"privacy": {"epsilon": "x"}}, "privacy epsilon is a str ('x'), not a number"),
    ({"config": {"epochs": "ten"}}, "config epochs is a str ('ten'), not a count"),
    ({"best": {"params": torch.zeros(3)}}, "best params holds 3 values, params 38"),
    ({"model": {"kind": "module", "name": 7}}, "model name is a int (7), not a model's name"),
    ({"model": {"kind": "module", "name": "m:f", "buffers": ["proj"]}},
     "model buffers is a list (['proj']), not {name: sha256}"),
    ({"model": {"kind": "module", "name": "embedding-mlp", "spec": {"n_classes": 2,
      "hidden": [-1]}}}, "model spec of embedding-mlp holds a list ([-1]), not positive"),
]


@pytest.mark.parametrize("changes, message", MALFORMED,
                         ids=[m[:30] for _, m in MALFORMED])
def test_a_malformed_model_file_is_refused_in_one_line(tmp_path, data, changes, message):
    _mlp_file(tmp_path / "run", data, **changes)
    with pytest.raises(CheckpointError, match="is not an mpidp model file: ") as info:
        ckpt.load_model(tmp_path / "run")
    assert message in str(info.value) and "\n" not in str(info.value)


def test_no_model_entry_and_a_forged_builtin_spec_end_eval_with_exit_2(tmp_path, data):
    payload = _mlp_file(tmp_path / "a", data)
    del payload["model"]
    ckpt.save(tmp_path / "a", payload, ckpt.BEST_NAME)
    code, text = _eval("--checkpoint", str(tmp_path / "a"), "--data", data)
    assert code == 2 and "Traceback" not in text
    assert "is not an mpidp model file: it has no 'model' entry" in text
    # an image model's spec whose parameter count is not the file's: counted on
    # the meta device, so a spec of 10^12 parameters costs nothing
    spec = {"image_shape": [1, 28, 28], "n_classes": 10 ** 7}
    _mlp_file(tmp_path / "b", data, model={"kind": "module", "name": "mnist-small",
                                           "spec": spec})
    code, text = _eval("--checkpoint", str(tmp_path / "b"), "--data", data)
    assert code == 2 and "its mnist-small spec builds" in text and "params holds 38" in text


def test_views_deep_nesting_and_builtin_names_as_modules_are_refused(tmp_path, data,
                                                                     monkeypatch):
    """Three forgeries a regression hunt found past the first checks: a 3 KB
    file whose params were one float expanded to 10^8 (5.3 GB per rank in
    the digest and the forward pass), a value nested 3,000 lists deep (a
    RecursionError traceback) and a module entry named "mlp", which imported
    ./mlp.py (the name of no factory, yet imported)."""
    wide = MLPSpec((FEATURES, 10 ** 6, 2))
    params = torch.zeros(1).expand(wide.n_params)
    _mlp_file(tmp_path / "wide", data, model=wide.to_dict(), params=params)
    code, text = _eval("--checkpoint", str(tmp_path / "wide"), "--data", data)
    assert code == 2 and "Traceback" not in text, text
    assert f"is not an mpidp model file: a tensor of shape ({wide.n_params},) is a view " \
        "over 4 stored bytes" in text
    deep: list = []
    for _ in range(200):  # enough to pass the bound (3,000 cannot be saved to test)
        deep = [deep]
    _mlp_file(tmp_path / "deep", data, notes=deep)
    code, text = _eval("--checkpoint", str(tmp_path / "deep"), "--data", data)
    assert code == 2 and "it nests deeper than 32 levels" in text and "Traceback" not in text
    (tmp_path / "mlp.py").write_text(MARKING)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "mlp", raising=False)
    _mlp_file(tmp_path / "named", data, model={"kind": "module", "name": "mlp",
                                               "spec": {"n_classes": 2, "image_shape": [1]}})
    code, text = _eval("--checkpoint", str(tmp_path / "named"), "--data", data)
    assert code == 2 and "its model entry names 'mlp' as a module" in text, text
    assert not (tmp_path / "IMPORTED").exists() and "mlp" not in sys.modules


def test_a_well_formed_file_still_scores_as_its_mlp_computes(tmp_path, data):
    """The reference: the MLP's forward in numpy from the flat [W | b] layout."""
    payload = _mlp_file(tmp_path / "run", data, data=None)  # data None: no description
    code, text = _eval("--checkpoint", str(tmp_path / "run"), "--data", data, "--json")
    assert code == 0, text
    X, y = _test_rows(data)
    flat = payload["params"].double().numpy()
    w1 = flat[:4 * 7].reshape(4, 7)
    w2 = flat[28:].reshape(2, 5)
    hidden = np.maximum(X[:, :FEATURES] @ w1[:, :-1].T + w1[:, -1], 0)
    pred = (hidden @ w2[:, :-1].T + w2[:, -1]).argmax(1)
    assert json.loads(text)["accuracy"] == pytest.approx(float((pred == y).mean()))


# ------------------------------------------------------- what the file checks
#: What eval and audit say of a model file that records only its data's layout.
LAYOUT_ONLY = ("which has the same task and feature layout: the model file records only the "
               "data's public layout, so the encoding (standardisation statistics)")


def _mlp_logits(payload: dict, X: np.ndarray) -> np.ndarray:
    """The reference: an MLP's forward in numpy from its flat [W | b] layers."""
    dims, flat = payload["model"]["dims"], payload["params"].double().numpy()
    h, at = X, 0
    for i, (n_in, n_out) in enumerate(zip(dims[:-1], dims[1:])):
        layer = flat[at:at + n_out * (n_in + 1)].reshape(n_out, n_in + 1)
        at += layer.size
        h = h @ layer[:, :-1].T + layer[:, -1]
        h = np.maximum(h, 0) if i < len(dims) - 2 else h
    return h


def test_a_model_file_alone_says_the_encoding_of_another_file_went_unchecked(tmp_path):
    """A run's directory refuses a file encoded with other statistics (its
    checkpoint.pt records the encoding's fingerprint); its best.pt moved out
    alone records only the public layout, so eval scores that file, and says
    in a note, and in the JSON's data_checked, that only the layout was
    checked (mpidp audit's note, the same words)."""
    from engine.audit.inputs import check_compatible
    from engine.trainer import Trainer

    path = synthetic.write(tmp_path / "d.h5", rows=300, features=FEATURES, test_rows=100,
                           val_rows=100, seed=7)
    run = tmp_path / "run"
    cfg = TrainConfig(data=path, checkpoint_dir=str(run), epochs=1, batch_size=64,
                      hidden=(8,), noise_multiplier=1.0, seed=3, progress=False,
                      allreduce="ring")
    cfg.validate()
    assert Trainer(cfg, MPI.COMM_SELF, out=io.StringIO()).run() == 0
    moved = tmp_path / "moved"
    moved.mkdir()
    ckpt.best_path_in(moved).write_bytes(ckpt.best_path_in(run).read_bytes())
    other = synthetic.write(tmp_path / "e.h5", rows=200, features=FEATURES, seed=9,
                            attrs={"encoding_fingerprint": "other statistics"})
    code, text = _eval("--checkpoint", str(run), "--data", other)
    assert code == 2 and "(encoding fingerprints differ)" in text, text
    code, text = _eval("--checkpoint", str(moved), "--data", other)
    assert code == 0, text
    note = [line for line in text.splitlines() if line.startswith("note: ")]
    assert len(note) == 1 and f"trained on d.h5; scoring {other}, {LAYOUT_ONLY} could not " \
        "be checked against the training data (give the run's directory" in note[0], text
    code, text = _eval("--checkpoint", str(moved), "--data", other, "--json")
    assert code == 0, text
    result = json.loads(text)
    assert result["data_checked"] == "layout" and len(result["notes"]) == 1
    assert LAYOUT_ONLY in result["notes"][0]
    X, y = _test_rows(other)  # scored as the model computes, whatever the encoding
    payload = ckpt.load_model(moved)
    want = _mlp_logits(payload, X[:, :FEATURES]).argmax(1)
    assert result["accuracy"] == pytest.approx(float((want == y).mean()))
    # the run's own file: the whole check made, nothing to note
    code, text = _eval("--checkpoint", str(run), "--data", path, "--json")
    assert code == 0 and json.loads(text)["data_checked"] == "encoding", text
    assert json.loads(text)["notes"] == []
    code, text = _eval("--checkpoint", str(run), "--data", path)
    assert code == 0 and "note:" not in text, text
    # mpidp audit says the same of the same file
    notes = check_compatible(payload, read_info(other), str(moved))
    assert len(notes) == 1 and LAYOUT_ONLY in notes[0], notes


def test_a_model_file_recording_no_data_says_only_the_shape_was_checked(tmp_path, data):
    _mlp_file(tmp_path / "run", data, data=None)
    code, text = _eval("--checkpoint", str(tmp_path / "run"), "--data", data, "--json")
    assert code == 0, text
    result = json.loads(text)
    assert result["data_checked"] == "shape" and len(result["notes"]) == 1
    assert "records neither the encoding nor the layout of its training data, so the " \
        "encoding (standardisation statistics) could not be checked" in result["notes"][0]


# ------------------------------------------------------------ zip records
def _rewritten(path, compress: int) -> None:
    """The archive at ``path`` written again with ``compress`` for every record."""
    with zipfile.ZipFile(path) as source:
        records = [(info.filename, source.read(info)) for info in source.infolist()]
    with zipfile.ZipFile(path, "w", compression=compress) as target:
        for name, body in records:
            target.writestr(name, body)


def test_compressed_records_or_sizes_beyond_the_file_are_refused_before_torch_reads(
        tmp_path, data, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("torch.load was called")

    _mlp_file(tmp_path / "a", data)
    best = ckpt.best_path_in(tmp_path / "a")
    _rewritten(best, zipfile.ZIP_STORED)
    assert ckpt.load_model(tmp_path / "a")["step"] == 3  # stored: read as torch's own
    _rewritten(best, zipfile.ZIP_DEFLATED)
    monkeypatch.setattr(torch, "load", never)
    with pytest.raises(CheckpointError, match=r"best.pt holds a compressed record \('.*'\); "
                       "mpidp never compresses a checkpoint: not loaded"):
        ckpt.load_model(tmp_path / "a")
    # a stored record whose central directory declares 256 MiB
    _mlp_file(tmp_path / "b", data)
    best = ckpt.best_path_in(tmp_path / "b")
    blob = bytearray(best.read_bytes())
    entry = blob.find(b"PK\x01\x02")  # the first central directory entry
    blob[entry + 24:entry + 28] = struct.pack("<I", 256 << 20)  # its uncompressed size
    best.write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match=r"its records declare [\d,]+ bytes in a file "
                       r"of [\d,]+; it is damaged or forged: not loaded"):
        ckpt.load_model(tmp_path / "b")


def test_a_legacy_torch_file_is_refused_clearly(tmp_path):
    path = tmp_path / "legacy.pt"
    torch.save({"format": ckpt.FORMAT, "version": 2}, path,
               _use_new_zipfile_serialization=False)
    with pytest.raises(CheckpointError, match="is not an mpidp checkpoint \\(not a file "
                       "written by mpidp train"):
        ckpt.load_file(path)


# ------------------------------------------------------------- every rank
def test_the_refusal_is_one_line_on_every_rank_under_mpiexec(tmp_path, data):
    """2 ranks: one line, exit 2, the module never imported on any rank."""
    (tmp_path / "marking_models.py").write_text(MARKING)
    _factory_file(tmp_path / "run", data)
    done = mpidp(2, "eval", "--checkpoint", str(tmp_path / "run"), "--data", data,
                 cwd=str(tmp_path), timeout=240)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("mpidp: error:")]
    assert len(lines) == 1 and f"pass --model {NAME}" in lines[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr and not (tmp_path / "IMPORTED").exists()
