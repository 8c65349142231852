"""Start mpidp (or a test script) under mpiexec from a test, with a timeout."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from collectives.launch import child_env as clean_env, find_tool

SCRIPTS = Path(__file__).parent / "scripts"


def mpiexec_path() -> str:
    """The mpiexec next to this Python (the pip MPICH's), else the one on PATH."""
    return find_tool("mpiexec")


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
