"""An all-reduce in your own mpi4py program, and what happens when ranks disagree or fail.

Run it on every rank:

    mpiexec -n 2 python -m mpi4py examples/allreduce_user_program.py
    mpiexec -n 4 python -m mpi4py examples/allreduce_user_program.py --fail-on-rank 1

1. Sums a gradient-sized buffer with two algorithms and checks the result.
2. Makes a mistake on purpose: rank 0 passes a buffer of another length. The
   ranks compare the first call of every signature, so the error is raised on
   every rank alike (``error.collective``); the program catches it and goes on
   with the same communicator.
3. With ``--fail-on-rank R``, rank R raises an ordinary bug of its own while
   the others wait in the next all-reduce. ``python -m mpi4py`` turns the
   uncaught exception into ``MPI_Abort``: the job ends within about a second
   with the error printed, instead of hanging. Run without it, rank R's exit
   ends the job too: collectives aborts it at R's exit, since the others
   could enter a call R never makes (docs/collectives.md, rule 6).
"""
from __future__ import annotations

import argparse

import numpy as np

import collectives  # before mpi4py: it sets MPI's defaults for this machine
from collectives import MPI


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fail-on-rank", type=int, default=None, metavar="R",
                        help="this rank raises an error of its own in step 3")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()

    # 1. Correct calls: every rank, same length, dtype, op and algorithm.
    grad = np.full(30_000, rank + 1, dtype=np.float32)
    for algorithm in ("ring", "auto"):
        grad[:] = rank + 1
        collectives.allreduce(grad, comm, algorithm=algorithm)
        assert (grad == size * (size + 1) // 2).all()
    if rank == 0:
        print(f"1. {size} ranks summed {grad.size} floats with ring and auto: "
              f"{grad[0]:g} everywhere", flush=True)

    # 2. A mistake the ranks find together: rank 0's buffer is one element longer.
    mistake = np.ones(101 if rank == 0 else 100, dtype=np.float32)
    try:
        collectives.allreduce(mistake, comm)
    except collectives.AllreduceMismatch as error:
        assert error.collective  # raised on every rank: the communicator is still usable
        if rank == 0:
            print("2. caught on every rank: " + str(error).splitlines()[0], flush=True)
    grad[:] = 1
    collectives.allreduce(grad, comm)
    assert (grad == size).all()
    if rank == 0:
        print(f"   and the next call on the same communicator gives {grad[0]:g}", flush=True)

    # 3. One rank's own bug while the others wait in an all-reduce.
    if args.fail_on_rank == rank:
        raise RuntimeError(f"an ordinary bug on rank {rank}")
    collectives.allreduce(grad, comm)
    if rank == 0:
        print("3. done", flush=True)


if __name__ == "__main__":
    main()
