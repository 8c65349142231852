"""Launching MPI jobs from Python: where mpiexec and mpidp are, and a clean environment.

The benchmarks (``mpidp bench prep``, ``bench scaling``) and the audit driver
launch ``mpiexec -n P mpidp ...`` themselves. This module sits beside
:mod:`collectives.runtime` (the MPI start-up of the launched ranks) so that
both ``engine`` and ``preprocessing`` can use it; it does not import MPI.
In a virtual environment that was never activated (``make test`` runs
``.venv/bin/python`` directly) neither ``mpiexec`` (from the ``mpich`` wheel)
nor ``mpidp`` is on ``PATH``; both sit next to the interpreter, so look there
first.
"""
from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

#: Variables of an MPI job we may be running inside; a child launch must not
#: inherit them or its mpiexec joins (or confuses) the parent's job.
_JOB_VARIABLES = ("PMI_", "MPI_LOCAL", "OMPI_", "PMIX_", "HYDRA_", "MV2_COMM_WORLD_", "PALS_")
#: Open MPI settings that are the user's, not a job's: always passed on.
_USER_VARIABLES = ("OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM")


#: The variables this process's start-up set itself, as ``NAME=value`` joined
#: by commas, so that a job it launches chooses its own
#: (:func:`child_env`, :func:`defaults_set_here`; set by
#: :mod:`collectives.runtime`).
SET_HERE = "MPIDP_MPI_DEFAULTS_SET"


def defaults_set_here(env: "os._Environ[str] | dict[str, str]") -> set[str]:
    """Names of the variables in ``env`` that an mpidp start-up set (and that
    still hold the value it set: one changed since is someone's choice)."""
    recorded = dict(item.split("=", 1) for item in env.get(SET_HERE, "").split(",")
                    if "=" in item)
    return {name for name, value in recorded.items() if env.get(name) == value}


class LaunchError(Exception):
    """A launch command that cannot be used; a user error (``exit_code``, see
    :mod:`engine.spmd`)."""

    exit_code = 2


class ToolNotFound(LaunchError):
    """An executable (mpiexec, mpidp, srun...) is neither next to Python nor on PATH."""


def find_tool(name: str) -> str:
    """Absolute path of ``name``: next to ``sys.executable`` first, then ``PATH``.

    Raises :class:`ToolNotFound` with a hint when it is in neither place.
    """
    if os.sep in name:
        if os.access(name, os.X_OK):
            return name
        raise ToolNotFound(f"{name} is not an executable file")
    local = Path(sys.executable).parent / name
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    found = shutil.which(name)
    if found is None:
        hint = (" (pip install mpich, or load your site's MPI module)"
                if name in ("mpiexec", "mpirun") else "")
        raise ToolNotFound(f"{name} not found next to {sys.executable} or on PATH{hint}")
    return found


def launcher_words(template: str, ranks: int) -> list[str]:
    """``template`` (e.g. ``'mpiexec -n {ranks}'``) filled in and split, as a user
    would type it. Raises :class:`LaunchError` for a template that cannot be
    filled in or split, or is empty."""
    try:
        words = shlex.split(template.format(ranks=ranks))
    except (KeyError, IndexError, ValueError) as exc:
        raise LaunchError(f"launch command {template!r} cannot be used ({exc}); the only "
                          "placeholder is {ranks}, e.g. 'srun -n {ranks} --mpi=pmi2'") from None
    if not words:
        raise ToolNotFound("the launch command is empty")
    return words


def launcher_argv(template: str, ranks: int) -> list[str]:
    """:func:`launcher_words` with the program resolved by :func:`find_tool`."""
    words = launcher_words(template, ranks)
    return [find_tool(words[0]), *words[1:]]


def child_env(**extra: str) -> dict[str, str]:
    """This environment without the variables of the MPI job we may be inside,
    plus ``extra``, and without the MPI defaults mpidp's start-up set in this
    process (its ranks choose their own). The user's Open MPI settings stay:
    the permission to run as root, and outside an Open MPI job every
    ``OMPI_MCA_`` parameter (inside one, its launcher's are mixed with them
    and all go)."""
    inside_open_mpi = "OMPI_COMM_WORLD_SIZE" in os.environ

    def kept(name: str) -> bool:
        if name in _USER_VARIABLES:
            return True
        if name.startswith("OMPI_MCA_") and not inside_open_mpi:
            return True
        return not name.startswith(_JOB_VARIABLES)

    # the MPI defaults this process's start-up chose for itself: the launched
    # job's ranks choose their own (SET_HERE)
    ours = defaults_set_here(os.environ) | {SET_HERE}
    env = {k: v for k, v in os.environ.items() if kept(k) and k not in ours}
    env.update(extra)
    return env
