"""The ``mpidp`` command: one SPMD program with subcommands.

Every rank parses the same command line and runs the same subcommand
(``mpiexec -n 4 mpidp train ...``). Each subcommand lives in the package that
owns its work and is named here in :data:`COMMANDS` as a module that provides

* ``add_arguments(parser: argparse.ArgumentParser) -> None`` and
* ``run(args: argparse.Namespace) -> int | None``.

Those modules import only argparse-level things at the top, so ``mpidp
--help`` stays fast; the heavy imports (torch, h5py) happen inside ``run``.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

from engine import __version__

#: Commands that run even when MPI's size disagrees with the launcher's (they
#: diagnose it); every other command refuses to run (``LaunchError``).
DIAGNOSTIC_COMMANDS = {"info"}

#: name -> (module, one-line help). ``bench`` groups the benchmarks.
COMMANDS: dict[str, tuple[str, str]] = {
    "info": ("engine.info",
             "versions, MPI library, ranks, kernels, threads (paste into bug reports)"),
    "train": ("engine.train", "train a model with DP-SGD (or --no-dp) over MPI ranks"),
    "eval": ("engine.evaluate", "accuracy and loss of a checkpoint on a prepared file"),
    "audit": ("engine.audit.command",
              "attack a checkpoint: membership inference and model inversion"),
    "privacy": ("engine.dp.privacy", "epsilon from (q, sigma, steps, delta), or sigma from a "
                "target epsilon (offline)"),
    "prep": ("preprocessing.prep",
             "PUMS person files -> cleaned, encoded, shuffled HDF5 (parallel over ranks)"),
    "synth": ("preprocessing.synth",
              "write a synthetic PUMS person file (official 2018 header) for demos/benchmarks"),
}

#: mpidp bench <name>: benchmarks that print ratios measured side by side.
BENCHMARKS: dict[str, tuple[str, str]] = {
    "allreduce": ("collectives.bench",
                  "all-reduce algorithms vs MPI_Allreduce, OSU / nccl-tests style"),
    "dpsgd": ("engine.bench.dpsgd", "DP-SGD vs non-DP, naive per-example loop and Opacus, "
              "side by side"),
    "prep": ("preprocessing.bench",
             "mpidp prep end to end at 1 and 2 ranks vs a one-process polars pipeline"),
    "scaling": ("engine.bench.scaling", "mpidp train at several rank counts: time per "
                "epoch, speed-up, comm/compute, time to accuracy, cost"),
}


class _RankZeroParser(argparse.ArgumentParser):
    """Prints usage, help and parse errors on rank 0 only.

    Every rank parses the same command line, so every rank reaches the same
    verdict; one copy of the message is enough.
    """

    def _print_message(self, message, file=None):
        from collectives.runtime import MPI

        if MPI.COMM_WORLD.Get_rank() == 0:
            super()._print_message(message, file)


def _add_command(subparsers, name: str, module_name: str, help_text: str):
    module = importlib.import_module(module_name)
    parser = subparsers.add_parser(
        name, help=help_text, description=(module.__doc__ or help_text).strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(parser)
    parser.set_defaults(_run=module.run, _command=name)
    return parser


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The full argument parser (every subcommand registered); with ``only``,
    the modules of the other commands are not imported (start-up time)."""
    parser = _RankZeroParser(
        prog="mpidp",
        description="MPI-based engine for differentially private training (DP-SGD) "
        "on ACS PUMS census microdata. Run it under mpiexec or srun; every rank "
        "runs the same command.",
        epilog="Example: mpiexec -n 2 mpidp info",
    )
    parser.add_argument("--version", action="version", version=f"mpidp {__version__}")
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        if only is None or name == only:
            _add_command(subparsers, name, module_name, help_text)
        else:  # listed by name only: its module (maybe torch) is not imported
            subparsers.add_parser(name, help=help_text)
    if BENCHMARKS and only in (None, "bench"):
        bench = subparsers.add_parser(
            "bench", help="benchmarks: " + ", ".join(BENCHMARKS),
            description="Benchmarks. Each prints ratios measured side by side in "
            "one run (ours against a reference), never absolute claims alone.")
        bench_sub = bench.add_subparsers(title="benchmarks", metavar="BENCHMARK")
        for name, (module_name, help_text) in BENCHMARKS.items():
            _add_command(bench_sub, name, module_name, help_text)
        bench.set_defaults(_run=lambda args: bench.error("choose a benchmark"), _command="bench")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mpidp`` console script (every rank calls it)."""
    from engine.spmd import run_spmd

    # Parsing is collective by nature (same argv everywhere), so a usage
    # error exits every rank with code 2 without aborting the job.
    words = list(sys.argv[1:] if argv is None else argv)
    chosen = next((w for w in words if not w.startswith("-")), None)
    parser = build_parser(only=chosen if chosen in COMMANDS or chosen == "bench" else None)
    args = parser.parse_args(words)
    if not hasattr(args, "_run"):
        parser.print_help()
        return 2

    def command() -> int | None:
        if args._command not in DIAGNOSTIC_COMMANDS:
            from collectives.runtime import check_launch

            check_launch()  # N singletons would all "succeed" on 1/N of the work
        return args._run(args)

    return run_spmd(command)


if __name__ == "__main__":
    sys.exit(main())
