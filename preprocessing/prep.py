"""Prepare ACS PUMS person files for training: clean, encode, split, shuffle.

Reads official person files (psam_pNN.csv, ssYYpXX.csv, gzipped or not, or
the Census Bureau's csv_pXX.zip; one or many states) and writes the HDF5 file that
`mpidp train` reads (layout: docs/preprocessing.md). Every rank
parses its own byte range of the inputs; statistics are global; households
are split into train/val/test by SERIALNO (val: a share of the training
households, scored every epoch by `mpidp train`; test: read once, at the
end); the rows are shuffled across ranks,
each household's persons kept together. Every row carries a household key,
a keyed hash of its SERIALNO (never the serial itself), for
`mpidp train --privacy-unit household`; the hash's secret is random per run
and not stored, unless --household-secret gives one. With the same secret,
the output is the same, row for row and byte for byte, whatever the number
of ranks.

examples:
  mpiexec -n 2 mpidp prep csv_pde.zip csv_pnh.zip --out pums.h5
  mpiexec -n 2 mpidp prep psam_p10.csv --out pums.h5 --task income --seed 7
  mpiexec -n 2 mpidp prep csv_pri.zip --out ri.h5 --like pums.h5
  mpiexec -n 2 mpidp prep csv_pde.zip --out commute.h5 --task-file commute.toml
  mpiexec -n 2 mpidp prep csv_pri.zip --out score.h5 --like pums.h5 --test-fraction 1
  mpidp prep --format mnist ../shared/data/mnist --out mnist.h5 --val-fraction 0
  mpidp prep --format cifar10 cifar-10-binary.tar.gz --out cifar10.h5
"""
from __future__ import annotations

import argparse
import ctypes
import difflib
import importlib.metadata
import os

from collectives import MPI
from collectives.runtime import node_share
from preprocessing import (atomic, dictionary, encoding, h5format, h5write, households,
                           inputs, taskfile, tasks)
from preprocessing.agreement import agree
from preprocessing.errors import PrepError
from preprocessing.parse import PERSON
from preprocessing.pipeline import Settings, prepare

