"""mpidp bench scaling end to end on tiny data (one launch per rank count; no timing
asserted): the tabular and image presets, the peers (engine.bench.ddp_baseline) and
the synthetic image files they run on."""
import json
import subprocess
import sys
from argparse import Namespace

import h5py
import numpy as np
import pytest

from collectives.launch import child_env
from engine.bench import ddp_setup, synthetic, synthetic_images
from engine.bench.scaling_plan import BenchError
from engine.cli import build_parser
from engine.dp.accountant import epsilon_for
from launcher import run_mpi
from preprocessing import h5format
from preprocessing.images.prepare import channel_stats


def _run(*argv):
    args = build_parser().parse_args(["bench", "scaling", *argv])
    return args._run(args)


def test_bench_scaling_runs_one_launch_per_rank_count(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert _run("--rows", "1500", "--test-rows", "300", "--features", "6", "--hidden", "8",
                "--batch-size", "100", "--ranks", "1,2", "--epochs", "2", "--privacy", "dp",
                "--target-accuracy", "0.01", "--time-budget", "60",
                "--cache", str(tmp_path / "cache"), "--keep", str(tmp_path / "runs"),
                "--json", str(out), "--price-per-node-hour", "1", "--baseline", "none") == 0
    text = capsys.readouterr().out
    assert "strong scaling (global batch 100), DP-SGD, all-reduce auto" in text
    assert "cost at 1 per node-hour" in text and "load average before" in text
    doc = json.loads(out.read_text())
    assert doc["machine"]["mlp_step"] in text and "MLP step" in doc["machine"]["mlp_step"]
    assert doc["provenance"]["machine"] == doc["machine"] and doc["provenance"]["command"]
    one, two = sorted(doc["summaries"], key=lambda s: s["ranks"])
    assert (one["ranks"], two["ranks"]) == (1, 2) and one["speedup"] == 1.0
    assert two["speedup"] == pytest.approx(one["epoch_avg_s"] / two["epoch_avg_s"])
    assert two["efficiency"] == pytest.approx(two["speedup"] / 2)
    runs = {r["ranks"]: r for r in doc["runs"]}
    assert sorted(runs) == [1, 2]
    steps_per_epoch = round(1500 / 100)
    for s in (one, two):
        epochs = runs[s["ranks"]]["epochs"]
        first, last = epochs[0], epochs[-1]
        # --time-budget given: the runs went on past the target, read off the history.
        assert s["epochs_run"] == len(epochs) == 2 and s["steady_epochs"] == 1
        assert s["first_epoch_s"] == first["epoch_time_s"]
        assert s["epoch_avg_s"] == last["epoch_time_s"]
        assert s["train_time_s"] == pytest.approx(first["epoch_time_s"] + last["epoch_time_s"])
        assert s["tta_epochs"] == 1 and s["tta_s"] == pytest.approx(first["epoch_time_s"])
        assert s["cost"] == pytest.approx(s["train_time_s"] / 3600)  # 1 node at price 1
        # Epsilon is the accountant's for the steps taken, whatever the rank count.
        assert last["step"] == 2 * steps_per_epoch and last["ranks"] == s["ranks"]
        assert s["epsilon"] == last["epsilon"] == pytest.approx(epsilon_for(
            100 / 1500, last["noise_multiplier"], last["step"], 1e-5), rel=1e-9)
        for e in epochs:
            assert e["examples_per_s"] == pytest.approx(e["train_examples"] / e["epoch_time_s"])
            assert e["comm_s"] + e["compute_s"] == pytest.approx(e["epoch_time_s"])
            assert sum(e["step_breakdown_s"].values()) <= e["epoch_time_s"]
            assert e["step_breakdown_s"]["comm_s"] == pytest.approx(e["comm_s"])
        assert s["command"].startswith(f"mpiexec -n {s['ranks']} mpidp train --data ")
    assert one["epsilon"] == pytest.approx(two["epsilon"], rel=1e-12)
    assert len(list((tmp_path / "runs").glob("*.jsonl"))) == 2


def test_dry_run_prints_the_commands(tmp_path, capsys):
    data = tmp_path / "d.h5"
    data.write_bytes(b"")  # never opened by a dry run
    assert _run("--preset", "mlbench-2a", "--data", str(data), "--ranks", "1,2,4",
                "--baseline", "ddp", "--dry-run") == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 6  # each mpidp run, then its peer
    ours, peers = lines[0::2], lines[1::2]
    assert all(" mpidp train " in line for line in ours)
    assert all(" python -m engine.bench.ddp_baseline " in line for line in peers)
    assert "--batch-size 400" in ours[2] and "--lr 600.0" in ours[2]
    for flags in ("--no-dp", "--lr-schedule inv-sqrt", "--weight-decay 2.5e-06",
                  "--sampling shuffle", "--momentum 0.0", "--target-accuracy 0.89",
                  "--hidden ''"):
        assert flags in ours[0] and flags in peers[0]
    # The peer runs the same options; only the program and the metrics file differ.
    for mine, peer in zip(ours, peers):
        assert mine.split(" train ")[1].split(" --metrics ")[0] == \
            peer.split("engine.bench.ddp_baseline ")[1].split(" --metrics ")[0]


def test_dry_run_of_the_image_presets(tmp_path, capsys):
    cache = tmp_path / "cache"
    assert _run("--preset", "mlbench-1a", "--ranks", "1,2,4", "--cache", str(cache),
                "--baseline", "ddp", "--dry-run") == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 6 and not cache.exists()  # a dry run writes no data
    for ranks, (mine, peer) in zip((1, 2, 4), zip(lines[0::2], lines[1::2])):
        assert mine.startswith(f"mpiexec -n {ranks} mpidp train --data {cache}/images-3x32x32-"
                               "50000-10000-")
        assert peer.startswith(f"mpiexec -n {ranks} python -m engine.bench.ddp_baseline ")
        for line in (mine, peer):
            # 32 examples per rank; lr 0.1 per 256 examples, scaled with the global batch
            assert f"--batch-size {32 * ranks} " in line
            assert f"--lr {0.1 * 32 * ranks / 256!r} " in line
            for flags in ("--model resnet20", "--epochs 164", "--momentum 0.9",
                          "--nesterov", "--weight-decay 0.0001", "--lr-schedule step",
                          "--lr-warmup-epochs 5", "--lr-milestones 82,109", "--lr-decay 0.1",
                          "--no-dp", "--sampling shuffle", "--target-accuracy 0.7"):
                assert flags in line, (flags, line)
    assert _run("--preset", "mlbench-1a", "--ranks", "2", "--privacy", "dp", "--cache",
                str(cache), "--time-budget", "60", "--baseline", "ddp", "--dry-run") == 0
    mine, peer = capsys.readouterr().out.strip().splitlines()
    for flags in ("--noise-multiplier 1.0", "--sampling poisson", "--time-budget 60"):
        assert flags in mine and flags in peer
    assert "opacus-ddp.jsonl" in peer and "--target-accuracy" not in mine

    assert _run("--preset", "dp-sweep", "--cache", str(cache), "--baseline", "ddp",
                "--dry-run") == 0
    lines = capsys.readouterr().out.strip().splitlines()
    # 2 models x 3 batches x 3 repeats x 2 privacy modes x 3 rank counts, each with its peer
    assert len(lines) == 2 * 3 * 3 * 2 * 3 * 2 and not cache.exists()
    ours = lines[0::2]
    assert {line.split("--model ")[1].split()[0] for line in ours} == {"mnist-small",
                                                                        "mnist-large"}
    assert {line.split("--batch-size ")[1].split()[0] for line in ours} == {"128", "256",
                                                                           "512"}
    assert {line.split("--data ")[1].split()[0].rsplit("/", 1)[1] for line in ours} == {
        f"images-1x28x28-{60000 * r}-10000-c10-seed0.h5" for r in (1, 4, 8)}
    assert all("--epochs 2 " in line for line in lines)
    assert sum("--no-dp" in line for line in ours) == len(ours) // 2
    # A sub-grid, and a real file tiled for the repeats (the cached name, nothing written)
    real = tmp_path / "mnist.h5"
    real.write_bytes(b"")
    assert _run("--preset", "dp-sweep", "--data", str(real), "--models", "mnist-large",
                "--batch-sizes", "256", "--repeat-data", "1,4", "--ranks", "2",
                "--privacy", "nodp", "--cache", str(cache), "--baseline", "none",
                "--dry-run") == 0
    one, four = capsys.readouterr().out.strip().splitlines()
    assert f"--data {real} " in one and f"--data {cache}/mnist-x4-" in four


def test_options_that_contradict_a_preset_are_one_line_errors(tmp_path):
    for argv, message in (
            (["--preset", "mlbench-1a", "--scaling", "strong"], "is weak scaling"),
            (["--preset", "mlbench-1a", "--model", "mnist-small"], "trains resnet20"),
            (["--preset", "mlbench-1a", "--batch-size", "256"], "use --local-batch"),
            (["--preset", "mlbench-1a", "--batch-sizes", "64"], "--batch-sizes applies to"),
            (["--preset", "dp-sweep", "--models", "mnist-small,resnet20"],
             "--model resnet20: --preset dp-sweep trains mnist-small or mnist-large"),
            (["--preset", "dp-sweep", "--scaling", "weak"], "is strong scaling"),
            (["--preset", "dp-sweep", "--batch-size", "64"], "takes --batch-sizes"),
            (["--preset", "dp-sweep", "--hidden", "8"], "--hidden applies to"),
            (["--preset", "dp-sweep", "--model", "mnist-small", "--models", "mnist-large"],
             "not both"),
            (["--preset", "dp-sweep", "--image-shape", "28x28"], "expected CxHxW"),
            (["--preset", "dp-sweep", "--data", __file__, "--image-shape", "1x8x8"],
             "has its own"),
            (["--preset", "seed", "--model", "resnet20"], "--model applies to the image"),
            (["--preset", "seed", "--data-repeats", "4"], "--data-repeats applies to"),
            (["--preset", "mlbench-2a", "--image-shape", "1x8x8"], "--image-shape applies")):
        with pytest.raises(BenchError, match=message):
            _run(*argv, "--cache", str(tmp_path), "--dry-run")
    # Through the command: exit 2, one line, nothing else.
    result = subprocess.run([sys.executable, "-m", "engine.cli", "bench", "scaling",
                             "--preset", "mlbench-1a", "--scaling", "strong", "--dry-run",
                             "--cache", str(tmp_path)],
                            capture_output=True, text=True, env=child_env(), timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        "mpidp: error: --scaling strong: --preset mlbench-1a is weak scaling (32 examples "
        "per rank)"]


def test_bench_scaling_user_errors(tmp_path):
    with pytest.raises(BenchError, match="no such file"):
        _run("--data", str(tmp_path / "missing.h5"), "--dry-run")
    with pytest.raises(BenchError, match="--scaling"):
        _run("--scaling", "diagonal", "--dry-run")
    with pytest.raises(BenchError, match="--allreduce 'ring,rings': choose from"):
        _run("--allreduce", "ring,rings", "--dry-run")
    with pytest.raises(BenchError, match="--hidden '128,x'"):
        _run("--hidden", "128,x", "--dry-run")
    with pytest.raises(BenchError, match="weak scaling needs --local-batch"):
        _run("--scaling", "weak", "--dry-run", "--data", __file__)


# ------------------------------------------------------------ image presets, for real
TINY = ("--image-shape", "1x8x8", "--rows", "240", "--test-rows", "80", "--threads", "1")


@pytest.mark.slow
@pytest.mark.long  # DDP and Opacus-DDP launched beside mpidp; test-long runs it
def test_dp_sweep_with_peers_on_a_tiny_grid(tmp_path, capsys):
    """One model, batch and repeat at 1 and 2 ranks, non-private and DP, each run
    followed by its peer (DDP, Opacus-DDP): the sweep's table, JSON and figure."""
    out, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    assert _run("--preset", "dp-sweep", "--models", "mnist-small", "--batch-sizes", "40",
                "--data-repeats", "1", "--ranks", "1,2", *TINY, "--baseline", "ddp",
                "--cache", str(tmp_path / "cache"), "--json", str(out), "--plot", str(png)) == 0
    text = capsys.readouterr().out
    assert "--preset dp-sweep: synthetic 1x8x8 images (240 training / 80 test rows" in text
    assert "not MNIST" in text
    for header in ("1st epoch s", "2nd epoch s", "overhead s", "1st ex/s", "2nd ex/s",
                   "speed-up", "DDP ex/s", "mpidp / DDP", "Opacus-DDP ex/s",
                   "mpidp / Opacus-DDP"):
        assert header in text
    doc = json.loads(out.read_text())
    assert doc["preset"] == "dp-sweep" and doc["baseline"] == "ddp" and doc["notes"] == []
    by = {(s["impl"], s["dp"], s["ranks"]): s for s in doc["summaries"]}
    assert sorted(by) == sorted((impl, dp, r) for dp, impl in ((False, "torch-ddp"),
                                                               (True, "opacus-ddp"))
                                for impl in ("mpidp", impl) for r in (1, 2))
    steps = round(240 / 40)
    for (impl, dp, ranks), s in by.items():
        assert (s["model"], s["grid_batch"], s["data_repeat"]) == ("mnist-small", 40, 1)
        assert s["batch_size"] == 40 and s["epochs_run"] == 2 and s["threads_used"] == 1
        assert s["first_epoch_overhead_s"] == pytest.approx(s["first_epoch_s"]
                                                            - s["epoch_avg_s"])
        assert s["speedup"] == pytest.approx(by[(impl, dp, 1)]["epoch_avg_s"]
                                             / s["epoch_avg_s"])
        assert 0 <= s["test_accuracy"] <= 1
        if dp:  # the same accountant for the same q, sigma and steps
            assert s["epsilon"] == pytest.approx(epsilon_for(40 / 240, 1.0, 2 * steps, 1e-5),
                                                 rel=1e-9)
        if impl == "mpidp":
            peer = by[("opacus-ddp" if dp else "torch-ddp", dp, ranks)]
            assert s["peer"] == peer["impl"]
            assert s["peer_examples_per_s"] == peer["examples_per_s"]
            assert s["vs_peer"] == pytest.approx(s["examples_per_s"] / peer["examples_per_s"])
    runs = {(r["impl"], r["dp"], r["ranks"]): r for r in doc["runs"]}
    for (impl, dp, ranks), run in runs.items():
        assert [e["epoch"] for e in run["epochs"]] == [1, 2]
        assert all(e["step"] == steps * e["epoch"] and e["ranks"] == ranks
                   for e in run["epochs"])
        if impl != "mpidp":
            assert run["command"].startswith(f"mpiexec -n {ranks} python -m "
                                             "engine.bench.ddp_baseline --data ")
            assert all(e["impl"] == impl for e in run["epochs"])
    assert png.stat().st_size > 10_000


def test_ddp_baseline_alone_under_mpiexec(tmp_path):
    """python -m engine.bench.ddp_baseline on 2 ranks: per-epoch JSON lines in the
    schema of mpidp train --metrics (what the scaling report reads)."""
    data = synthetic_images.write_images(tmp_path / "img.h5", (1, 8, 8), rows=200, test_rows=60)
    metrics = tmp_path / "ddp.jsonl"
    result = run_mpi(2, [sys.executable, "-m", "engine.bench.ddp_baseline", "--data", data,
                         "--model", "mnist-small", "--epochs", "2", "--batch-size", "40",
                         "--lr", "0.05", "--no-dp", "--seed", "3", "--threads", "1",
                         "--allreduce", "ring", "--no-progress", "--metrics", str(metrics)],
                     timeout=180)
    assert result.returncode == 0, result.stderr
    assert "torch-ddp over gloo, 2 rank(s) x 1 thread(s)" in result.stdout
    assert "ignored: --allreduce ring --no-progress" in result.stdout
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["epoch"] for r in records] == [1, 2]
    total = 0.0
    for r in records:
        total += r["epoch_time_s"]
        assert r["impl"] == "torch-ddp" and r["ranks"] == 2 and r["threads"] == 1
        assert r["step"] == 5 * r["epoch"] and r["epsilon"] is None and r["comm_s"] is None
        assert r["examples_per_s"] == pytest.approx(r["train_examples"] / r["epoch_time_s"])
        assert r["train_time_s"] == pytest.approx(total)
        assert 0 <= r["test_accuracy"] <= 1 and r["test_loss"] > 0
    # A setting it cannot reproduce: one line, exit 2, from rank 0 only.
    bad = run_mpi(2, [sys.executable, "-m", "engine.bench.ddp_baseline", "--data", data,
                      "--model", "mnist-small", "--no-dp", "--kernels", "numba",
                      "--secure-noise"], timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "mpidp: error: --secure-noise: the DDP baseline cannot reproduce this mpidp train "
        "option; drop it (or run with --baseline none)"]


