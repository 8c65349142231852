"""Failure modes of collectives.allreduce in a user's own mpi4py program.

Each test starts a user-style program (tests/scripts/user_allreduce.py,
tests/scripts/fuzz_allreduce.py) under mpiexec with a timeout, so a hang is a
failure and not a stuck suite, and reads its exit code and output. The rules
checked are those of :mod:`collectives.core.failures`: an error seen by some ranks
ends the job promptly (exit code 2, the error printed); an error seen by
every rank alike is raised everywhere; never a hang, a crash or a wrong
number.
"""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from launcher import SCRIPTS, run_mpi

USER = str(SCRIPTS / "user_allreduce.py")
FUZZ = str(SCRIPTS / "fuzz_allreduce.py")
ALGORITHMS = ["naive", "recursive_doubling", "ring", "rabenseifner", "native", "auto"]
LONG = pytest.mark.long  # the same rule at one more rank count: make test-long


def cases(first: list, more: list) -> list:
    """``first`` in every suite, ``more`` (the same checks at more rank counts
    or algorithms) only in ``make test-long``."""
    return [*first, *(pytest.param(*c if isinstance(c, tuple) else (c,), marks=LONG)
                      for c in more)]
#: A job that fails must end within this many seconds (start-up included).
PROMPT_S = 20


def run(n: int, *argv: str, mpi4py: bool = False) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    prefix = [sys.executable, "-m", "mpi4py"] if mpi4py else [sys.executable]
    try:
        result = run_mpi(n, [*prefix, *argv], timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"mpiexec -n {n} {' '.join(argv)}: no exit within 60 s (a hang)")
    return result, time.monotonic() - start


def count(text: str, marker: str) -> int:
    return text.count(marker)


@pytest.mark.parametrize("algorithm, n", cases([(a, 2) for a in ALGORITHMS] + [("native", 4)],
                                               [(a, 4) for a in ALGORITHMS if a != "native"]))
def test_a_rank_failing_after_an_allreduce_ends_the_job(algorithm, n):
    """Rank 1 raises its own ValueError after one all-reduce while the others
    wait in a barrier: under python -m mpi4py the job ends as a plain mpi4py
    program does (nothing collective happens at exit)."""
    result, seconds = run(n, USER, "raise-after", algorithm, mpi4py=True)
    assert result.returncode != 0
    assert "ValueError: an ordinary bug" in result.stderr
    assert seconds < PROMPT_S, f"took {seconds:.1f} s"


@pytest.mark.parametrize("algorithm, n", cases(
    [(a, 3) for a in ("recursive_doubling", "rabenseifner", "ring", "naive", "auto")]
    + [("auto", 4)], [(a, 4) for a in ("recursive_doubling", "rabenseifner", "ring", "naive")]))
def test_checked_signatures_called_out_of_order_end_the_job(algorithm, n):
    """Rank 0 calls two checked signatures in the other order: the ranks that
    see it print the mismatch and the job ends (no rank is left waiting)."""
    result, seconds = run(n, USER, "swap", algorithm)
    out = result.stdout + result.stderr
    assert count(out, "WRONG") == 0
    assert seconds < PROMPT_S
    if algorithm == "auto" and "Message truncated" in out:
        # auto tried MPI_Allreduce on this call (its tuning explores every
        # candidate): MPICH itself ends the job on different byte counts.
        assert result.returncode != 0
        return
    assert result.returncode == 2, out[-2000:]
    assert "AllreduceMismatch" in result.stderr and "same sequence of calls" in result.stderr
    assert "ending the job" in result.stderr


@pytest.mark.parametrize("algorithm", ["native", "auto"])
@pytest.mark.parametrize("n", [2, 3])
def test_equal_byte_counts_out_of_order_raise_on_every_rank(algorithm, n):
    """float32[16] and int32[16] in the other order: MPI_Allreduce cannot tell
    them apart; the order check after the call raises on every rank
    (collective, caught by the program), never a wrong number, and the
    buffer is wiped (NaN, or 0 for integers) instead of holding the other
    rank's bits."""
    result, _ = run(n, USER, "swap-same-bytes", algorithm)
    out = result.stdout + result.stderr
    assert count(out, "WRONG") == 0
    if result.returncode == 0:
        assert count(out, "COLLECTIVE-ERROR") == n, out
        assert "in a different order" in out
        assert count(out, "WIPED rank") == n and "NOT-WIPED" not in out, out
    else:  # auto ran a schedule: the detecting ranks end the job
        assert result.returncode == 2 and "AllreduceMismatch" in result.stderr, out[-2000:]


@pytest.mark.parametrize("n, algorithm", [(2, "ring"), (2, "native"), (2, "naive"),
                                          (3, "auto")])