#: --val-fraction when not given (and --test-fraction is below 1).
DEFAULT_VAL_FRACTION = 0.1
#: --test-fraction when not given (PUMS, and an image set without its official test split).
DEFAULT_TEST_FRACTION = 0.2
#: --max-invalid-share when not given.
DEFAULT_MAX_INVALID_SHARE = 0.05
#: --format values: PUMS person files, or an image set (preprocessing.images).
FORMATS = ("pums", "mnist", "cifar10")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", metavar="FILE_OR_ZIP",
                        help="PUMS person files (.csv or .csv.gz) or the Census zips holding them; "
                        "with --format mnist|cifar10, the directory of the official "
                        "files (or cifar-10-binary.tar.gz)")
    parser.add_argument("--format", choices=FORMATS, default="pums",
                        help="what the inputs are: pums (default), mnist (the four idx "
                        "files, gzipped or not, from http://yann.lecun.com/exdb/mnist/; "
                        "the test pair alone is split by --test-fraction) or cifar10 "
                        "(the binary version, data_batch_1..5.bin and test_batch.bin, "
                        "or its .tar.gz, from https://www.cs.toronto.edu/~kriz/cifar.html; "
                        "the python version's pickles are read without running them). "
                        "Images are stored as uint8 with their per-channel mean and std "
                        "and normalised on load; nothing is downloaded")
    parser.add_argument("--out", required=True, metavar="FILE.h5",
                        help="the HDF5 file to write (replaced atomically if it exists)")
    # No argparse choices: a typo gets one line with the closest name
    # (make_settings), not the whole usage block.
    parser.add_argument("--task", default=None, metavar="NAME",
                        help="what to predict, one of the tasks listed below (default: "
                        "employment, or the task of --like)")
    parser.add_argument("--task-file", metavar="FILE.toml", default=None,
                        help="what to predict, defined in a TOML file: name, label (a "
                        "condition, e.g. \"PINCP > 50000\"), universe (conditions) and "
                        "[features] (NAME = \"numeric\" or \"categorical\"); see "
                        "docs/preprocessing.md, Tasks")
    parser.add_argument("--test-fraction", type=float, default=None, metavar="F",
                        help="share of households (images) in the test split (default: "
                        "0.2; images: the official test set, when present); 1 "
                        "makes a file only for scoring (`mpidp eval`, with --like the "
                        "model's training file): every row in test, none to train on")
    parser.add_argument("--val-fraction", type=float, default=None, metavar="F",
                        help="share of the *training* households moved to a validation "
                        "split, which `mpidp train` scores every epoch (and selects the "
                        "best epoch on) so that the test split is read once, at the end; "
                        "0: no validation split (default: 0.1, or 0 with --test-fraction 1)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the household split and the shuffle (default: 0)")
    parser.add_argument("--like", metavar="OTHER.h5",
                        help="encode exactly like this prepared file (its categories, "
                        "statistics and column order), e.g. for other states or years; "
                        "images: normalise with its channel statistics (a file to score "
                        "a model on)")
    parser.add_argument("--encoding", choices=encoding.LAYOUTS, default=None,
                        help="how categorical features are stored: onehot, one 0/1 column "
                        "per category (every model; the default), or codes, one column "
                        "of integer category codes per feature (for --model embedding-mlp "
                        "and models that embed categories: income's 827 columns become "
                        "11). With --like: the layout of that file")
    parser.add_argument("--universe", metavar="COND[,COND]",
                        help="records to keep, replacing the task's universe, e.g. "
                        "'AGEP>=18' or 'AGEP>=16,AGEP<65'")
    parser.add_argument("--compression", default="none", metavar="none|gzip[:LEVEL]",
                        help="compression of the datasets (default: none, the fastest "
                        "to write and to read)")
    parser.add_argument("--max-invalid-share", type=float,
                        default=DEFAULT_MAX_INVALID_SHARE, metavar="F",
                        help="fail when more than this share of a file's records is "
                        "invalid (default: 0.05); fewer are dropped and counted")
    parser.add_argument("--check-fields", action="store_true",
                        help="also drop lines whose number of fields is not the header's "
                        "(two records glued by a lost newline, a padded line): counts "
                        "every comma, +40-70%% prep time on 2 cores. Off by default: polars stops "
                        "reading a line after the last needed column and cannot see them")
    parser.add_argument("--household-secret", metavar="FILE", default=None,
                        help="file whose bytes (16 or more) key the hash of SERIALNO into "
                        "the household keys; give the same file to get the same keys again "
                        "and keep it as private as the data (default: a random secret per "
                        "run, never stored)")
    parser.add_argument("--quiet", action="store_true", help="print nothing on success")
    parser.add_argument("--timings", action="store_true",
                        help="also print the seconds spent in each step (rank 0's clock)")
    if parser.epilog is None:
        parser.epilog = task_list()


def task_list() -> str:
    """The built-in tasks, one per line, for the end of ``mpidp prep --help``."""
    import textwrap

    lines = ["tasks (--task): folktables' ACS problems, the same rows and labels except",
             "where a task says it differs (docs/preprocessing.md, Tasks)"]
    for t in tasks.TASKS.values():
        lines += textwrap.wrap(f"{t.name}: {t.description}", width=79, initial_indent="  ",
                               subsequent_indent="      ")
    return "\n".join(lines)


def _read_like(path: str) -> tuple[str, str, str]:
    """(task name, encoding JSON, label definition: ``""`` where the file does
    not record it) of a prepared PUMS file.

    Raises:
        PrepError: ``path`` is missing, not HDF5, not prepared by mpidp, or
            prepared from images (no encoding to copy).
    """
    import h5py  # deferred: keeps `mpidp prep --help` fast

    if not os.path.exists(path):
        raise PrepError(f"{path}: no such file (given to --like)")
    try:
        with h5py.File(path, "r") as handle:
            attrs = handle.attrs
            if attrs.get("format") != h5format.FORMAT:
                raise PrepError(f"{path}: not a file written by mpidp prep (no "
                                "format='mpidp' attribute); --like needs one")
            if "image_shape" in attrs or "encoding" not in attrs:
                what = (f"{attrs.get('task')} images" if "image_shape" in attrs
                        else "no encoding attribute")
                raise PrepError(f"--like {path} holds {what}; these are PUMS rows: give "
                                "--like a PUMS file prepared by mpidp prep")
            label = attrs.get("label", "")
            return (str(attrs["task"]), str(attrs["encoding"]),
                    label.decode() if isinstance(label, bytes) else str(label))
    except OSError as exc:
        raise PrepError(f"{path}: cannot read it as HDF5 ({exc})") from None


