"""Running ``mpidp bench scaling``'s configurations: the data files they train
on, one launch per configuration, and the metrics read back.

:func:`ensure_data` makes (once, into ``--cache``) or checks the file of each
data repeat; :func:`execute` launches one configuration of
:func:`engine.bench.scaling_plan.plan` and returns it with its epoch
records; :func:`collect` reads the runs of cluster jobs
(``jobs/sweep_scaling.sh``) instead.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from collectives.launch import child_env, launcher_argv
from engine.bench import synthetic, synthetic_images
from engine.bench.scaling_plan import BenchError, shown_command

# ------------------------------------------------------------ data
def ensure_data(settings: argparse.Namespace, write: bool = True) -> tuple[dict[int, str], str]:
    """The file to train on for each data repeat ({repeat: path}) and a line saying
    what the data is: --data (tiled into --cache for repeats above 1), or the
    preset's synthetic file (written once into --cache; not with ``write=False``)."""
    if settings.data:
        if not os.path.isfile(settings.data):
            raise BenchError(f"--data {settings.data}: no such file")
        files = {1: settings.data}
        for repeat in settings.repeat_list:
            if repeat > 1:
                files[repeat] = _tiled(settings, repeat, write)
        return files, _describe_file(settings, write)
    if settings.image:
        c, h, w = settings.image_shape_tuple
        files = {}
        for repeat in settings.repeat_list:
            rows = settings.rows * repeat
            path = Path(settings.cache) / (f"images-{c}x{h}x{w}-{rows}-{settings.test_rows}-"
                                           "c10-seed0.h5")
            if write and not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                print(f"writing {path} (once) ...", file=sys.stderr, flush=True)
                synthetic_images.write_images(path, (c, h, w), rows=rows,
                                              test_rows=settings.test_rows, seed=0)
            files[repeat] = str(path)
        rows = ", ".join(f"{settings.rows * r:,}" for r in settings.repeat_list)
        what = (f"synthetic {c}x{h}x{w} images ({rows} training / {settings.test_rows:,} test "
                f"rows, 10 classes; not {settings.real}: give --data FILE of `mpidp prep "
                f"--format {settings.real.lower().replace('-', '')}` for the real set)")
        return files, what
    kind = f"dense-decay{synthetic.DENSE_DECAY:g}" if settings.dense else "synth"
    path = Path(settings.cache) / (f"{kind}-{settings.rows}x{settings.features}-"
                                   f"{settings.test_rows}-seed0.h5")
    if write and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"writing {path} (once) ...", file=sys.stderr, flush=True)
        if settings.dense:
            synthetic.write_dense(path, rows=settings.rows, features=settings.features,
                                  test_rows=settings.test_rows, seed=0)
        else:
            synthetic.write(path, rows=settings.rows, features=settings.features,
                            test_rows=settings.test_rows, seed=0)
    return {1: str(path)}, str(path)


def _tiled(settings: argparse.Namespace, repeat: int, write: bool) -> str:
    """The --data file with its training rows repeated, cached under a name that
    changes with the source's path, size and modification time."""
    source = os.path.abspath(settings.data)
    stat = os.stat(source)
    digest = hashlib.sha256(f"{source}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    path = Path(settings.cache) / f"{Path(source).stem}-x{repeat}-{digest[:12]}.h5"
    if write and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"writing {path} ({settings.data} with its training rows x{repeat}, once) ...",
              file=sys.stderr, flush=True)
        synthetic.tile_rows(source, path, repeat)
    return str(path)


def _describe_file(settings: argparse.Namespace, read: bool) -> str:
    """``--data``'s line in the report (an image preset checks it holds images)."""
    if not read:
        return settings.data
    from preprocessing import h5format

    try:
        info = h5format.read_info(settings.data)
    except h5format.FormatError as exc:
        raise BenchError(str(exc)) from None
    if settings.image and not info.is_image:
        raise BenchError(f"--data {settings.data} holds tabular rows; --preset "
                         f"{settings.preset} needs images (`mpidp prep --format "
                         f"{settings.real.lower().replace('-', '')}`)")
    if not settings.image and info.is_image:
        raise BenchError(f"--data {settings.data} holds images; --preset {settings.preset} "
                         "trains an MLP on tabular rows (image presets: mlbench-1a, dp-sweep)")
    if not info.is_image:
        return settings.data
    shape = "x".join(map(str, info.image_shape))
    return (f"{settings.data} ({info.task or 'image'} images {shape}, {info.rows['train']:,} "
            f"training / {info.rows['test']:,} test rows, {info.n_classes} classes)")


