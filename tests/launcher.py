"""Start mpidp (or a test script) under mpiexec from a test, with a timeout."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).parent / "scripts"


def mpiexec_path() -> str:
    """The mpiexec next to this Python (the pip MPICH's), else the one on PATH."""
    candidate = Path(sys.executable).parent / "mpiexec"
    found = str(candidate) if candidate.exists() else shutil.which("mpiexec")
    if found is None:
        raise RuntimeError("mpiexec not found: install the 'mpich' wheel or an MPI")
    return found


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without the variables of the MPI job we may be inside."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "MPI_LOCAL", "OMPI_", "PMIX_", "HYDRA_"))}
    env.update(extra)
    return env


def run_mpi(n: int, argv: list[str], timeout: float = 120, env: dict | None = None,
            cwd: str | None = None) -> subprocess.CompletedProcess:
    """Run ``mpiexec -n n argv...``; raises subprocess.TimeoutExpired on a hang."""
    env = clean_env() if env is None else env
    env.setdefault("MPIEXEC_TIMEOUT", str(int(timeout) + 5))
    return subprocess.run([mpiexec_path(), "-n", str(n), *argv], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=cwd)


def mpidp(n: int, *args: str, **kwargs) -> subprocess.CompletedProcess:
    """Run ``mpiexec -n n mpidp args...`` through this Python."""
    return run_mpi(n, [sys.executable, "-m", "engine.cli", *args], **kwargs)
