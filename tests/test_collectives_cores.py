"""collectives.cores: how the ranks of a node share its cores."""
import pytest

from collectives import cores, runtime


@pytest.mark.parametrize("local, mask, node, bound, oversubscribed, threads", [
    (None, 8, 8, False, False, 8),   # a process alone: all its cores
    (2, 2, 2, False, False, 1),      # mpiexec -n 2 on 2 cores, unbound
    (4, 2, 2, False, True, 1),       # 4 ranks share 2 cores
    (2, 1, 2, True, False, 1),       # Open MPI at 2 ranks, -bind-to core: a core each
    (4, 4, 16, True, False, 4),      # srun -n 4 --cpus-per-task=4: 4 cores each
    (4, 1, 2, True, True, 1),        # -bind-to core with 4 ranks on 2 cores: wrapped
    (16, 8, 8, False, True, 1),      # a Slurm step's cpuset of 8 for 16 unbound ranks
    (2, 2, 3, True, False, 1),       # masks that must overlap: 2 x 2 on 3 cores
])
def test_core_share(local, mask, node, bound, oversubscribed, threads):
    share = cores.CoreShare(local_ranks=local, cores=mask, node_cores=node)
    assert (share.bound, share.oversubscribed, share.threads) == (bound, oversubscribed,
                                                                  threads)


def test_cpu_lists_are_counted():
    assert cores._cpu_list_size("0-3,8,10-11\n") == 7
    assert cores._cpu_list_size("5") == 1
    assert cores._cpu_list_size("") is None and cores._cpu_list_size("0-x") is None


def test_node_cpus_takes_the_narrowest_source(monkeypatch):
    monkeypatch.setattr(cores, "_cores_under", lambda quota: 1)
    monkeypatch.setattr(cores, "_cgroup_cpus", lambda: 64)
    monkeypatch.setattr(cores, "_parent_cpus", lambda: 64)
    monkeypatch.setenv("SLURM_CPUS_ON_NODE", "8")
    assert cores.node_cpus() == 8                    # the job's share of the node
    monkeypatch.delenv("SLURM_CPUS_ON_NODE")
    monkeypatch.setattr(cores, "_parent_cpus", lambda: 1)  # taskset -c 0 mpiexec
    assert cores.node_cpus() == 1
    monkeypatch.setattr(cores, "_parent_cpus", lambda: None)
    monkeypatch.setattr(cores, "_cgroup_cpus", lambda: None)
    monkeypatch.setattr(cores.os, "cpu_count", lambda: 32)
    assert cores.node_cpus() == 32
    monkeypatch.setattr(cores, "_cores_under", lambda quota: 48)  # never below our own
    assert cores.node_cpus() == 48


def _facts(host, mask, local=None, oversubscribed=False, quota=None):
    """A rank's facts; its estimate says ``oversubscribed`` or not."""
    estimate = cores.CoreShare(local_ranks=local, cores=len(mask) or 1, node_cores=64)
    if oversubscribed:  # e.g. a rank whose bound wrapper hid the launcher's mask
        estimate = cores.CoreShare(local_ranks=local, cores=1, node_cores=1)
    return cores.RankFacts(host, tuple(mask), quota, estimate)


@pytest.mark.parametrize("facts, expected", [
    ([_facts("a", (0,), 2), _facts("a", (1,), 2)], False),          # a core each
    ([_facts("a", (0,), 2), _facts("a", (0,), 2)], True),           # taskset -c 0 mpiexec -n 2
    ([_facts("a", (0, 1), 1), _facts("b", (0, 1), 1)], False),      # two nodes
    ([_facts("a", (0,), 1), _facts("b", (0,), 2), _facts("b", (0,), 2)], True),
    ([_facts("a", (0, 1), 4, True), _facts("a", (0, 1), 4)], True),  # part of a host: estimates
    ([_facts("a", (0,), 2, True), _facts("a", (1,), 2, True)], False),  # whole host: exact wins
    ([_facts("a", ()), _facts("a", ())], False),                    # no masks to compare
])
def test_oversubscribed_anywhere(facts, expected):
    assert cores.oversubscribed_anywhere(facts) is expected


def test_node_views_see_through_a_bound_wrapper():
    """`srun --cpus-per-task=4 ./wrapper.sh` on 16 cores: each rank's parent is
    the bound wrapper, so alone it reads 4 ranks sharing its 4 cores (1 thread);
    together the four masks cover 16 cores: 4 threads each."""
    masks = [tuple(range(4 * i, 4 * i + 4)) for i in range(4)]
    alone = cores.CoreShare(local_ranks=4, cores=4, node_cores=4)
    facts = [cores.RankFacts("n1", mask, None, alone) for mask in masks]
    assert alone.threads == 1
    views = cores.node_views(facts)
    assert [v.threads for v in views] == [4, 4, 4, 4]
    assert not any(v.oversubscribed for v in views)
    # a quota of 8 CPUs for the container holding all four
    quota = [cores.RankFacts("n1", mask, 8, alone) for mask in masks]
    assert [v.threads for v in cores.node_views(quota)] == [2, 2, 2, 2]


