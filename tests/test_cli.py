"""The mpidp command line: help, version, usage errors."""
import subprocess
import sys

from engine import __version__
from engine.cli import BENCHMARKS, COMMANDS, build_parser


def _mpidp(*args):
    return subprocess.run([sys.executable, "-m", "engine.cli", *args],
                          capture_output=True, text=True, timeout=120)


def test_help_lists_every_command():
    result = _mpidp("--help")
    assert result.returncode == 0
    for name in COMMANDS:
        assert name in result.stdout
    if BENCHMARKS:
        assert "bench" in result.stdout


def test_version():
    result = _mpidp("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"mpidp {__version__}"


def test_unknown_command_is_a_usage_error():
    result = _mpidp("no-such-command")
    assert result.returncode == 2
    assert "invalid choice" in result.stderr


def test_an_unknown_option_is_named_with_its_commands_usage():
    """It came with mpidp's own usage line, which lists no option at all."""
    for words, prog in ((["train", "--data", "x.h5", "--bogus", "1"], "mpidp train"),
                        (["bench", "noise", "--bogus"], "mpidp bench noise"),
                        (["--bogus"], "mpidp")):
        result = _mpidp(*words)
        assert result.returncode == 2
        assert result.stderr.startswith(f"usage: {prog} "), result.stderr
        unknown = " ".join(w for w in words[words.index("--bogus"):])
        assert result.stderr.endswith(f"{prog}: error: unrecognized arguments: {unknown}\n")


def test_no_command_prints_help_and_fails():
    result = _mpidp()
    assert result.returncode == 2
    assert "usage: mpidp" in result.stdout


def test_every_command_has_a_description_and_a_runner():
    import argparse

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name in COMMANDS:
        sub = commands.choices[name]
        assert sub.description and len(sub.description) > 20
        assert callable(sub.get_default("_run"))


def test_a_refused_train_answers_before_torch_is_imported(tmp_path):
    """Options are checked before the trainer is imported (torch and Numba take
    over a second): a refused run exits 2 with torch never loaded."""
    code = ("import sys\nfrom engine.cli import main\n"
            "try:\n    code = main(['train', '--data', 'x.h5', '--hidden', '8,x'])\n"
            "except SystemExit as exit:\n    code = exit.code\n"
            "print(code, 'torch' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=tmp_path, timeout=60)
    assert result.stdout.split() == ["2", "False"], result.stdout + result.stderr
    assert "--hidden '8,x'" in result.stderr


def test_every_seed_option_refuses_a_negative_number(tmp_path):
    """numpy's generators refuse a negative seed with a traceback (`mpidp audit
    --seed -1`, `mpidp bench dpsgd --seed -1` printed one): every command's
    --seed refuses it as a usage error, or (prep, synth, which do not import
    the engine) as one line of their own."""
    import argparse

    import pytest

    found = {}

    def walk(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, (*path, name))
            elif "--seed" in action.option_strings:
                found[path] = action.type

    walk(build_parser(), ())
    checked_later = {path for path, kind in found.items() if kind is int}
    assert checked_later == {("prep",), ("synth",)} and len(found) >= 7
    for path, kind in found.items():
        if kind is not int:
            with pytest.raises(argparse.ArgumentTypeError, match="-1 must be a whole number"):
                kind("-1")
            assert kind("0") == 0
    synth = ["synth", "--rows", "5", "--out", str(tmp_path / "s.csv")]
    prep = ["prep", str(tmp_path / "s.csv"), "--out", str(tmp_path / "s.h5")]
    # prep records its seed as an unsigned 64-bit HDF5 attribute (2**64 was an
    # h5py traceback after the whole run)
    for argv, seed, limits in ((synth, "-1", ">= 0"), (prep, "-1", ">= 0 and < 2**64"),
                               (prep, str(2**64), ">= 0 and < 2**64")):
        result = _mpidp(*argv, "--seed", seed)
        assert result.returncode == 2 and result.stderr.strip() == \
            f"mpidp: error: --seed {seed}: must be {limits}", result.stderr
    assert not list(tmp_path.iterdir())


def test_every_threads_option_takes_one_or_more():
    """torch.set_num_threads(-1) is a traceback (`mpidp train --threads -1`
    printed one): every --threads of type int refuses 0 and below at parsing."""
    import argparse

    import pytest

    kinds = []

    def walk(parser):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    walk(sub)
            elif "--threads" in action.option_strings and action.type is not None:
                kinds.append(action.type)

    walk(build_parser())
    assert len(kinds) >= 4 and int not in kinds
    for kind in set(kinds):
        for bad in ("-1", "0"):
            with pytest.raises(argparse.ArgumentTypeError, match=f"{bad} must be at least 1"):
                kind(bad)
        assert kind("3") == 3
    result = _mpidp("privacy", "--sample-rate", "0.01", "--noise-multiplier", "1", "--steps",
                    "10", "--train-rows", "-1")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == "mpidp: error: --train-rows -1 must be at least 1"


def test_a_stop_signal_after_the_command_is_ignored_slurms_warning_too(monkeypatch):
    """After the command, every stop signal is ignored: SIGUSR1 (Slurm's
    time-limit warning) landing in MPI_Finalize killed a finished rank, and
    the job was reported FAILED (exit 138) with its outputs complete."""
    import signal

    from engine import cli

    monkeypatch.setattr(cli, "main", lambda: 0)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    try:
        assert cli.console() == 0
        assert {s: signal.getsignal(s) for s in before} == dict.fromkeys(before, signal.SIG_IGN)
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
