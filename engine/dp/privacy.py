"""Privacy accounting offline: epsilon from (q, sigma, steps, delta), or sigma
from a target epsilon — without data or MPI work.

The sampling rate is q, or B/N from --batch-size and --train-rows; the
length is --steps, or --epochs (steps = epochs * round(N/B), as mpidp train
counts them). For a run with --privacy-unit household, N and B count
households. Both accountants are printed by default: pld (privacy loss
distributions, tight; what mpidp train uses unless told otherwise) and rdp
(Renyi DP, a looser upper bound). delta must not exceed 1/N (N training
rows; without --train-rows, q: an expected batch of at least one row means
N >= 1/q), unless --allow-large-delta. Examples:

  mpidp privacy --sample-rate 0.004267 --noise-multiplier 1.1 --steps 14062
  mpidp privacy --batch-size 256 --train-rows 60000 --epochs 60 --target-epsilon 2
"""
from __future__ import annotations

import argparse
import json
import math

from collectives import MPI
from engine.dp.accountant import KINDS, calibrate, check_delta, epsilon_for, rdp_is_tighter
from engine.errors import ConfigError, PrivacyError


def check_delta_for_rows(delta: float, rows: int, allow: bool = False,
                         where: str | None = None, escape: bool = True,
                         unit: str = "person") -> str | None:
    """Refuse a delta above 1/N for N training units, unless ``allow``
    (``escape``: the message names ``--allow-large-delta``, for the commands
    that have it).

    An (epsilon, delta) guarantee with delta > 1/N is met by a mechanism that
    publishes one random unit (a row, or with ``unit="household"`` a
    household) in the clear, so it protects nobody. Returns None for a delta
    at or below 1/N, and the warning a run must print when ``allow`` lets a
    larger one through.

    Args:
        rows: N, the training units: rows for the person unit, households
            for the household unit.
        unit: the privacy unit (``"person"`` or ``"household"``), which the
            message names.

    Raises:
        PrivacyError: delta > 1/N and not ``allow`` (local: callers make it
            collective).
    """
    bound = 1.0 / rows
    if delta <= bound:
        return None
    of = f" of {where}" if where else ""
    units, one = ("households", "household") if unit == "household" else ("rows", "row")
    if allow:
        return (f"delta {delta:g} is above 1/N = {bound:.3g} for the {rows:,} training "
                f"{units}{of}: the guarantee permits releasing a {one} in the clear")
    suggestion = 10.0 ** math.floor(math.log10(bound))
    if suggestion >= bound:
        suggestion /= 10
    raise PrivacyError(f"--delta {delta:g} is above 1/N = {bound:.3g} for the {rows:,} training "
                       f"{units}{of}: a guarantee with delta > 1/N is met by releasing a random "
                       f"{one} in the clear, so it protects nobody. Use --delta {suggestion:g} "
                       "or smaller" + (" (or --allow-large-delta, if you know why you need it)"
                                       if escape else ""))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    rate = parser.add_mutually_exclusive_group(required=True)
    rate.add_argument("--sample-rate", type=float, help="Poisson sampling rate q")
    rate.add_argument("--batch-size", type=int, help="expected batch size B (needs --train-rows)")
    parser.add_argument("--train-rows", type=int, help="training rows N (with --batch-size; "
                        "with --sample-rate, to check delta against 1/N)")
    length = parser.add_mutually_exclusive_group(required=True)
    length.add_argument("--steps", type=int, help="number of DP-SGD steps")
    length.add_argument("--epochs", type=float, help="epochs (needs --batch-size/--train-rows)")
    noise = parser.add_mutually_exclusive_group(required=True)
    noise.add_argument("--noise-multiplier", type=float, help="sigma: report epsilon")
    noise.add_argument("--target-epsilon", type=float, help="report the sigma that reaches it")
    parser.add_argument("--delta", type=float, default=1e-5,
                        help="delta, at most 1/N (default: 1e-5)")
    parser.add_argument("--allow-large-delta", action="store_true",
                        help="experts: accept a delta above 1/N (said in the output)")
    parser.add_argument("--accountant", default="both", metavar="{pld,rdp,both}",
                        help="which accountant(s) to use (default: both)")
    parser.add_argument("--json", action="store_true", help="print one JSON document")


