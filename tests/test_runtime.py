"""collectives.runtime: launch checks and oversubscription defaults."""
import pytest

from collectives import runtime


def test_size_mismatch_detected_from_slurm(monkeypatch):
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "8")
    for name in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    info = runtime.launch_info(runtime.MPI.COMM_SELF)
    assert info.size == 1 and info.expected_size == 8 and info.size_mismatch
    with pytest.raises(runtime.LaunchError, match="--mpi=pmi2"):
        runtime.check_launch(runtime.MPI.COMM_SELF)


def test_batch_script_itself_is_not_a_task(monkeypatch):
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "8")
    for name in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert not runtime.launch_info(runtime.MPI.COMM_SELF).size_mismatch


def test_pmi_size_agreeing_is_fine(monkeypatch):
    monkeypatch.setenv("PMI_SIZE", "1")
    assert runtime.check_launch(runtime.MPI.COMM_SELF).expected_size == 1


def test_oversubscription_defaults(monkeypatch):
    monkeypatch.setenv("MPI_LOCALNRANKS", str(runtime.available_cores() + 2))
    for name in ("MPI4PY_RC_THREAD_LEVEL", "MPIR_CVAR_ENABLE_HEAVY_YIELD"):
        monkeypatch.delenv(name, raising=False)
    runtime._configure_environment()
    import os

    assert os.environ["MPIR_CVAR_ENABLE_HEAVY_YIELD"] == "1"
    assert os.environ["MPI4PY_RC_THREAD_LEVEL"] == "multiple"


def test_user_settings_are_respected(monkeypatch):
    monkeypatch.setenv("MPI_LOCALNRANKS", "1")
    monkeypatch.setenv("MPI4PY_RC_THREAD_LEVEL", "serialized")
    runtime._configure_environment()
    import os

    assert os.environ["MPI4PY_RC_THREAD_LEVEL"] == "serialized"


def test_cuda_support_override(monkeypatch):
    monkeypatch.setenv("MPIDP_CUDA_AWARE", "1")
    assert runtime.mpi_cuda_support() is True
    monkeypatch.setenv("MPIDP_CUDA_AWARE", "0")
    assert runtime.mpi_cuda_support() is False


def test_importing_mpi4py_first_is_reported_when_it_matters():
    """Settings come too late when mpi4py.MPI was imported first; with more
    ranks than cores that costs, and the user is told (once, a warning)."""
    import subprocess
    import sys

    code = "from mpi4py import MPI; import collectives"
    env = dict(__import__("os").environ, MPI_LOCALNRANKS="64")
    env.pop("MPIR_CVAR_ENABLE_HEAVY_YIELD", None)
    late = subprocess.run([sys.executable, "-W", "always", "-c", code], env=env,
                          capture_output=True, text=True, timeout=60)
    assert late.returncode == 0, late.stderr
    assert "import collectives first" in late.stderr
    early = subprocess.run([sys.executable, "-W", "always", "-c",
                            "import collectives; from mpi4py import MPI"], env=env,
                           capture_output=True, text=True, timeout=60)
    assert "import collectives first" not in early.stderr


@pytest.mark.parametrize("local, cores, node, bound, oversubscribed, threads", [
    (None, 8, 8, False, False, 8),   # a process alone: all its cores
    (2, 2, 2, False, False, 1),      # mpiexec -n 2 on 2 cores, unbound
    (4, 2, 2, False, True, 1),       # 4 ranks share 2 cores
    (2, 1, 2, True, False, 1),       # Open MPI at 2 ranks, -bind-to core: a core each
    (4, 4, 16, True, False, 4),      # srun -n 4 --cpus-per-task=4: 4 cores each
    (4, 1, 2, True, True, 1),        # -bind-to core with 4 ranks on 2 cores: wrapped
    (16, 8, 8, False, True, 1),      # a Slurm step's cpuset of 8 for 16 unbound ranks
    (2, 2, 3, True, False, 1),       # masks that must overlap: 2 x 2 on 3 cores
])
def test_core_share(local, cores, node, bound, oversubscribed, threads):
    share = runtime.CoreShare(local_ranks=local, cores=cores, node_cores=node)
    assert (share.bound, share.oversubscribed, share.threads) == (bound, oversubscribed,
                                                                  threads)


def test_cpu_lists_are_counted():
    assert runtime._cpu_list_size("0-3,8,10-11\n") == 7
    assert runtime._cpu_list_size("5") == 1
    assert runtime._cpu_list_size("") is None and runtime._cpu_list_size("0-x") is None


def test_node_cpus_takes_the_narrowest_source(monkeypatch):
    monkeypatch.setattr(runtime, "available_cores", lambda: 1)
    monkeypatch.setattr(runtime, "_cgroup_cpus", lambda: 64)
    monkeypatch.setattr(runtime, "_parent_cpus", lambda: 64)
    monkeypatch.setenv("SLURM_CPUS_ON_NODE", "8")
    assert runtime.node_cpus() == 8                    # the job's share of the node
    monkeypatch.delenv("SLURM_CPUS_ON_NODE")
    monkeypatch.setattr(runtime, "_parent_cpus", lambda: 1)  # taskset -c 0 mpiexec
    assert runtime.node_cpus() == 1
    monkeypatch.setattr(runtime, "_parent_cpus", lambda: None)
    monkeypatch.setattr(runtime, "_cgroup_cpus", lambda: None)
    monkeypatch.setattr(runtime.os, "cpu_count", lambda: 32)
    assert runtime.node_cpus() == 32
    monkeypatch.setattr(runtime, "available_cores", lambda: 48)  # never below our own
    assert runtime.node_cpus() == 48


