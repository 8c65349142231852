"""engine.warmup: a machine's one-time costs paid before the runs that count, and said."""
import io
import json
import os
import subprocess
import sys

import pytest

from collectives import MPI
from engine import warmup
from engine.bench import synthetic
from engine.config import TrainConfig
from engine.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def marker(tmp_path, monkeypatch):
    path = tmp_path / "warm.json"
    monkeypatch.setenv("MPIDP_WARM_FILE", str(path))
    return path


def test_a_machine_is_warm_once_marked_for_its_numba_cache(marker, monkeypatch):
    assert not warmup.is_warm()
    warmup.mark_warm()
    assert warmup.is_warm()
    warmup.mark_warm()  # the same state once
    assert len(json.loads(marker.read_text())["states"]) == 1
    monkeypatch.setenv("NUMBA_CACHE_DIR", "/elsewhere")
    assert not warmup.is_warm()  # another cache: compiled nothing yet
    monkeypatch.setenv("MPIDP_WARM_FILE", "none")
    assert warmup.is_warm()


def test_a_first_run_says_it_pays_one_time_costs_and_marks_the_machine(marker, tmp_path):
    data = synthetic.write(tmp_path / "d.h5", rows=600, features=6, val_rows=100, seed=1)
    lines = []
    for _ in range(2):
        out = io.StringIO()
        cfg = TrainConfig(data=str(data), epochs=1, batch_size=64, noise_multiplier=1.0,
                          delta=1e-4, seed=0, progress=False)
        assert Trainer(cfg, MPI.COMM_SELF, out=out).run() == 0
        lines.append(out.getvalue())
    assert "epoch 1 compiles the kernels" in lines[0] and "mpidp warmup" in lines[0]
    assert "compiles the kernels" not in lines[1] and warmup.is_warm()


