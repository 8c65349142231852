"""The subcommands collectives adds to ``mpidp`` (composed by :mod:`engine.cli`).

Each entry is ``name -> (module, one-line help)``; the module provides
``add_arguments(parser)`` and ``run(args)`` and is imported only when its
command is chosen, so this table stays free of imports.
"""
from __future__ import annotations

#: mpidp <name>
COMMANDS: dict[str, tuple[str, str]] = {}

#: mpidp bench <name>
BENCHMARKS: dict[str, tuple[str, str]] = {
    "allreduce": ("collectives.bench.allreduce",
                  "all-reduce algorithms vs MPI_Allreduce, OSU / nccl-tests style"),
}