def test_ddp_baseline_builds_mpidps_model_and_schedule(tmp_path):
    """The peer starts from mpidp's initial parameters and follows its learning rates."""
    import torch

    from engine import models

    data = synthetic_images.write_images(tmp_path / "img.h5", (3, 8, 8), rows=20, test_rows=10)
    info = h5format.read_info(data)
    for name in ("mnist-small", "resnet20"):
        ours = models.resolve(name, (), info.n_features, info.n_classes, 5,
                              torch.device("cpu"), image_shape=info.image_shape).module_obj
        args = ddp_setup.build_parser().parse_args(["--data", data, "--model", name])
        theirs = ddp_setup.build_model(args, info, 5)
        a, b = ours.state_dict(), theirs.state_dict()
        assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    tabular = synthetic.write(tmp_path / "t.h5", rows=30, features=5)
    tab = h5format.read_info(tabular)
    args = ddp_setup.build_parser().parse_args(["--data", tabular, "--hidden", "4"])
    mlp = ddp_setup.build_model(args, tab, 2)
    assert [m.weight.shape[1] for m in mlp if hasattr(m, "weight")] == [5, 4]

    args = Namespace(lr=0.4, lr_schedule="step", lr_warmup_epochs=2, lr_milestones=(3, 5),
                     lr_decay=0.1)
    lr = [ddp_setup.learning_rate(args, t, 10, 4) for t in range(1, 61)]
    assert lr[0] == pytest.approx(0.1 + 0.3 / 20) and lr[19] == pytest.approx(0.4)
    assert lr[20:30] == [pytest.approx(0.4)] * 10
    assert lr[30:50] == [pytest.approx(0.04)] * 20 and lr[50] == pytest.approx(0.004)
    args.lr_schedule = "inv-sqrt"
    assert ddp_setup.learning_rate(args, 4, 10, 4) == pytest.approx(0.2)


