"""mpidp warmup: pay the one-time costs of this machine before the runs that count.

A first run on a machine pays three costs once: Numba measures the vector
width it compiles for and compiles the step's kernels (both cached per
machine), and the all-reduce's ``auto`` tries its candidates for the step's
buffer before it settles (cached in its tuning file). They land in the first
epochs, which then look many times slower than the next ones. This command
pays them now, on the data and ranks of the runs to come: a short training
run (not saved) of the default model on ``--data`` (or on a small synthetic
file with the seed's 100 features), long enough for ``auto`` to settle.
Run it the way you run training::

    mpiexec -n 2 mpidp warmup --data pums.h5

Afterwards :func:`is_warm` says so, and ``mpidp train`` stops saying, on its
first lines, that its first epoch pays a one-time cost.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import signal
import socket
import tempfile
import time
from pathlib import Path

from collectives import MPI

#: The marker of a warmed machine, in mpidp's cache folder.
MARKER = "warm.json"
#: Steps of the short run: enough for ``auto`` to try every candidate.
STEPS = 300


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", default=None,
                        help="the prepared file of the runs to come (their model's size is "
                        "what the all-reduce measures); default: a small synthetic file")
    parser.add_argument("--steps", type=int, default=STEPS,
                        help=f"steps of the short run, at least (whole epochs of the file; "
                        f"default: {STEPS})")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="the runs' device (default: cpu)")


def _state() -> dict:
    """What makes a warm machine: the host, the Numba cache in use and the versions."""
    import numba

    from engine import __version__

    return {"host": socket.gethostname(),
            "numba_cache_dir": os.path.abspath(os.environ.get("NUMBA_CACHE_DIR", "")) or None,
            "numba": numba.__version__, "mpidp": __version__}


def _marker() -> Path | None:
    from kernels.files import cache_file

    return cache_file(MARKER, "MPIDP_WARM_FILE")


def is_warm() -> bool:
    """Whether this machine ran :func:`warm_up` (or a finished training run)
    with the same Numba cache and versions."""
    path = _marker()
    if path is None:
        return True  # MPIDP_WARM_FILE=none: never say anything
    try:
        known = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return _state() in known.get("states", [])


def mark_warm() -> None:
    """Record that the caches of this machine are filled (rank 0 calls it)."""
    from kernels.files import replace_file

    path = _marker()
    if path is None:
        return
    try:
        known = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        known = {}
    states = [s for s in known.get("states", []) if s != _state()] + [_state()]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_file(path, json.dumps({"states": states[-16:]}, indent=1) + "\n")
    except OSError:  # a cache that cannot be written changes nothing but a line
        pass


def warm_up(data: str | None, steps: int, device: str, comm) -> tuple[int, float]:
    """Collective: the short run (module docstring), at least ``steps`` steps in
    whole epochs; returns (steps taken, seconds), the seconds with the
    one-time costs paid within (imports, the vector width's measurement,
    compiles).

    Raises:
        MpidpError: as ``mpidp train`` does for a bad file or device.
        engine.stopping.Interrupted: a stop signal ended the run at a step (the
            machine is not marked warm).
    """
    start = time.perf_counter()
    from engine.bench.synthetic import write  # deferred: h5py
    from engine.config import TrainConfig
    from engine.errors import DataError
    from engine.shard import read_info
    from engine.trainer import Trainer  # the kernels: the vector width measured once

    folder = None
    if data is None:
        folder = tempfile.mkdtemp(prefix="mpidp-warmup-") if comm.Get_rank() == 0 else None
        folder = comm.bcast(folder, root=0)
        data = os.path.join(folder, "warmup.h5")
        if comm.Get_rank() == 0:
            write(data, rows=20_000, features=100, test_rows=2_000, val_rows=2_000, seed=0)
        comm.Barrier()
    try:
        info = read_info(data, comm)
        rows = info.rows["train"]
        if rows == 0:  # every rank read the same header
            raise DataError(f"{data} has no training rows (a file only for scoring, made with "
                            "mpidp prep --test-fraction 1?): warm up on the data of the "
                            "training runs, or with no --data at all", collective=True)
        batch = min(256, max(1, rows // 4))
        per_epoch = max(1, round(rows / batch))
        # the model of the runs to come: a file of category codes needs embeddings
        model = {"model": "embedding-mlp"} if info.code_columns else {}
        cfg = TrainConfig(data=data, epochs=-(-steps // per_epoch), batch_size=batch,
                          noise_multiplier=1.0, delta=min(1e-6, 1 / rows), seed=0,
                          device=device, progress=False, **model)
        cfg.validate()
        trainer = Trainer(cfg, comm, out=io.StringIO())
        code = trainer.run()
        if code != 0:  # a stop signal at a step (128 + n): not warm, and not a success
            from engine.stopping import Interrupted

            raise Interrupted(code - 128 if code > 128 else signal.SIGTERM)
    finally:
        comm.Barrier()
        if folder is not None and comm.Get_rank() == 0:
            for name in os.listdir(folder):
                os.unlink(os.path.join(folder, name))
            os.rmdir(folder)
    return trainer.step, time.perf_counter() - start


def run(args: argparse.Namespace) -> int:
    """Collective: warm this machine up; prints what was cached where."""
    comm = MPI.COMM_WORLD
    if args.steps < 1:
        from engine.errors import ConfigError

        raise ConfigError(f"--steps {args.steps} must be at least 1", collective=True)
    if comm.Get_rank() == 0:  # before the vector width's measurement and the compiles
        print(f"mpidp warmup: filling this machine's caches on {comm.Get_size()} rank(s) "
              f"(the vector width Numba compiles for, the step's kernels, the all-reduce's "
              f"measurements); a machine already warm takes seconds", flush=True)
    taken, seconds = warm_up(args.data, args.steps, args.device, comm)
    if comm.Get_rank() == 0:
        from collectives.auto.tuning import tuning_file
        from kernels.numba_target import CHOICE  # measured by then (the trainer's kernels)

        mark_warm()
        numba_cache = os.environ.get("NUMBA_CACHE_DIR") or "next to mpidp's modules"
        tuning = tuning_file()
        print(f"mpidp warmup: {taken} steps in {seconds:.1f} s on {comm.Get_size()} "
              f"rank(s); {CHOICE.describe()}; kernels compiled into Numba's cache "
              f"({numba_cache}); the all-reduce's measurements "
              + (f"in {tuning}" if tuning else "not kept (MPIDP_ALLREDUCE_TUNING_FILE=none)"))
    return 0
