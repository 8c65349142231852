"""Threads per rank: one rank per core unless told otherwise."""
from __future__ import annotations

from typing import NamedTuple

import numba
import torch

from collectives.cores import CoreShare
from collectives.runtime import MPI, launch_info, node_share


class Threads(NamedTuple):
    """What :func:`configure_threads` set."""

    #: Threads per rank (torch's; Numba's at most its pool).
    threads: int
    #: Ranks on this node.
    local_ranks: int
    #: A line for a ``--threads`` that oversubscribes the cores (None: fits).
    note: str | None


def configure_threads(requested: int | None, comm: "MPI.Intracomm | None" = None
                      ) -> Threads:
    """Threads per rank unless ``requested``: the cores a launcher bound this
    rank to, or else this node's cores divided by its ranks (at least 1;
    :attr:`collectives.runtime.CoreShare.threads`).

    Alone, a rank judges from the launcher's count of ranks on its node and
    its own affinity mask (:func:`collectives.runtime.launch_info`); with
    ``comm`` (then a collective over it) the ranks compare their masks, which
    is exact where ``comm`` holds every rank of the node
    (:func:`collectives.runtime.node_share`: a launcher that announced no
    count, a wrapper script bound with its rank). Applies to torch and Numba,
    and turns on flush-to-zero for denormals. Returns :class:`Threads`:
    the threads, the ranks on this node and :func:`oversubscription_note`.
    """
    launch = node_share(comm) if comm is not None and comm.Get_size() > 1 else launch_info()
    local = launch.local_ranks or 1
    threads = requested or launch.threads
    torch.set_num_threads(threads)
    # Flush denormals to zero: once a model fits well, softmax gradients of
    # confident examples underflow into the denormal range, where x86 float
    # arithmetic is many times slower. Values below 1.2e-38 change nothing.
    torch.set_flush_denormal(True)
    numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))
    return Threads(threads, local, oversubscription_note(requested, launch))


def oversubscription_note(requested: int | None, share: CoreShare) -> str | None:
    """A line for a ``--threads`` that gives this rank more threads than its
    cores, or the node's ranks more than the cores they share: the threads
    take turns and a step runs several times slower. None when it fits, or
    when ``--threads`` was not given (mpidp's own count fits) or is 1 (then
    the ranks outnumber the cores, which :mod:`collectives` warns about)."""
    local = share.local_ranks or 1
    if requested is None or requested == 1 or (requested <= share.cores
                                               and requested * local <= share.capacity):
        return None
    return (f"note: --threads {requested} with {local} rank(s) on this node puts "
            f"{requested * local} threads on {share.capacity} core(s) ({share.cores} for this "
            "rank): they take turns and every step slows down; leave --threads out for one "
            "thread per core")


def thread_facts(threads: int, note: str | None = None) -> dict:
    """The threads a run or benchmark runs on, once :func:`configure_threads`
    set ``threads`` (torch's: ``--threads`` or the cores per rank) with
    ``note`` (its oversubscription note, None when the threads fit the cores):
    ``threads``, ``numba_threads`` (Numba's: as many, at most its pool,
    ``NUMBA_NUM_THREADS``), ``numba_pool`` and ``threads_note``."""
    return {"threads": threads, "numba_threads": numba.get_num_threads(),
            "numba_pool": numba.config.NUMBA_NUM_THREADS, "threads_note": note}


def thread_label(facts: dict) -> str:
    """``N thread(s)`` for :func:`thread_facts`, or torch's and Numba's counts
    apart where Numba's pool holds fewer than ``--threads``."""
    if facts["numba_threads"] == facts["threads"]:
        return f"{facts['threads']} thread(s)"
    return (f"{facts['threads']} torch thread(s), {facts['numba_threads']} Numba thread(s) "
            f"(its pool, NUMBA_NUM_THREADS={facts['numba_pool']})")
