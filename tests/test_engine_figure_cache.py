"""The per-host file of privacy figures (engine.dp.figure_cache): a repeated
plan is answered from it without dp-accounting, bit for bit; a file from other
code or libraries, a damaged file, an unwritable folder and errors never change
an answer."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.dp import figure_cache
from engine.dp.accountant import calibrate, epsilon_for
from engine.dp.figure_cache import remembered
from engine.errors import PrivacyError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "figures" / "privacy-figures.json"
    monkeypatch.setenv(figure_cache.FILE_VARIABLE, str(path))
    return path


def _counted():
    calls = []

    @remembered("scaled")
    def scaled(x: float, factor: float = 2.0) -> float:
        calls.append((x, factor))
        return x * factor
    return scaled, calls


def _forget_loaded() -> None:
    """As a new process would start: nothing read yet."""
    figure_cache._loaded.clear()


def test_an_answer_is_computed_once_then_read_back_exactly(cache):
    scaled, calls = _counted()
    assert scaled(0.1) == scaled(0.1, 2.0) == scaled(x=0.1) == 0.1 * 2.0
    assert calls == [(0.1, 2.0)]  # defaults filled in: one key for all three spellings
    _forget_loaded()
    assert scaled(0.1) == 0.1 * 2.0 and calls == [(0.1, 2.0)]
    assert scaled(0.1, 3.0) == 0.1 * 3.0 and calls == [(0.1, 2.0), (0.1, 3.0)]
    data = json.loads(cache.read_text())
    assert data["stamp"] == figure_cache.stamp()
    assert data["figures"] == {"scaled(0.1, 2.0)": [0.2], "scaled(0.1, 3.0)": [0.1 * 3.0]}


def test_none_keeps_no_file(tmp_path, monkeypatch):
    monkeypatch.setenv(figure_cache.FILE_VARIABLE, "none")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    scaled, calls = _counted()
    scaled(1.0), scaled(1.0)
    assert len(calls) == 2 and not list(tmp_path.rglob("*"))


def test_default_file_is_in_mpidps_cache_folder(tmp_path, monkeypatch):
    monkeypatch.delenv(figure_cache.FILE_VARIABLE, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert figure_cache.cache_path() == tmp_path / "mpidp" / "privacy-figures.json"


@pytest.mark.parametrize("content", [
    "not json", "[1, 2]", '{"stamp": "%s", "figures": []}',
    '{"stamp": "%s", "figures": {"scaled(1.5, 2.0)": "three"}}',
    '{"stamp": "%s", "figures": {"scaled(1.5, 2.0)": [NaN]}}',
    '{"stamp": "%s", "figures": {"scaled(1.5, 2.0)": []}}',
    '{"stamp": "%s", "figures": {"scaled(1.5, 2.0)": [true]}}',
    # kept by other code or other library versions: a wrong answer it must not read
    '{"stamp": "another", "figures": {"scaled(1.5, 2.0)": [99.0]}}',
])
def test_a_damaged_or_foreign_file_is_computed_past_and_replaced(cache, content):
    cache.parent.mkdir()
    cache.write_text(content.replace("%s", figure_cache.stamp()))
    scaled, calls = _counted()
    assert scaled(1.5) == 3.0 and len(calls) == 1
    data = json.loads(cache.read_text())
    assert data == {"stamp": figure_cache.stamp(), "figures": {"scaled(1.5, 2.0)": [3.0]}}


def test_the_stamp_follows_the_accounting_source_and_libraries(monkeypatch, tmp_path):
    here = figure_cache.stamp.__wrapped__()
    assert here == figure_cache.stamp()
    copy = tmp_path / "engine" / "dp"
    copy.mkdir(parents=True)
    for name in figure_cache._SOURCES:
        (copy / name).write_bytes((ROOT / "engine" / "dp" / name).read_bytes())
    monkeypatch.setattr(figure_cache, "__file__", str(copy / "figure_cache.py"))
    assert figure_cache.stamp.__wrapped__() == here
    with open(copy / "pld.py", "a") as f:
        f.write("\nPLD_TOLERANCE = 1e-3\n")
    assert figure_cache.stamp.__wrapped__() != here
    monkeypatch.setattr(figure_cache, "__file__", str(ROOT / "engine/dp/figure_cache.py"))
    monkeypatch.setattr(figure_cache, "_LIBRARIES", ("dp-accounting", "numpy"))
    assert figure_cache.stamp.__wrapped__() != here


def test_errors_and_non_finite_answers_are_not_kept(cache):
    calls = []

    @remembered("checked")
    def checked(x: float) -> float:
        calls.append(x)
        if x < 0:
            raise PrivacyError("negative")
        return float("inf") if x == 0 else x

    for _ in range(2):
        with pytest.raises(PrivacyError):
            checked(-1.0)
        assert checked(0.0) == float("inf")
    assert calls == [-1.0, 0.0, -1.0, 0.0] and not cache.exists()


def test_the_file_keeps_the_newest_answers(cache, monkeypatch):
    monkeypatch.setattr(figure_cache, "MAX_FIGURES", 3)
    scaled, calls = _counted()
    for x in range(5):
        scaled(float(x))
    assert list(json.loads(cache.read_text())["figures"]) == [
        "scaled(2.0, 2.0)", "scaled(3.0, 2.0)", "scaled(4.0, 2.0)"]
    _forget_loaded()
    scaled(4.0), scaled(0.0)
    assert calls[5:] == [(0.0, 2.0)]


def test_an_unwritable_folder_still_answers(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(figure_cache.FILE_VARIABLE, str(blocker / "privacy-figures.json"))
    scaled, calls = _counted()
    assert scaled(2.0) == 4.0 and scaled(2.0) == 4.0
    assert blocker.read_text() == ""


def test_writers_merge_with_what_others_kept(cache):
    scaled, _ = _counted()
    scaled(1.0)
    other = json.loads(cache.read_text())
    other["figures"]["scaled(7.0, 2.0)"] = [14.0]  # another process, meanwhile
    cache.write_text(json.dumps(other))
    scaled(2.0)
    assert set(json.loads(cache.read_text())["figures"]) == {
        "scaled(1.0, 2.0)", "scaled(7.0, 2.0)", "scaled(2.0, 2.0)"}


def test_kept_privacy_figures_equal_computed_ones(cache, monkeypatch):
    q, steps, delta = 256 / 60000, 500, 1e-5
    found = calibrate(q, steps, 2.0, delta)
    eps = epsilon_for(q, found.sigma, steps, delta, "pld", found.interval)
    rdp = epsilon_for(q, 1.1, steps, delta, "rdp")
    _forget_loaded()
    assert calibrate(q, steps, 2.0, delta) == found
    assert epsilon_for(q, found.sigma, steps, delta, "pld", found.interval) == eps
    assert epsilon_for(q, 1.1, steps, delta, "rdp") == rdp
    monkeypatch.setenv(figure_cache.FILE_VARIABLE, "none")
    assert calibrate(q, steps, 2.0, delta) == found
    assert epsilon_for(q, 1.1, steps, delta, "rdp") == rdp


_PLAN = """
import sys
from engine.dp.accountant import Accountant
acct, budget = Accountant.plan(256 / 60000, 1e-5, 700, target_epsilon=1.5)
print(repr(acct.sigma), repr(acct.interval), repr(acct.epsilon(350)), repr(acct.epsilon(700)),
      "dp_accounting" in sys.modules)