def test_synthetic_images_are_what_prep_writes(tmp_path):
    path = synthetic_images.write_images(tmp_path / "img.h5", (3, 6, 5), rows=300, test_rows=90,
                                  seed=1)
    info = h5format.read_info(path)
    assert info.image_shape == (3, 6, 5) and info.rows == {"train": 300, "test": 90}
    assert info.n_classes == 10 and info.task == "synthetic-images"
    with h5py.File(path) as f:
        X, y = f["train/X"][:], f["train/y"][:]
        attrs = dict(f.attrs)
        assert X.dtype == np.uint8 and X.shape == (300, 90) and f["test/X"].shape == (90, 90)
        assert f["train/y"].dtype == np.int8 and "train/household" not in f
    # every attribute prepare.py writes, mean/std from the written training pixels
    assert set(attrs) == {"format", "format_version", "image_shape", "channel_mean",
                          "channel_std", "task", "n_classes", "encoding_fingerprint",
                          "sources", "seed", "test_fraction", "val_fraction", "created_by",
                          "drop_counts"}
    assert attrs["format_version"] == h5format.IMAGE_VERSION
    mean, std = channel_stats(X.reshape(300, 3, 6, 5))
    assert info.channel_mean == pytest.approx(mean, abs=1e-12)
    assert info.channel_std == pytest.approx(std, abs=1e-12)
    assert sorted(set(y.tolist())) == list(range(10))
    # the same data again from the same seed; the test images do not depend on the rows
    again = synthetic_images.write_images(tmp_path / "again.h5", (3, 6, 5), rows=600, test_rows=90,
                                   seed=1)
    with h5py.File(path) as a, h5py.File(again) as b:
        assert np.array_equal(a["test/X"][:], b["test/X"][:])
    # tiled: the training rows repeated, the rest and the attributes as they were
    tiled = synthetic.tile_rows(path, tmp_path / "x3.h5", 3)
    assert h5format.read_info(tiled).rows == {"train": 900, "test": 90}
    with h5py.File(tiled) as f:
        assert np.array_equal(f["train/X"][:], np.tile(X, (3, 1)))
        assert f.attrs["channel_mean"] == attrs["channel_mean"]