def test_the_command_at_two_ranks_runs_its_steps_and_marks_the_machine(marker, tmp_path):
    data = synthetic.write(tmp_path / "d.h5", rows=2000, features=8, val_rows=200, seed=2)
    env = dict(os.environ, MPIDP_WARM_FILE=str(marker))
    marker.write_text("[]")  # damaged: ignored and rewritten (rank 0 raised, the job hung)
    done = subprocess.run([os.path.join(os.path.dirname(sys.executable), "mpiexec"), "-n", "2",
                           sys.executable, "-m", "engine.cli", "warmup", "--data", str(data),
                           "--steps", "12"], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    # whole epochs of the file: 2,000 rows at a batch of 256 are 8 steps an epoch
    first, *_, last = done.stdout.splitlines()
    # said first, before any measurement or compilation; the result last
    assert first.startswith("mpidp warmup: filling this machine's caches on 2 rank(s)")
    assert last.startswith("mpidp warmup: 16 steps in ") and "on 2 rank(s)" in last
    assert "measurements not kept" in done.stdout  # the suite keeps no tuning file
    assert warmup.is_warm()
    bad = subprocess.run([sys.executable, "-m", "engine.cli", "warmup", "--steps", "0"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert bad.returncode == 2 and "--steps 0 must be at least 1" in bad.stderr


def test_a_warm_up_a_signal_stopped_is_no_success(marker, tmp_path, monkeypatch):
    """A stop at a step ended the trainer with 130, which warm_up ignored: the
    command said "N steps in S s", exited 0 and marked the machine warm."""
    from engine.stopping import Interrupted

    data = synthetic.write(tmp_path / "d.h5", rows=600, features=6, seed=1)
    monkeypatch.setattr(Trainer, "run", lambda self: 130)  # as after SIGINT at a step
    with pytest.raises(Interrupted) as stopped:
        warmup.warm_up(str(data), 4, "cpu", MPI.COMM_SELF)
    assert stopped.value.signum == 2 and not marker.exists() and not warmup.is_warm()


def test_warm_up_on_a_scoring_file_or_a_file_of_codes(marker, tmp_path):
    """A scoring-only file (no training rows) was a ZeroDivisionError on every
    rank; a file of category codes was refused with advice to pass --model,
    which warmup does not take. Now a one-line DataError, and the embedding
    MLP that such a file's runs train."""
    from engine.errors import DataError

    scoring = synthetic.write(tmp_path / "s.h5", rows=0, features=8, test_rows=100, seed=2)
    with pytest.raises(DataError, match="has no training rows .* warm up on the data of "):
        warmup.warm_up(scoring, 4, "cpu", MPI.COMM_WORLD)
    codes = synthetic.write(tmp_path / "c.h5", rows=600, features=8, codes=True, seed=2)
    steps, _ = warmup.warm_up(codes, 4, "cpu", MPI.COMM_WORLD)
    assert steps >= 4


@pytest.mark.parametrize("text", ["[]", '{"states": 5}', '{"states": null}', '"x"',
                                  '{"states": [1, "a", null]}', "{", "\xff"])
def test_a_damaged_marker_is_a_machine_not_warm_and_rewritten_whole(marker, text):
    """A wrong-shaped warm.json raised AttributeError in is_warm (rank 0 of a
    training run: MPI_Abort; of a warm-up: a hang in its finally's barrier)."""
    marker.write_bytes(text.encode("latin-1"))
    assert warmup.is_warm() is False
    assert warmup.mark_warm() is None
    assert json.loads(marker.read_text()) == {"states": [warmup._state()]}
    assert warmup.is_warm()


def test_the_marker_is_keyed_by_numba_cache_not_by_the_current_folder(marker, tmp_path,
                                                                        monkeypatch):
    """Unset, NUMBA_CACHE_DIR was abspath("") (the current folder): a warm-up in
    one folder and a run in another said "first run" with the same cache."""
    for unset in (None, "", "  "):
        if unset is None:
            monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
        else:
            monkeypatch.setenv("NUMBA_CACHE_DIR", unset)
        marker.unlink(missing_ok=True)
        (tmp_path / "a").mkdir(exist_ok=True)
        (tmp_path / "b").mkdir(exist_ok=True)
        monkeypatch.chdir(tmp_path / "a")
        assert warmup._state()["numba_cache_dir"] is None
        warmup.mark_warm()
        monkeypatch.chdir(tmp_path / "b")
        assert warmup.is_warm()


def _has_index(folder):
    """Reference: any *.nbi at most one folder down (Numba's layout)."""
    import glob

    return bool(glob.glob(os.path.join(folder, "*.nbi"))
                or glob.glob(os.path.join(folder, "*", "*.nbi")))


def test_a_numba_cache_removed_or_empty_is_not_warm(marker, tmp_path, monkeypatch):
    """After rm -rf of a Numba cache marked warm, a run compiled again without
    the first-run note: the marker now also needs index files in that cache."""
    import shutil

    cache = tmp_path / "numba"
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(cache))
    sub = cache / "core_abc"
    steps = [lambda: None,  # no folder at all
             lambda: sub.mkdir(parents=True),  # an empty package folder
             lambda: (sub / "k.f-1.py311.1.nbc").write_bytes(b"x"),  # data, no index
             lambda: (sub / "k.f-1.py311.nbi").write_bytes(b"x"),  # an index: warm
             lambda: shutil.rmtree(cache),  # rm -rf
             lambda: cache.mkdir(),
             lambda: (cache / "k.nbi").write_bytes(b"x")]  # an index at the top counts
    warmup.mark_warm()
    seen = []
    for step in steps:
        step()
        seen.append(warmup.is_warm())
        assert seen[-1] is _has_index(cache)
        assert warmup.numba_cache_filled(str(cache)) is _has_index(cache)
    assert seen == [False, False, False, True, False, False, True]
    (cache / "k.nbi").unlink()
    (cache / "not-a-folder").write_bytes(b"x")
    assert not warmup.numba_cache_filled(str(cache / "not-a-folder"))
    assert warmup.numba_cache_filled(None)  # beside the modules: Numba's own affair


def test_a_warm_up_that_saves_no_cache_says_which_where_and_why(tmp_path, monkeypatch,
                                                                 capsys):
    """With XDG_CACHE_HOME a regular file, warmup exited 0 naming
    .../afile/mpidp/allreduce-tuning.json as where the measurements were, and
    the warm marker was silently not written."""
    import argparse

    afile = tmp_path / "afile"
    afile.write_text("x")
    monkeypatch.setenv("XDG_CACHE_HOME", str(afile))
    monkeypatch.delenv("MPIDP_WARM_FILE", raising=False)
    monkeypatch.delenv("MPIDP_ALLREDUCE_TUNING_FILE", raising=False)
    monkeypatch.setattr(warmup, "warm_up", lambda *a: (12, 0.5))  # the run itself: elsewhere
    assert isinstance(warmup.mark_warm(), NotADirectoryError)
    args = argparse.Namespace(data=None, steps=12, device="cpu")
    assert warmup.run(args) == 0
    out, err = capsys.readouterr()
    assert str(afile / "mpidp") not in out and "measurements not saved (below)" in out
    warning, = err.splitlines()
    assert warning.startswith("mpidp warmup: warning: could not save the warm marker at "
                              f"{afile / 'mpidp' / 'warm.json'} (Not a directory); the "
                              "all-reduce's measurements at "
                              f"{afile / 'mpidp' / 'allreduce-tuning.json'} (Not a directory)")
    assert not warmup.is_warm()
    # a writable cache folder: no warning, and each path said is a file written
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert warmup.run(args) == 0
    out, err = capsys.readouterr()
    tuning = tmp_path / "cache" / "mpidp" / "allreduce-tuning.json"
    assert err == "" and f"measurements in {tuning}" in out and warmup.is_warm()
    assert os.listdir(tuning.parent) == ["warm.json"]  # the probe left nothing behind


def test_a_rank_local_error_in_the_warm_up_waits_in_no_barrier(tmp_path, monkeypatch):
    """A non-collective error on rank 0 went to ``finally: comm.Barrier()``
    while the other ranks were in the step's all-reduce: a hang."""
    import engine.trainer

    class Recording:  # COMM_SELF, its barriers counted
        barriers = 0

        def __getattr__(self, name):
            return getattr(MPI.COMM_SELF, name)

        def Barrier(self):
            Recording.barriers += 1

    class Failing:
        def __init__(self, cfg, comm, out):
            self.data = cfg.data

        def run(self):
            assert os.path.exists(self.data)
            made.append(self.data)
            raise RuntimeError("a rank-local failure")

    made, real_write = [], synthetic.write
    monkeypatch.setattr(engine.trainer, "Trainer", Failing)
    monkeypatch.setattr(synthetic, "write",  # a small synthetic file keeps it cheap
                        lambda path, **kw: real_write(path, rows=600, features=6))
    with pytest.raises(RuntimeError, match="rank-local"):
        warmup.warm_up(None, 4, "cpu", Recording())
    assert Recording.barriers == 0
    assert made and not os.path.exists(os.path.dirname(made[0]))  # the temporary removed