def common_settings(args: argparse.Namespace) -> tuple[float, float, "h5write.Compression"]:
    """Check the options of every format: (test fraction, val fraction, compression).

    Raises:
        PrepError: a fraction out of range, a val split with nothing to train,
            a negative seed, an unknown compression.
    """
    test_fraction = DEFAULT_TEST_FRACTION if args.test_fraction is None else args.test_fraction
    if not 0.0 <= test_fraction <= 1.0:
        raise PrepError(f"--test-fraction {test_fraction}: must be in [0, 1] (1: a "
                        "file only for scoring)")
    val_fraction = args.val_fraction
    if val_fraction is None:
        val_fraction = 0.0 if test_fraction == 1.0 else DEFAULT_VAL_FRACTION
    if not 0.0 <= val_fraction < 1.0:
        raise PrepError(f"--val-fraction {val_fraction}: must be in [0, 1) (0: no "
                        "validation split)")
    if test_fraction == 1.0 and val_fraction > 0:
        raise PrepError(f"--val-fraction {val_fraction:g} with --test-fraction 1: a file "
                        "only for scoring has no training households to take a validation "
                        "split from; drop --val-fraction")
    if not 0.0 <= args.max_invalid_share <= 1.0:
        raise PrepError(f"--max-invalid-share {args.max_invalid_share}: must be in [0, 1]")
    if not 0 <= args.seed < 2**64:  # the file records it as an unsigned 64-bit attribute
        raise PrepError(f"--seed {args.seed}: must be >= 0 and < 2**64")
    try:
        compression = h5write.Compression.parse(args.compression)
    except ValueError as exc:
        raise PrepError(f"--compression: {exc}") from None
    return test_fraction, val_fraction, compression


def _with_universe(task: tasks.Task, text: str, codebook) -> tasks.Task:
    """``task`` with the universe of ``--universe TEXT``, each condition's column
    checked as a task file's are (numeric codes in the 2018 person file)."""
    try:
        conditions = tasks.parse_conditions(text)
    except ValueError as exc:
        raise PrepError(f"--universe: {exc}") from None
    if not conditions:  # '' from an unset shell variable, or ','
        default = ",".join(map(str, task.universe)) or "everyone"
        raise PrepError(f"--universe {text!r} has no condition: leave --universe out for "
                        f"the task's universe ({default}), or give conditions (every "
                        "record: --universe AGEP>=0)")
    for condition in conditions:
        taskfile.numeric_column(condition.column, codebook, "--universe")
    return task.with_universe(conditions)