def _train_accepts(*options: str) -> bool:
    from engine.bench.scaling_plan import check_train_options

    return check_train_options({"train_argv": ["train", "--data", "-", *options]}) is None


def test_mlbench_1a_on_tiny_images_or_what_it_needs(tmp_path, capsys):
    """mlbench-1a's schedule needs mpidp train --nesterov, --lr-schedule step and its
    warm-up and milestones: without them the preset is refused before any data is
    written; with them, a tiny run reports both mlbench metrics and the peer."""
    cache, out = tmp_path / "cache", tmp_path / "1a.json"
    argv = ("--preset", "mlbench-1a", "--ranks", "1", "--epochs", "1", "--image-shape",
            "3x8x8", "--rows", "128", "--test-rows", "64", "--threads", "1",
            "--target-accuracy", "0.01", "--time-budget", "600", "--baseline", "ddp",
            "--cache", str(cache), "--json", str(out))
    if not _train_accepts("--nesterov", "--lr-schedule", "step", "--lr-warmup-epochs", "5",
                          "--lr-milestones", "82,109", "--lr-decay", "0.1"):
        with pytest.raises(BenchError, match="refuses the planned options"):
            _run(*argv)
        assert not cache.exists()
        return
    assert _run(*argv) == 0
    text = capsys.readouterr().out
    assert "synthetic 3x32x32" not in text and "synthetic 3x8x8 images" in text
    assert "not CIFAR-10" in text and "s to 0.01" in text and "acc@600s" in text
    doc = json.loads(out.read_text())
    mine = [s for s in doc["summaries"] if s["impl"] == "mpidp"][0]
    assert mine["model"] == "resnet20" and mine["batch_size"] == 32 and mine["mode"] == "weak"
    assert mine["tta_epochs"] == 1 and mine["accuracy_after_time"] is not None
    assert mine["peer"] == "torch-ddp" and mine["vs_peer"] > 0


