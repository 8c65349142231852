"""PLD calibration over a grid of (epsilon, q, steps): seconds, peak memory, and
Opacus' PRV accountant side by side.

Each grid point runs in a fresh Python process (so its peak resident memory
is its own, interpreter and libraries included), which calibrates sigma with
:func:`engine.dp.accountant.calibrate` and times the call; ``--jobs`` runs
points in parallel (timings then share the cores). With ``--reference
opacus`` each point also asks Opacus' PRV accountant (``opacus`` extra) for
its sigma at the target and its epsilon at our sigma, and the table shows the
relative differences. The last lines give the maxima over the grid. Examples:

  mpidp bench accountant                      # the default grid, ~140 points
  mpidp bench accountant --epsilons 1 --rates 0.00195 --steps 2570 --reference opacus
  mpidp bench accountant --json grid.json --jobs 2

Run it on one rank: it is offline arithmetic. ``--json`` writes one document:
the run's settings, every point's result under ``points`` and the
``provenance`` block (command, date, commit, machine). A stop signal ends
the run at once: queued points are dropped, running ones killed, nothing
written.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

from engine import outputs
from engine.errors import ConfigError

EPSILONS = (0.1, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
RATES = (1e-4, 1e-3, 1e-2, 0.1)
STEPS = (100, 1000, 10_000, 30_000, 100_000)
#: Opacus' PRV: its epsilon error, relative to the target.
PRV_RELATIVE_ERROR = 5e-3
#: A grid point's process is stopped beyond this resident memory (Opacus' PRV
#: grows to many GiB at small epsilon errors and long runs).
MAX_POINT_RSS = 4 << 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--epsilons", default=",".join(map(str, EPSILONS)),
                        help="target epsilons, comma-separated (default: %(default)s)")
    parser.add_argument("--rates", default=",".join(map(str, RATES)),
                        help="sampling rates q (default: %(default)s)")
    parser.add_argument("--steps", default=",".join(map(str, STEPS)),
                        help="numbers of steps (default: %(default)s)")
    parser.add_argument("--delta", type=float, default=1e-5, help="delta (default: 1e-5)")
    parser.add_argument("--reference", choices=("none", "opacus"), default="none",
                        help="also run Opacus' PRV accountant at each point (default: none)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="points run at once, one process each, at least 1 (default: 1)")
    parser.add_argument("--json", default=None, metavar="FILE",
                        help="write every point's result (under \"points\") with the "
                             "settings and provenance as JSON")


def _floats(text: str, option: str, low: float = 0.0, high: float = math.inf,
            whole: bool = False) -> list[float]:
    """Comma-separated numbers, each in ``(low, high]`` (and whole with
    ``whole``); ConfigError otherwise, before any point is computed (a bad
    one used to become an error row, and the run exit 0)."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{option} {text!r}: expected comma-separated numbers",
                          collective=True) from None
    if not values:
        raise ConfigError(f"{option} is empty", collective=True)
    for v in values:
        if not (low < v <= high and math.isfinite(v)) or (whole and v != int(v)):
            what = "a whole number" if whole else "a finite number"
            where = f"> {low:g}" if high == math.inf else f"in ({low:g}, {high:g}]"
            raise ConfigError(f"{option}: {v:g} must be {what} {where}", collective=True)
    return values