def test_node_views_keep_estimates_for_part_of_a_host():
    """tune's groups: two of a host's four announced ranks cannot judge the host."""
    estimate = cores.CoreShare(local_ranks=4, cores=1, node_cores=4)
    facts = [cores.RankFacts("n1", (mask,), None, estimate) for mask in (0, 1)]
    assert cores.node_views(facts) == [estimate, estimate]


def _fake_cgroups(monkeypatch, tmp_path, listing: str, files: dict[str, str]) -> None:
    """/proc/self/cgroup and the cgroup files under tmp_path."""
    (tmp_path / "proc").write_text(listing)
    for name, text in files.items():
        path = tmp_path / "sys" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    monkeypatch.setattr(cores, "_PROC_CGROUP", str(tmp_path / "proc"))
    monkeypatch.setattr(cores, "_CGROUP_ROOT", str(tmp_path / "sys"))


def test_cgroup_v2_cpuset_and_quota(monkeypatch, tmp_path):
    _fake_cgroups(monkeypatch, tmp_path, "0::/job_7/step_0\n", {
        "job_7/step_0/cpuset.cpus.effective": "4-7\n",
        "job_7/step_0/cpu.max": "150000 100000\n"})
    assert cores._cgroup_cpus() == 4
    assert cores._cgroup_quota_cpus() == 2  # 1.5 CPUs' time, rounded up
    (tmp_path / "sys" / "job_7/step_0/cpu.max").write_text("max 100000\n")
    assert cores._cgroup_quota_cpus() is None


def test_cgroup_v1_cpuset_and_quota(monkeypatch, tmp_path):
    _fake_cgroups(monkeypatch, tmp_path, "4:cpu,cpuacct:/docker/abc\n3:cpuset:/docker/abc\n", {
        "cpuset/docker/abc/cpuset.effective_cpus": "0,2,4\n",
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "200000\n",
        "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n"})
    assert cores._cgroup_cpus() == 3
    assert cores._cgroup_quota_cpus() == 2
    (tmp_path / "sys" / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us").write_text("-1\n")
    assert cores._cgroup_quota_cpus() is None


def test_a_cpu_quota_caps_the_cores_and_the_node(monkeypatch, tmp_path):
    """A container run with --cpus=2 sees every CPU of a 64-CPU host: four
    unbound ranks there share two CPUs' time, one thread each."""
    _fake_cgroups(monkeypatch, tmp_path, "0::/\n", {"cpu.max": "200000 100000\n"})
    monkeypatch.setattr(cores.os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setenv("MPI_LOCALNRANKS", "4")
    monkeypatch.delenv("SLURM_CPUS_ON_NODE", raising=False)
    share = runtime.launch_estimate()
    assert (share.cores, share.node_cores) == (2, 2)
    assert share.oversubscribed and share.threads == 1


def test_the_launchers_daemon_is_found_above_a_wrapper(monkeypatch, tmp_path):
    """python (pid 40) <- bash, bound with it (30) <- hydra_pmi_proxy (20): the
    proxy's mask is the node's share, not the wrapper's."""
    tree = {40: ("python3", 30), 30: ("bash", 20), 20: ("hydra_pmi_proxy", 10),
            10: ("mpiexec", 1)}
    masks = {30: {0}, 20: {0, 1, 2, 3}, 10: {0, 1, 2, 3}, 40: {0}}
    for pid, (name, parent) in tree.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} ({name}) S {parent} 1 1 0 -1\n")
    monkeypatch.setattr(cores, "_PROC", str(tmp_path))
    monkeypatch.setattr(cores.os, "getppid", lambda: 30)
    monkeypatch.setattr(cores.os, "sched_getaffinity", lambda pid: masks[pid])
    assert cores._parent_cpus() == 4
    tree_text = (tmp_path / "20" / "stat").read_text().replace("hydra_pmi_proxy", "sshd")
    (tmp_path / "20" / "stat").write_text(tree_text)  # no launcher known above (10 is)
    assert cores._parent_cpus() == 4  # mpiexec itself, one level up
    (tmp_path / "10" / "stat").write_text("10 (sshd) S 1 1 1 0 -1\n")
    assert cores._parent_cpus() == 1  # none at all: the parent's own mask


def test_a_process_name_with_spaces_and_parentheses_is_read(monkeypatch, tmp_path):
    (tmp_path / "77").mkdir()
    (tmp_path / "77" / "stat").write_text("77 (my (odd) prog) S 12 1 1 0 -1\n")
    monkeypatch.setattr(cores, "_PROC", str(tmp_path))
    assert cores._parent_of(77) == ("my (odd) prog", 12)
    assert cores._parent_of(78) is None  # no such process
