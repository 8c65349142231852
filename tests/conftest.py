"""pytest set-up shared by every test, and the MPI harness.

Under ``mpiexec -n N python -m pytest --with-mpi -m mpi`` every rank runs the
same tests in the same order. Three things make that safe:

* After each test, the ranks agree on its outcome over a private
  communicator (a duplicate of COMM_WORLD, so the agreement never matches a
  collective of the test itself). Rank 0 reports a test as failed when any
  rank failed it, and a failing rank prints its own failure, tagged.
* If the agreement does not complete within ``MPIDP_TEST_SYNC_TIMEOUT``
  seconds (default 20), some rank is stuck in a collective its failed peer
  never reached: the failing rank prints its failure and aborts the job, so
  mpiexec exits non-zero instead of hanging.
* At the end the ranks combine their exit statuses, so rank 0's summary line
  and exit code are the truth for the whole job.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

# auto's tunings of other runs would change what the tests' calls run.
os.environ.setdefault("MPIDP_ALLREDUCE_TUNING_FILE", "none")
# Nor may a test's run mark this machine warm, or say it is not (engine.warmup).
os.environ.setdefault("MPIDP_WARM_FILE", "none")
# Nor may the host's privacy figures answer a test (tests/run_suite.py gives
# the suite a file of its own, which its runs share).
os.environ.setdefault("MPIDP_PRIVACY_CACHE_FILE", "none")
# tools/as_avx2.sh runs the suite with AVX2 code; its MPIDP_ISA_LIMIT only
# relabels the machine facts, which the tests pin themselves (the code it
# asks for, through NUMBA_CPU_FEATURES and the rest, stays in force).
os.environ.pop("MPIDP_ISA_LIMIT", None)

# MPI must be configured before anything (pytest-mpi included) imports mpi4py.
from collectives.runtime import MPI
import collectives

# In-process tests check which ranks raise which error; the job-ending
# default (collectives.core.failures, rule 4) is tested with user programs under
# mpiexec (tests/test_collectives_failures.py).
collectives.abort_on_error(False)
from engine.spmd import ABORT_GRACE_S

# Property tests draw the same examples on every run (and every rank), so a
# CI failure is reproducible and no run passes by luck where another fails.
# HYPOTHESIS_PROFILE=explore draws fresh random examples, to hunt for new ones.
from hypothesis import settings as _hypothesis_settings  # noqa: E402

_hypothesis_settings.register_profile("deterministic", derandomize=True, database=None)
_hypothesis_settings.register_profile("explore", derandomize=False)
_hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))

_SYNC_TIMEOUT = float(os.environ.get("MPIDP_TEST_SYNC_TIMEOUT", "20"))
_harness: "_MpiHarness | None" = None


class _MpiHarness:
    """Keeps the ranks of an MPI test run in agreement (see module docstring)."""

    def __init__(self) -> None:
        self.comm = MPI.COMM_WORLD.Dup()
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.item_failed = False
        self.failure_text = ""

    def agree(self, value: int, failed: bool, what: str, detail: str = "") -> int:
        """Sum ``value`` over the ranks. A rank that ``failed`` gives up after
        the timeout and aborts the job; the others wait (a genuine hang is
        caught by pytest-timeout or MPIEXEC_TIMEOUT)."""
        send = np.array([value], dtype=np.int64)
        recv = send.copy()
        request = self.comm.Iallreduce(send, recv, op=MPI.SUM)
        deadline = time.monotonic() + _SYNC_TIMEOUT
        while not request.Test():
            if failed and time.monotonic() > deadline:
                self.emit(f"{what}: failed here, and the other ranks did not finish "
                          f"within {_SYNC_TIMEOUT:.0f} s (blocked in a collective this "
                          f"rank never reached); aborting the job.\n{detail}")
                time.sleep(ABORT_GRACE_S)  # let the launcher forward the message
                MPI.COMM_WORLD.Abort(1)
            time.sleep(0.0005)
        return int(recv[0])

    def emit(self, text: str) -> None:
        prefix = f"[rank {self.rank}] "
        sys.stderr.write("".join(prefix + line for line in text.splitlines(True)) + "\n")
        sys.stderr.flush()

    def end_of_test(self, item, report) -> None:
        failures = self.agree(int(self.item_failed), self.item_failed, item.nodeid,
                              self.failure_text)
        if self.item_failed and self.rank != 0:
            self.emit(f"FAILED {item.nodeid}\n{self.failure_text}")
        if failures and not self.item_failed and self.rank == 0:
            report.outcome = "failed"
            report.longrepr = (f"{failures} of {self.size} ranks failed this test; each "
                               "printed its failure on stderr, tagged [rank N]")
        self.item_failed = False


def pytest_configure(config):
    global _harness
    config.addinivalue_line("markers", "mpi(min_size=N): test that runs on N+ MPI ranks")
    config.addinivalue_line("markers", "slow: takes more than a few seconds")
    config.addinivalue_line("markers", "gpu: needs a real CUDA GPU (make test-gpu)")
    config.addinivalue_line("markers", "long: minutes each (Slurm time limits, every requeue "
                            "variant); run with MPIDP_LONG_TESTS=1 (make test-long)")
    if MPI.COMM_WORLD.Get_size() > 1:
        _harness = _MpiHarness()


def pytest_collection_modifyitems(config, items):
    """Tests marked long run only with MPIDP_LONG_TESTS=1: `make test` stays
    within its few minutes on 2 cores; `make test-long` runs them all. Under
    pytest-xdist (the serial stage) the modules go longest first
    (:mod:`module_order`)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        from module_order import longest_first, stored_seconds

        items[:] = longest_first(items, stored_seconds())
    if os.environ.get("MPIDP_LONG_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="long: set MPIDP_LONG_TESTS=1 (make test-long)")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    if _harness is None:
        return
    count = len(session.items)
    total = _harness.agree(count, session.testsfailed > 0, "collection")
    if total != count * _harness.size:
        _harness.emit(f"collected {count} tests but the ranks disagree (total {total} "
                      f"over {_harness.size} ranks); a rank failed to import a test "
                      "module. Aborting.")
        time.sleep(ABORT_GRACE_S)
        MPI.COMM_WORLD.Abort(1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if _harness is None:
        return
    report = outcome.get_result()
    if report.failed:
        _harness.item_failed = True
        _harness.failure_text = str(report.longrepr)
    # Exactly one agreement per test on every rank: after the call, or after
    # the setup when the setup failed (then there is no call phase).
    if report.when == "call" or (report.when == "setup" and report.failed):
        _harness.end_of_test(item, report)


def pytest_sessionfinish(session, exitstatus):
    if _harness is None:
        return
    status = int(exitstatus not in (0, 5))
    failed = _harness.agree(status, bool(status), "session end")
    if failed and session.exitstatus in (0, 5):
        session.exitstatus = 1


@pytest.fixture
def comm():
    """COMM_WORLD (tests marked ``mpi`` run on every rank of it)."""
    return MPI.COMM_WORLD


@pytest.fixture
def shared_tmp(tmp_path_factory, comm):
    """A fresh directory that every rank sees (rank 0 creates it)."""
    path = str(tmp_path_factory.mktemp("shared")) if comm.Get_rank() == 0 else None
    return Path(comm.bcast(path, root=0))


@pytest.fixture
def threads_restored():
    """Leave torch's and Numba's thread counts as they were (a test that runs
    configure_threads changes them for the rest of its worker)."""
    import numba  # deferred: the fixture's users import them anyway
    import torch

    before = torch.get_num_threads(), numba.get_num_threads()
    yield
    torch.set_num_threads(before[0])
    numba.set_num_threads(before[1])
