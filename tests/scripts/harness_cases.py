"""Deliberately failing MPI tests that test_harness.py runs under mpiexec.

Not collected by the normal suite (the name does not start with ``test_``).
"""
import pytest


@pytest.mark.mpi(min_size=2)
def test_rank1_fails_before_collective(comm):
    if comm.Get_rank() == 1:
        raise AssertionError("rank 1 fails before the barrier")
    comm.Barrier()


@pytest.mark.mpi(min_size=2)
def test_rank1_fails_alone(comm):
    assert comm.Get_rank() != 1, "only rank 1 fails, no collective follows"


@pytest.mark.mpi(min_size=2)
def test_passes(comm):
    assert comm.allreduce(1) == comm.Get_size()
