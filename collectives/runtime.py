"""MPI start-up for every mpidp process: settings chosen before ``MPI_Init``.

Import MPI through this module (``from collectives.runtime import MPI``), never
``from mpi4py import MPI`` first: the settings below only take effect if they
are in the environment when the MPI library initialises.

What it decides, from what the launcher tells the process about itself:

* **Thread level.** mpidp calls MPI from the main thread only, so it asks for
  ``MPI_THREAD_FUNNELED``; with MPICH that roughly halves small-message
  latency compared with mpi4py's default ``MULTIPLE``.
* **Oversubscription.** When more ranks share a node than it has cores,
  ranks waiting in a collective must give their core to the rank that is
  computing, or the job crawls. With MPICH that takes ``MPIR_CVAR_ENABLE_HEAVY_YIELD=1``
  (waiting ranks ``nanosleep``), which only acts at thread level ``MULTIPLE``;
  the computing rank then runs about as fast as alone, at the price of the
  latency of tiny collectives (docs/design/waiting-when-oversubscribed.md).
  Open MPI's counterpart, ``OMPI_MCA_mpi_yield_when_idle=1``, is set alike.

Cores are counted for the node, not only for this process: a launcher that
binds each rank to its own cores (``srun --cpu-bind=cores``, Open MPI's
default at two ranks, Hydra's ``-bind-to core``) leaves every rank an
affinity mask of its own share, and such ranks are not oversubscribed
(:mod:`collectives.cores`; docs/design/bound-ranks.md).

Every choice is a default: a variable the user already set is left alone.
"""
from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass

from collectives.cores import (CoreShare, RankFacts, available_cores, node_cpus, node_views,
                               oversubscribed_anywhere, rank_facts, share_alone)
from collectives.launch import SET_HERE, defaults_set_here

__all__ = ["MPI", "LaunchError", "LaunchInfo", "CoreShare", "launch_info", "launch_estimate",
           "check_launch", "available_cores", "node_cpus", "node_share", "sharing_facts",
           "oversubscribed_anywhere"]

#: Environment variables through which launchers announce the job's size.
_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS")
_LOCAL_SIZE_VARIABLES = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE",
                         "MV2_COMM_WORLD_LOCAL_SIZE", "PALS_LOCAL_SIZE")


def _env_int(names: tuple[str, ...]) -> tuple[int | None, str | None]:
    for name in names:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value), name
    return None, None


def _local_ranks_announced() -> int | None:
    local, _ = _env_int(_LOCAL_SIZE_VARIABLES)
    if local is None and "SLURM_PROCID" in os.environ:
        # srun: tasks on this node, e.g. "4" or "4(x2)" for SLURM_TASKS_PER_NODE.
        text = os.environ.get("SLURM_NTASKS_PER_NODE") or os.environ.get(
            "SLURM_TASKS_PER_NODE", "")
        head = text.split("(")[0].split(",")[0]
        local = int(head) if head.isdigit() else None
    return local


def x86_64() -> bool:
    """Whether this machine is x86-64 (its stores are seen in program order, and it
    has the non-temporal stores of :mod:`collectives.channels.streaming`)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def launch_estimate() -> CoreShare:
    """This node's :class:`CoreShare` (local call, before or after ``MPI_Init``)."""
    return share_alone(_local_ranks_announced())


def sharing_facts() -> RankFacts:
    """This rank's facts for :func:`collectives.cores.node_views` (local call)."""
    return rank_facts(_local_ranks_announced())


def node_share(comm: "MPI.Intracomm") -> CoreShare:
    """This rank's :class:`CoreShare` as the ranks of ``comm`` see it together
    (:func:`collectives.cores.node_views`): exact where ``comm`` holds every
    rank of this node. Collective over ``comm``: every rank must call it."""
    return node_views(comm.allgather(sharing_facts()))[comm.Get_rank()]


def _configure_environment() -> None:
    """Set MPI defaults in ``os.environ``; runs once, before MPI is imported."""
    env = os.environ
    if launch_estimate().oversubscribed:
        defaults = {"MPI4PY_RC_THREAD_LEVEL": "multiple", "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1",
                    "MPIR_CVAR_POLLS_BEFORE_YIELD": "100", "OMPI_MCA_mpi_yield_when_idle": "1"}
    else:
        defaults = {"MPI4PY_RC_THREAD_LEVEL": "funneled"}
    inherited = defaults_set_here(env)
    mine = [name for name in defaults if name not in env or name in inherited]
    for name in mine:
        env[name] = defaults[name]
    env[SET_HERE] = ",".join(f"{name}={defaults[name]}" for name in mine)


