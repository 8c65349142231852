"""engine.run.threads: how many threads a rank runs."""
import numba
import pytest
import torch

from collectives import runtime
from collectives.cores import CoreShare
from engine.run.threads import configure_threads, oversubscription_note


def test_a_requested_count_is_applied(threads_restored):
    threads, _, note = configure_threads(1)
    assert threads == 1 and note is None and torch.get_num_threads() == 1 and numba.get_num_threads() == 1


@pytest.mark.mpi(min_size=1)
def test_without_the_launchers_count_the_ranks_of_the_node_are_counted(comm, monkeypatch,
                                                                       threads_restored):
    """A launcher that announces no local rank count (none of Hydra's, Open
    MPI's, MVAPICH2's, PALS's or Slurm's variables) left every rank all of its
    cores; the trainer's communicator counts the ranks sharing this node."""
    for name in runtime._LOCAL_SIZE_VARIABLES + ("SLURM_PROCID",):
        monkeypatch.delenv(name, raising=False)
    alone, _, _ = configure_threads(None)  # no communicator: nothing to count
    threads, local, note = configure_threads(None, comm)
    assert note is None  # mpidp's own count never oversubscribes
    size = comm.Get_size()  # the tests' ranks share one machine, unbound
    assert local == size
    assert threads == max(1, runtime.available_cores() // size)
    assert alone == runtime.available_cores()


@pytest.mark.parametrize("requested, local, cores, node, crowded", [
    (None, 4, 1, 4, False),   # mpidp's own count
    (1, 8, 2, 2, False),      # the ranks outnumber the cores: not --threads' doing
    (2, 1, 2, 2, False),      # one rank, every core
    (999, 1, 2, 2, True),     # more threads than the machine's cores
    (2, 2, 2, 2, True),       # two unbound ranks of 2 threads on 2 cores
    (2, 2, 1, 2, True),       # each rank bound to one core, given 2 threads
    (2, 2, 2, 4, False),      # each rank bound to 2 of 4 cores
])
def test_a_threads_option_that_crowds_the_cores_gets_a_note(requested, local, cores, node,
                                                            crowded):
    """`mpidp train --threads 999` on 2 cores ran 999 torch threads without a word."""
    note = oversubscription_note(requested, CoreShare(local, cores, node))
    assert (note is not None) == crowded
    if crowded:
        assert note.startswith(f"note: --threads {requested} with {local} rank(s) on this node "
                               f"puts {requested * local} threads on ")
