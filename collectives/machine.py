"""What a measurement ran on: CPU model, vector extensions, MPI library, host.

Every benchmark prints this in its header and JSON, and the all-reduce tuner
keys its cache by it, because a figure or a choice measured on one CPU need
not hold on the next. :func:`provenance` adds what a result file needs to be
measured again: the command, the date and the commit.
"""
from __future__ import annotations

import datetime
import functools
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

from collectives.runtime import MPI, available_cores

#: The x86 vector extensions worth naming, widest last (``flags`` in /proc/cpuinfo).
VECTOR_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512dq", "avx512bw", "avx512vl")


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> tuple[str, ...]:
    """The lines of /proc/cpuinfo (empty where there is none), read once."""
    try:
        return tuple(Path("/proc/cpuinfo").read_text().splitlines())
    except OSError:
        return ()


def _cpuinfo_field(name: str) -> str | None:
    for line in _cpuinfo():
        key, _, value = line.partition(":")
        if key.strip().lower() == name:
            return value.strip()
    return None


def cpu_model() -> str:
    """``model name`` from /proc/cpuinfo, else what platform says."""
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def isa_limit() -> str | None:
    """``avx2`` where ``MPIDP_ISA_LIMIT`` says the libraries were told to leave
    AVX-512 alone (``tools/as_avx2.sh``), else None."""
    return "avx2" if os.environ.get("MPIDP_ISA_LIMIT", "").strip().lower() == "avx2" else None


def vector_extensions() -> list[str]:
    """The :data:`VECTOR_FLAGS` this CPU has (empty off x86 or without /proc),
    less the AVX-512 ones under :func:`isa_limit`."""
    flags = set((_cpuinfo_field("flags") or "").split())
    limited = isa_limit() is not None
    return [flag for flag in VECTOR_FLAGS
            if flag in flags and not (limited and flag.startswith("avx512"))]


def physical_memory() -> int | None:
    """This node's memory in bytes (``SC_PHYS_PAGES``), or None where unknown."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def mpi_library() -> str:
    """The first line of the MPI library's version string (Open MPI's ends in a
    NUL character, left out)."""
    return MPI.Get_library_version().replace("\0", "").strip().splitlines()[0].strip()


def describe() -> dict:
    """Host, CPU model, vector extensions, cores and MPI library, for a JSON."""
    facts = {"host": platform.node(), "cpu": cpu_model(),
             "vector_extensions": vector_extensions(), "cores": available_cores(),
             "mpi": mpi_library()}
    limit = isa_limit()
    if limit:
        facts["isa_limit"] = f"{limit} (AVX-512 left unused on a CPU that has it)"
    return facts


def one_line(facts: dict | None = None) -> str:
    """:func:`describe` as one header line."""
    facts = facts or describe()
    vector = ", ".join(facts["vector_extensions"]) or "no vector extensions listed"
    if facts.get("isa_limit"):
        vector += f"; limited to {facts['isa_limit']}"
    return (f"{facts['cpu']} ({vector}), {facts['cores']} cores, {facts['host']}; "
            f"{facts['mpi']}")


#: The checkout mpidp runs from (the folder above ``collectives/``).
_SOURCE = Path(__file__).resolve().parent.parent


def source_commit(root: Path = _SOURCE) -> tuple[str | None, bool]:
    """(``git rev-parse --short HEAD``, whether tracked files differ from it) of
    the checkout at ``root``; (None, False) where mpidp does not run from a git
    checkout of its own (an installed copy, no git)."""
    def git(*argv: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(root), *argv], capture_output=True,
                                  text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != root.resolve():
        return None, False
    commit = git("rev-parse", "--short", "HEAD")
    return commit, bool(commit and git("status", "--porcelain", "--untracked-files=no"))


def command_line(argv: list[str] | None = None, ranks: int = 1) -> str:
    """The command as a user types it again: ``mpidp ...`` (or ``python
    script.py ...``), with ``mpiexec -n P`` in front when ``ranks`` > 1 and
    ``tools/as_avx2.sh`` in front of all under :func:`isa_limit`."""
    argv = list(sys.argv if argv is None else argv)
    program = os.path.basename(argv[0]) if argv else "python"
    if argv and Path(argv[0]).resolve() == _SOURCE / "engine" / "cli.py":
        program = "mpidp"  # python -m engine.cli: the entry point itself
    elif program.endswith(".py"):
        path = Path(argv[0]).resolve()
        shown = path.relative_to(_SOURCE) if _SOURCE in path.parents else path
        program = f"python {shown}"
    text = " ".join([program, *map(shlex.quote, argv[1:])])
    text = f"mpiexec -n {ranks} {text}" if ranks > 1 else text
    return f"tools/as_avx2.sh {text}" if isa_limit() else text


def provenance(facts: dict | None = None, argv: list[str] | None = None,
               ranks: int | None = None) -> dict:
    """The block a result file carries so that its figures can be traced and
    measured again: ``command`` (:func:`command_line`; ``ranks`` defaults to
    the size of ``COMM_WORLD``), ``date`` (UTC, ISO 8601), ``commit`` and
    ``dirty`` (:func:`source_commit`) and ``machine`` (``facts``, default
    :func:`describe`)."""
    ranks = MPI.COMM_WORLD.Get_size() if ranks is None else ranks
    commit, dirty = source_commit()
    return {"command": command_line(argv, ranks),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit, "dirty": dirty, "machine": facts or describe()}