def point(q: float, steps: int, target: float, delta: float, reference: str) -> dict:
    """One grid point, in this process: calibration seconds, our sigma and
    epsilon, and (``reference="opacus"``) Opacus' PRV sigma and epsilon."""
    import resource
    import time
    import warnings

    from engine.dp import accountant, figure_cache
    from engine.errors import PrivacyError

    accountant.epsilon_for(0.5, 1.0, 1, delta, "rdp")  # load dp-accounting before timing
    result = {"epsilon": target, "q": q, "steps": steps, "delta": delta}
    start = time.perf_counter()
    with figure_cache.off():  # times the calibration, never the file of kept figures
        try:
            found = accountant.calibrate(q, steps, target, delta, "pld")
        except PrivacyError as exc:
            result.update(error=str(exc), seconds=time.perf_counter() - start)
        else:
            result.update(seconds=time.perf_counter() - start, sigma=found.sigma,
                          interval=found.interval,
                          epsilon_pld=accountant.epsilon_for(q, found.sigma, steps, delta,
                                                             "pld", found.interval))
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if reference == "opacus" and "sigma" in result:
        warnings.filterwarnings("ignore")
        t0 = time.perf_counter()
        try:
            result.update(_prv(q, steps, target, delta, result["sigma"]))
        except Exception as exc:  # noqa: BLE001 - the reference's own failure, reported
            result["prv_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        result["seconds_prv"] = time.perf_counter() - t0
    return result


def _prv(q: float, steps: int, target: float, delta: float, sigma: float) -> dict:
    """Opacus' PRV accountant: its epsilon at ``sigma``, and its own sigma for
    ``target`` (the root of its epsilon, to a relative 1e-3, found by secant
    steps from ``sigma``: a few PRV evaluations where Opacus' bisection from
    [0, 20] needs twenty)."""
    from opacus.accountants import PRVAccountant  # deferred: optional extra

    # Relative errors: PRV's default eps_error (0.01, absolute) would be 10 %
    # at epsilon 0.1 and bias its sigma upwards.
    error = PRV_RELATIVE_ERROR * target

    def prv_epsilon(s: float) -> float:
        acct = PRVAccountant()
        acct.history = [(s, q, steps)]
        return float(acct.get_epsilon(delta=delta, eps_error=error))

    at_ours = prv_epsilon(sigma)
    points = [(sigma, math.log(at_ours / target))]
    x = sigma * (at_ours / target) ** 0.5  # epsilon falls roughly like 1/sigma^2..1/sigma
    for _ in range(30):
        points.append((x, math.log(prv_epsilon(x) / target)))
        below = [p for p in points if p[1] > 0]
        above = [p for p in points if p[1] <= 0]
        if below and above:
            lo, hi = max(below), min(above)
            if hi[0] / lo[0] - 1 <= 1e-3:
                return {"epsilon_prv": at_ours, "sigma_prv": hi[0]}
            # false position inside the bracket, kept off its ends
            t = lo[1] / (lo[1] - hi[1])
            x = math.exp(math.log(lo[0]) + min(0.9, max(0.1, t)) * math.log(hi[0] / lo[0]))
        else:
            (x0, f0), (x1, f1) = points[-2], points[-1]
            slope = (f1 - f0) / math.log(x1 / x0) if x1 != x0 and f1 != f0 else -1.0
            step = min(0.7, max(-0.7, -f1 / slope if slope < 0 else (0.3 if f1 > 0 else -0.3)))
            x = x1 * math.exp(step)
    raise RuntimeError("PRV calibration did not converge")


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _in_subprocess(q: float, steps: int, target: float, delta: float, reference: str,
                   stop: threading.Event | None = None) -> dict | None:
    """:func:`point` in a fresh process, stopped if it grows past MAX_POINT_RSS.

    Once ``stop`` is set (the run was interrupted) no process is started and a
    running one is killed within a poll (0.2 s); the result is then None.
    """
    import tempfile

    stop = stop or threading.Event()
    if stop.is_set():
        return None
    code = ("import json, sys; from engine.bench.accountant import point; "
            f"print(json.dumps(point({q!r}, {steps!r}, {target!r}, {delta!r}, {reference!r})))")
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=err, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        too_big = stopped = False
        while proc.poll() is None:
            if _rss(proc.pid) > MAX_POINT_RSS:
                too_big = True
                proc.kill()
            if stop.wait(0.2):  # the poll's pause, cut short by a stop
                stopped = True
                proc.kill()
                proc.wait()
        if stopped:
            return None
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    base = {"epsilon": target, "q": q, "steps": steps, "delta": delta}
    if too_big:
        return {**base, "error": f"stopped: more than {MAX_POINT_RSS >> 30} GiB resident"
                + (" (the PRV reference)" if reference != "none" else "")}
    if proc.returncode != 0:
        tail = (stderr.strip().splitlines() or ["?"])[-1]
        return {**base, "error": f"exit {proc.returncode}: {tail}"}
    return json.loads(stdout.strip().splitlines()[-1])


def _row(r: dict) -> str:
    """One point's line of the table; q with the digits the footer gives it (``g``)."""
    head = f"{r['epsilon']:>6g} {r['q']:>10g} {r['steps']:>7d}"
    if "sigma" not in r:
        return f"{head}  {r.get('error', '?')[:70]}"
    line = (f"{head} {r['sigma']:>9.4f} {r['epsilon_pld']:>8.4f} {r['seconds']:>6.2f} "
            f"{r['peak_rss_mib']:>6.0f}")
    if "sigma_prv" in r:
        line += (f" {r['sigma_prv']:>9.4f} {r['epsilon_prv']:>8.4f} "
                 f"{r['sigma'] / r['sigma_prv'] - 1:>+7.2%} "
                 f"{r['epsilon_pld'] / r['epsilon_prv'] - 1:>+7.2%}")
    elif "prv_error" in r:
        line += f"  PRV: {r['prv_error'][:50]}"
    return line


def run(args: argparse.Namespace) -> int:
    """Rank 0 walks the grid and prints; other ranks do nothing."""
    from collectives import MPI

    epsilons = _floats(args.epsilons, "--epsilons")
    rates = _floats(args.rates, "--rates", high=1.0)
    steps = [int(s) for s in _floats(args.steps, "--steps", whole=True)]
    if not 0.0 < args.delta < 1.0:
        raise ConfigError(f"--delta {args.delta:g} must be in (0, 1)", collective=True)
    if args.jobs < 1:
        raise ConfigError(f"--jobs {args.jobs} must be at least 1", collective=True)
    if MPI.COMM_WORLD.Get_rank() != 0:
        return 0
    outputs.check_all({"--json": args.json})  # before the minutes of work (engine.outputs)
    grid = [(q, t, e) for e in epsilons for q in rates for t in steps]
    print(f"PLD calibration (dp-accounting) at delta={args.delta:g}, {len(grid)} points, "
          f"{args.jobs} at a time")
    head = f"{'eps':>6} {'q':>10} {'steps':>7} {'sigma':>9} {'eps_pld':>8} {'s':>6} {'MiB':>6}"
    if args.reference == "opacus":
        head += f" {'sigma_prv':>9} {'eps_prv':>8} {'dsigma':>7} {'deps':>7}"
    print(head, flush=True)
    results = _walk(grid, args)
    done = [r for r in results if "sigma" in r]
    if done:
        worst = max(done, key=lambda r: r["seconds"])
        print(f"max time {worst['seconds']:.2f} s (eps {worst['epsilon']:g}, q "
              f"{worst['q']:g}, steps {worst['steps']}); max peak memory "
              f"{max(r['peak_rss_mib'] for r in done):.0f} MiB; "
              f"{len(done)} calibrated, {len(results) - len(done)} out of reach or failed")
    compared = [r for r in done if "sigma_prv" in r]
    if compared:
        print(f"vs Opacus PRV: max |sigma/sigma_prv - 1| = "
              f"{max(abs(r['sigma'] / r['sigma_prv'] - 1) for r in compared):.2%}, max "
              f"|eps_pld/eps_prv - 1| = "
              f"{max(abs(r['epsilon_pld'] / r['epsilon_prv'] - 1) for r in compared):.2%} "
              f"over {len(compared)} points")
    if args.json:
        from collectives import machine  # deferred: a point's process imports this module

        where = machine.describe()
        outputs.write_json(args.json, {
            "delta": args.delta, "reference": args.reference, "jobs": args.jobs,
            "points": results, "provenance": machine.provenance(where)}, "--json")
    return 0


def _walk(grid: list[tuple[float, int, float]], args: argparse.Namespace) -> list[dict]:
    """Each point of ``grid`` ((q, steps, epsilon)) in its own process, ``args.jobs``
    at a time, printed in grid order as they finish; returns the results.

    A stop signal (:class:`engine.stopping.Interrupted`, raised here while
    waiting) drops the queued points, kills the running processes and is
    raised again once they are gone (within about 0.2 s).
    """
    stop = threading.Event()
    pool = ThreadPoolExecutor(args.jobs)
    results = []
    try:
        futures = [pool.submit(_in_subprocess, q, t, e, args.delta, args.reference, stop)
                   for q, t, e in grid]
        for future in futures:
            results.append(future.result())
            print(_row(results[-1]), flush=True)
    except BaseException:
        stop.set()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return results
