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
import sys
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


def _numba_cache_dir() -> str | None:
    """The Numba cache folder named by ``NUMBA_CACHE_DIR`` (absolute), or None
    where it is unset or empty (Numba then caches beside the modules)."""
    text = os.environ.get("NUMBA_CACHE_DIR", "").strip()
    return os.path.abspath(os.path.expanduser(text)) if text else None


def numba_cache_filled(folder: str | None) -> bool:
    """Whether the Numba cache ``folder`` exists and holds index files (``*.nbi``),
    directly or in its per-package subfolders (Numba's layout); None (the cache
    beside the modules) counts as filled. Cheap: stops at the first index found."""
    if folder is None:
        return True
    try:
        with os.scandir(folder) as top:
            subfolders = []
            for entry in top:
                if entry.name.endswith(".nbi"):
                    return True
                if entry.is_dir(follow_symlinks=False):
                    subfolders.append(entry.path)
        for sub in subfolders:
            with os.scandir(sub) as inner:
                if any(entry.name.endswith(".nbi") for entry in inner):
                    return True
    except OSError:  # gone, not a folder, unreadable: nothing cached there
        return False
    return False


def _state() -> dict:
    """What makes a warm machine: the host, the Numba cache in use and the versions."""
    import numba

    from engine import __version__

    return {"host": socket.gethostname(), "numba_cache_dir": _numba_cache_dir(),
            "numba": numba.__version__, "mpidp": __version__}


def _marker() -> Path | None:
    from kernels.files import cache_file

    return cache_file(MARKER, "MPIDP_WARM_FILE")


def _known_states(path: Path) -> list:
    """The states recorded in the marker ``path``; [] where it is missing,
    unreadable or of another shape (a cache: a damaged one counts as empty)."""
    try:
        known = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    states = known.get("states") if isinstance(known, dict) else None
    return [s for s in states if isinstance(s, dict)] if isinstance(states, list) else []


def is_warm() -> bool:
    """Whether this machine ran :func:`warm_up` (or a finished training run)
    with the same Numba cache and versions, and that Numba cache (when
    ``NUMBA_CACHE_DIR`` names one) still holds compiled kernels. Never raises:
    a missing or damaged marker is a machine not warm."""
    path = _marker()
    if path is None:
        return True  # MPIDP_WARM_FILE=none: never say anything
    state = _state()
    return state in _known_states(path) and numba_cache_filled(state["numba_cache_dir"])


def mark_warm() -> OSError | None:
    """Record that the caches of this machine are filled (rank 0 calls it); a
    damaged marker is rewritten whole.

    Returns:
        None when the marker was written (or none is kept: ``MPIDP_WARM_FILE=none``),
        else the OSError that kept it from being written (a cache: not raised,
        the caller says it).
    """
    from kernels.files import replace_file

    path = _marker()
    if path is None:
        return None
    state = _state()
    states = [s for s in _known_states(path) if s != state] + [state]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_file(path, json.dumps({"states": states[-16:]}, indent=1) + "\n")
    except OSError as exc:
        return exc
    return None


def _why(path: Path, exc: OSError) -> str:
    """``path (reason)`` for a warning line."""
    return f"{path} ({exc.strerror or exc})"


def _synthetic_file() -> str:
    """Rank 0: a small synthetic file in a new temporary folder; its path.

    Raises:
        OutputError: the temporary folder could not be written.
    """
    from engine.bench.synthetic import write  # deferred: h5py
    from engine.errors import OutputError

    data = None
    try:
        data = os.path.join(tempfile.mkdtemp(prefix="mpidp-warmup-"), "warmup.h5")
        write(data, rows=20_000, features=100, test_rows=2_000, val_rows=2_000, seed=0)
    except OSError as exc:
        if data is not None:
            _remove(data)
        raise OutputError(f"cannot write warmup's synthetic file in {tempfile.gettempdir()} "
                          f"({exc.strerror or exc}): set TMPDIR to a writable folder, or "
                          "pass --data") from exc
    return data


def _remove(data: str) -> None:
    """Rank 0: the synthetic file and its folder removed (errors ignored: a temporary)."""
    folder = os.path.dirname(data)
    try:
        for name in os.listdir(folder):
            os.unlink(os.path.join(folder, name))
        os.rmdir(folder)
    except OSError:
        pass


