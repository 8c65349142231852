"""kernels.shared_compiles: processes sharing Numba's disk cache compile a
kernel's signature once; a held lock delays, never hangs; a lock dies with
the process that held it."""
import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numba
import pytest

from kernels import numba_target, shared_compiles

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "slow_compile.py"
AVX512 = "+avx512f" in numba_target._host()[1].split(",")


def _start(cache: Path, compile_s: float, at: float) -> subprocess.Popen:
    """The slow-compiling kernel's script, calling it at wall-clock time ``at``."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), MPIDP_VECTOR_WIDTH="host",
               SLOW_COMPILE_S=str(compile_s),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.Popen([sys.executable, str(SCRIPT), str(at)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _children(cache: Path, n: int, compile_s: float, start_in: float = 2.5) -> list[dict]:
    """Run n copies of the slow-compiling kernel's script, all calling it at the
    same moment on the same (empty) cache; their JSON reports."""
    start = time.time() + start_in
    procs = [_start(cache, compile_s, start) for _ in range(n)]
    reports = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=60 + start_in + n * compile_s)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError("a process calling the kernel did not finish (waiting on "
                                 "a lock?)") from None
        assert p.returncode == 0, err
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


def test_processes_starting_together_compile_a_kernel_once(tmp_path):
    # each compilation takes 1.5 s and all three call at the same moment: without
    # the lock each of them compiles (checked by hand with plain numba.njit)
    reports = _children(tmp_path / "cache", 3, compile_s=1.5)
    assert [r["value"] for r in reports] == [42, 42, 42]
    assert sorted(r["misses"] for r in reports) == [0, 0, 1], reports
    assert sorted(r["hits"] for r in reports) == [0, 1, 1], reports
    assert list((tmp_path / "cache").rglob("*" + shared_compiles.SUFFIX))


def test_a_kernel_in_the_cache_loads_without_the_lock(tmp_path):
    _children(tmp_path / "cache", 1, compile_s=1.0, start_in=0)
    [lock] = (tmp_path / "cache").rglob("*" + shared_compiles.SUFFIX)
    with open(lock, "a") as other:  # as if another process were compiling it
        fcntl.flock(other, fcntl.LOCK_EX)
        # waiting on the lock would take WAIT_S (300 s), past _children's limit
        [again] = _children(tmp_path / "cache", 1, compile_s=30.0, start_in=0)
    assert again == {"value": 42, "misses": 0, "hits": 1}


def _locked_elsewhere(path: Path) -> bool:
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False


def test_a_process_killed_while_compiling_frees_the_kernel(tmp_path):
    cache = tmp_path / "cache"
    first = _start(cache, compile_s=120.0, at=0)  # would hold the lock two minutes
    try:
        deadline = time.monotonic() + 60
        while not [p for p in cache.rglob("*" + shared_compiles.SUFFIX) if _locked_elsewhere(p)]:
            assert first.poll() is None, first.communicate()[1]
            assert time.monotonic() < deadline, "the first process never took the lock"
            time.sleep(0.05)
        second = _start(cache, compile_s=1.0, at=0)
        time.sleep(2.0)  # started, and waiting on the lock
        assert second.poll() is None
    finally:
        first.kill()
        first.wait()
    # the lock died with the first process: no wait of WAIT_S (300 s)
    try:
        out, err = second.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        second.kill()
        raise AssertionError("the lock outlived the process that held it") from None
    assert second.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1]) == {"value": 42, "misses": 1, "hits": 0}


def test_a_lock_held_elsewhere_is_waited_for_then_given_up(tmp_path):
    path = tmp_path / "f.compile-lock"
    with open(path, "a") as other:  # another open file: flock conflicts as across processes
        fcntl.flock(other, fcntl.LOCK_EX)
        start = time.monotonic()
        assert shared_compiles.acquire(path, wait_s=0.4) is None
        assert 0.4 <= time.monotonic() - start < 5
        fcntl.flock(other, fcntl.LOCK_UN)
    lock = shared_compiles.acquire(path, wait_s=0.4)
    assert lock is not None
    assert shared_compiles.acquire(path, wait_s=0.4) is None  # held by this process
    lock.release()
    assert not shared_compiles._held
    shared_compiles.acquire(path, wait_s=0.4).release()


def test_a_folder_that_cannot_hold_the_lock_compiles_unlocked(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert shared_compiles.acquire(blocker / "sub" / "f.compile-lock", wait_s=5) is None


def test_a_dispatcher_without_disk_cache_is_left_alone():
    plain = numba.njit(lambda x: x + 1)
    assert shared_compiles.share_compiles(plain) is plain
    assert "compile" not in vars(plain)
    assert shared_compiles.lock_path(plain, (numba.int64,)) is None


@pytest.mark.parametrize("options", [{}, {"fastmath": True}])
def test_cached_njit_is_a_cached_njit_with_its_options(options):
    from kernels.numba_cpu import relu_backward

    kernel = relu_backward._relu_backward
    assert kernel._cache._cache_path and "compile" in vars(kernel)
    decorated = shared_compiles.cached_njit(**options)(lambda x: x)
    assert decorated.targetoptions.get("fastmath", False) == options.get("fastmath", False)


def test_a_lock_is_per_target(tmp_path):
    """The lock file names the kernel, its argument types and the process's
    target: processes compiling one kernel for two vector widths (the
    width's measurement) do not wait on each other."""
    code = ("import numba; from kernels import shared_compiles; "
            "from kernels.numba_cpu.gaussian import sfc64_raw; "
            "a = numba.types.Array(numba.uint64, 2, 'C'); "
            "print(shared_compiles.lock_path(sfc64_raw, (a, a)))")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CPU_FEATURES"}
    env.update(NUMBA_CACHE_DIR=str(tmp_path), MPIDP_NUMBA_TARGET_FILE="none")

    def path(width: str) -> str:
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                              text=True, timeout=120, env={**env, "MPIDP_VECTOR_WIDTH": width})
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    first, again, other = path("256"), path("256"), path("512")
    assert first == again and first.endswith(shared_compiles.SUFFIX)
    assert Path(first).parent == Path(other).parent
    if AVX512:
        assert first != other
    else:  # one target whatever the width asked for
        assert first == other