def make_settings(args: argparse.Namespace):
    """Check the command line and the inputs (rank 0); returns Settings.

    Raises:
        PrepError: anything the user must fix before a record is parsed.
    """
    test_fraction, val_fraction, compression = common_settings(args)
    if args.task is not None and args.task not in tasks.TASKS:
        close = difflib.get_close_matches(args.task.lower(), list(tasks.TASKS), n=1)
        hint = (f" (did you mean --task-file {args.task}?)" if args.task.endswith(".toml")
                else f" (did you mean {close[0]}?)" if close else "")
        raise PrepError(f"--task {args.task}: no such task{hint}; the tasks are "
                        f"{', '.join(tasks.TASKS)} (or define one with --task-file)")
    if args.task and args.task_file:
        raise PrepError(f"--task {args.task} and --task-file {args.task_file}: give one "
                        "of them")
    codebook = dictionary.load()
    from_file = taskfile.load(args.task_file, codebook) if args.task_file else None
    like_task, like_encoding, like_label = (None, None, "")
    if args.like:
        like_task, like_encoding, like_label = _read_like(args.like)
        if from_file is not None and from_file.name != like_task:
            raise PrepError(f"--task-file {args.task_file} defines task {from_file.name!r}, "
                            f"but {args.like} holds task {like_task!r}")
        if from_file is None and like_task not in tasks.TASKS:
            raise PrepError(f"{args.like}: task {like_task!r} is not built in; give the "
                            "--task-file that defines it")
        if args.task and args.task != like_task:
            raise PrepError(f"--task {args.task} differs from the task of {args.like} "
                            f"({like_task}); leave --task out to use {like_task}")
    task = from_file or tasks.TASKS[args.task or like_task or "employment"]
    if like_label and str(task.label) != like_label:  # a task file of the same name
        raise PrepError(f"{args.like} labels its rows {like_label}, this task {task.label}: a "
                        "model of one would be scored against the other's labels; give the "
                        "task file the --like file was prepared with")
    if args.universe is not None:
        task = _with_universe(task, args.universe, codebook)
    layout = args.encoding or "onehot"
    if like_encoding is not None:
        like = encoding.Encoding.from_json(like_encoding)
        encoding.check_compatible(like, task, codebook, args.like)
        if args.encoding and args.encoding != like.layout:
            raise PrepError(f"--encoding {args.encoding} differs from the layout of "
                            f"{args.like} ({like.layout}); leave --encoding out to use "
                            f"{like.layout}")
        layout = like.layout
    _check_out(args)
    secret = (households.read_secret(args.household_secret) if args.household_secret
              else households.new_secret())
    found = inputs.inspect_inputs(args.inputs)
    needed = {"SERIALNO": ("SERIALNO",)}
    for name in task.columns():
        feature = task.feature(name)
        needed[name] = tuple(s.column for s in feature.sources) if feature else (name,)
    sources = {}
    for inp in found:
        chosen = inputs.require_columns(inp, needed)
        chosen.pop("SERIALNO")
        sources[inp.index] = chosen
    return Settings(inputs=found, sources=sources, task=task, codebook=codebook,
                    out=args.out, seed=args.seed, test_fraction=test_fraction,
                    val_fraction=val_fraction,
                    max_invalid_share=args.max_invalid_share, compression=compression,
                    like=args.like, like_encoding=like_encoding, layout=layout,
                    quiet=args.quiet,
                    check_fields=args.check_fields, household_secret=secret)


def _version() -> str:
    """mpidp's version from the installed metadata (written into ``created_by``)."""
    try:
        return importlib.metadata.version("mpidp")
    except importlib.metadata.PackageNotFoundError:  # a source tree never installed
        return "0+unknown"


def _threads_per_rank(comm) -> int:
    """Parser threads per rank: the cores a launcher bound this rank to, or
    this node's cores shared by the ranks on it (collective over ``comm``;
    :func:`collectives.runtime.node_share`)."""
    return node_share(comm).threads


