"""What a measurement ran on: CPU model, vector extensions, MPI library, host.

Every benchmark prints this in its header and JSON, and the all-reduce tuner
keys its cache by it, because a figure or a choice measured on one CPU need
not hold on the next.
"""
from __future__ import annotations

import functools
import platform
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


def vector_extensions() -> list[str]:
    """The :data:`VECTOR_FLAGS` this CPU has (empty off x86 or without /proc)."""
    flags = set((_cpuinfo_field("flags") or "").split())
    return [flag for flag in VECTOR_FLAGS if flag in flags]


def mpi_library() -> str:
    """The first line of the MPI library's version string."""
    return MPI.Get_library_version().strip().splitlines()[0].strip()


def describe() -> dict:
    """Host, CPU model, vector extensions, cores and MPI library, for a JSON."""
    return {"host": platform.node(), "cpu": cpu_model(),
            "vector_extensions": vector_extensions(), "cores": available_cores(),
            "mpi": mpi_library()}


def one_line(facts: dict | None = None) -> str:
    """:func:`describe` as one header line."""
    facts = facts or describe()
    vector = ", ".join(facts["vector_extensions"]) or "no vector extensions listed"
    return (f"{facts['cpu']} ({vector}), {facts['cores']} cores, {facts['host']}; "
            f"{facts['mpi']}")