def test_a_skipped_call_ends_the_job_when_the_rank_that_skipped_it_ends(n, algorithm):
    """Rank 1 skips one of ten calls of one signature. Nothing tells two calls
    of a signature apart (nor does MPI), so the sums after the skip mix calls
    (docs/collectives.md says so); but the others' last call, which rank 1
    never makes, must not wait for ever: the job ends with the mismatch."""
    result, seconds = run(n, USER, "skip", algorithm)
    assert result.returncode == 2, (result.stdout + result.stderr)[-2000:]
    assert "one rank made more allreduce calls than another" in result.stderr \
        or "rank 1 is gone from this communicator (its program is ending)" in result.stderr \
        or "which never made this call (its program is ending)" in result.stderr, \
        result.stderr[-2000:]
    assert "ending the job" in result.stderr
    assert seconds < PROMPT_S, f"took {seconds:.1f} s"


def test_a_stop_midway_while_a_peer_stays_in_mpi_allreduce_ends_the_job():
    """Ranks 0 and 2 leave the third call with KeyboardInterrupt as it completes;
    rank 1 waits inside MPI_Allreduce of a fourth, which no mark reaches. The
    exiting ranks skipped the exit check (their call had failed), so the job
    waited for ever (seen under Ctrl-C at 4 ranks, 3 runs in 20)."""
    result, seconds = run(3, USER, "stopped-midway")
    assert result.returncode == 130, result.stdout + result.stderr
    assert "KeyboardInterrupt on rank" in result.stderr
    assert "in the middle of an allreduce, while a peer is still inside it" in result.stderr
    assert "DONE" not in result.stdout and seconds < PROMPT_S, f"took {seconds:.1f} s"


@pytest.mark.parametrize("abort", [True, False], ids=["abort", "abort-off"])
def test_a_rank_failing_between_calls_never_leaves_its_peers_in_mpi_allreduce(abort):
    """Rank 1 raises its own error (uncaught, no -m mpi4py) between two
    calls; the others then enter a native call on a second communicator,
    rank 0 at once and rank 2 after rank 1's exit check. Rank 1 checked its
    peers once and went on to MPI_Finalize, leaving them inside
    MPI_Allreduce for ever. Now it ends the job (rule 6); with abort off it
    watches until they leave and releases them from MPI_Allreduce: they
    raise, and the job ends with rank 1's exit code."""
    scenario = "fail-between" if abort else "fail-between-abort-off"
    # 3 ranks with abort off: one peer enters before rank 1's exit, one after
    result, seconds = run(2 if abort else 3, USER, scenario, "native")
    out = result.stdout + result.stderr
    assert result.returncode == 1, out[-2000:]
    assert "RuntimeError: an ordinary bug of the user's, on rank 1" in result.stderr
    assert seconds < PROMPT_S, f"took {seconds:.1f} s"
    if abort:
        assert "[rank 1] RuntimeError: an ordinary bug of the user's, on rank 1" \
            in result.stderr and "[rank 1] collectives: this rank's program failed; ending " \
            "the job" in result.stderr, out[-2000:]
        assert "DONE" not in result.stdout
        return
    for peer in (0, 2):
        assert f"CAUGHT rank {peer}: rank {peer}: allreduce of float32[1000] sum" in out, out
        assert f"DONE rank {peer}" in result.stdout, out
    assert count(out, "waited in MPI_Allreduce for rank 1, which never made this call (its "
                 "program is ending)") == 2, out


@pytest.mark.parametrize("n", [2, 3])
def test_a_first_call_on_one_rank_only_ends_the_job(n):
    """The first all-reduce on a communicator under `if rank == 0:`: its
    set-up (collective) would wait for the other ranks for ever; their
    programs' ending marks end the job with the reason."""
    result, seconds = run(n, USER, "rank-0-only")
    assert result.returncode == 2, (result.stdout + result.stderr)[-2000:]
    assert "[rank 0] PeerEnded: collectives.allreduce(): the program of world rank " \
        in result.stderr, result.stderr[-2000:]
    assert "ended without making its first call: every rank of the communicator must " \
        "call collectives.allreduce()" in result.stderr
    assert "DONE" not in result.stdout and seconds < PROMPT_S, f"took {seconds:.1f} s"


@pytest.mark.parametrize("n, algorithm", [(2, "recursive_doubling"), (3, "native")])
def test_a_rank_raising_with_abort_off_releases_peers_from_mpi_allreduce(n, algorithm):
    """abort_on_error(False): rank 0 raises (it calls another signature) while
    the others wait in a cached native call inside MPI_Allreduce, where no
    check of ours runs. Rank 0 joins that MPI_Allreduce with scratch data
    before raising; the others raise too, their buffers NaN (no result, none
    of rank 0's numbers)."""
    result, seconds = run(n, USER, "left-in-native", algorithm)
    out = result.stdout
    assert result.returncode == 0, result.stderr[-2000:]
    assert count(out, "CAUGHT rank") == n, out
    # (rank 0's mark may already say that its program is ending)
    assert count(out, "waited in MPI_Allreduce for rank 0, which never made this call") \
        == n - 1, out
    assert count(out, "NAN rank") == n - 1 and "NOT-NAN" not in out, out
    assert seconds < PROMPT_S


