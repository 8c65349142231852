"""The vector width Numba compiles for (kernels.numba_target): the choice's logic
with fake timings, and in child processes that the width takes effect and
that a real measurement fills the tuning file."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numba
import pytest

from kernels import numba_target

ROOT = Path(__file__).resolve().parent.parent
AVX512 = "+avx512f" in numba_target._host()[1].split(",")
HOST = ("testcpu", "+avx2,+avx512f,+fma")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """configure() as in a process that has not compiled yet, on a fake AVX-512
    host, with the tuning file in tmp_path; Numba's real setting is restored."""
    monkeypatch.setattr(numba_target, "_host", lambda: HOST)
    monkeypatch.setattr(numba_target, "_numba_target_fixed", lambda: False)
    monkeypatch.setattr(numba.config, "CPU_FEATURES", None)
    monkeypatch.delenv("NUMBA_CPU_FEATURES", raising=False)
    monkeypatch.delenv("MPIDP_VECTOR_WIDTH", raising=False)
    path = tmp_path / "cache" / "numba-target.json"
    monkeypatch.setenv("MPIDP_NUMBA_TARGET_FILE", str(path))
    return path


class FakeTimes:
    """``time_width`` with fixed seconds per width, counting its calls."""

    def __init__(self, **seconds):
        self.seconds = {int(k[1:]): v for k, v in seconds.items()}
        self.calls: list[int] = []

    def __call__(self, width: int) -> float:
        self.calls.append(width)
        value = self.seconds[width]
        if isinstance(value, Exception):
            raise value
        return value.pop(0) if isinstance(value, list) else value


def test_measure_alternates_and_keeps_each_widths_best():
    fake = FakeTimes(w256=[5.0, 4.0], w512=[3.0, 6.0])
    assert numba_target.measure(fake, passes=2) == {"256": 4.0, "512": 3.0}
    assert fake.calls == [256, 512, 256, 512]


@pytest.mark.parametrize("t512, width", [(0.90, 512), (0.969, 512), (0.98, 256), (1.2, 256)])
def test_decide_keeps_512_only_when_clearly_faster(t512, width):
    assert numba_target.decide({"256": 1.0, "512": t512}) == width


def test_features_for_sets_or_clears_the_256_bit_preference():
    base = "+avx2,+prefer-256-bit,+avx512f"
    assert numba_target.features_for(base, 512) == "+avx2,+avx512f,-prefer-256-bit"
    assert numba_target.features_for(base, 256) == "+avx2,+avx512f,+prefer-256-bit"


def test_auto_measures_once_then_reads_the_file(fresh, capsys):
    fake = FakeTimes(w256=2.0, w512=1.0)
    first = numba_target.configure(fake)
    assert first.width == 512 and "measured now" in first.source
    # the seconds it takes are announced, on stderr (stdout may be a program's data)
    said = capsys.readouterr()
    assert said.out == "" and said.err == (
        "mpidp: measuring which vector width Numba's loops run faster at on this CPU "
        f"(testcpu): once per CPU, kept in {fresh}\n")
    assert numba.config.CPU_FEATURES == "+avx2,+avx512f,+fma,-prefer-256-bit"
    assert len(fake.calls) == 2 * numba_target.PASSES
    entries = json.loads(fresh.read_text())["entries"]
    (key, entry), = entries.items()
    assert key.startswith("testcpu | numba ") and key.endswith(HOST[1])
    assert entry["width"] == 512 and entry["seconds"] == {"256": 2.0, "512": 1.0}

    numba.config.CPU_FEATURES = None  # as a new process
    again = numba_target.configure(FakeTimes(w256=RuntimeError("measured again"),
                                             w512=RuntimeError("measured again")))
    assert again.width == 512 and "measured earlier" in again.source
    assert again.seconds == {"256": 2.0, "512": 1.0}
    assert numba.config.CPU_FEATURES.endswith("-prefer-256-bit")
    assert capsys.readouterr().err == ""  # nothing measured, nothing said


def test_cached_reads_the_file_and_never_measures(fresh, monkeypatch):
    """`mpidp info` on a fresh machine spent 18 s measuring (AMD EPYC Zen 4):
    in ``cached`` mode a missing entry is LLVM's choice, nothing is written."""
    monkeypatch.setenv("MPIDP_VECTOR_WIDTH", "cached")
    never = FakeTimes(w256=RuntimeError("measured"), w512=RuntimeError("measured"))
    missing = numba_target.configure(never)
    assert missing.width is None and "not measured on this CPU yet" in missing.source
    assert never.calls == [] and not fresh.exists() and numba.config.CPU_FEATURES is None
    monkeypatch.setenv("MPIDP_VECTOR_WIDTH", "auto")
    numba_target.configure(FakeTimes(w256=2.0, w512=1.0))  # a training run measures
    numba.config.CPU_FEATURES = None  # as a new process
    monkeypatch.setenv("MPIDP_VECTOR_WIDTH", "cached")
    cached = numba_target.configure(never)
    assert cached.width == 512 and "measured earlier" in cached.source and never.calls == []


