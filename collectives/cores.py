"""How the ranks of a node share its cores.

A rank's affinity mask alone cannot tell ranks left to share every core
from ranks a launcher bound to cores of their own (``srun --cpu-bind``,
Open MPI's default at two ranks, Hydra's ``-bind-to core``): alone, a rank
also counts the node's cores from the job's share of it (the cgroup's
cpuset and CPU quota, ``SLURM_CPUS_ON_NODE``) and from the mask of the
launcher's process on the node (:class:`CoreShare`); together, the ranks
compare their masks (:func:`node_views`). Docs: docs/design/bound-ranks.md.
No MPI here: :mod:`collectives.runtime` uses it before ``MPI_Init``.
"""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["CoreShare", "RankFacts", "available_cores", "node_cpus", "node_views",
           "oversubscribed_anywhere", "rank_facts", "share_alone"]


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, and no more than its
    cgroup's CPU quota), at least 1."""
    return _cores_under(_cgroup_quota_cpus())


def _cores_under(quota: int | None) -> int:
    """:func:`available_cores` with the quota already read."""
    try:
        mask = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)
    return max(1, min(mask, quota or mask))


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
        cpus = _quota_cpus(*text) if len(text) == 2 else None
        if cpus:
            return cpus
    v1 = _cgroup_files(None, "cpu", ("cpu.cfs_quota_us", "cpu.cfs_period_us"))
    for quota_name, period_name in zip(v1[0::2], v1[1::2]):
        cpus = _quota_cpus((_read_text(quota_name) or "").strip(),
                           (_read_text(period_name) or "").strip())
        if cpus:
            return cpus
    return None


