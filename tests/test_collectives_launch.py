"""Finding mpiexec/mpidp for the commands that launch them (no MPI needed)."""
import os
import sys
from pathlib import Path

import pytest

from collectives.launch import LaunchError, ToolNotFound, child_env, find_tool, launcher_argv


def test_the_tool_next_to_the_interpreter_wins_over_path(monkeypatch, tmp_path):
    """make test runs .venv/bin/python without activating the venv: mpiexec is
    not on PATH, but it is next to the interpreter."""
    monkeypatch.setenv("PATH", str(tmp_path))
    here = Path(sys.executable).parent / "mpiexec"
    if not here.exists():
        pytest.skip("no mpiexec next to this Python (not a pip-MPICH environment)")
    assert find_tool("mpiexec") == str(here)


def test_a_missing_tool_is_a_user_error_with_a_hint(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    with pytest.raises(ToolNotFound, match=r"mpirun not found .*\(pip install mpich"):
        find_tool("mpirun")
    assert ToolNotFound.exit_code == 2


def test_the_path_is_searched_and_explicit_paths_are_checked(monkeypatch, tmp_path):
    tool = tmp_path / "srun"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_tool("srun") == str(tool)
    assert find_tool(str(tool)) == str(tool)
    with pytest.raises(ToolNotFound, match="not an executable"):
        find_tool(str(tmp_path / "nothing"))


def test_launcher_template(monkeypatch, tmp_path):
    tool = tmp_path / "srun"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert launcher_argv("srun -n {ranks} --mpi=pmi2", 4) == [str(tool), "-n", "4",
                                                              "--mpi=pmi2"]
    for bad in ("srun -n {rank}", "srun -n {}", "srun 'unclosed", ""):
        with pytest.raises(LaunchError):
            launcher_argv(bad, 2)


def test_child_env_drops_the_variables_of_the_enclosing_job(monkeypatch):
    monkeypatch.setenv("PMI_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    monkeypatch.setenv("PALS_LOCAL_SIZE", "2")
    monkeypatch.setenv("KEEP_ME", "yes")
    env = child_env(EXTRA="1")
    assert "PMI_RANK" not in env and "OMPI_COMM_WORLD_SIZE" not in env
    assert "PALS_LOCAL_SIZE" not in env
    assert env["KEEP_ME"] == "yes" and env["EXTRA"] == "1"
    assert os.environ["PMI_RANK"] == "1"


def test_child_env_keeps_the_users_open_mpi_settings(monkeypatch):
    """`mpidp bench prep` run as root under Open MPI launched mpiexec without
    OMPI_ALLOW_RUN_AS_ROOT, which then refused to start."""
    for name in list(os.environ):
        if name.startswith(("OMPI_", "PMI_", "PMIX_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT", "1")
    monkeypatch.setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    monkeypatch.setenv("OMPI_MCA_osc", "^ucx")
    env = child_env()
    assert env["OMPI_ALLOW_RUN_AS_ROOT"] == env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"
    assert env["OMPI_MCA_osc"] == "^ucx"
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")  # inside a job: its MCA settings go
    monkeypatch.setenv("OMPI_MCA_num_procs", "2")
    env = child_env()
    assert "OMPI_MCA_num_procs" not in env and "OMPI_MCA_osc" not in env
    assert env["OMPI_ALLOW_RUN_AS_ROOT"] == "1"