def test_a_slower_512_keeps_256(fresh):
    choice = numba_target.configure(FakeTimes(w256=1.0, w512=1.0))
    assert choice.width == 256
    assert numba.config.CPU_FEATURES.endswith("+prefer-256-bit")


def test_a_failed_measurement_is_recorded_and_not_repeated(fresh):
    failing = FakeTimes(w256=subprocess.CalledProcessError(1, "child"), w512=1.0)
    choice = numba_target.configure(failing)
    assert choice.width is None and "measuring failed" in choice.source
    assert str(fresh) in choice.source  # says which file to delete to retry
    assert numba.config.CPU_FEATURES is None  # LLVM's own choice
    later = FakeTimes(w256=1.0, w512=0.5)
    assert numba_target.configure(later).width is None and later.calls == []


@pytest.mark.parametrize("mode, width, source", [("256", 256, "MPIDP_VECTOR_WIDTH=256"),
                                                 ("512", 512, "MPIDP_VECTOR_WIDTH=512"),
                                                 ("host", None, "MPIDP_VECTOR_WIDTH=host")])
def test_the_environment_forces_a_width(fresh, monkeypatch, mode, width, source):
    monkeypatch.setenv("MPIDP_VECTOR_WIDTH", mode)
    fake = FakeTimes(w256=1.0, w512=1.0)
    choice = numba_target.configure(fake)
    assert (choice.width, fake.calls) == (width, []) and source in choice.source
    assert (numba.config.CPU_FEATURES is None) == (width is None)
    assert not fresh.exists()


@pytest.mark.parametrize("mode", ["1024", "fast", "256bit"])
def test_a_mistyped_width_is_a_one_line_user_error(fresh, monkeypatch, mode):
    """MPIDP_VECTOR_WIDTH=1024 was ignored by train (LLVM's width, not even the
    cached one): now an error that mpidp prints as one line, exit code 2,
    naming the accepted values, whatever else applies."""
    from engine import spmd

    monkeypatch.setenv("MPIDP_VECTOR_WIDTH", mode)
    fake = FakeTimes(w256=1.0, w512=1.0)
    with pytest.raises(numba_target.VectorWidthError) as caught:
        numba_target.configure(fake)
    assert spmd.is_user_error(caught.value) and caught.value.exit_code == 2
    line = spmd._line(caught.value)
    assert line.startswith(f"mpidp: error: MPIDP_VECTOR_WIDTH={mode!r} is not one of ")
    assert all(m in line for m in numba_target.MODES) and "\n" not in line
    assert fake.calls == [] and numba.config.CPU_FEATURES is None and not fresh.exists()
    # checked before the cases that leave the width alone
    monkeypatch.setenv("NUMBA_CPU_FEATURES", "+avx2")
    with pytest.raises(numba_target.VectorWidthError):
        numba_target.configure(fake)
    monkeypatch.delenv("NUMBA_CPU_FEATURES")
    monkeypatch.setattr(numba_target, "_host", lambda: ("zen3", "+avx2,-avx512f,+fma"))
    with pytest.raises(numba_target.VectorWidthError):
        numba_target.configure(fake)