def test_bound_ranks_keep_funneled_and_no_yield(monkeypatch):
    """Two ranks each bound to a core of their own are not oversubscribed:
    MPI keeps its fast thread level and waiting ranks keep their cores."""
    monkeypatch.setenv("MPI_LOCALNRANKS", "2")
    monkeypatch.setattr(runtime, "available_cores", lambda: 1)
    monkeypatch.setattr(runtime, "node_cpus", lambda: 2)
    for name in ("MPI4PY_RC_THREAD_LEVEL", "MPIR_CVAR_ENABLE_HEAVY_YIELD",
                 "OMPI_MCA_mpi_yield_when_idle"):
        monkeypatch.delenv(name, raising=False)
    runtime._configure_environment()
    import os

    assert os.environ["MPI4PY_RC_THREAD_LEVEL"] == "funneled"
    assert "MPIR_CVAR_ENABLE_HEAVY_YIELD" not in os.environ
    monkeypatch.setattr(runtime, "node_cpus", lambda: 1)  # both on one core
    monkeypatch.delenv("MPI4PY_RC_THREAD_LEVEL")
    runtime._configure_environment()
    assert os.environ["MPIR_CVAR_ENABLE_HEAVY_YIELD"] == "1"
    assert os.environ["OMPI_MCA_mpi_yield_when_idle"] == "1"


@pytest.mark.parametrize("facts, expected", [
    ([("a", (0,), False), ("a", (1,), False)], False),         # a core each
    ([("a", (0,), False), ("a", (0,), False)], True),          # taskset -c 0 mpiexec -n 2
    ([("a", (0, 1), False), ("b", (0, 1), False)], False),     # two nodes
    ([("a", (0,), False), ("b", (0,), False), ("b", (0,), False)], True),
    ([("a", (0, 1), True), ("a", (0, 1), False)], True),       # one rank's estimate
    ([("a", (), False), ("a", (), False)], False),             # no masks to compare
])
def test_oversubscribed_anywhere(facts, expected):
    assert runtime.oversubscribed_anywhere(facts) is expected


def _fake_cgroups(monkeypatch, tmp_path, listing: str, files: dict[str, str]) -> None:
    """/proc/self/cgroup and the cgroup files under tmp_path."""
    (tmp_path / "proc").write_text(listing)
    for name, text in files.items():
        path = tmp_path / "sys" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    monkeypatch.setattr(runtime, "_PROC_CGROUP", str(tmp_path / "proc"))
    monkeypatch.setattr(runtime, "_CGROUP_ROOT", str(tmp_path / "sys"))


def test_cgroup_v2_cpuset_and_quota(monkeypatch, tmp_path):
    _fake_cgroups(monkeypatch, tmp_path, "0::/job_7/step_0\n", {
        "job_7/step_0/cpuset.cpus.effective": "4-7\n",
        "job_7/step_0/cpu.max": "150000 100000\n"})
    assert runtime._cgroup_cpus() == 4
    assert runtime._cgroup_quota_cpus() == 2  # 1.5 CPUs' time, rounded up
    (tmp_path / "sys" / "job_7/step_0/cpu.max").write_text("max 100000\n")
    assert runtime._cgroup_quota_cpus() is None


def test_cgroup_v1_cpuset_and_quota(monkeypatch, tmp_path):
    _fake_cgroups(monkeypatch, tmp_path, "4:cpu,cpuacct:/docker/abc\n3:cpuset:/docker/abc\n", {
        "cpuset/docker/abc/cpuset.effective_cpus": "0,2,4\n",
        "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "200000\n",
        "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n"})
    assert runtime._cgroup_cpus() == 3
    assert runtime._cgroup_quota_cpus() == 2
    (tmp_path / "sys" / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us").write_text("-1\n")
    assert runtime._cgroup_quota_cpus() is None


def test_a_cpu_quota_caps_the_cores_and_the_node(monkeypatch, tmp_path):
    """A container run with --cpus=2 sees every CPU of a 64-CPU host: four
    unbound ranks there share two CPUs' time, one thread each."""
    _fake_cgroups(monkeypatch, tmp_path, "0::/\n", {"cpu.max": "200000 100000\n"})
    monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setenv("MPI_LOCALNRANKS", "4")
    monkeypatch.delenv("SLURM_CPUS_ON_NODE", raising=False)
    share = runtime.launch_estimate()
    assert (share.cores, share.node_cores) == (2, 2)
    assert share.oversubscribed and share.threads == 1


@pytest.mark.parametrize("name", ["MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE",
                                  "MV2_COMM_WORLD_LOCAL_SIZE", "PALS_LOCAL_SIZE"])
def test_each_launchers_local_rank_count_is_read(monkeypatch, name):
    """Hydra (MPICH, Intel MPI), Open MPI, MVAPICH2's mpirun_rsh and HPE Cray's
    PALS each announce the ranks on the node under their own name."""
    for other in runtime._LOCAL_SIZE_VARIABLES + ("SLURM_PROCID",):
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(name, "6")
    assert runtime.launch_estimate().local_ranks == 6