def test_dp_runs_get_a_delta_below_one_over_n(tmp_path, capsys, monkeypatch):
    """mpidp train refuses a delta above 1/N; the seed preset has 790,000 rows, so
    its DP runs pass --delta 1e-06 (train's default 1e-5 would be refused)."""
    from engine.bench import scaling_plan
    data = tmp_path / "d.h5"
    data.write_bytes(b"")
    monkeypatch.setattr(scaling_plan, "read_info",
                        lambda path: Namespace(rows={"train": 790_000}))
    scaling_plan._delta_for.cache_clear()
    try:
        assert _run("--data", str(data), "--ranks", "1", "--privacy", "dp,nodp",
                    "--dry-run") == 0
        dp, dp_peer, nodp, nodp_peer = capsys.readouterr().out.strip().splitlines()
        assert "--delta 1e-06" in dp and "--delta 1e-06" in dp_peer  # Opacus-DDP too
        assert "--delta" not in nodp + nodp_peer
        assert _run("--data", str(data), "--ranks", "1", "--privacy", "dp", "--dry-run",
                    "--train-args", "--delta 1e-7") == 0
        ours = capsys.readouterr().out.splitlines()[0]
        assert ours.count("--delta") == 1 and "--delta 1e-7" in ours  # the user's own
    finally:
        scaling_plan._delta_for.cache_clear()


