"""engine.run.threads: how many threads a rank runs."""
import numba
import pytest
import torch

from collectives import runtime
from engine.run.threads import configure_threads


@pytest.fixture
def restored():
    """Leave torch's and Numba's thread counts as they were."""
    before = torch.get_num_threads(), numba.get_num_threads()
    yield
    torch.set_num_threads(before[0])
    numba.set_num_threads(before[1])


def test_a_requested_count_is_applied(restored):
    threads, _ = configure_threads(1)
    assert threads == 1 and torch.get_num_threads() == 1 and numba.get_num_threads() == 1


@pytest.mark.mpi(min_size=1)
def test_without_the_launchers_count_the_ranks_of_the_node_are_counted(comm, monkeypatch,
                                                                       restored):
    """A launcher that announces no local rank count (none of Hydra's, Open
    MPI's, MVAPICH2's, PALS's or Slurm's variables) left every rank all of its
    cores; the trainer's communicator counts the ranks sharing this node."""
    for name in runtime._LOCAL_SIZE_VARIABLES + ("SLURM_PROCID",):
        monkeypatch.delenv(name, raising=False)
    alone, _ = configure_threads(None)  # no communicator: nothing to count
    threads, local = configure_threads(None, comm)
    size = comm.Get_size()  # the tests' ranks share one machine, unbound
    assert local == size
    assert threads == max(1, runtime.available_cores() // size)
    assert alone == runtime.available_cores()
