"""The vector width Numba's CPU loops are compiled for: measured once per CPU, then cached.

Numba compiles for the host CPU through LLVM, and on an AVX-512 CPU LLVM's
tuning may prefer 256-bit vectors (the first AVX-512 cores lowered their
clock for 512-bit code) or 512-bit ones. Which is faster for mpidp's own
loops depends on the core, not on the instruction set, so it is measured
where it runs: the first process that imports a Numba loop of mpidp on a
CPU it has not seen times the DP step's Numba kernels (the Gaussian noise
and the clipping norms) compiled each way, in child processes, keeps the
faster, and caches the choice in a JSON file the user can read, delete or
ship: ``MPIDP_NUMBA_TARGET_FILE``, default ``numba-target.json`` in mpidp's
cache folder, ``$XDG_CACHE_HOME/mpidp`` or ``~/.cache/mpidp``
(:func:`kernels.files.cache_file`; ``none``: no file and no measurement,
LLVM's own choice). Entries are keyed by what the code depends on: LLVM's
CPU name and features and the Numba version (with the host that measured,
for the reader). An entry is read without a lock (the file is replaced
whole, atomically), so a site's file on a read-only mount serves; an entry
that is not one this module writes counts as missing. Processes that start
together (the ranks of a job) wait on a lock while one measures; a file that
cannot be written is reported before measuring, and nothing is measured.
The kernels of both widths are compiled first, one child per width at once,
into Numba's disk cache, so that the timed children only load them and a
second core shortens the wait.

``MPIDP_VECTOR_WIDTH=256`` or ``512`` forces a width, ``host`` keeps LLVM's
choice, ``auto`` (the default) measures, ``cached`` takes the cached choice
where there is one and LLVM's otherwise, never measuring (``mpidp info``,
which reports and must not spend a first run's seconds measuring). A
``NUMBA_CPU_FEATURES`` set by the user is left alone. A CPU without AVX-512
has nothing to choose. Any other value of ``MPIDP_VECTOR_WIDTH`` is an error
(:class:`VectorWidthError`, one line, exit code 2), never silently ignored.

Numba fixes its target when the process decorates its first ``@njit``
function, so every module of mpidp that decorates one imports this module
first; importing it applies the choice (:func:`configure`). If another
library decorated one before, the target is already fixed and is reported
as such. The choice changes speed, not results: the kernels' elementwise
values are the same either way, and their sums are reordered only within
float rounding.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kernels import files

#: ``MPIDP_VECTOR_WIDTH`` values.
MODES = ("auto", "host", "256", "512", "cached")
#: LLVM's x86 tuning flag that caps auto-vectorisation at 256 bits.
PREFER_256 = "prefer-256-bit"
#: The measured widths, in the order they are timed.
WIDTHS = (256, 512)
#: 512-bit code is kept only when it is at least this much faster (ties keep
#: 256-bit: same speed, less power).
MARGIN = 0.97
#: Each width is timed this many times, alternating, in a fresh child process
#: each (Numba's target is per process); the best of its times counts.
PASSES = 2
#: A child that takes longer than this (compiling included) counts as failed.
CHILD_TIMEOUT_S = 300.0
VERSION = 1


class VectorWidthError(ValueError):
    """``MPIDP_VECTOR_WIDTH`` is not one of :data:`MODES`: a user error, printed
    by ``mpidp`` as one line, exit code 2 (:mod:`engine.spmd`), as a bad
    ``MPIDP_ALLREDUCE_AUTO`` is. Raised where this module is first imported,
    on the rank that reads the setting (not ``collective``: each rank reads its
    own environment)."""

    exit_code = 2
    collective = False


def _mode() -> str:
    """``MPIDP_VECTOR_WIDTH``, normalised (default ``auto``).

    Raises:
        VectorWidthError: a value not in :data:`MODES`, naming the accepted ones.
    """
    raw = os.environ.get("MPIDP_VECTOR_WIDTH", "auto")
    mode = raw.strip().lower() or "auto"
    if mode not in MODES:
        raise VectorWidthError(f"MPIDP_VECTOR_WIDTH={raw!r} is not one of "
                               f"{', '.join(MODES)}: unset it (auto) or give one of these")
    return mode


@dataclass
class Choice:
    """What this process's Numba compiles for, and why.

    ``width`` is 256 or 512, or None where LLVM's own choice stands;
    ``source`` says where it came from; ``seconds`` holds the measured
    per-step kernel times by width, where a measurement made the choice.
    """

    cpu: str
    width: int | None
    source: str
    seconds: dict[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        width = "LLVM's default vector width" if self.width is None \
            else f"{self.width}-bit vectors"
        return f"Numba compiles for '{self.cpu}', {width} ({self.source})"


def _host() -> tuple[str, str]:
    """(LLVM's name for this CPU, its feature string), as Numba sees them."""
    import llvmlite.binding as llvm

    return llvm.get_host_cpu_name(), llvm.get_host_cpu_features().flatten()


def features_for(host_features: str, width: int) -> str:
    """``host_features`` with LLVM's 256-bit preference set (256) or cleared (512)."""
    kept = [f for f in host_features.split(",") if f and f[1:] != PREFER_256]
    return ",".join(kept + [("+" if width == 256 else "-") + PREFER_256])


def _key(cpu: str, host_features: str) -> str:
    import numba

    return f"{cpu} | numba {numba.__version__} | {host_features}"


def _numba_target_fixed() -> bool:
    """True once this process has decorated a Numba function (its target is fixed)."""
    from numba.core.registry import cpu_target

    return "_toplevel_target_context" in vars(cpu_target)


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != VERSION:
        return {}
    entries = data.get("entries")
    return entries if isinstance(entries, dict) else {}


def _write(path: Path, entries: dict) -> None:
    files.replace_file(path, json.dumps({"version": VERSION, "entries": entries}, indent=1,
                                        sort_keys=True) + "\n")


def _child(width: int, flag: str) -> dict:
    """What ``python -m kernels.numba_target FLAG`` prints, compiled for ``width``."""
    env = dict(os.environ, MPIDP_VECTOR_WIDTH=str(width))
    done = subprocess.run([sys.executable, "-m", "kernels.numba_target", flag],
                          env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _time_in_child(width: int) -> float:
    """Seconds per step of the timed kernels, compiled for ``width`` in a child."""
    return float(_child(width, "--time-kernels")["seconds"])


def compile_in_children(widths=WIDTHS) -> dict[str, int]:
    """Compile the timed kernels for every width at once, one child each, into
    Numba's disk cache, so that the timed children only load them: the
    compilations overlap where there are cores for them, the timings never
    do. Returns each width's compilations (0: found in the cache). A child
    that fails is left to fail again, and be reported, when it is timed."""
    with ThreadPoolExecutor(len(widths)) as pool:
        done = {w: pool.submit(_child, w, "--compile-kernels") for w in widths}
    compiled = {}
    for width, future in done.items():
        try:
            compiled[str(width)] = int(future.result()["compiled"])
        except (OSError, ValueError, KeyError, subprocess.SubprocessError):
            pass
    return compiled


def measure(time_width=_time_in_child, passes: int = PASSES) -> dict[str, float]:
    """Best seconds per width over ``passes`` alternating timings
    (``time_width(width) -> seconds``; the tests pass fake ones). The real
    children's kernels are compiled first, all widths at once
    (:func:`compile_in_children`)."""
    if time_width is _time_in_child:
        compile_in_children()
    best: dict[str, float] = {}
    for _ in range(passes):
        for width in WIDTHS:
            seconds = time_width(width)
            best[str(width)] = min(seconds, best.get(str(width), float("inf")))
    return best


def decide(seconds: dict[str, float]) -> int:
    """512 when its time is under :data:`MARGIN` times the 256-bit one's, else 256."""
    return 512 if seconds["512"] < MARGIN * seconds["256"] else 256


def _announce(cpu: str, path: Path) -> None:
    """Say, on stderr, that this process measures now: seconds of a first run
    that would otherwise pass in silence (one process a node measures)."""
    print(f"mpidp: measuring which vector width Numba's loops run faster at on this "
          f"CPU ({cpu}): once per CPU, kept in {path}", file=sys.stderr, flush=True)


def _usable(entry: object) -> dict | None:
    """``entry`` if it is one this module wrote (a width, or a failure with its
    error), else None: a damaged entry counts as a missing one and is measured
    again and rewritten (the file is a cache)."""
    if not isinstance(entry, dict):
        return None
    seconds = entry.get("seconds", {})
    if not isinstance(seconds, dict) or not all(
            isinstance(s, (int, float)) and not isinstance(s, bool) for s in seconds.values()):
        return None
    width = entry.get("width")
    if width in WIDTHS and not isinstance(width, bool):
        return entry
    return entry if width is None and isinstance(entry.get("error"), str) else None


def _measure_entry(time_width) -> dict:
    """A new entry: the measured width and seconds, or the failure's error
    (recorded, so that every later process does not fail again)."""
    try:
        seconds = measure(time_width)
        entry: dict = {"width": decide(seconds), "seconds": seconds}
    except (OSError, ValueError, KeyError, IndexError, subprocess.SubprocessError) as exc:
        entry = {"width": None, "error": f"{type(exc).__name__}: {exc}"[:300]}
    entry["measured"] = datetime.date.today().isoformat()
    entry["host"] = platform.node()
    return entry


def _measured(path: Path | None, cpu: str, host_features: str, time_width,
              measure_missing: bool = True) -> Choice:
    """The cached choice for this CPU, read without a lock (the file is replaced
    whole, atomically: a read-only file serves as well); else, where
    ``measure_missing`` and the file can be written, measured now under the
    lock and saved. A damaged entry counts as missing (:func:`_usable`)."""
    if path is None:
        return Choice(cpu, None, "MPIDP_NUMBA_TARGET_FILE=none: not measured")
    key = _key(cpu, host_features)
    entry = _usable(_read(path).get(key))
    source = f"measured earlier, from {path}"
    if entry is None and not measure_missing:
        return Choice(cpu, None, "not measured on this CPU yet, LLVM's choice for now; the "
                      "first mpidp train or mpidp warmup measures it, once")
    if entry is None:
        try:
            problem = files.write_problem(path)  # before seconds are spent measuring
            if problem is not None:
                raise problem
            handle = files.lock(path.with_name(path.name + ".lock"))
        except OSError as exc:
            return Choice(cpu, None, f"{path} not usable ({exc.strerror or exc}): not measured")
        try:
            entries = _read(path)  # another process may have measured while this one waited
            entry = _usable(entries.get(key))
            if entry is None:
                _announce(cpu, path)
                entry = entries[key] = _measure_entry(time_width)
                try:
                    _write(path, entries)
                    source = f"measured now, saved in {path}"
                except OSError as exc:
                    source = (f"measured now, but {path} is not usable "
                              f"({exc.strerror or exc}): not kept")
        finally:
            with contextlib.suppress(OSError):
                files.unlock(handle)
    if entry.get("width") not in WIDTHS:
        return Choice(cpu, None, f"measuring failed ({entry.get('error', 'no width')}); "
                      f"delete {path} to try again")
    return Choice(cpu, int(entry["width"]), source, dict(entry.get("seconds", {})))


def configure(time_width=_time_in_child) -> Choice:
    """Set Numba's target features for this process (module docstring). Run once,
    at import (:data:`CHOICE`): a second call finds the features set and
    reports them as the user's.

    Raises:
        VectorWidthError: ``MPIDP_VECTOR_WIDTH`` is not one of :data:`MODES`
            (checked first, whatever else applies: a mistyped value is never
            silently ignored).
    """
    import numba

    mode = _mode()
    cpu, host_features = _host()
    if os.environ.get("NUMBA_CPU_FEATURES") or numba.config.CPU_FEATURES:
        return Choice(cpu, None, "NUMBA_CPU_FEATURES set by the user")
    if _numba_target_fixed():
        return Choice(cpu, None, "fixed before mpidp was imported")
    if "+avx512f" not in host_features.split(","):
        return Choice(cpu, None, "no AVX-512: nothing to choose")
    if mode == "host":
        return Choice(cpu, None, "MPIDP_VECTOR_WIDTH=host")
    if mode in ("256", "512"):
        choice = Choice(cpu, int(mode), f"MPIDP_VECTOR_WIDTH={mode}")
    else:
        choice = _measured(files.cache_file("numba-target.json", "MPIDP_NUMBA_TARGET_FILE"),
                           cpu, host_features, time_width, measure_missing=mode == "auto")
    if choice.width is not None:
        numba.config.CPU_FEATURES = features_for(host_features, choice.width)
    return choice


def _timed_step():
    """(step, kernels): one step's noise (29,698 float32, the bench MLP's
    parameters) plus its clipping norms (256 rows), compiled as this
    process's target says, on one thread; the Numba dispatchers it calls."""
    import numba
    import numpy as np

    from kernels.numba_cpu import gaussian
    from kernels.numba_cpu.clip_rows import NO_EXTRA, clip_rows_core

    numba.set_num_threads(1)
    rng = np.random.default_rng(0)
    stream = gaussian.NumbaGaussianStream(np.random.SeedSequence(0))
    noise = np.zeros(29_698, dtype=np.float32)
    acts = tuple(rng.standard_normal((256, d), dtype=np.float32) for d in (101, 129, 129))
    grads = tuple(rng.standard_normal((256, d), dtype=np.float32) for d in (128, 128, 2))
    no_bias, factors = np.zeros(3), np.empty(256, dtype=np.float32)

    def step():
        stream.add_(noise, 1.0)
        clip_rows_core(acts, grads, no_bias, NO_EXTRA, 1e30, factors)

    return step, (gaussian.add_normal_chunks, gaussian.add_normal_chunks_serial,
                  gaussian.add_normal, gaussian._warm_up, clip_rows_core)


def _time_kernels(rounds: int = 15, calls: int = 40) -> dict:
    """``{"seconds": median seconds of the timed step (:func:`_timed_step`),
    "compiled": how many of its kernels were compiled here (0: all loaded
    from Numba's disk cache)}``; ``rounds=0``: compile or load, no timing."""
    step, kernels = _timed_step()
    step()  # compile or load
    compiled = sum(sum(k.stats.cache_misses.values()) for k in kernels)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            step()
        times.append((time.perf_counter() - start) / calls)
    return {"seconds": statistics.median(times) if times else None, "compiled": compiled}


#: This process's choice, made when the module is first imported (run as a
#: script, the module imports itself under its own name for it).
CHOICE = configure() if __name__ != "__main__" else None


def main(argv: list[str] | None = None) -> int:
    from kernels.numba_target import CHOICE as choice  # this process's (above)

    parser = argparse.ArgumentParser(prog="python -m kernels.numba_target",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--time-kernels", action="store_true",
                        help="time the kernels as compiled here and print JSON (the "
                        "measurement's child process)")
    parser.add_argument("--compile-kernels", action="store_true",
                        help="compile the timed kernels into Numba's cache and print JSON "
                        "(how many were compiled)")
    args = parser.parse_args(argv)
    if args.compile_kernels or args.time_kernels:
        timed = _time_kernels(rounds=0 if args.compile_kernels else 15)
        print(json.dumps({**timed, "choice": asdict(choice)}))
    else:
        print(choice.describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
