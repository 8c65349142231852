"""One all-reduce call's machinery, behind :func:`collectives.allreduce`.

* :mod:`~collectives.core.dispatch`: the entry point, the fast path for a
  repeated call and the checks of a new one;
* :mod:`~collectives.core.plans`: per-communicator state, its channels and
  the checked plans of each call signature;
* :mod:`~collectives.core.peers`: the blind-call words each rank publishes,
  read to tell where a peer is when a call fails;
* :mod:`~collectives.core.context`: what a plan is given (ranks, length,
  dtype, op, the array space);
* :mod:`~collectives.core.consistency`: every rank makes the same call;
* :mod:`~collectives.core.failures`: what happens when a call fails;
* :mod:`~collectives.core.device`: device buffers, handed to a CUDA-aware
  MPI or staged through the host;
* :mod:`~collectives.core.combine` (and its Numba loops,
  :mod:`~collectives.core.combine_kernels`): the element-wise combine and
  its one rule for special values.

Nothing here names an algorithm or a channel; callers outside
``collectives`` use the package's top level.
"""
