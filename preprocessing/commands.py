"""The subcommands preprocessing adds to ``mpidp`` (composed by :mod:`engine.cli`).

Each entry is ``name -> (module, one-line help)``; the module provides
``add_arguments(parser)`` and ``run(args)`` and is imported only when its
command is chosen, so this table stays free of imports.
"""
from __future__ import annotations

#: mpidp <name>
COMMANDS: dict[str, tuple[str, str]] = {
    "prep": ("preprocessing.prep",
             "PUMS person files -> cleaned, encoded, shuffled HDF5 (parallel over ranks)"),
    "synth": ("preprocessing.synth",
              "write a synthetic PUMS person file (official 2018 header) for demos/benchmarks"),
}

#: mpidp bench <name>
BENCHMARKS: dict[str, tuple[str, str]] = {
    "prep": ("preprocessing.bench",
             "mpidp prep end to end at 1 and 2 ranks vs a one-process polars pipeline"),
}
