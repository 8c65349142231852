"""The ``mpidp`` command: one SPMD program with subcommands.

Every rank parses the same command line and runs the same subcommand
(``mpiexec -n 4 mpidp train ...``). Each package registers its own
subcommands in a table ``name -> (module, one-line help)``: the engine's
are :data:`ENGINE_COMMANDS` and :data:`ENGINE_BENCHMARKS` below,
preprocessing's are in :mod:`preprocessing.commands`, collectives' in
:mod:`collectives.commands`; this module composes them. A command's module
provides

* ``add_arguments(parser: argparse.ArgumentParser) -> None`` and
* ``run(args: argparse.Namespace) -> int | None``,

and is imported only when its command is chosen, so ``mpidp --help`` lists
the commands without importing any of them; command modules keep their
heavy imports (torch, h5py) inside ``run`` for the same reason.

Stop signals (SIGINT, SIGTERM, SIGUSR1) are recorded from the first line of
the engine package on (``engine/__init__.py``), before MPI, numpy or torch
load, so an early Ctrl-C never becomes a traceback (:mod:`engine.stopping`).
A command module that sets
``STOPS_AT_STEPS = True`` (``mpidp train``) acts on them itself; for every
other command they raise :class:`engine.stopping.Interrupted` once it runs.
"""
from __future__ import annotations

import argparse
import importlib
import signal
import sys
from typing import Sequence

import collectives.commands
import preprocessing.commands
from collectives import MPI
from collectives.runtime import check_launch
from engine.stopping import SIGNALS
from engine import __version__, stopping
from engine.spmd import run_spmd

#: Commands that run even when MPI's size disagrees with the launcher's (they
#: diagnose it); every other command refuses to run (``LaunchError``).
DIAGNOSTIC_COMMANDS = {"info"}

#: The engine's commands: name -> (module, one-line help).
ENGINE_COMMANDS: dict[str, tuple[str, str]] = {
    "info": ("engine.info",
             "versions, MPI library, ranks, kernels, threads (paste into bug reports)"),
    "train": ("engine.train_command", "train a model with DP-SGD (or --no-dp) over MPI ranks"),
    "eval": ("engine.evaluate", "accuracy and loss of a checkpoint on a prepared file"),
    "tune": ("engine.tune.command", "hyperparameter search: trials side by side, chosen on the "
             "val split, the tuning's privacy cost stated"),
    "audit": ("engine.audit.command",
              "attack a checkpoint: membership inference and model inversion"),
    "privacy": ("engine.dp.privacy", "epsilon from (q, sigma, steps, delta), or sigma from a "
                "target epsilon (offline)"),
    "warmup": ("engine.warmup", "pay a machine's one-time costs (kernel compiles, the "
               "all-reduce's measurements) before the runs that count"),
}

#: The engine's benchmarks (``mpidp bench <name>``).
ENGINE_BENCHMARKS: dict[str, tuple[str, str]] = {
    "accountant": ("engine.bench.accountant", "PLD calibration over a grid of (epsilon, q, "
                   "steps): seconds, peak memory, Opacus' PRV side by side"),
    "dpsgd": ("engine.bench.dpsgd", "DP-SGD vs non-DP, naive per-example loop and Opacus, "
              "side by side"),
    "noise": ("engine.bench.noise", "the Gaussian noise kernel vs torch's and numpy's "
              "samplers: ns per sample"),
    "scaling": ("engine.bench.scaling", "mpidp train at several rank counts: time per "
                "epoch, speed-up, comm/compute, time to accuracy, cost"),
}


def _compose(*tables: dict[str, tuple[str, str]]) -> dict[str, tuple[str, str]]:
    """One table from the packages' tables, in order; a name registered twice
    is a programming error."""
    merged: dict[str, tuple[str, str]] = {}
    for table in tables:
        for name, entry in table.items():
            if name in merged:
                raise ValueError(f"mpidp command {name!r} registered by {merged[name][0]} "
                                 f"and by {entry[0]}")
            merged[name] = entry
    return merged


#: Every ``mpidp <name>`` command.
COMMANDS = _compose(ENGINE_COMMANDS, preprocessing.commands.COMMANDS,
                    collectives.commands.COMMANDS)
#: Every ``mpidp bench <name>`` benchmark (they print ratios measured side by side),
#: in alphabetical order.
BENCHMARKS = dict(sorted(_compose(ENGINE_BENCHMARKS, preprocessing.commands.BENCHMARKS,
                                  collectives.commands.BENCHMARKS).items()))


class _RankZeroParser(argparse.ArgumentParser):
    """Prints usage, help and parse errors on rank 0 only.

    Every rank parses the same command line, so every rank reaches the same
    verdict; one copy of the message is enough.
    """

    def _print_message(self, message, file=None):
        if MPI.COMM_WORLD.Get_rank() == 0:
            super()._print_message(message, file)


def _add_command(subparsers, name: str, module_name: str, help_text: str):
    module = importlib.import_module(module_name)
    parser = subparsers.add_parser(
        name, help=help_text, description=(module.__doc__ or help_text).strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(parser)
    parser.set_defaults(_run=module.run, _command=name, _parser=parser)
    return parser


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The argument parser of ``mpidp``.

    Args:
        only: None registers every command in full (importing every command's
            module); a command's name (or ``"bench"``) imports that command's
            module(s) only; any other word imports none. Commands not imported
            are listed by name and help, so ``mpidp --help`` reads the same.
    """
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
    if BENCHMARKS:
        bench_help = "benchmarks: " + ", ".join(BENCHMARKS)
        if only not in (None, "bench"):
            subparsers.add_parser("bench", help=bench_help)
            return parser
        bench = subparsers.add_parser(
            "bench", help=bench_help,
            description="Benchmarks. Each prints ratios measured side by side in "
            "one run (ours against a reference), never absolute claims alone.")
        bench_sub = bench.add_subparsers(title="benchmarks", metavar="BENCHMARK")
        for name, (module_name, help_text) in BENCHMARKS.items():
            _add_command(bench_sub, name, module_name, help_text)
        bench.set_defaults(_run=lambda args: bench.error("choose a benchmark"), _command="bench")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``mpidp`` console script (every rank calls it)."""
    # Parsing is collective by nature (same argv everywhere), so a usage
    # error exits every rank with code 2 without aborting the job.
    words = list(sys.argv[1:] if argv is None else argv)
    chosen = next((w for w in words if not w.startswith("-")), None)
    known = chosen in COMMANDS or chosen == "bench"
    parser = build_parser(only=chosen if known else "")
    args, unknown = parser.parse_known_args(words)
    if unknown:  # said by the command's parser: its usage, not mpidp's
        getattr(args, "_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if not hasattr(args, "_run"):
        parser.print_help()
        return 2

    module = sys.modules.get(getattr(args._run, "__module__", ""), None)
    steps = bool(getattr(module, "STOPS_AT_STEPS", False))

    def command() -> int | None:
        with stopping.handled_signals(raising=not steps):
            if args._command not in DIAGNOSTIC_COMMANDS:
                check_launch()  # N singletons would all "succeed" on 1/N of the work
            return args._run(args)

    return run_spmd(command)


def console() -> int:
    """The ``mpidp`` console script: :func:`main`, then a stop signal that
    arrives after the command finished is ignored. The work is done and
    written by then; a Ctrl-C during MPI_Finalize would otherwise kill the
    rank *by* the signal, and mpiexec would report the job as failed."""
    code = main()  # SIGNALS: every stop signal (Slurm's time-limit warning is SIGUSR1)
    for signum in SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    return code


if __name__ == "__main__":
    sys.exit(console())
