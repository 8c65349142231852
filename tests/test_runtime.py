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


def test_bound_ranks_keep_funneled_and_no_yield(monkeypatch):
    """Two ranks each bound to a core of their own are not oversubscribed:
    MPI keeps its fast thread level and waiting ranks keep their cores."""
    monkeypatch.setenv("MPI_LOCALNRANKS", "2")
    from collectives import cores

    monkeypatch.setattr(cores, "_cores_under", lambda quota: 1)
    monkeypatch.setattr(cores, "_node_cpus", lambda quota, mine: 2)
    for name in ("MPI4PY_RC_THREAD_LEVEL", "MPIR_CVAR_ENABLE_HEAVY_YIELD",
                 "OMPI_MCA_mpi_yield_when_idle"):
        monkeypatch.delenv(name, raising=False)
    runtime._configure_environment()
    import os

    assert os.environ["MPI4PY_RC_THREAD_LEVEL"] == "funneled"
    assert "MPIR_CVAR_ENABLE_HEAVY_YIELD" not in os.environ
    monkeypatch.setattr(cores, "_node_cpus", lambda quota, mine: 1)  # both on one core
    monkeypatch.delenv("MPI4PY_RC_THREAD_LEVEL")
    runtime._configure_environment()
    assert os.environ["MPIR_CVAR_ENABLE_HEAVY_YIELD"] == "1"
    assert os.environ["OMPI_MCA_mpi_yield_when_idle"] == "1"


@pytest.mark.parametrize("name", ["MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE",
                                  "MV2_COMM_WORLD_LOCAL_SIZE", "PALS_LOCAL_SIZE"])
def test_each_launchers_local_rank_count_is_read(monkeypatch, name):
    """Hydra (MPICH, Intel MPI), Open MPI, MVAPICH2's mpirun_rsh and HPE Cray's
    PALS each announce the ranks on the node under their own name."""
    for other in runtime._LOCAL_SIZE_VARIABLES + ("SLURM_PROCID",):
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(name, "6")
    assert runtime.launch_estimate().local_ranks == 6


def test_the_defaults_set_here_are_named_and_not_handed_to_a_launched_job(monkeypatch):
    """`mpidp bench scaling` (one process, funneled) launched `mpiexec -n 4` on
    2 cores whose ranks inherited its funneled and no yield settings, and spun."""
    import os

    from collectives.launch import child_env

    for name in ("MPI4PY_RC_THREAD_LEVEL", "MPIR_CVAR_ENABLE_HEAVY_YIELD", runtime.SET_HERE):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("MPI_LOCALNRANKS", raising=False)
    runtime._configure_environment()  # a process alone: funneled
    assert os.environ["MPI4PY_RC_THREAD_LEVEL"] == "funneled"
    assert os.environ[runtime.SET_HERE] == "MPI4PY_RC_THREAD_LEVEL=funneled"
    env = child_env()
    assert "MPI4PY_RC_THREAD_LEVEL" not in env and runtime.SET_HERE not in env
    # a child that inherited them anyway (a plain subprocess) chooses again
    monkeypatch.setenv("MPI_LOCALNRANKS", str(runtime.available_cores() + 2))
    runtime._configure_environment()
    assert os.environ["MPI4PY_RC_THREAD_LEVEL"] == "multiple"
    assert "MPIR_CVAR_ENABLE_HEAVY_YIELD=1" in os.environ[runtime.SET_HERE].split(",")
    # the user's own setting is neither changed nor dropped
    monkeypatch.setenv("MPI4PY_RC_THREAD_LEVEL", "serialized")  # set since: the user's
    runtime._configure_environment()
    assert os.environ["MPI4PY_RC_THREAD_LEVEL"] == "serialized"
    assert child_env()["MPI4PY_RC_THREAD_LEVEL"] == "serialized"
