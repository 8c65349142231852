"""Run the whole test suite: serial, then the MPI tests at 2, 3 and 4 ranks.

``make test`` calls this. Stages:

1. ``pytest --with-mpi``: every serial test, and every ``@pytest.mark.mpi``
   test on a single rank, spread over pytest-xdist workers (one per core, at
   most 4; ``--dist loadfile`` keeps a module's tests, and its module-scoped
   fixtures such as the throw-away Slurm cluster, in one worker; the modules
   go longest first by the stored run's times, :mod:`module_order`). Many of
   these tests wait on subprocesses, daemons and sockets, so two workers on
   two cores finish the stage in about 0.8 of the time of one.
2. For each N in ``--ranks`` (default 2,3,4): ``mpiexec -n N pytest --with-mpi
   -m mpi``; rank 0 reports, ranks > 0 run silently (the harness in
   ``conftest.py`` makes rank 0's verdict the verdict of all ranks).

Before them, the vector width Numba compiles for is measured, if this CPU
has none cached yet (:mod:`kernels.numba_target`), and printed.

Every stage has a wall-clock limit (``MPIEXEC_TIMEOUT`` and pytest-timeout),
so a hang fails with a message instead of blocking CI. Any stage failing
fails the command. The last line is the summary; ``--json FILE`` also writes
it, with the command, date, commit and machine (docs/results/test-suite.md).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"


def mpi_test_files() -> list[str]:
    """The test modules that hold MPI tests: the MPI stages collect only these
    (collecting every module costs each of the N ranks the imports of all of
    them)."""
    return [str(p) for p in sorted(TESTS.glob("test_*.py"))
            if "mark.mpi" in p.read_text(encoding="utf-8")]


def _pytest(junit: Path | None, extra: list[str], quiet_rank: bool = False,
            paths: list[str] | None = None) -> list[str]:
    argv = [sys.executable, "-m", "pytest", *(paths or [str(TESTS)]), "--with-mpi", "-p",
            "no:cacheprovider", "--timeout=900", "--timeout-method=thread", *extra]
    if quiet_rank:
        argv += ["-p", "no:terminal"]
    elif junit is not None:
        argv += [f"--junitxml={junit}", "-o", "junit_family=xunit2"]
    return argv


def default_workers() -> int:
    """pytest-xdist workers for stage 1: one per usable core, at most 4; 0 (one
    process) on one core or without pytest-xdist."""
    try:
        import xdist  # noqa: F401  (the test extra installs it)
    except ImportError:
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return min(4, cores or 1) if (cores or 1) > 1 else 0


def _counts(junit: Path) -> dict[str, int]:
    try:
        root = ET.parse(junit).getroot()
    except (OSError, ET.ParseError):
        return {}
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    keys = ("tests", "failures", "errors", "skipped")
    return {k: int(suite.get(k, 0)) for k in keys} if suite is not None else {}


def slowest(junits: list[tuple[str, Path]], count: int = 12) -> list[dict]:
    """The ``count`` slowest test runs over the stages' junit files: stage,
    test id and seconds, slowest first (where the suite's time goes)."""
    runs = []
    for stage, junit in junits:
        try:
            cases = ET.parse(junit).getroot().iter("testcase")
        except (OSError, ET.ParseError):
            continue
        runs += [{"stage": stage, "test": f"{c.get('classname', '')}::{c.get('name', '')}",
                  "seconds": round(float(c.get("time", 0) or 0), 1)} for c in cases]
    return sorted(runs, key=lambda r: -r["seconds"])[:count]


def compiled_modules_kept(env: dict) -> dict[str, str]:
    """Environment for the stages under which Python keeps what it compiles.

    With ``PYTHONDONTWRITEBYTECODE`` set (some images set it), every process
    compiles the project's modules again and pytest rewrites every test
    module again: 2-3 s per pytest process, and the stages start dozens. The
    suite lets its processes write bytecode where Python normally does (the
    ``__pycache__`` folders beside the sources, ignored by git). A cache
    folder of its own (``PYTHONPYCACHEPREFIX``) would not do: Python then
    looks for no bytecode elsewhere, so the first process would compile
    torch and every other installed package again."""
    return {"PYTHONDONTWRITEBYTECODE": ""} if env.get("PYTHONDONTWRITEBYTECODE") else {}


def _mpiexec() -> str:
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else "mpiexec"


def run_stage(name: str, argv: list[str], timeout: int, env: dict) -> tuple[int, float]:
    print(f"\n=== {name} ===\n$ {' '.join(argv)}", flush=True)
    start = time.monotonic()
    try:
        code = subprocess.run(argv, env=env, timeout=timeout + 30).returncode
    except subprocess.TimeoutExpired:
        print(f"*** {name}: no result after {timeout + 30} s: killed (a hang?)", flush=True)
        code = 124
    if code == 255 and env.get("MPIEXEC_TIMEOUT"):
        print(f"*** {name}: mpiexec exit 255 (MPIEXEC_TIMEOUT={env['MPIEXEC_TIMEOUT']} s "
              "reached, or a rank was killed)", flush=True)
    return code, time.monotonic() - start


def summary(results: list[tuple[str, int, float, dict]]) -> dict:
    """The stages as a JSON document: name, exit code, seconds and junit counts
    of each, whether all passed, the test runs (run, not skipped) and the time."""
    return {"stages": [{"stage": name, "exit_code": code, "seconds": round(secs, 1), **counts}
                       for name, code, secs, counts in results],
            "passed": all(code == 0 for _, code, _, _ in results),
            "test_runs": sum(c.get("tests", 0) - c.get("skipped", 0) for *_, c in results),
            "seconds": round(sum(r[2] for r in results), 1)}


def module_seconds(junit: Path) -> dict[str, float]:
    """Module path -> seconds its tests took in a stage's junit file (what
    :mod:`module_order` schedules the serial stage by), longest first."""
    try:
        cases = list(ET.parse(junit).getroot().iter("testcase"))
    except (OSError, ET.ParseError):
        return {}
    times: dict[str, float] = {}
    for case in cases:
        name = case.get("classname", "").replace(".", "/") + ".py"
        times[name] = times.get(name, 0.0) + float(case.get("time", 0) or 0)
    return {k: round(v, 1) for k, v in sorted(times.items(), key=lambda kv: -kv[1])}


def write_summary(path: str, results: list, slow: list[dict], modules: dict[str, float]
                  ) -> None:
    from collectives import machine  # deferred: MPI, only once the stages have run

    doc = {**summary(results), "slowest": slow, "module_seconds": modules,
           "provenance": machine.provenance(ranks=1)}
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,3,4",
                        help="rank counts for the MPI stages (default: 2,3,4)")
    # A hang guard, not a speed goal: the serial stage takes about 7 minutes on
    # a quick 2-core machine and may take 2-3x that on a slow one.
    parser.add_argument("--stage-timeout", type=int, default=2400,
                        help="seconds allowed per stage (default: 2400)")
    parser.add_argument("--no-serial", action="store_true", help="skip stage 1")
    parser.add_argument("--workers", type=int, default=None,
                        help="pytest-xdist workers for stage 1 (default: one per core, at "
                             "most 4; 0 runs it in one process)")
    parser.add_argument("--json", metavar="FILE", default=None,
                        help="also write the summary, with the command, date, commit and "
                             "machine, as JSON")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args()
    if args.json and not Path(args.json).resolve().parent.is_dir():
        parser.error(f"--json {args.json}: no such folder")

    env = dict(os.environ)
    env.setdefault("NUMBA_CACHE_DIR", str(ROOT / ".numba_cache"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(compiled_modules_kept(env))
    # Numba's vector width, measured once per CPU (kernels.numba_target): here,
    # before the stages, so that no test's time limit pays for it.
    start = time.perf_counter()
    target = subprocess.run([sys.executable, "-m", "kernels.numba_target"], env=env,
                            cwd=ROOT, capture_output=True, text=True)
    print(f"{(target.stdout or target.stderr).strip()} "
          f"[{time.perf_counter() - start:.1f} s]", flush=True)
    results, junits = [], []
    with tempfile.TemporaryDirectory(prefix="mpidp-tests-") as tmp:
        # Privacy figures (engine.dp.figure_cache) shared by every stage's runs,
        # not the host's: a test's run reuses what an earlier one computed.
        env["MPIDP_PRIVACY_CACHE_FILE"] = str(Path(tmp) / "privacy-figures.json")
        if not args.no_serial:
            junit = Path(tmp) / "serial.xml"
            workers = default_workers() if args.workers is None else args.workers
            # in collection order, which conftest makes longest module first
            spread = (["-n", str(workers), "--dist", "loadfile", "--no-loadscope-reorder"]
                      if workers > 0 else [])
            code, secs = run_stage(f"serial tests + MPI tests on 1 rank ({workers or 1} "
                                   f"process{'es' if workers > 1 else ''})",
                                   _pytest(junit, [*spread, *args.pytest_args]),
                                   args.stage_timeout, env)
            results.append(("1 rank (serial)", code, secs, _counts(junit)))
            junits.append(("1 rank (serial)", junit))
        for n in [int(x) for x in args.ranks.split(",") if x.strip()]:
            junit = Path(tmp) / f"mpi{n}.xml"
            stage_env = dict(env, MPIEXEC_TIMEOUT=str(args.stage_timeout))
            mpi_args = ["-m", "mpi", *args.pytest_args]
            files = mpi_test_files()
            argv = [_mpiexec(), "-n", "1", *_pytest(junit, mpi_args, paths=files)]
            if n > 1:
                argv += [":", "-n", str(n - 1),
                         *_pytest(None, mpi_args, quiet_rank=True, paths=files)]
            code, secs = run_stage(f"MPI tests on {n} ranks", argv, args.stage_timeout,
                                   stage_env)
            results.append((f"{n} ranks", code, secs, _counts(junit)))
            junits.append((f"{n} ranks", junit))
        slow = slowest(junits)
        modules = module_seconds(Path(tmp) / "serial.xml")

    if slow:
        print("\n=== slowest test runs ===")
        for run in slow:
            print(f"{run['seconds']:>7.1f}s  {run['stage']:<16} {run['test']}")

    print("\n=== summary ===")
    print(f"{'stage':<16} {'result':<7} {'tests':>6} {'failed':>7} {'skipped':>8} {'time':>8}")
    for name, code, secs, counts in results:
        failed = counts.get("failures", 0) + counts.get("errors", 0)
        verdict = "ok" if code == 0 else f"FAIL({code})"
        print(f"{name:<16} {verdict:<7} {counts.get('tests', '?'):>6} {failed:>7} "
              f"{counts.get('skipped', '?'):>8} {secs:>7.1f}s")
    if args.json:
        write_summary(args.json, results, slow, modules)
    bad = [name for name, code, *_ in results if code != 0]
    total = sum(r[2] for r in results)
    ran = sum(r[3].get("tests", 0) - r[3].get("skipped", 0) for r in results)
    if bad:
        print(f"mpidp test suite: FAILED in {', '.join(bad)} ({total:.0f} s)")
        return 1
    print(f"mpidp test suite: PASSED, {ran} test runs in {len(results)} stages ({total:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