def _late_import_warning() -> None:
    """mpi4py.MPI was imported before this module: its settings came too late.

    Harmless unless the node is oversubscribed, where waiting ranks then spin
    in MPICH and steal the core of the rank they wait for; say so once.
    """
    launch = launch_estimate()
    if launch.oversubscribed and "MPIR_CVAR_ENABLE_HEAVY_YIELD" not in os.environ:
        import warnings  # deferred: only on this unusual path

        warnings.warn(
            "mpi4py.MPI was imported before collectives, so collectives could not set "
            f"MPI's settings for {launch.local_ranks} ranks on {launch.capacity} cores "
            "(waiting ranks "
            "will spin and slow the others down): import collectives first, or set "
            "MPI4PY_RC_THREAD_LEVEL=multiple MPIR_CVAR_ENABLE_HEAVY_YIELD=1 yourself",
            RuntimeWarning, stacklevel=3)


if "mpi4py.MPI" not in sys.modules:
    _configure_environment()
else:
    _late_import_warning()

from mpi4py import MPI  # noqa: E402  (must follow the environment set-up)


class LaunchError(RuntimeError):
    """The MPI job was not started the way the launcher says it was.

    Typical cause: ``srun`` without ``--mpi=pmi2`` (MPICH) or ``--mpi=pmix``
    (Open MPI) starts N independent singletons of size 1 that all "succeed".
    """

    exit_code = 2


@dataclass(frozen=True)
class LaunchInfo(CoreShare):
    """What the launcher announced about this job, against what MPI sees, and
    how the node's cores are shared (:class:`CoreShare`)."""

    size: int
    rank: int
    expected_size: int | None
    expected_from: str | None

    @property
    def size_mismatch(self) -> bool:
        return self.expected_size is not None and self.expected_size != self.size

    def mismatch_message(self) -> str:
        return (
            f"MPI reports a communicator of size {self.size}, but the launcher "
            f"set {self.expected_from}={self.expected_size}. The ranks were "
            "probably started as independent singletons: with the pip MPICH use "
            "`srun --mpi=pmi2` or `mpiexec` inside the allocation; with Open MPI "
            "use `srun --mpi=pmix` or `mpirun`. Check that mpi4py was built "
            "against the MPI whose launcher you use (`mpidp info`)."
        )


def launch_info(comm: "MPI.Comm | None" = None) -> LaunchInfo:
    """Describe the launch of this process (local call, no communication)."""
    comm = MPI.COMM_WORLD if comm is None else comm
    expected, source = _env_int(_SIZE_VARIABLES)
    if source == "SLURM_STEP_NUM_TASKS" and "SLURM_PROCID" not in os.environ:
        expected, source = None, None  # the batch script itself, not a task
    return LaunchInfo(
        size=comm.Get_size(),
        rank=comm.Get_rank(),
        expected_size=expected,
        expected_from=source,
        **vars(launch_estimate()),
    )


def check_launch(comm: "MPI.Comm | None" = None) -> LaunchInfo:
    """Raise :class:`LaunchError` if MPI's size disagrees with the launcher's.

    Local check on every rank (no communication, so it cannot hang even when
    the ranks are disconnected singletons).
    """
    info = launch_info(comm)
    if info.size_mismatch:
        raise LaunchError(info.mismatch_message())
    return info


def _mpi_library_handle():
    """ctypes handle of the loaded MPI library, or None."""
    import ctypes

    for name in (None, "libmpi.so.12", "libmpi.so.40", "libmpi.so"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        if hasattr(lib, "MPI_Init"):
            return lib
    return None


def mpi_cuda_support() -> bool | None:
    """Whether the MPI library can read and write CUDA device memory.

    ``MPIDP_CUDA_AWARE=0|1`` in the environment overrides the detection (for
    libraries that are CUDA-aware but cannot say so). Otherwise asks the
    library through ``MPIX_Query_cuda_support`` (MPICH >= 4, Open MPI >= 4,
    Cray MPICH). Returns ``None`` when the library offers no way to ask.
    Local call, any rank.
    """
    override = os.environ.get("MPIDP_CUDA_AWARE", "").strip()
    if override in ("0", "1"):
        return override == "1"
    lib = _mpi_library_handle()
    query = getattr(lib, "MPIX_Query_cuda_support", None) if lib is not None else None
    if query is None:
        return None
    import ctypes

    query.restype = ctypes.c_int
    query.argtypes = []
    return bool(query())