def test_a_mistyped_width_fails_the_import_in_a_child(tmp_path):
    """The error is raised where the module is first imported (a command's
    main, under engine.spmd.run_spmd): the import fails with it."""
    code = ("import sys\ntry:\n    import kernels.numba_target\n"
            "except Exception as exc:\n    print(type(exc).__name__, exc.exit_code)\n")
    full = {k: v for k, v in os.environ.items() if k != "NUMBA_CPU_FEATURES"}
    full.update(PYTHONPATH=str(ROOT), MPIDP_VECTOR_WIDTH=" 1024 ",
                MPIDP_NUMBA_TARGET_FILE=str(tmp_path / "t.json"))
    done = subprocess.run([sys.executable, "-c", code], env=full, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "VectorWidthError 2", done.stderr


@pytest.mark.parametrize("damaged", [[512], "512", 512, None, {"width": 1024},
                                     {"width": 512, "seconds": [1.0]},
                                     {"width": True}, {"seconds": {"256": 1.0}}])
def test_a_damaged_entry_is_measured_again_and_rewritten(fresh, damaged, capsys):
    """``{KEY: [512]}`` made mpidp info, warmup and train die with an
    AttributeError: a damaged entry counts as a missing one."""
    key = numba_target._key(*HOST)
    fresh.parent.mkdir(parents=True)
    other = {"width": 256, "seconds": {"256": 1.0, "512": 2.0}}
    fresh.write_text(json.dumps({"version": numba_target.VERSION,
                                 "entries": {key: damaged, "other cpu": other}}))
    fake = FakeTimes(w256=2.0, w512=1.0)
    choice = numba_target.configure(fake)
    assert choice.width == 512 and "measured now" in choice.source
    assert len(fake.calls) == 2 * numba_target.PASSES
    entries = json.loads(fresh.read_text())["entries"]
    assert entries[key]["width"] == 512 and entries["other cpu"] == other
    # in cached mode (mpidp info) it is a missing entry: no traceback, no measuring
    entries[key] = damaged
    fresh.write_text(json.dumps({"version": numba_target.VERSION, "entries": entries}))
    numba.config.CPU_FEATURES = None
    os.environ["MPIDP_VECTOR_WIDTH"] = "cached"  # removed again by the fixture
    never = FakeTimes(w256=RuntimeError("measured"), w512=RuntimeError("measured"))
    cached = numba_target.configure(never)
    assert cached.width is None and "not measured on this CPU yet" in cached.source
    assert never.calls == []


def test_an_existing_entry_is_read_without_the_lock(fresh, monkeypatch):
    """A site's file on a read-only mount was ignored: the lock file was opened
    for writing even to read an entry ("not usable (Read-only file system)")."""
    numba_target.configure(FakeTimes(w256=2.0, w512=1.0))
    numba.config.CPU_FEATURES = None  # as a new process, on a read-only mount

    def read_only(path, *args, **kwargs):
        raise OSError(30, "Read-only file system", str(path))

    monkeypatch.setattr(numba_target.files, "lock", read_only)
    monkeypatch.setattr(numba_target.files, "replace_file", read_only)
    never = FakeTimes(w256=RuntimeError("measured"), w512=RuntimeError("measured"))
    choice = numba_target.configure(never)
    assert choice.width == 512 and "measured earlier" in choice.source and never.calls == []
    # a missing entry there is reported, without measuring in vain
    numba.config.CPU_FEATURES = None
    monkeypatch.setattr(numba_target, "_host", lambda: ("othercpu", HOST[1]))
    missing = numba_target.configure(never)
    assert missing.width is None and never.calls == []
    assert missing.source == f"{fresh} not usable (Read-only file system): not measured"


def test_a_directory_as_the_file_is_refused_before_measuring(fresh, monkeypatch, tmp_path,
                                                              capsys):
    """A directory as MPIDP_NUMBA_TARGET_FILE was measured (20-50 s), then
    reported "not usable (Is a directory): not measured", in every process."""
    folder = tmp_path / "a-folder"
    folder.mkdir()
    monkeypatch.setenv("MPIDP_NUMBA_TARGET_FILE", str(folder))
    fake = FakeTimes(w256=2.0, w512=1.0)
    choice = numba_target.configure(fake)
    assert choice.width is None and fake.calls == [] and capsys.readouterr().err == ""
    assert choice.source == f"{folder} not usable (Is a directory): not measured"


def test_a_measurement_that_cannot_be_kept_is_used_and_said_so(fresh, monkeypatch):
    def failing(path, entries):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(numba_target, "_write", failing)
    fake = FakeTimes(w256=2.0, w512=1.0)
    choice = numba_target.configure(fake)
    assert choice.width == 512 and len(fake.calls) == 2 * numba_target.PASSES
    assert choice.source == (f"measured now, but {fresh} is not usable "
                             "(No space left on device): not kept")
    assert "not measured" not in choice.source


def test_nothing_is_measured_or_changed_where_there_is_no_choice(fresh, monkeypatch):
    fake = FakeTimes(w256=1.0, w512=0.5)
    monkeypatch.setattr(numba_target, "_host", lambda: ("zen3", "+avx2,-avx512f,+fma"))
    assert "no AVX-512" in numba_target.configure(fake).source
    monkeypatch.setattr(numba_target, "_host", lambda: HOST)
    monkeypatch.setenv("NUMBA_CPU_FEATURES", "+avx2")
    assert "set by the user" in numba_target.configure(fake).source
    monkeypatch.delenv("NUMBA_CPU_FEATURES")
    monkeypatch.setattr(numba_target, "_numba_target_fixed", lambda: True)
    assert "fixed before" in numba_target.configure(fake).source
    monkeypatch.setattr(numba_target, "_numba_target_fixed", lambda: False)
    monkeypatch.setenv("MPIDP_NUMBA_TARGET_FILE", "none")
    assert "not measured" in numba_target.configure(fake).source
    assert fake.calls == [] and numba.config.CPU_FEATURES is None and not fresh.exists()


def test_an_unusable_tuning_file_means_no_measurement(fresh, monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("MPIDP_NUMBA_TARGET_FILE", str(blocker / "numba-target.json"))
    fake = FakeTimes(w256=1.0, w512=0.5)
    choice = numba_target.configure(fake)
    assert choice.width is None and "not usable" in choice.source and fake.calls == []


def _child(code: str | None, **env) -> str:
    """The last line a child process prints: ``python -c code``, or the module
    run as a script when ``code`` is None. The child chooses on this host's own
    features: a NUMBA_CPU_FEATURES of the caller's (tools/as_avx2.sh) is left out."""
    full = {k: v for k, v in os.environ.items() if k != "NUMBA_CPU_FEATURES"}
    full.update(PYTHONPATH=str(ROOT), **env)
    argv = ["-m", "kernels.numba_target"] if code is None else ["-c", textwrap.dedent(code)]
    done = subprocess.run([sys.executable, *argv], env=full, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(not AVX512, reason="needs an AVX-512 CPU (the only kind with a choice)")
@pytest.mark.parametrize("width", [256, 512])
def test_the_width_reaches_the_compiled_code(width, tmp_path):
    # a loop LLVM vectorises at the preferred width: zmm registers only at 512
    out = _child("""
        import kernels.numba_target as target
        import numba, numpy as np
        @numba.njit(fastmath=True)
        def total(x):
            s = np.float32(0)
            for i in range(x.shape[0]):
                s += x[i] * x[i]
            return s
        total(np.ones(4096, np.float32))
        asm = total.inspect_asm(total.signatures[0])
        print(target.CHOICE.width, "zmm" in asm)
    """, MPIDP_VECTOR_WIDTH=str(width), MPIDP_NUMBA_TARGET_FILE=str(tmp_path / "t.json"))
    assert out == f"{width} {width == 512}"


def test_a_real_measurement_fills_the_tuning_file(tmp_path):
    path = tmp_path / "numba-target.json"
    out = _child(None, MPIDP_NUMBA_TARGET_FILE=str(path), MPIDP_VECTOR_WIDTH="auto")
    if not AVX512:
        assert "nothing to choose" in out and not path.exists()
        return
    entry, = json.loads(path.read_text())["entries"].values()
    assert entry["width"] in (256, 512) and set(entry["seconds"]) == {"256", "512"}
    assert all(0 < s < 0.01 for s in entry["seconds"].values())  # per step: us, not s
    assert f"{entry['width']}-bit vectors (measured now, saved in {path})" in out
    again = _child("from kernels.numba_target import CHOICE; print(CHOICE.describe())",
                   MPIDP_NUMBA_TARGET_FILE=str(path))
    assert f"{entry['width']}-bit vectors (measured earlier" in again


def test_both_widths_compile_at_once_before_any_timing(monkeypatch):
    """The real measurement first compiles each width's kernels in a child of
    its own, all at once (their compilations overlap where there are cores),
    then times the widths in turn with children that only load them (with
    real children: test_a_real_measurement_fills_the_tuning_file)."""
    calls = []

    def child(width, flag):
        calls.append((flag, width))
        return {"compiled": 5 if flag == "--compile-kernels" else 0,
                "seconds": {256: 2e-5, 512: 1e-5}[width]}

    monkeypatch.setattr(numba_target, "_child", child)
    assert numba_target.measure() == {"256": 2e-5, "512": 1e-5}
    compiles, timings = calls[:2], calls[2:]
    assert sorted(compiles) == [("--compile-kernels", 256), ("--compile-kernels", 512)]
    assert timings == [("--time-kernels", w) for w in (256, 512) * numba_target.PASSES]
    # a compiling child that fails is left to fail again, reported, when timed
    calls.clear()
    monkeypatch.setattr(numba_target, "_child", lambda w, flag: calls.append(flag) or (
        {} if flag == "--compile-kernels" else {"seconds": 1e-5}))
    assert numba_target.compile_in_children() == {}
    assert numba_target.measure() == {"256": 1e-5, "512": 1e-5}


@pytest.mark.skipif(not AVX512, reason="needs an AVX-512 CPU (the only kind with a choice)")
def test_the_width_does_not_change_the_noise(tmp_path):
    code = """
        import hashlib
        import numpy as np
        from kernels.numba_cpu.gaussian import NumbaGaussianStream
        from kernels.numba_target import CHOICE
        stream, buf = NumbaGaussianStream(np.random.SeedSequence(7)), np.zeros(100_003, np.float32)
        for _ in range(3):
            stream.add_(buf, 1.5)
        print(CHOICE.width, hashlib.sha256(buf.tobytes()).hexdigest())
    """
    out = {w: _child(code, MPIDP_VECTOR_WIDTH=str(w),
                     MPIDP_NUMBA_TARGET_FILE=str(tmp_path / "t.json")).split()
           for w in (256, 512)}
    assert out[256][0] == "256" and out[512][0] == "512"
    assert out[256][1] == out[512][1]
