"""A failing rank must end the whole MPI job promptly (engine.spmd)."""
import sys
import time

import pytest

from launcher import SCRIPTS, run_mpi

SCRIPT = str(SCRIPTS / "fail_on_rank.py")


def test_crash_on_one_rank_aborts_the_job_quickly():
    start = time.monotonic()
    result = run_mpi(3, [sys.executable, SCRIPT, "crash", "1"], timeout=60)
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert elapsed < 30, f"the job took {elapsed:.1f} s to end"
    # The traceback is printed once, tagged with the failing rank.
    assert result.stderr.count("ZeroDivisionError: deliberate failure") == 1
    assert "[rank 1] Traceback (most recent call last):" in result.stderr
    assert "[rank 0] Traceback" not in result.stderr


def test_user_error_on_one_rank_prints_one_line_and_aborts():
    result = run_mpi(3, [sys.executable, SCRIPT, "user", "2"], timeout=60)
    assert result.returncode != 0
    assert "[rank 2] mpidp: error: deliberate bad input on one rank" in result.stderr
    assert "Traceback" not in result.stderr


def test_collective_user_error_is_printed_once_with_its_exit_code():
    result = run_mpi(3, [sys.executable, SCRIPT, "collective", "0"], timeout=60)
    assert result.returncode == 2
    assert result.stderr.count("mpidp: error: the same bad input on every rank") == 1
    assert "Traceback" not in result.stderr


def test_single_rank_failure_exits_with_code_and_traceback():
    result = run_mpi(1, [sys.executable, SCRIPT, "crash", "0"], timeout=60)
    assert result.returncode == 1
    assert "ZeroDivisionError" in result.stderr
    assert "[rank" not in result.stderr  # no tag when there is one rank


def test_run_spmd_returns_main_exit_code():
    from engine.spmd import run_spmd

    assert run_spmd(lambda: None) == 0
    assert run_spmd(lambda: 0) == 0
    with pytest.raises(SystemExit) as raised:
        run_spmd(lambda: sys.exit(3))
    assert raised.value.code == 3


@pytest.mark.parametrize("refusal", [
    MemoryError("Unable to allocate 48.1 GiB for an array with shape (12900017409,) and "
                "data type float32"),
    RuntimeError("[enforce fail at alloc_cpu.cpp:119] data. DefaultCPUAllocator: can't "
                 "allocate memory: you tried to allocate 51600069636 bytes. Error code 12 "
                 "(Cannot allocate memory)"),
])
def test_a_refused_allocation_is_one_line_and_its_own_exit_code(refusal, capsys):
    """A model or batch too large for the machine (``--hidden 100000,100000``, a
    file whose n_classes is 10^8) is the user's to change: one line, exit 71."""
    from engine.errors import EXIT_OUT_OF_MEMORY
    from engine.spmd import run_spmd

    def main():
        raise refusal

    with pytest.raises(SystemExit) as raised:
        run_spmd(main)
    assert raised.value.code == EXIT_OUT_OF_MEMORY == 71
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("mpidp: error: out of memory (") and "too large for this machine" in err
    assert str(refusal).split()[1] in err  # numpy's or torch's own words, kept


def test_other_runtime_errors_stay_internal_errors():
    from engine.errors import out_of_memory

    assert out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
    assert out_of_memory(ValueError("out of memory")) is None
    assert out_of_memory(MemoryError()).exit_code == 71


def test_only_the_first_rank_of_a_node_reports_a_stop(tmp_path, monkeypatch):
    """Ranks of one launch share a parent: the first to create the parent's
    marker prints the stop line, the others (same parent) do not."""
    from engine import spmd

    monkeypatch.setattr(spmd, "STOP_MARKER", str(tmp_path / "stop-{ppid}-{start}"))
    assert spmd._first_to_say_so(rank=1) is True
    assert spmd._first_to_say_so(rank=0) is False
    assert len(list(tmp_path.iterdir())) == 1


@pytest.mark.parametrize("fail_rank", [0, 2])
def test_interrupt_while_the_others_wait_in_mpi_is_exit_130_every_time(fail_rank):
    """The ranks still inside MPI are ended by the launcher. When the stopped
    rank left on its own (``os._exit``), mpiexec reported one of those killed
    ranks instead (exit 9, SIGKILL): this test failed on its first run."""
    for _ in range(3):
        result = run_mpi(3, [sys.executable, SCRIPT, "interrupt", str(fail_rank)], timeout=60)
        assert result.returncode == 130, result.stdout + result.stderr
        assert result.stderr.strip().splitlines() == ["mpidp: stopped by SIGINT (exit code 130)"]


@pytest.mark.parametrize("ranks,fail_rank", [(1, 0), (3, 1)])
def test_an_interrupt_swallowed_by_native_code_is_still_the_stop(ranks, fail_rank):
    """A SIGINT raised inside a call back from native code (polars reading a CSV
    block) was swallowed there ("Exception ignored", with a traceback) and the
    native code failed with a TypeError of its own, printed as an internal
    error with its traceback: the error is the stop, one line, exit 130."""
    result = run_mpi(ranks, [sys.executable, SCRIPT, "swallowed", str(fail_rank)], timeout=60)
    assert result.returncode == 130, result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == ["mpidp: stopped by SIGINT (exit code 130)"]


class _SlowBarrier:
    """A communicator of 3 whose barrier completes at its ``after``-th test."""

    def __init__(self, after: int):
        self.after, self.tests = after, 0

    def Get_size(self):
        return 3

    def Ibarrier(self):
        return self

    def Test(self):
        self.tests += 1
        return self.tests >= self.after


def test_the_entry_check_names_an_ended_peer_and_says_when_it_waits(monkeypatch, capsys,
                                                                    tmp_path):
    """collectives.core.ended.wait_for_peers polls its barrier: an ended
    peer's mark (in a folder of this test) is a PeerEnded naming it; a long
    wait is one line on stderr, and the wait goes on."""
    from collectives.core import ended
    from collectives.errors import PeerEnded
    from engine import entry

    monkeypatch.setattr(ended, "SHM", str(tmp_path))
    monkeypatch.setattr(ended, "_world_ranks", lambda comm: [1, 2])
    entry.wait_for_peers(_SlowBarrier(after=40), notice_s=0.0)
    assert capsys.readouterr().err.count(
        "mpidp: engine.train() has waited 0 s for the other ranks of its communicator to "
        "call it; every rank must call it (still waiting)") == 1
    ended.mark_ended(2)
    assert ended.ended([0, 1, 2]) == [2]
    # a peer that made the call and ended just after: its part of the barrier
    # comes in within the grace period, and that is no error
    late = _SlowBarrier(after=5)
    entry.wait_for_peers(late)
    assert late.tests >= 5
    with pytest.raises(PeerEnded, match=r"^engine.train\(\): the program of world "
                       r"rank 2 ended without making its call number \d+ here"):
        entry.wait_for_peers(_SlowBarrier(after=10**9))