# ------------------------------------------------------------ running
def execute(config: dict, launcher: str, cores: int | None) -> dict:
    """Launch one configuration; returns the run (config + its epoch records).

    Raises:
        BenchError: the launch failed, its metrics cannot be read, or they record
            another number of ranks than the configuration's (:func:`check_ranks`).
    """
    argv = [*launcher_argv(launcher, config["ranks"]), sys.executable, "-m",
            config.get("program", "engine.cli"), *config["train_argv"],
            "--metrics", config["metrics"]]
    started = time.perf_counter()
    result = subprocess.run(argv, capture_output=True, text=True, env=child_env())
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-8:])
        raise BenchError(f"{shown_command(config, launcher)} failed with exit code "
                         f"{result.returncode}:\n{tail}")
    epochs = read_metrics(config["metrics"])
    check_ranks(epochs, config["ranks"], shown_command(config, launcher),
                "does the launch command pass {ranks} on?")
    threads = epochs[-1].get("threads") or 1
    run = dict(config, epochs=epochs, launch_s=seconds,
               command=shown_command(config, launcher),
               oversubscribed=bool(cores and config["ranks"] * threads > cores))
    run.pop("train_argv")
    run.pop("program", None)
    return run


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The epoch records of a metrics file (JSON lines)."""
    try:
        lines = Path(path).read_text().splitlines()
        records = [json.loads(line) for line in lines if line.strip()]
    except (OSError, ValueError) as exc:
        raise BenchError(f"{path}: cannot read the run's metrics ({exc})") from None
    if not records:
        raise BenchError(f"{path}: no epoch finished in this run")
    return records


def check_ranks(epochs: list[dict], planned: int, what: str, hint: str) -> None:
    """Raise BenchError (one line) when the epoch records say the run had another
    number of ranks than ``planned``: its rows would be labelled with a rank
    count that never ran. Records without ``ranks`` (older files) pass."""
    recorded = sorted({int(e["ranks"]) for e in epochs if e.get("ranks") is not None})
    if recorded and recorded != [planned]:
        ran = "/".join(map(str, recorded))
        raise BenchError(f"{what} ran on {ran} rank(s), not the planned {planned}; {hint}")


def collect(directories: list[str]) -> list[dict]:
    """Runs from job directories (``metrics.jsonl`` + optional ``sweep-point.json``).

    Raises:
        BenchError: a directory without metrics, with train_args that are not
            mpidp train's, or whose metrics record another number of ranks than
            its sweep-point.json's layout (nodes x tasks_per_node).
    """
    # deferred: torch, kept out of `mpidp bench --help`
    from engine.config import add_arguments as train_arguments

    parser = argparse.ArgumentParser(add_help=False)
    train_arguments(parser)
    runs = []
    for directory in directories:
        metrics = Path(directory) / "metrics.jsonl"
        if not metrics.is_file():
            raise BenchError(f"{directory}: no metrics.jsonl (did its job run? see its "
                             "output file)")
        point_file = Path(directory) / "sweep-point.json"
        point = json.loads(point_file.read_text()) if point_file.is_file() else {}
        epochs = read_metrics(metrics)
        try:
            train = parser.parse_args(["--data", "-", *shlex.split(point.get("train_args",
                                                                              ""))])
        except SystemExit:
            raise BenchError(f"{point_file}: train_args are not mpidp train options") \
                from None
        ranks = int(epochs[-1]["ranks"])
        nodes = int(point.get("nodes", 1))
        if point.get("tasks_per_node") is not None:
            tasks = int(point["tasks_per_node"])
            check_ranks(epochs, nodes * tasks, f"{directory} (layout {nodes}x{tasks})",
                        "did its job get the tasks it asked for? leave it out or run it again")
        runs.append({"name": point.get("layout", Path(directory).name),
                     "mode": point.get("scaling", "strong"),
                     "dp": epochs[-1].get("epsilon") is not None,
                     "allreduce": train.allreduce,
                     "threads": str(train.threads) if train.threads else "auto",
                     "ranks": ranks, "nodes": nodes,
                     "layout": point.get("layout", f"{nodes}x{ranks // max(1, nodes)}"),
                     "batch_size": train.batch_size,
                     "oversubscribed": bool(point.get("oversubscribed", False)),
                     "command": point.get("command"), "job_id": point.get("job_id"),
                     "epochs": epochs})
    return runs
