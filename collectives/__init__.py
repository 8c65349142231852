"""All-reduce algorithms over mpi4py, the channels they run over, and their micro-benchmark.

``allreduce(buf, comm, algorithm="auto", op="sum")`` reduces a contiguous
1-D buffer in place on every rank (numpy, torch CPU, or a device array).

Example (every rank runs it)::

    import numpy as np
    import collectives
    grad = np.ones(100_000, dtype=np.float32)
    collectives.allreduce(grad, algorithm="ring")   # grad now holds the sum

Import MPI from here (``from collectives import MPI``) or import
``collectives`` before ``mpi4py``: the MPI settings of
:mod:`collectives.runtime` only take effect before MPI initialises.

The public API is what this module exports (``__all__``) and the modules
beside it; the sub-packages are the machinery and the extension points::

    runtime.py     MPI start-up: every mpidp package imports MPI from here
    launch.py      launching ``mpiexec -n P mpidp ...`` from Python
    machine.py     what a measurement ran on (CPU, vector extensions, MPI)
    describe.py    describe(comm): how calls run on a communicator
    errors.py      the errors a caller can act on
    commands.py    the ``mpidp`` subcommands this package adds
    registry.py    algorithms by name: register one (an extension point)
    schedule.py    what an algorithm is: rounds of sends and receives
    algorithms/    the schedules, one module each (naive, ring, ...; native)
    channels/      how bytes move (MPI point-to-point, shared memory)
    core/          one call's machinery: dispatch, plans, consistency,
                   failures, device staging, the element-wise combine
    auto/          ``auto``: the static table and the tuner that measures
    bench/         ``mpidp bench allreduce``, the micro-benchmark
"""
from __future__ import annotations

from collectives.runtime import MPI  # first: MPI settings before MPI_Init

from collectives import algorithms  # noqa: F401,E402 - registers the algorithms, in order
from collectives.auto import table  # noqa: F401,E402 - registers the selector
from collectives.core.dispatch import algorithm_for, allreduce, forget  # noqa: E402
from collectives.core.failures import abort_on_error  # noqa: E402
from collectives.describe import describe  # noqa: E402
from collectives.errors import (AllreduceError, AllreduceMismatch, UnknownAlgorithm,  # noqa: E402
                                UnknownOp, UnsupportedBuffer)
from collectives.registry import get, names  # noqa: E402

__all__ = ["MPI", "allreduce", "algorithm_for", "abort_on_error", "describe", "names", "get",
           "forget",
           "AllreduceError", "AllreduceMismatch", "UnknownAlgorithm", "UnknownOp",
           "UnsupportedBuffer"]
