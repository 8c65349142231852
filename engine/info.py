"""mpidp info: what a bug report needs, from every rank of the job.

Prints the versions of mpidp and its dependencies, the MPI library and how
the job was launched (communicator size, every rank's host, pid and local
rank), whether MPI is CUDA-aware, which kernel back-ends are usable and the
thread settings. The threads are a training run's: ``collect`` applies
:func:`engine.run.threads.configure_threads` as ``mpidp train`` does without
``--threads`` (torch's threads per rank, Numba's: as many, at most its pool
of ``NUMBA_NUM_THREADS``), reads them back, and the kernel back-ends are
probed at those counts. Run it the way you run training, e.g.
``mpiexec -n 2 mpidp info``; it warns loudly when the launcher announced more
ranks than MPI sees (ranks started as singletons).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import platform
import socket
import sys

import collectives
from collectives import MPI
from collectives.machine import mpi_library
from collectives.runtime import CoreShare, launch_info, mpi_cuda_support, node_share
from engine import __version__
from kernels.probe import probe_all

#: Environment variables that change threading or MPI behaviour.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                    "NUMBA_NUM_THREADS", "MPI4PY_RC_THREAD_LEVEL",
                    "OMPI_MCA_mpi_yield_when_idle")


def waiting_yields() -> bool:
    """Whether this process's MPI library was told to let waiting ranks yield
    their core (MPICH's heavy yield, Open MPI's yield_when_idle): set by
    :mod:`collectives.runtime` before MPI starts where the launch looks
    oversubscribed, or by the user."""
    return os.environ.get("MPIR_CVAR_ENABLE_HEAVY_YIELD", "0") not in ("", "0") \
        or os.environ.get("OMPI_MCA_mpi_yield_when_idle", "0") not in ("", "0")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true",
                        help="print one JSON document instead of the report")


def _distribution_version(name: str) -> str:
    """Installed version of a distribution, without importing it."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def versions() -> dict[str, str]:
    """Versions of Python and every library mpidp uses (absent ones said so)."""
    import h5py  # deferred: keeps `mpidp info --help` fast

    vendor, vendor_version = MPI.get_vendor()
    library = mpi_library()
    result = {
        "mpidp": __version__,
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
        "mpi4py": _distribution_version("mpi4py"),
        "mpi_library": library,
        "mpi_vendor": f"{vendor} {'.'.join(map(str, vendor_version))}",
        "mpi_standard": ".".join(map(str, MPI.Get_version())),
        "numpy": _distribution_version("numpy"),
        "torch": _distribution_version("torch"),
        "numba": _distribution_version("numba"),
        "h5py": f"{h5py.__version__} (HDF5 {h5py.version.hdf5_version})",
        "dp_accounting": _distribution_version("dp-accounting"),
        "tqdm": _distribution_version("tqdm"),
    }
    for name in ("cupy-cuda12x", "cupy-cuda13x", "cupy", "numba-cuda"):
        version = _distribution_version(name)
        if version != "not installed":
            result[name] = version
    return result


def rank_facts(share: CoreShare, threads: int | None = None) -> dict:
    """Facts about this rank (local, no communication); ``share``: how its node's
    cores are shared, as the ranks see it together (:func:`node_share`);
    ``threads``: the threads per rank a training run sets without
    ``--threads`` (:func:`engine.run.threads.configure_threads`; default
    ``share.threads``).

    ``torch_threads`` and ``numba_threads`` are this process's counts now: a
    training run's once ``configure_threads`` ran (as in :func:`collect`);
    ``numba_pool`` is the most Numba runs in any process (``NUMBA_NUM_THREADS``,
    fixed at its start): ``numba_threads`` is never above it.
    """
    # deferred: keeps `mpidp info --help` fast
    import numba
    import torch

    launch = launch_info()
    levels = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
              MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}
    return {
        "rank": launch.rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "local_ranks": share.local_ranks,
        "cores": share.cores,
        "node_cores": share.node_cores,
        "bound": share.bound,
        "oversubscribed": share.oversubscribed,
        # whether MPI was started with waiting ranks yielding their core
        # (collectives.runtime sets it where the launch looked oversubscribed)
        "waiting_yields": waiting_yields(),
        "capacity": share.capacity,
        "threads": share.threads if threads is None else threads,
        "torch_threads": torch.get_num_threads(),
        "numba_threads": numba.get_num_threads(),
        "numba_pool": numba.config.NUMBA_NUM_THREADS,
        "mpi_thread_level": levels.get(MPI.Query_thread(), "unknown"),
        "expected_size": launch.expected_size,
        "expected_from": launch.expected_from,
        "size_mismatch": launch.size_mismatch,
        "mismatch_message": launch.mismatch_message() if launch.size_mismatch else "",
    }