@pytest.mark.parametrize("n", cases([2], [4]))
def test_a_bad_name_on_one_rank_at_first_use_ends_the_job(n):
    result, seconds = run(n, USER, "bad-first-call", "ring")
    assert result.returncode == 2
    assert "[rank 1] UnknownAlgorithm: unknown all-reduce algorithm 'butterfly'" in result.stderr
    assert seconds < PROMPT_S


@pytest.mark.parametrize("n", [2, 3])
def test_resized_reshaped_and_read_only_arrays(n):
    """A bound array cannot be resized until collectives.forget(); made 2-D or
    read-only after a first call, it is refused like on the first call."""
    result, _ = run(n, USER, "buffers", "ring")
    out = result.stdout
    assert result.returncode == 0, result.stderr[-2000:]
    assert count(out, "RESIZE-REFUSED") == n and "RESIZED" not in out
    assert count(out, "REFUSED 2-D") == n and count(out, "REFUSED read-only") == n
    assert count(out, "DONE") == n and "WRONG" not in out and "ACCEPTED" not in out


@pytest.mark.parametrize("n", cases([2, 3], [4]))
def test_special_values_give_one_answer_on_every_rank_and_algorithm(n):
    result, _ = run(n, USER, "specials")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "DIFFERENT" not in result.stdout, result.stdout
    assert count(result.stdout, "DONE") == n


#: Seeds of the suite's fuzz runs (rank counts 2, 3, 4 in turn): 1-6 in every
#: suite, 7-12 in make test-long; others with MPIDP_FUZZ_SEEDS=first:last
#: (docs/testing.md).
def _seeds() -> list:
    import os

    text = os.environ.get("MPIDP_FUZZ_SEEDS")
    if text:
        first, last = (int(x) for x in text.split(":"))
        return list(range(first, last + 1))
    return cases(list(range(1, 7)), list(range(7, 13)))


@pytest.mark.parametrize("seed", _seeds())
def test_fuzzed_call_sequences(seed):
    """Random algorithm, dtype, op, length and order per rank (seeded): a
    correct result or an error, never a hang, a crash or a wrong number;
    after a skipped call, wrong numbers as in MPI but still an error."""
    n = 2 + seed % 3
    result, _ = run(n, FUZZ, str(seed))
    out = result.stdout + result.stderr
    plan = next(line for line in result.stdout.splitlines() if line.startswith("PLAN"))
    if plan.startswith("PLAN skip"):
        assert (result.returncode == 2 and "Mismatch" in out) \
            or "Message truncated" in out \
            or (result.returncode == 0 and count(out, "COLLECTIVE-ERROR") == n) \
            or (result.returncode == 0 and count(out, "DONE rank") == n
                and "WRONG" not in out), f"{plan}\n{out[-2000:]}"
        return
    assert "WRONG" not in out, out[-2000:]
    if plan == "PLAN none":
        assert result.returncode == 0 and count(out, "DONE rank") == n, out[-2000:]
    elif result.returncode == 0:
        assert count(out, "COLLECTIVE-ERROR") == n, out[-2000:]
    elif "Message truncated" in out:
        pass  # MPICH itself ends the job (MPI_Allreduce of different byte counts)
    else:
        assert result.returncode == 2 and "Mismatch" in out, f"{plan}\n{out[-2000:]}"


#: A program calling native max/min on floats for more lengths than MPI has
#: user-defined operations (mpi4py: 32).
MANY_LENGTHS = """
import numpy as np
import collectives
from collectives import MPI
comm = MPI.COMM_WORLD
for n in range(1, 46):
    for dtype in (np.float32, np.float64):
        for op, want in (("max", comm.Get_size() - 1), ("min", 0)):
            x = np.full(n, comm.Get_rank(), dtype=dtype)
            collectives.allreduce(x, comm, algorithm="native", op=op)
            if not (x == want).all():
                print("WRONG", n, dtype.__name__, op, flush=True)
print("DONE rank", comm.Get_rank(), flush=True)
"""


def test_native_max_min_on_floats_for_many_lengths():
    """Each length is a plan; each plan once made its own MPI operation, and the
    33rd ended the job ("cannot create too many user-defined reduction
    operations"): one operation per (op, dtype) now."""
    result, _ = run(2, "-c", MANY_LENGTHS)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-2000:]
    assert count(out, "DONE rank") == 2 and "WRONG" not in out, out[-2000:]


def test_an_allreduce_after_mpi_finalize_is_an_error_to_catch():
    """MPICH ended the process with its own words ("Attempting to use an MPI
    routine ... after finalizing MPICH"): nothing a program could catch."""
    program = ("import numpy as np, collectives\n"
               "from collectives import MPI\n"
               "MPI.Finalize()\n"
               "try:\n"
               "    collectives.allreduce(np.ones(4, np.float32), MPI.COMM_WORLD)\n"
               "except collectives.AllreduceError as error:\n"
               "    print('CAUGHT', error)\n")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ("CAUGHT allreduce after MPI_Finalize: MPI has been shut "
                                   "down in this process; reduce before finalizing")