def run(args: argparse.Namespace) -> int:
    """Every rank computes (deterministic); rank 0 prints.

    Raises:
        ConfigError, PrivacyError: inconsistent options or an impossible target
            (collective).
    """
    def fail(message):
        raise ConfigError(message, collective=True)

    if args.accountant not in (*KINDS, "both"):
        fail(f"--accountant {args.accountant!r} is not an accountant; choose pld, rdp or both")
    try:
        check_delta(args.delta)
    except PrivacyError as exc:
        exc.collective = True
        raise
    if args.train_rows is not None and args.train_rows < 1:
        fail(f"--train-rows {args.train_rows} must be at least 1")
    if args.sample_rate is not None:
        q = args.sample_rate
        if args.epochs is not None:
            fail("--epochs needs --batch-size and --train-rows (or use --steps)")
    else:
        if not args.train_rows or args.train_rows < args.batch_size or args.batch_size < 1:
            fail("--batch-size needs --train-rows N >= B >= 1")
        q = args.batch_size / args.train_rows
    if not 0 < q <= 1:
        fail(f"sampling rate {q} must be in (0, 1]")
    warning = None
    if args.train_rows:
        try:
            warning = check_delta_for_rows(args.delta, args.train_rows, args.allow_large_delta)
        except PrivacyError as exc:
            exc.collective = True
            raise
    elif args.delta > q:  # a batch holds one row or more on average: N >= 1/q, 1/N <= q
        if not args.allow_large_delta:
            raise PrivacyError(f"--delta {args.delta:g} is above the sample rate q = {q:g}, so "
                               "above 1/N for any data set whose batches hold a row on "
                               "average (N >= 1/q): a guarantee with delta > 1/N is met by "
                               "releasing a random row in the clear. Give --train-rows N and "
                               "a delta below 1/N (or --allow-large-delta)", collective=True)
        warning = f"delta {args.delta:g} is above q = {q:g}, hence above 1/N"
    if args.steps is not None:
        steps = args.steps
    elif not (math.isfinite(args.epochs) and args.epochs > 0):
        fail(f"--epochs {args.epochs:g} must be a finite positive number")
    else:
        steps = int(round(args.epochs * max(1, round(args.train_rows / args.batch_size))))
    if steps < 1:
        fail("the run needs at least one step")
    kinds = KINDS if args.accountant == "both" else (args.accountant,)
    result = {"sample_rate": q, "steps": steps, "delta": args.delta}
    if warning:
        result["warning"] = f"--allow-large-delta: {warning}"
    pld_below_rdp = False  # at the RDP's sigma: worth saying what the PLD certifies
    try:
        for kind in kinds:
            if args.noise_multiplier is not None:
                if not (args.noise_multiplier > 0 and math.isfinite(args.noise_multiplier)):
                    fail(f"--noise-multiplier {args.noise_multiplier} must be a finite "
                         "positive number")
                result["noise_multiplier"] = args.noise_multiplier
                result[f"epsilon_{kind}"] = epsilon_for(q, args.noise_multiplier, steps,
                                                        args.delta, kind)
            else:
                result["target_epsilon"] = args.target_epsilon
                found = calibrate(q, steps, args.target_epsilon, args.delta, kind)
                result[f"noise_multiplier_{kind}"] = found.sigma
                if kind == "rdp":  # what the looser calibration really spends
                    result["epsilon_pld_at_rdp_sigma"] = epsilon_for(
                        q, found.sigma, steps, args.delta, "pld")
                    pld_below_rdp = not rdp_is_tighter(q, found.sigma, steps, args.delta)
        if "pld" in kinds:  # the RDP bound where it is the tighter (docs/privacy.md)
            sigma = result.get("noise_multiplier", result.get("noise_multiplier_pld"))
            if rdp_is_tighter(q, sigma, steps, args.delta):
                result["pld_is_the_rdp_bound"] = True
    except PrivacyError as exc:
        exc.collective = True
        raise
    tighter = " (the RDP bound: the PLD's is looser at this delta)" \
        if result.get("pld_is_the_rdp_bound") else ""
    if MPI.COMM_WORLD.Get_rank() == 0:
        if args.json:
            print(json.dumps(result))
        else:
            if warning:
                print(f"WARNING --allow-large-delta: {warning}")
            print(f"q={q:.6g}, steps={steps}, delta={args.delta:g}")
            for kind in kinds:
                if args.noise_multiplier is not None:
                    print(f"  {kind}: epsilon = {result[f'epsilon_{kind}']:.4f} at noise "
                          f"multiplier {args.noise_multiplier:g}"
                          f"{tighter if kind == 'pld' else ''}")
                else:
                    extra = tighter if kind == "pld" else ""
                    if kind == "rdp" and pld_below_rdp:
                        extra = (f" (the PLD certifies epsilon = "
                                 f"{result['epsilon_pld_at_rdp_sigma']:.4f} for it)")
                    print(f"  {kind}: noise multiplier = "
                          f"{result[f'noise_multiplier_{kind}']:.4f} for epsilon "
                          f"{args.target_epsilon:g}{extra}")
    return 0