def collect() -> dict | None:
    """Gather the report on rank 0 (collective over COMM_WORLD); None elsewhere.

    Sets torch's and Numba's threads as ``mpidp train`` does without
    ``--threads`` while it reads and probes them (the thread facts and the
    back-ends' lines are a training run's), and puts the previous counts back.
    """
    # deferred: torch and Numba, kept out of `mpidp info --help`
    import numba
    import torch

    from engine.run.threads import configure_threads

    comm = MPI.COMM_WORLD
    before = torch.get_num_threads(), numba.get_num_threads()
    try:
        threads = configure_threads(None, comm).threads  # collective, as the trainer's
        ranks = comm.gather(rank_facts(node_share(comm), threads), root=0)  # collective
        reduce_facts = allreduce_facts(comm)  # collective
        if comm.Get_rank() != 0:
            return None
        cuda_aware = mpi_cuda_support()
        return {
            "versions": versions(),
            "size": comm.Get_size(),
            "ranks": ranks,
            "mpi_cuda_aware": {True: "yes", False: "no", None: "unknown"}[cuda_aware],
            "kernel_backends": [vars(b) for b in probe_all()],
            "allreduce": reduce_facts,
            "environment": {k: os.environ[k] for k in sorted(os.environ)
                            if k in THREAD_VARIABLES or k.startswith("MPIR_CVAR_")
                            or k.startswith("MPIDP_")},
        }
    finally:
        torch.set_num_threads(before[0])
        numba.set_num_threads(before[1])


def allreduce_facts(comm) -> dict:
    """How ``collectives.allreduce`` runs on ``comm`` (:func:`collectives.describe`;
    collective: the first call sets up the communicator's state)."""
    from collectives.auto import tuning  # deferred: only the report needs it

    facts = dict(collectives.describe(comm))
    path = tuning.tuning_file() if tuning.enabled() else None
    facts["tuning_file"] = None if path is None else str(path)
    return facts


def format_report(report: dict) -> str:
    """The human-readable report (rank 0's stdout)."""
    lines = []
    mismatched = [r for r in report["ranks"] if r["size_mismatch"]]
    if mismatched:
        bar = "!" * 78
        lines += [bar, "WARNING: WRONG LAUNCH. " + mismatched[0]["mismatch_message"], bar, ""]
    lines.append("versions")
    width = max(map(len, report["versions"]))
    lines += [f"  {k:<{width}}  {v}" for k, v in report["versions"].items()]
    lines += ["", "MPI job",
              f"  communicator size  {report['size']}",
              f"  CUDA-aware MPI     {report['mpi_cuda_aware']}"]
    lines.append("  rank  host                  pid  local_ranks  cores  torch  numba"
                 "  mpi_threads")
    for r in report["ranks"]:
        local = "-" if r["local_ranks"] is None else r["local_ranks"]
        lines.append(f"  {r['rank']:>4}  {r['host'][:18]:<18}  {r['pid']:>7}  {local:>11}"
                     f"  {r['cores']:>5}  {r['torch_threads']:>5}  {r['numba_threads']:>5}"
                     f"  {r['mpi_thread_level']}")
    pool = report["ranks"][0]["numba_pool"]
    lines.append("  (torch, numba: the threads per rank of mpidp train without --threads, "
                 "torch's and Numba's;")
    lines.append(f"   Numba's at most its pool of {pool}, NUMBA_NUM_THREADS; prep parses on "
                 "torch's count)")
    over = [r for r in report["ranks"] if r["oversubscribed"]]
    bound = [r for r in report["ranks"] if r["bound"]]
    if over and all(r["waiting_yields"] for r in over):
        lines.append(f"  oversubscribed: {over[0]['local_ranks']} ranks on {over[0]['capacity']}"
                     " cores; waiting ranks yield the CPU (MPICH's heavy yield, Open MPI's"
                     " yield_when_idle)")
    elif over:
        lines.append(f"  oversubscribed: {over[0]['local_ranks']} ranks on {over[0]['capacity']}"
                     " cores, and waiting ranks spin: the launch did not look oversubscribed"
                     " before MPI started")
        lines.append("  (each rank's own affinity mask), so MPI's yield was not set: export "
                     "MPIR_CVAR_ENABLE_HEAVY_YIELD=1 (Open MPI: OMPI_MCA_mpi_yield_when_idle=1)"
                     " or give each rank cores of its own")
    elif bound:
        lines.append(f"  bound: the launcher gave each rank cores of its own ({bound[0]['cores']}"
                     f" of the node's {bound[0]['node_cores']} on rank {bound[0]['rank']})")
    facts = report["allreduce"]
    lines += ["", "all-reduce (collectives.allreduce on COMM_WORLD)",
              f"  placement      {facts['placement']}",
              f"  shared memory  {facts['shared_memory']}; waiting ranks: {facts['waiting']}"]
    if facts.get("copies"):
        lines.append(f"  pair copies    {facts['copies']}")
    lines.append(f"  channels       {', '.join(facts['channels'])}")
    lines.append(f"  auto runs      {facts['auto_text']}")
    if facts.get("tuning_file"):  # auto's own measurements come first where it has them
        lines.append(f"                 (where it has measured a size on these ranks: the fastest "
                     f"it measured, kept in {facts['tuning_file']})")
    lines += ["", "kernel back-ends"]
    for b in report["kernel_backends"]:
        mark = "yes" if b["usable"] else "no "
        lines.append(f"  {b['name']:<15} {mark}  {b['detail']}")
    lines += ["", "environment"]
    if report["environment"]:
        lines += [f"  {k}={v}" for k, v in report["environment"].items()]
    else:
        lines.append("  (no thread or MPI variables set)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    # A report, not a first run: the Numba vector width is reported as cached,
    # never measured here (that costs a fresh machine 15-20 s of compiling).
    set_here = "MPIDP_VECTOR_WIDTH" not in os.environ
    os.environ.setdefault("MPIDP_VECTOR_WIDTH", "cached")
    report = collect()
    if report is None:
        return 0
    if set_here:  # the report's own setting, not the user's environment
        report["environment"].pop("MPIDP_VECTOR_WIDTH", None)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0