"""


def test_a_repeated_plan_does_not_load_dp_accounting(cache):
    """What a repeated `mpidp train --target-epsilon` run saves: the import and
    the calibration, with the same sigma, grid and epsilons to the last bit."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))

    def plan() -> list[str]:
        out = subprocess.run([sys.executable, "-c", _PLAN], env=env, cwd=ROOT, text=True,
                             capture_output=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    first, second = plan(), plan()
    assert first[-1] == "True" and second[-1] == "False"
    assert first[:-1] == second[:-1]


def test_off_computes_and_keeps_nothing(cache):
    scaled, calls = _counted()
    scaled(1.0)
    with figure_cache.off():
        scaled(1.0), scaled(5.0)
    scaled(1.0)
    assert len(calls) == 3
    assert list(json.loads(cache.read_text())["figures"]) == ["scaled(1.0, 2.0)"]


def test_unreadable_accounting_source_keeps_no_file(cache, monkeypatch):
    """No digest of the code, no answer kept: an answer from other code must never be read."""
    monkeypatch.setattr(figure_cache, "__file__", str(cache.parent / "gone" / "figure_cache.py"))
    figure_cache.stamp.cache_clear()
    try:
        assert figure_cache.stamp() is None and figure_cache.cache_path() is None
        scaled, calls = _counted()
        assert scaled(1.0) == scaled(1.0) == 2.0 and len(calls) == 2 and not cache.exists()
    finally:
        monkeypatch.setattr(figure_cache, "__file__", str(ROOT / "engine/dp/figure_cache.py"))
        figure_cache.stamp.cache_clear()
    assert figure_cache.stamp() is not None


def test_the_accountant_benchmark_times_a_calibration_not_the_file(cache):
    from engine.bench.accountant import point

    first = point(256 / 60000, 300, 2.0, 1e-5, "none")
    second = point(256 / 60000, 300, 2.0, 1e-5, "none")
    assert first["sigma"] == second["sigma"]
    assert "calibrate(" not in (cache.read_text() if cache.exists() else "")


@pytest.mark.parametrize("how", ["others may write it", "another user owns it"])
def test_a_file_others_could_have_written_is_not_believed(cache, monkeypatch, how):
    """A planted answer (here: epsilon 0.01 for any run) must not understate a run's epsilon."""
    cache.parent.mkdir()
    planted = {"stamp": figure_cache.stamp(), "figures": {"scaled(1.5, 2.0)": [0.01]}}
    cache.write_text(json.dumps(planted))
    scaled, calls = _counted()
    with monkeypatch.context() as patch:
        if how == "others may write it":
            cache.chmod(0o666)
        else:
            owner = cache.stat().st_uid
            patch.setattr(figure_cache.os, "geteuid", lambda: owner + 1)
        assert scaled(1.5) == 3.0 and len(calls) == 1
    mode = cache.stat().st_mode & 0o777
    assert not mode & 0o022, oct(mode)  # written anew, this user's alone to write
    _forget_loaded()
    assert scaled(1.5) == 3.0 and len(calls) == 1