def warm_up(data: str | None, steps: int, device: str, comm) -> tuple[int, float]:
    """Collective: the short run (module docstring), at least ``steps`` steps in
    whole epochs; returns (steps taken, seconds), the seconds with the
    one-time costs paid within (imports, the vector width's measurement,
    compiles).

    No collective waits after an error: an MpidpError is agreed by every rank
    (raised on all), anything else raised on one rank alone reaches
    :func:`engine.spmd.run_spmd`, which ends the job (no barrier in a
    ``finally`` that would leave the other ranks in the step's all-reduce).

    Raises:
        MpidpError: as ``mpidp train`` does for a bad file or device; OutputError
            where the synthetic file (no ``data``) cannot be written.
        engine.stopping.Interrupted: a stop signal ended the run at a step (the
            machine is not marked warm).
    """
    start = time.perf_counter()
    from engine.config import TrainConfig
    from engine.errors import DataError
    from engine.run.collective import rank0_value
    from engine.shard import read_info
    from engine.trainer import Trainer  # the kernels: the vector width measured once

    synthetic = data is None
    if synthetic:
        data = rank0_value(comm, _synthetic_file)
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
        if synthetic:
            comm.Barrier()  # every rank done with the file before rank 0 removes it
    except BaseException:
        if synthetic and comm.Get_rank() == 0:
            _remove(data)  # no barrier: the others may be in a collective (docstring)
        raise
    if synthetic and comm.Get_rank() == 0:
        _remove(data)
    return trainer.step, time.perf_counter() - start


def _unsaved() -> list[str]:
    """Rank 0, after the run: each cache that could not be saved, as ``what at
    path (why)``; the warm marker written (when it can be) on the way."""
    from collectives.auto.tuning import tuning_file
    from kernels.files import write_problem

    unsaved = []
    failed = mark_warm()
    if failed is not None:
        unsaved.append(f"the warm marker at {_why(_marker(), failed)}")
    tuning = tuning_file()
    failed = write_problem(tuning) if tuning is not None else None
    if failed is not None:  # written at exit (collectives.auto.tuning): probed now
        unsaved.append(f"the all-reduce's measurements at {_why(tuning, failed)}")
    folder = _numba_cache_dir()
    if not numba_cache_filled(folder):
        unsaved.append(f"the compiled kernels at {folder} (no index files written there)")
    return unsaved


def run(args: argparse.Namespace) -> int:
    """Collective: warm this machine up; prints what was cached where (rank 0),
    and on stderr one warning line naming each cache that could not be saved,
    where and why (the exit code stays 0: the run itself went through)."""
    comm = MPI.COMM_WORLD
    if args.steps < 1:
        from engine.errors import ConfigError

        raise ConfigError(f"--steps {args.steps} must be at least 1", collective=True)
    if comm.Get_rank() == 0:  # before the vector width's measurement and the compiles
        print(f"mpidp warmup: filling this machine's caches on {comm.Get_size()} rank(s) "
              f"(the vector width Numba compiles for, the step's kernels, the all-reduce's "
              f"measurements); a machine already warm takes seconds", flush=True)
    taken, seconds = warm_up(args.data, args.steps, args.device, comm)
    if comm.Get_rank() == 0:  # no collective follows: an error here ends the job
        from collectives.auto.tuning import tuning_file
        from kernels.numba_target import CHOICE  # measured by then (the trainer's kernels)

        unsaved = _unsaved()
        numba_cache = _numba_cache_dir() or "next to mpidp's modules"
        kernels = ("compiled, not cached (below)"
                   if any(line.startswith("the compiled") for line in unsaved)
                   else f"compiled into Numba's cache ({numba_cache})")
        tuning = tuning_file()
        if tuning is None:
            measurements = "not kept (MPIDP_ALLREDUCE_TUNING_FILE=none)"
        elif any(line.startswith("the all-reduce's") for line in unsaved):
            measurements = "not saved (below)"
        else:
            measurements = f"in {tuning}"
        print(f"mpidp warmup: {taken} steps in {seconds:.1f} s on {comm.Get_size()} "
              f"rank(s); {CHOICE.describe()}; kernels {kernels}; the all-reduce's "
              f"measurements {measurements}", flush=True)
        if unsaved:
            print("mpidp warmup: warning: could not save " + "; ".join(unsaved)
                  + ": the next runs pay these one-time costs again (point XDG_CACHE_HOME, "
                  "MPIDP_WARM_FILE, MPIDP_ALLREDUCE_TUNING_FILE or NUMBA_CACHE_DIR at a "
                  "writable folder)", file=sys.stderr, flush=True)
    return 0