def test_the_cache_folder_follows_xdg_cache_home(tmp_path, monkeypatch):
    """--cache defaults to $MPIDP_CACHE, else mpidp's cache folder
    (kernels.files.cache_dir: $XDG_CACHE_HOME/mpidp)."""
    monkeypatch.delenv("MPIDP_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    args = build_parser().parse_args(["bench", "scaling"])
    assert args.cache == str(tmp_path / "xdg" / "mpidp")
    monkeypatch.setenv("MPIDP_CACHE", str(tmp_path / "mine"))
    args = build_parser().parse_args(["bench", "scaling"])
    assert args.cache == str(tmp_path / "mine")


# ------------------------------------------------------------ checked before any work
@pytest.mark.parametrize("argv, message", [
    (["--target-accuracy", "2"], r"--target-accuracy 2 must be in \(0, 1\]"),
    (["--target-accuracy", "0"], r"--target-accuracy 0 must be in \(0, 1\]"),
    (["--time-budget", "-1"], "--time-budget -1 must be a positive number of seconds"),
    (["--time-budget", "inf"], "--time-budget inf must be a positive number"),
    (["--rows", "0"], "--rows 0 must be at least 1"),
    (["--test-rows", "-5"], "--test-rows -5 must be at least 1"),
    (["--features", "0"], "--features 0 must be at least 1"),
    (["--batch-size", "0"], "--batch-size 0 must be at least 1"),
    (["--price-per-node-hour", "-3"], "--price-per-node-hour -3 must be a finite number"),
    (["--noise-multiplier", "nan"], "--noise-multiplier nan must be a finite positive"),
    (["--launcher", "mpiexec"], r"--launcher 'mpiexec' has no \{ranks\}"),
    (["--launcher", "srun --mpi=pmi2"], r"has no \{ranks\}: every run would start")])
def test_bad_numbers_and_a_launcher_without_ranks_are_refused_before_any_work(
        tmp_path, argv, message):
    """Refused up front, a dry run too: no data file written, no run launched."""
    cache = tmp_path / "cache"
    for dry in ([], ["--dry-run"]):
        with pytest.raises(BenchError, match=message):
            _run("--rows", "2000", "--test-rows", "500", "--features", "10", "--ranks",
                 "1,2", "--epochs", "2", "--baseline", "none", "--cache", str(cache),
                 *argv, *dry)
    assert not cache.exists()


def test_a_launcher_without_ranks_is_one_line_exit_2(tmp_path):
    result = subprocess.run([sys.executable, "-m", "engine.cli", "bench", "scaling",
                             "--ranks", "1,2", "--launcher", "mpiexec", "--baseline", "none",
                             "--cache", str(tmp_path / "cache")],
                            capture_output=True, text=True, env=child_env(), timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        "mpidp: error: --launcher 'mpiexec' has no {ranks}: every run would start the "
        "launcher's own number of ranks, not --ranks; e.g. 'mpiexec -n {ranks}' or "
        "'srun --mpi=pmi2 -n {ranks}'"]
    assert not (tmp_path / "cache").exists()


def test_a_run_on_other_ranks_than_planned_is_refused(tmp_path, monkeypatch):
    """A launch whose metrics record another rank count than its configuration's
    (a launcher that drops {ranks} on the way) is refused, not tabulated."""
    from engine.bench import scaling_runs

    def fake_run(argv, **kw):  # an "mpiexec" that started one rank whatever it was told
        metrics = argv[argv.index("--metrics") + 1]
        with open(metrics, "w") as f:
            f.write(json.dumps({"epoch": 1, "epoch_time_s": 0.1, "ranks": 1}) + "\n")
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(scaling_runs.subprocess, "run", fake_run)
    config = {"name": "n2", "impl": "mpidp", "ranks": 2, "train_argv": ["train"],
              "metrics": str(tmp_path / "n2.jsonl")}
    with pytest.raises(BenchError, match="ran on 1 rank.s., not the planned 2; does the "
                       r"launch command pass \{ranks\} on\?"):
        scaling_runs.execute(config, "mpiexec -n {ranks}", None)
    config.update(ranks=1, metrics=str(tmp_path / "n1.jsonl"))
    assert scaling_runs.execute(config, "mpiexec -n {ranks}", None)["ranks"] == 1


@pytest.mark.parametrize("ending", ["failed", "interrupted", "kept"])
def test_the_temporary_folder_goes_however_the_runs_end(tmp_path, monkeypatch, ending):
    """A failed or interrupted run removes the metrics folder it made; --keep's stays."""
    from engine.bench import scaling

    workdir = tmp_path / "mpidp-scaling-test"
    monkeypatch.setattr(scaling.tempfile, "mkdtemp",
                        lambda prefix: (workdir.mkdir(), str(workdir))[1])

    def fails(config, launcher, cores):
        (workdir / "partial.jsonl").write_text("")
        raise KeyboardInterrupt if ending == "interrupted" else BenchError("run failed")

    monkeypatch.setattr(scaling, "execute", fails)
    keep = ["--keep", str(workdir)] if ending == "kept" else []
    if ending == "kept":
        workdir.mkdir()
    with pytest.raises(KeyboardInterrupt if ending == "interrupted" else BenchError):
        _run("--rows", "200", "--test-rows", "50", "--features", "4", "--hidden", "4",
             "--ranks", "1", "--epochs", "1", "--privacy", "nodp", "--baseline", "none",
             "--cache", str(tmp_path / "cache"), *keep)
    assert workdir.exists() == (ending == "kept")


def test_a_dry_run_prints_the_delta_the_real_run_passes(tmp_path, capsys, monkeypatch):
    """Before its data exists, a dry run's DP commands carry the --delta that the
    real run computes from the file (from the planned rows); where the rows are
    unknown (an unreadable --data), it says the delta is decided later."""
    from engine.bench import scaling_plan

    cache = tmp_path / "cache"
    scaling_plan._delta_for.cache_clear()
    try:
        for rows, delta in ((None, "1e-06"), ("2000", "1e-05")):  # seed: 790,000 rows
            assert _run("--ranks", "1", "--privacy", "dp", "--baseline", "none",
                        "--cache", str(cache), "--dry-run",
                        *(["--rows", rows] if rows else [])) == 0
            out, err = capsys.readouterr()
            assert f"--delta {delta} " in out and "--delta is decided" not in err
        assert not cache.exists()
        data = tmp_path / "mnist.h5"
        data.write_bytes(b"")  # unreadable: the rows are not known
        argv = ("--preset", "dp-sweep", "--data", str(data), "--models", "mnist-small",
                "--batch-sizes", "256", "--data-repeats", "1,4", "--ranks", "1",
                "--privacy", "dp", "--baseline", "none", "--cache", str(cache), "--dry-run")
        assert _run(*argv) == 0
        out, err = capsys.readouterr()
        assert "--delta" not in out and "--delta is decided once --data can be read" in err
        # A readable --data of 60,000 rows: 1e-05, and its copy tiled x4 (240,000) 1e-06.
        monkeypatch.setattr(scaling_plan, "read_info", lambda path: Namespace(
            rows={"train": 60_000}) if path == str(data) else 1 / 0)
        scaling_plan._delta_for.cache_clear()
        assert _run(*argv) == 0
        one, four = capsys.readouterr().out.strip().splitlines()
        assert "--delta 1e-05 " in one and "--delta 1e-06 " in four and "-x4-" in four
    finally:
        scaling_plan._delta_for.cache_clear()
