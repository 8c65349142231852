"""The Gaussian noise kernels against torch's and numpy's samplers, side by side.

Each method adds ``std * N(0, 1)`` to the same float32 buffer in place, what
a DP-SGD step does once per step (the buffer's length is the model's
parameter count, 29,698 for the default MLP 100-128-128-2):

* ``mpidp``          the CPU kernel ``mpidp train`` runs
  (:mod:`kernels.numba_cpu.gaussian`: SFC64 lanes, vectorised Box-Muller),
  bound to its buffer once as the training step binds it;
* ``torch``          ``torch.Tensor.normal_`` then ``add_`` (the torch kernel,
  :mod:`kernels.torch.gaussian`, what ``--kernels torch`` runs);
* ``numpy-sfc64``, ``numpy-pcg64`` numpy's ``Generator.standard_normal`` (its
  ziggurat) in float32 into a scratch buffer, then ``+=``.

Methods are interleaved over ``--repeats`` rounds and the median reported,
so a load change hits them alike; the ratios are each method's time over
mpidp's. The header names the CPU, its vector extensions, the target
Numba compiled for and the threads each library runs
(:func:`engine.run.threads.thread_facts`:
``--threads`` above Numba's pool gives torch more threads than mpidp's
kernel, and a count above the cores prints the oversubscription note, also
in ``--json``). Run it on one rank::

  mpidp bench noise
  mpidp bench noise --threads 2 --size 1000000 --json noise.json
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict

from collectives import MPI, machine
from engine import outputs
from engine.choices import thread_count
from engine.errors import ConfigError, OutputError

METHODS = ("mpidp", "torch", "numpy-sfc64", "numpy-pcg64")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", type=int, default=29_698,
                        help="samples per call, the model's parameter count (default: "
                             "%(default)s, the default MLP)")
    parser.add_argument("--threads", type=thread_count, default=1,
                        help="threads for mpidp's and torch's kernels (numpy's sampler "
                             "has one) (default: %(default)s)")
    parser.add_argument("--seconds", type=float, default=0.2,
                        help="time per method per round (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=7,
                        help="rounds; the median is reported (default: %(default)s)")
    parser.add_argument("--json", default=None, metavar="FILE",
                        help="write ns per sample per method, the ratios and the machine")


def _methods(size: int) -> tuple[dict, dict]:
    """Each method as a callable adding one call's noise to its own buffer, and
    the buffers (float32 tensors of ``size``), by method."""
    import numpy as np
    import torch

    from kernels import registry

    seeds = np.random.SeedSequence(0)
    ours = registry.get("gaussian_stream", "cpu", "numba")(seeds)
    theirs = registry.get("gaussian_stream", "cpu", "torch")(seeds)
    buffers = {name: torch.zeros(size) for name in METHODS}
    scratch = np.empty(size, dtype=np.float32)
    sfc64 = np.random.Generator(np.random.SFC64(1))
    pcg64 = np.random.Generator(np.random.PCG64(1))

    def numpy_method(generator, buf):
        array = buf.numpy()

        def call():
            generator.standard_normal(size, dtype=np.float32, out=scratch)
            array.__iadd__(scratch)
        return call

    return {
        "mpidp": ours.bind(buffers["mpidp"], 1.0),  # bound once, as the training step does
        "torch": lambda: theirs.add_(buffers["torch"], 1.0),
        "numpy-sfc64": numpy_method(sfc64, buffers["numpy-sfc64"]),
        "numpy-pcg64": numpy_method(pcg64, buffers["numpy-pcg64"]),
    }, buffers


def _time(call, seconds: float) -> float:
    """Seconds per call: calls repeated for about ``seconds``."""
    calls, start = 0, time.perf_counter()
    while True:
        call()
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return elapsed / calls


def run(args: argparse.Namespace) -> int:
    """Rank 0 alone: every method on the same buffer size; prints the table."""
    from engine.run.threads import configure_threads, thread_facts, thread_label

    if MPI.COMM_WORLD.Get_size() > 1:
        raise ConfigError("mpidp bench noise times one process: run it without mpiexec "
                          "(or with -n 1)", collective=True)
    for option, value, least in (("--size", args.size, 1), ("--threads", args.threads, 1),
                                 ("--repeats", args.repeats, 1)):
        if value < least:
            raise ConfigError(f"{option} {value} must be at least {least}", collective=True)
    if not args.seconds > 0:
        raise ConfigError(f"--seconds {args.seconds} must be positive", collective=True)
    try:
        outputs.check_all({"--json": args.json})
    except OutputError as exc:
        exc.collective = True
        raise
    configured = configure_threads(args.threads)
    threads = thread_facts(configured.threads, configured.note)
    where = machine.describe()
    from kernels.numba_target import CHOICE  # deferred: Numba
    print(f"mpidp bench noise: {args.size:,} float32 samples per call, "
          f"{thread_label(threads)}, {args.repeats} rounds of {args.seconds:g} s per method")
    if threads["threads_note"]:
        print(threads["threads_note"])
    print(f"machine: {machine.one_line(where)}; {CHOICE.describe()}")
    methods, _ = _methods(args.size)
    for call in methods.values():  # compile, fault pages in
        call()
    seconds: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(args.repeats):
        for name, call in methods.items():
            seconds[name].append(_time(call, args.seconds))
    ns = {name: statistics.median(values) * 1e9 / args.size for name, values in seconds.items()}
    # ratios per round, then the median: both ran within a second of each other
    ratio = {name: statistics.median(s / o for s, o in zip(values, seconds["mpidp"]))
             for name, values in seconds.items()}
    print(f"{'method':<14} {'ns/sample':>10} {'Msamples/s':>11} {'time / mpidp':>13}")
    for name in methods:
        print(f"{name:<14} {ns[name]:>10.3f} {1e3 / ns[name]:>11.0f} {ratio[name]:>12.2f}x")
    if args.json:
        outputs.write_json(args.json, {"ns_per_sample": ns, "over_mpidp": ratio,
                                       "all_rounds_s": seconds, "size": args.size,
                                       **threads, "machine": where,
                                       "numba_target": asdict(CHOICE),
                                       "provenance": machine.provenance(where)}, "--json")
    return 0
