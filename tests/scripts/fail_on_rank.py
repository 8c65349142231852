"""Test program: rank ``FAIL_RANK`` raises before a collective the others enter.

Usage: fail_on_rank.py KIND FAIL_RANK, KIND one of
  crash       an unexpected exception (traceback expected)
  user        a user error (one line, exit code 2)
  collective  a user error raised on every rank (rank 0 prints it once)
  interrupt   a Ctrl-C seen by that rank alone (the others wait inside MPI,
              where Python cannot act on it)
  swallowed   a SIGINT whose exception code that called back into Python
              swallowed (as polars does while it reads a CSV block), then
              fails with an error of its own
"""
import os
import signal
import sys

from collectives.runtime import MPI
from engine.spmd import run_spmd


class BadInput(ValueError):
    exit_code = 2


def main() -> None:
    kind, fail_rank = sys.argv[1], int(sys.argv[2])
    comm = MPI.COMM_WORLD
    if kind == "collective":
        error = BadInput("the same bad input on every rank")
        error.collective = True
        raise error
    if comm.Get_rank() == fail_rank:
        if kind == "crash":
            raise ZeroDivisionError("deliberate failure before the collective")
        if kind == "interrupt":
            raise KeyboardInterrupt
        if kind == "swallowed":
            from engine import stopping

            stopping.raise_on_signals()

            class Callback:  # an exception raised in __del__ is swallowed, as in a callback
                def __del__(self):
                    os.kill(os.getpid(), signal.SIGINT)

            Callback()
            raise TypeError("the native code's own error after it swallowed the interrupt")
        raise BadInput("deliberate bad input on one rank")
    comm.Barrier()  # the failing rank never arrives


if __name__ == "__main__":
    sys.exit(run_spmd(main))
