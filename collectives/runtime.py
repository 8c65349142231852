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
(:class:`LaunchInfo`; docs/design/bound-ranks.md).

Every choice is a default: a variable the user already set is left alone.
"""
from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass

__all__ = ["MPI", "LaunchError", "LaunchInfo", "CoreShare", "launch_info", "launch_estimate",
           "check_launch", "available_cores", "node_cpus", "sharing_facts",
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


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, and no more than its
    cgroup's CPU quota), at least 1."""
    try:
        mask = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)
    return max(1, min(mask, _cgroup_quota_cpus() or mask))


def _cpu_list_size(text: str) -> int | None:
    """Number of CPUs in a kernel CPU list such as ``0-3,8,10-11``; None if unreadable."""
    count = 0
    for part in text.strip().split(","):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            return None
        count += int(high or low) - int(low) + 1
    return count or None


#: Where this process's cgroups are listed, and where cgroup files are mounted.
_PROC_CGROUP = "/proc/self/cgroup"
_CGROUP_ROOT = "/sys/fs/cgroup"


def _cgroup_files(v2_name: str | None, v1_controller: str,
                  v1_names: tuple[str, ...]) -> list[str]:
    """Paths of one cgroup setting of this process: ``v2_name`` in its v2 group
    (None: none), ``v1_names`` in its v1 ``v1_controller`` group."""
    paths = []
    for line in (_read_text(_PROC_CGROUP) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        path = path.rstrip("/")
        if controllers == "":  # v2: the unified hierarchy
            if v2_name:
                paths.append(f"{_CGROUP_ROOT}{path}/{v2_name}")
        elif v1_controller in controllers.split(","):
            root = f"{_CGROUP_ROOT}/{controllers}"
            if not os.path.isdir(root):
                root = f"{_CGROUP_ROOT}/{v1_controller}"
            paths += [f"{root}{path}/{name}" for name in v1_names]
    return paths


def _read_text(name: str) -> str | None:
    try:
        with open(name) as f:
            return f.read()
    except OSError:
        return None


def _cgroup_cpus() -> int | None:
    """CPUs of this process's cgroup cpuset (v2 or v1), or None where none is readable."""
    for name in _cgroup_files("cpuset.cpus.effective", "cpuset",
                              ("cpuset.effective_cpus", "cpuset.cpus")):
        text = _read_text(name)
        size = _cpu_list_size(text) if text else None
        if size:
            return size
    return None


def _cgroup_quota_cpus() -> int | None:
    """CPUs' worth of this process's cgroup CPU quota, rounded up (a container
    run with ``--cpus=2`` may run on every CPU, for two CPUs' time); None
    where there is no quota or none is readable."""
    for name in _cgroup_files("cpu.max", "cpu", ()):
        text = (_read_text(name) or "").split()
        if len(text) == 2 and text[0].isdigit() and text[1].isdigit() and int(text[1]):
            return max(1, -(-int(text[0]) // int(text[1])))
    v1 = _cgroup_files(None, "cpu", ("cpu.cfs_quota_us", "cpu.cfs_period_us"))
    for quota_name, period_name in zip(v1[0::2], v1[1::2]):
        quota = (_read_text(quota_name) or "").strip()
        period = (_read_text(period_name) or "").strip()
        if quota.isdigit() and period.isdigit() and int(period):
            return max(1, -(-int(quota) // int(period)))
    return None


def _parent_cpus() -> int | None:
    """CPUs the parent process (the launcher's proxy) may run on, or None."""
    try:
        return len(os.sched_getaffinity(os.getppid())) or None
    except (AttributeError, OSError):
        return None


def node_cpus() -> int:
    """CPUs the ranks of this node may share, as far as one process can tell
    alone (no communication): the fewest of this process's cgroup cpuset and
    CPU quota, Slurm's CPUs for the job on this node (``SLURM_CPUS_ON_NODE``) and the
    parent process's affinity mask (a launcher's proxy keeps the mask it
    narrows for its ranks; one itself confined, as by ``taskset``, passes
    its confinement on); ``os.cpu_count()`` where none is known. Never fewer
    than :func:`available_cores`."""
    found = [n for n in (_cgroup_cpus(), _cgroup_quota_cpus(), _parent_cpus()) if n]
    slurm = os.environ.get("SLURM_CPUS_ON_NODE", "")
    if slurm.isdigit() and int(slurm) > 0:
        found.append(int(slurm))
    return max(min(found) if found else os.cpu_count() or 1, available_cores())


@dataclass(frozen=True)
class CoreShare:
    """How the ranks of this node share its cores, as one process sees it alone.

    Two launches look alike from one rank's affinity mask: ranks left to share
    every core (each mask is the node's), and ranks each bound to a share of
    their own (each mask is smaller than the node's). In the second, the
    ranks run on the node's cores together. What one process cannot see: a
    rank started through a wrapper that was itself bound (its parent's mask is
    its own), which then counts as sharing; the collectives, which can ask
    the others, also compare the ranks' masks (:func:`oversubscribed_anywhere`).
    """

    #: Ranks on this node, as the launcher announced them (None: not announced).
    local_ranks: int | None
    #: Cores this process may run on (:func:`available_cores`).
    cores: int
    #: CPUs the node's ranks may share (:func:`node_cpus`).
    node_cores: int

    @property
    def bound(self) -> bool:
        """Whether the launcher gave this rank a share of the node's cores."""
        return self.cores < self.node_cores

    @property
    def capacity(self) -> int:
        """Cores the ranks of this node run on together."""
        return self.node_cores if self.bound else self.cores

    @property
    def oversubscribed(self) -> bool:
        """More ranks on this node than cores for them."""
        return self.local_ranks is not None and self.local_ranks > self.capacity

    @property
    def threads(self) -> int:
        """Threads for this rank: its cores when bound to a share of its own,
        else the shared cores divided by the ranks (at least 1)."""
        return max(1, min(self.cores, self.capacity // (self.local_ranks or 1)))


def launch_estimate() -> CoreShare:
    """This node's :class:`CoreShare` (local call, before or after ``MPI_Init``)."""
    return CoreShare(local_ranks=_local_ranks_announced(), cores=available_cores(),
                     node_cores=node_cpus())


def sharing_facts() -> tuple[str, tuple[int, ...], bool]:
    """What :func:`oversubscribed_anywhere` needs from this rank: its host, its
    affinity mask and its own estimate (local call)."""
    try:
        mask = tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux: no mask to compare
        mask = ()
    return platform.node(), mask, launch_estimate().oversubscribed


def oversubscribed_anywhere(facts: list[tuple[str, tuple[int, ...], bool]]) -> bool:
    """Whether any node of a communicator has more ranks than cores for them,
    given every rank's :func:`sharing_facts`: a rank's estimate says so, or
    the ranks of one host outnumber the union of their masks (which catches
    ranks confined together, e.g. ``taskset -c 0 mpiexec -n 2``)."""
    if any(estimate for _, _, estimate in facts):
        return True
    masks: dict[str, set[int]] = {}
    ranks: dict[str, int] = {}
    for host, mask, _ in facts:
        if mask:
            masks.setdefault(host, set()).update(mask)
            ranks[host] = ranks.get(host, 0) + 1
    return any(ranks[host] > len(cores) for host, cores in masks.items())


def _configure_environment() -> None:
    """Set MPI defaults in ``os.environ``; runs once, before MPI is imported."""
    env = os.environ
    if launch_estimate().oversubscribed:
        env.setdefault("MPI4PY_RC_THREAD_LEVEL", "multiple")
        env.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")
        env.setdefault("MPIR_CVAR_POLLS_BEFORE_YIELD", "100")
        env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    else:
        env.setdefault("MPI4PY_RC_THREAD_LEVEL", "funneled")


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
