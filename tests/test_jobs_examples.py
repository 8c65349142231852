"""The sbatch examples of the docs and of the jobs/ headers pass every value whole.

sbatch splits ``--export`` at every comma, quoted or not: the documented
``--export=ALL,TUNE_ARGS="--space lr=0.01,0.05"`` reached the job as
``TUNE_ARGS=--space lr=0.01`` and ran a search over one point, exit 0. The
examples set such variables in sbatch's environment instead
(``TUNE_ARGS='...' sbatch --export=ALL jobs/tune.sbatch``); this test reads
every ``--export=`` of the docs, the README, jobs/ and examples/ and fails on
one that sbatch would cut.
"""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


def _example_text(path: Path) -> str:
    """The file's text with comment markers dropped (a script's header holds its
    examples as comments) and backslash-newline continuations joined."""
    lines = path.read_text().splitlines()
    if path.suffix in (".sh", ".sbatch"):
        lines = [re.sub(r"^#+ ?", "", line) for line in lines]
    return re.sub(r"\\\n\s*", "", "\n".join(lines))


def export_cuts(argument: str) -> list[str]:
    """What sbatch does to ``--export=ARGUMENT`` as the shell hands it over (the
    text up to the first blank outside quotes): the items between commas that
    show a value cut off, empty when every comma separates ``NAME=value`` items
    (or ALL, NONE). A comma inside quotes cuts all the same: sbatch sees none."""
    quote, end, escaped = "", len(argument), False
    for i, char in enumerate(argument):
        if escaped or char == "\\":
            escaped = not escaped
        elif quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char.isspace():
            end = i
            break
    items = argument[:end].split(",")
    cuts = []
    for position, item in enumerate(items):
        bare = item.replace('"', "").replace("'", "")
        unclosed = (item.count('"') % 2 or item.count("'") % 2) and position < len(items) - 1
        head = position == 0 or bare in ("ALL", "NONE") or NAME.match(bare)
        if unclosed or not head:
            cuts.append(item)
    return cuts


def _exports(path: Path) -> list[str]:
    text = _example_text(path)
    return [m.group(1) for m in re.finditer(r"--export=(\S.*)", text)]


def _example_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for folder in ("jobs", "examples"):
        files += sorted(p for p in (ROOT / folder).iterdir()
                        if p.suffix in (".sh", ".sbatch", ".md"))
    return files


@pytest.mark.parametrize("argument", [
    # the examples that cut their values (jobs/tune.sbatch, bench_scaling.sbatch)
    'ALL,DATA=pums.h5,OUT_DIR=runs/tune,TUNE_ARGS="--target-epsilon 1 --space '
    'lr=0.01,0.05;batch_size=256,1024 --parallel 4" jobs/tune.sbatch',
    'ALL,BENCH_ARGS="--preset dp-sweep --models mnist-small --ranks 1,2" x.sbatch',
    'ALL,TRAIN_ARGS="--epochs 3 --hidden 64,batch=2" jobs/train.sbatch',
    "ALL,TRAIN_ARGS=--hidden\\ 64,64 jobs/train.sbatch",
])
def test_a_comma_inside_a_value_is_found(argument):
    """The check itself: each of these reached the job cut at its comma."""
    assert export_cuts(argument)


@pytest.mark.parametrize("argument", [
    "ALL jobs/train.sbatch",
    "ALL,MPIDP_GPU=1,DATA=pums.h5 jobs/train.sbatch",
    'ALL,INPUTS="a.zip b.zip",OUT=pums.h5 jobs/prep.sbatch',
    'ALL,BENCH_ARGS="-b 1K -e 256M" jobs/bench_allreduce.sbatch',
    "NONE,DATA=pums.h5",
])
def test_whole_values_pass(argument):
    assert export_cuts(argument) == []


def test_no_example_passes_a_value_that_sbatch_would_cut():
    found = {path: _exports(path) for path in _example_files()}
    assert any(found.values())  # the examples are there to be read
    cut = {str(path.relative_to(ROOT)): [a for a in arguments if export_cuts(a)]
           for path, arguments in found.items()}
    assert not {path: arguments for path, arguments in cut.items() if arguments}, (
        "set such variables in sbatch's environment: VAR='a,b' sbatch --export=ALL ...")