def _quota_cpus(quota: str, period: str) -> int | None:
    """CPUs' worth of a CPU quota per period (rounded up, at least 1), or None
    where either is not a number ("max": no quota) or the period is 0."""
    if not (quota.isdigit() and period.isdigit() and int(period)):
        return None
    return max(1, -(-int(quota) // int(period)))


#: Names (as in /proc/PID/comm) of the per-node processes of launchers, which
#: keep the mask they narrow for their ranks: Hydra's proxy, Slurm's step
#: daemon, Open MPI's (PRRTE's) daemons, HPE Cray PALS's, Flux's task shell.
LAUNCHER_DAEMONS = frozenset({"hydra_pmi_proxy", "pmi_proxy", "slurmstepd", "prted", "orted",
                              "prterun", "mpirun", "mpiexec", "mpiexec.hydra", "palsd",
                              "flux-shell"})
#: How far up the process tree a launcher's daemon is looked for.
ANCESTORS = 8
_PROC = "/proc"


def _parent_of(pid: int) -> tuple[str, int] | None:
    """(name, parent pid) of process ``pid`` from /proc, or None."""
    text = _read_text(f"{_PROC}/{pid}/stat")
    if not text or ")" not in text:
        return None
    name = text[text.index("(") + 1:text.rindex(")")]  # the name may hold spaces
    fields = text[text.rindex(")") + 2:].split()
    return (name, int(fields[1])) if len(fields) > 1 and fields[1].isdigit() else None


def _parent_cpus() -> int | None:
    """CPUs the launcher's daemon on this node may run on: the nearest
    ancestor named in :data:`LAUNCHER_DAEMONS` (so that a wrapper script bound
    with its rank is seen through), else the parent process; None if unknown."""
    pid = os.getppid()
    target = pid
    for _ in range(ANCESTORS):
        found = _parent_of(pid) if pid > 1 else None
        if found is None:
            break
        name, parent = found
        if name in LAUNCHER_DAEMONS:
            target = pid
            break
        pid = parent
    try:
        return len(os.sched_getaffinity(target)) or None
    except (AttributeError, OSError):
        return None


def node_cpus() -> int:
    """CPUs the ranks of this node may share, as far as one process can tell
    alone (no communication): the fewest of this process's cgroup cpuset and
    CPU quota, Slurm's CPUs for the job on this node (``SLURM_CPUS_ON_NODE``)
    and the mask of the launcher's process on the node (:func:`_parent_cpus`:
    it keeps the mask it narrows for its ranks; one itself confined, as by
    ``taskset``, passes its confinement on); ``os.cpu_count()`` where none is
    known. Never fewer than :func:`available_cores`."""
    quota = _cgroup_quota_cpus()
    return _node_cpus(quota, _cores_under(quota))


def _node_cpus(quota: int | None, cores: int) -> int:
    """:func:`node_cpus` with the quota and this process's cores already known."""
    found = [n for n in (_cgroup_cpus(), quota, _parent_cpus()) if n]
    slurm = os.environ.get("SLURM_CPUS_ON_NODE", "")
    if slurm.isdigit() and int(slurm) > 0:
        found.append(int(slurm))
    return max(min(found) if found else os.cpu_count() or 1, cores)


def share_alone(local_ranks: int | None) -> CoreShare:
    """This rank's :class:`CoreShare` from what it sees alone, given the ranks
    the launcher announced on this node."""
    return _share(local_ranks, _cgroup_quota_cpus())


def _share(local_ranks: int | None, quota: int | None) -> CoreShare:
    """:func:`share_alone` with the quota already read (each source read once)."""
    cores = _cores_under(quota)
    return CoreShare(local_ranks=local_ranks, cores=cores, node_cores=_node_cpus(quota, cores))


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


class RankFacts(NamedTuple):
    """What one rank tells the others of its node (:func:`node_views`)."""

    host: str
    #: The CPUs of its affinity mask (empty where the system has none to read).
    mask: tuple[int, ...]
    #: Its cgroup CPU quota in CPUs (None: no quota).
    quota: int | None
    #: What it made of its node alone (:class:`CoreShare`).
    estimate: CoreShare


def rank_facts(local_ranks: int | None) -> RankFacts:
    """This rank's :class:`RankFacts`, given the ranks the launcher announced
    on this node (local call)."""
    try:
        mask = tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux: no mask to compare
        mask = ()
    quota = _cgroup_quota_cpus()
    return RankFacts(platform.node(), mask, quota, _share(local_ranks, quota))


def node_views(facts: list[RankFacts]) -> list[CoreShare]:
    """Every rank's :class:`CoreShare` from the facts of all ranks of a
    communicator (index = rank).

    Where the communicator holds every rank of a host (as many as the
    launcher announced, or it announced none) the view is exact: the ranks
    there, each one's mask, the union of their masks. That is right where a
    rank's lone estimate cannot be: a rank started through a wrapper that was
    bound with it (``srun ./wrapper.sh``), or ranks confined together
    (``taskset -c 0 mpiexec -n 2``). Elsewhere (part of a host's ranks, as in
    ``mpidp tune``'s groups, or a mask missing) each rank keeps its estimate.
    """
    by_host: dict[str, list[int]] = {}
    for i, fact in enumerate(facts):
        by_host.setdefault(fact.host, []).append(i)
    views = [fact.estimate for fact in facts]
    for ranks in by_host.values():
        announced = {facts[i].estimate.local_ranks for i in ranks}
        if any(not facts[i].mask for i in ranks) or announced - {None, len(ranks)}:
            continue
        union = set().union(*(facts[i].mask for i in ranks))
        for i in ranks:
            quota = facts[i].quota or len(union)
            mine = min(len(facts[i].mask), quota)
            views[i] = CoreShare(local_ranks=len(ranks), cores=mine,
                                 node_cores=max(min(len(union), quota), mine))
    return views


def oversubscribed_anywhere(facts: list[RankFacts]) -> bool:
    """Whether any host of a communicator has more ranks than cores for them
    (:func:`node_views`; one verdict for every rank)."""
    return any(view.oversubscribed for view in node_views(facts))
