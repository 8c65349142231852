"""The MPI test harness (conftest.py) turns one rank's failure into a failed,
finished job: never a hang, never a green run."""
import subprocess
import sys
import time

from launcher import SCRIPTS, clean_env, mpiexec_path

CASES = str(SCRIPTS / "harness_cases.py")


def _pytest_under_mpi(n, case, sync_timeout="5"):
    """As run_suite.py does it: rank 0 reports, ranks > 0 are silent."""
    pytest = [sys.executable, "-m", "pytest", CASES, "--with-mpi", "-k", case,
              "-p", "no:cacheprovider"]
    argv = [mpiexec_path(), "-n", "1", *pytest, "-q", ":", "-n", str(n - 1), *pytest,
            "-p", "no:terminal"]
    env = clean_env(MPIDP_TEST_SYNC_TIMEOUT=sync_timeout, MPIEXEC_TIMEOUT="80")
    start = time.monotonic()
    result = subprocess.run(argv, capture_output=True, text=True, timeout=90, env=env)
    return result, time.monotonic() - start


def test_failure_before_collective_ends_the_job():
    result, elapsed = _pytest_under_mpi(3, "before_collective")
    assert result.returncode != 0
    assert elapsed < 30
    assert "[rank 1]" in result.stderr and "rank 1 fails before the barrier" in result.stderr


def test_failure_on_one_rank_is_rank_zeros_failure():
    result, _ = _pytest_under_mpi(2, "fails_alone or passes")
    assert result.returncode != 0
    assert "1 failed, 1 passed" in result.stdout  # rank 0's summary tells the truth
    assert "only rank 1 fails" in result.stderr


def test_passing_run_passes():
    result, _ = _pytest_under_mpi(3, "passes")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_serial_stage_takes_one_worker_per_core_up_to_four(monkeypatch):
    import run_suite

    for cores, workers in ((1, 0), (2, 2), (3, 3), (16, 4)):
        monkeypatch.setattr(run_suite.os, "sched_getaffinity", lambda pid, c=cores: set(range(c)))
        assert run_suite.default_workers() == workers
    monkeypatch.setitem(sys.modules, "xdist", None)  # not installed: one process
    assert run_suite.default_workers() == 0


def test_the_suites_summary_as_json(tmp_path, monkeypatch):
    """``run_suite.py --json``: every stage with its counts and time, the test runs
    that ran (skips not counted), and how the run was made."""
    import json

    import run_suite
    results = [("1 rank (serial)", 0, 10.04, {"tests": 5, "failures": 0, "errors": 0,
                                               "skipped": 1}),
               ("2 ranks", 1, 2.5, {"tests": 3, "failures": 1, "errors": 0, "skipped": 0})]
    monkeypatch.setattr(run_suite.sys, "argv", [str(run_suite.ROOT / "tests/run_suite.py"),
                                                "--ranks", "2"])
    slow = [{"stage": "2 ranks", "test": "tests.test_x::test_y", "seconds": 2.0}]
    modules = {"tests/test_x.py": 8.0, "tests/test_w.py": 2.0}
    run_suite.write_summary(str(tmp_path / "s.json"), results, slow, modules)
    doc = json.loads((tmp_path / "s.json").read_text())
    assert doc["slowest"] == slow and doc["module_seconds"] == modules
    assert doc["stages"][0] == {"stage": "1 rank (serial)", "exit_code": 0, "seconds": 10.0,
                                "tests": 5, "failures": 0, "errors": 0, "skipped": 1}
    assert doc["passed"] is False and doc["test_runs"] == 7 and doc["seconds"] == 12.5
    assert doc["provenance"]["command"] == "python tests/run_suite.py --ranks 2"


def test_the_slowest_test_runs_come_from_every_stages_junit_file(tmp_path):
    """``slowest``: the test runs of all stages' junit files, slowest first, cut
    to the count asked; a stage whose file is missing or broken adds none."""
    import run_suite

    def junit(name, times):
        cases = "".join(f'<testcase classname="tests.test_m" name="t{i}" time="{t}"/>'
                        for i, t in enumerate(times))
        (tmp_path / name).write_text(f'<testsuites><testsuite tests="{len(times)}">{cases}'
                                     '</testsuite></testsuites>')
        return tmp_path / name

    (tmp_path / "broken.xml").write_text("<testsuites><testsuite")
    runs = run_suite.slowest([("1 rank (serial)", junit("s.xml", [0.5, 9.04, 3])),
                              ("2 ranks", junit("m.xml", [4.0])),
                              ("3 ranks", tmp_path / "broken.xml"),
                              ("4 ranks", tmp_path / "missing.xml")], count=3)
    assert runs == [{"stage": "1 rank (serial)", "test": "tests.test_m::t1", "seconds": 9.0},
                    {"stage": "2 ranks", "test": "tests.test_m::t0", "seconds": 4.0},
                    {"stage": "1 rank (serial)", "test": "tests.test_m::t2", "seconds": 3.0}]


def test_the_serial_stage_runs_the_stored_longest_modules_first(tmp_path):
    """``module_seconds`` of a stage's junit file, summed per module, is what
    the next run's xdist workers order the modules by: longest first, new
    modules after them in collection order, each module's tests together and
    in their order."""
    import json

    import run_suite
    from module_order import longest_first, stored_seconds

    cases = [("tests.test_a", 1.0), ("tests.test_b", 30.0), ("tests.test_a", 2.5),
             ("tests.test_c", 9.0)]
    (tmp_path / "s.xml").write_text("<testsuites><testsuite>" + "".join(
        f'<testcase classname="{c}" name="t{i}" time="{t}"/>' for i, (c, t) in
        enumerate(cases)) + "</testsuite></testsuites>")
    seconds = run_suite.module_seconds(tmp_path / "s.xml")
    assert list(seconds.items()) == [("tests/test_b.py", 30.0), ("tests/test_c.py", 9.0),
                                     ("tests/test_a.py", 3.5)]
    (tmp_path / "suite.json").write_text(json.dumps({"module_seconds": seconds}))
    assert stored_seconds(tmp_path / "suite.json") == seconds
    assert stored_seconds(tmp_path / "missing.json") == {}
    items = ["tests/test_new.py::x", "tests/test_a.py::one", "tests/test_c.py::y",
             "tests/test_a.py::two", "tests/test_b.py::z[1]", "tests/test_b.py::z[2]",
             "tests/test_old.py::w"]
    assert longest_first(items, seconds, nodeid=str) == [
        "tests/test_b.py::z[1]", "tests/test_b.py::z[2]", "tests/test_c.py::y",
        "tests/test_a.py::one", "tests/test_a.py::two", "tests/test_new.py::x",
        "tests/test_old.py::w"]


def test_the_stages_keep_compiled_modules_even_where_the_image_says_not_to():
    """PYTHONDONTWRITEBYTECODE set: the stages run with it empty (Python's "not
    set"), so each process reuses the bytecode and pytest's rewritten test
    modules of the ones before; unset: nothing is changed."""
    import run_suite

    assert run_suite.compiled_modules_kept({"PYTHONDONTWRITEBYTECODE": "1"}) == \
        {"PYTHONDONTWRITEBYTECODE": ""}
    assert run_suite.compiled_modules_kept({}) == {}
    assert run_suite.compiled_modules_kept({"PYTHONDONTWRITEBYTECODE": ""}) == {}