def _reuse_freed_memory() -> None:
    """Keep freed blocks in the heap instead of returning them to the kernel:
    touching fresh pages is slow on virtual machines, and the parser allocates
    a new block of text for every 32 MiB it reads."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


def run(args: argparse.Namespace) -> int:
    """Collective: prepare the file on every rank of COMM_WORLD; rank 0 prints.

    Raises:
        PrepError: bad input or settings (on every rank).
    """
    comm = MPI.COMM_WORLD
    if args.format != "pums":
        return _run_images(comm, args)
    threads = _threads_per_rank(comm)
    # Before polars' first import (the parser's): polars reads it once.
    os.environ.setdefault("POLARS_MAX_THREADS", str(threads))
    _reuse_freed_memory()
    settings = agree(comm, lambda: make_settings(args) if comm.Get_rank() == 0 else None)
    settings = comm.bcast(settings, root=0)
    report = prepare(comm, settings, threads=threads, version=_version())
    if comm.Get_rank() == 0 and not args.quiet:
        print(summary(report, settings, comm.Get_size()), flush=True)
    if comm.Get_rank() == 0 and args.timings:
        print("  steps   " + ", ".join(f"{k} {v:.2f}" for k, v in report.steps.items()),
              flush=True)
        for r, (hashing, parsing, size) in enumerate(report.per_rank):
            print(f"  rank {r:<3} parsed and cleaned {size / 1e6:.0f} MB in {parsing:.2f} s, "
                  f"then {hashing:.2f} s to finish its sha256", flush=True)
    return 0


def _check_out(args: argparse.Namespace) -> None:
    """``--out`` can be written and is none of the files ``mpidp prep`` reads
    (its inputs and option files, named as messages name them)."""
    atomic.check_writable(args.out)
    files = {f"the input {path}": path for path in args.inputs}
    for option in ("like", "task_file", "household_secret"):
        given = getattr(args, option, None)
        files[f"--{option.replace('_', '-')} {given}"] = given
    atomic.check_not_input(args.out, files)


def _run_images(comm, args: argparse.Namespace) -> int:
    """``--format mnist|cifar10`` (:mod:`preprocessing.images.prepare`)."""
    from preprocessing.images import prepare as images  # deferred: only images need it

    def check():
        images.check_options(args)
        _, val_fraction, compression = common_settings(args)
        _check_out(args)
        return val_fraction, compression

    val_fraction, compression = comm.bcast(
        agree(comm, lambda: check() if comm.Get_rank() == 0 else None), root=0)
    report = images.prepare_images(comm, args, val_fraction, compression, _version())
    if comm.Get_rank() == 0 and not args.quiet:
        print(images.summary(report, args, comm.Get_size()), flush=True)
    return 0


def summary(report, settings, ranks: int) -> str:
    """The lines printed after a successful run."""
    files = len(settings.inputs)
    records, empty = report.records, report.empty_lines
    rate = records / report.seconds if report.seconds > 0 else 0.0
    drops = ", ".join(f"{name} {count:,}" for name, count in report.drop_counts.items()
                      if name != "empty_line")
    universe = ",".join(map(str, settings.task.universe)) or "everyone"
    return "\n".join([
        f"mpidp prep: wrote {settings.out} ({report.out_bytes / 1e6:.1f} MB) in "
        f"{report.seconds:.2f} s on {ranks} rank{'s' if ranks > 1 else ''}",
        f"  read    {records:>12,} records from {files} file{'s' if files > 1 else ''}"
        f" ({rate:,.0f} records/s)" + (f"; {empty:,} empty lines skipped" if empty else ""),
        f"  kept    {report.kept:>12,} (train {report.train:,}, "
        + (f"val {report.val:,}, " if report.val is not None else "")
        + f"test {report.test:,}; "
        f"{report.n_features} feature{'s' if report.n_features != 1 else ''}, "
        f"task {settings.task.name})",
        f"  dropped {records - report.kept:>12,} ({drops}; universe: {universe})",
    ] + label_notes(report, settings) + year_notes(settings) + unchecked_notes(settings))


def label_notes(report, settings) -> list[str]:
    """``  note    every kept record has label 0 ...``: a file with one class only
    (a task file's label that is never, or always, true; or too few records),
    on which a model learns nothing and scores a perfect accuracy."""
    counts = report.label_counts
    if len(counts) != 2 or sum(1 for c in counts if c) != 1:
        return []
    only = next(i for i, c in enumerate(counts) if c)
    when = "never" if only == 0 else "always"
    return [f"  note    every kept record has label {only}: the label "
            f"{settings.task.label} is {when} true in these records, so a model trained "
            "on this file learns nothing (check the task's label condition)"]


def unchecked_notes(settings) -> list[str]:
    """``  note    FILES: no SPORDER column ...``: the inputs in which prep
    cannot find a person given twice (:func:`preprocessing.pipeline.check_people_once`)."""
    names = [_input_name(inp) for inp in settings.inputs if PERSON not in inp.header]
    if not names:
        return []
    return [f"  note    {', '.join(names)}: no SPORDER column, so a person given twice "
            "(overlapping extracts, a state's zip and its CSV) cannot be found there; "
            "make sure each person is in the inputs once"]


def _input_name(inp) -> str:
    return os.path.basename(inp.path) + (f"/{inp.member}" if inp.member else "")


def year_notes(settings) -> list[str]:
    """``  note    FILES: RELP read from RELSHIPP (...), recoded ...``: the
    features that some inputs give in another survey year's column."""
    files: dict[str, list[str]] = {}
    for inp in settings.inputs:
        for note in settings.task.notes(settings.sources[inp.index]):
            files.setdefault(note, []).append(_input_name(inp))
    return [f"  note    {', '.join(names)}: {note}" for note, names in files.items()]
