"""The epsilon of a DP-SGD run from dp-accounting: the PLD on a grid that has
converged and stays bounded, and the RDP epsilon that sizes its first guess.

One step is ``PoissonSampledDpEvent(q, GaussianDpEvent(sigma))``
(:func:`event`). dp-accounting's PLD (pessimistic, connect-the-dots) costs
time and memory in proportion to the privacy-loss range over the grid's
interval: :func:`pld_interval` guesses an interval from the epsilon's
scale, :func:`pld_grid` halves it until epsilon moves by less than
:data:`PLD_TOLERANCE`, and :func:`effective_interval` coarsens a grid that
would be longer than :data:`MAX_STEP_POINTS` or :data:`MAX_COMPOSED_POINTS`
(the estimate stays an upper bound, only looser). A failure inside
dp-accounting becomes one :class:`~engine.errors.PrivacyError` line.
:mod:`engine.dp.accountant` checks the arguments and is the interface.
"""
from __future__ import annotations

import logging
import math
from functools import lru_cache

from engine.dp.figure_cache import remembered
from engine.errors import PrivacyError

#: Relative accuracy asked of the PLD: the grid is refined until halving its
#: interval changes epsilon by less than this (:func:`pld_grid`).
PLD_TOLERANCE = 2e-3
#: What the first guess of the grid aims at (:func:`pld_interval`).
_GUESS_TOLERANCE = 1e-3
#: Bounds on the grid's interval.
PLD_MIN_INTERVAL, PLD_MAX_INTERVAL = 1e-6, 1.0
#: Halvings of the interval tried at most before accepting the grid.
_MAX_REFINEMENTS = 6
#: Longest single-step PLD grid (points) before the interval is coarsened:
#: with dp-accounting's FFT composition, memory stays well under 1 GiB.
MAX_STEP_POINTS = 1 << 20
#: Longest composed grid (points, predicted by :func:`_composed_width`) before
#: the interval is coarsened. dp-accounting composes with scipy's FFT, which
#: holds a few complex arrays of this length and caches the plans (twiddle
#: factors, 16 bytes a point) of its last 16 lengths, each evaluation's being
#: new: about 16 x 16 MiB at this cap.
MAX_COMPOSED_POINTS = 1 << 20
#: Longest composition :func:`run_pld` runs. Up to about 10^8 steps the
#: coarsened grid keeps it near :data:`MAX_COMPOSED_POINTS`; beyond, each
#: step's rounding to the coarse grid widens it (10^10 steps at q = 0.01,
#: sigma = 1: 10^7 points, 12 s; 10^11: 1.3 * 10^8 points, 150 s).
MAX_RUN_POINTS = 4 * MAX_COMPOSED_POINTS
#: Points per step of the coarse grid that measures the composed width.
_PROBE_POINTS = 64


def quiet_absl() -> None:
    """Silence dp-accounting's absl warnings."""
    # dp-accounting logs a warning per excluded RDP order; not useful to users.
    logging.getLogger("absl").setLevel(logging.ERROR)


def pld_interval(epsilon_scale: float, steps: int) -> float:
    """The first PLD grid interval tried for epsilons near ``epsilon_scale``
    after ``steps`` steps.

    The pessimistic grid's error grows with the steps (each one's loss is
    rounded up) and shrinks about quadratically with the interval
    (connect-the-dots), so ``sqrt(1e-3 * epsilon / steps)`` puts it near
    :data:`PLD_TOLERANCE`; :func:`pld_grid` then checks the grid and refines
    it where the guess was too coarse. Deterministic: every rank picks the same.
    """
    if not (math.isfinite(epsilon_scale) and epsilon_scale > 0):
        return PLD_MAX_INTERVAL
    guess = math.sqrt(_GUESS_TOLERANCE * epsilon_scale / max(1, steps))
    return min(PLD_MAX_INTERVAL, 0.01 * epsilon_scale, max(PLD_MIN_INTERVAL, guess))


# -- RDP ---------------------------------------------------------------------

def event(q: float, sigma: float):
    import dp_accounting  # deferred: slow to load; keeps `mpidp train --help` fast

    return dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))


@lru_cache(maxsize=512)
def rdp_epsilon(q: float, sigma: float, steps: int, delta: float) -> float:
    from dp_accounting import rdp  # deferred: as in event

    quiet_absl()
    if steps <= 0:
        return 0.0
    accountant = rdp.RdpAccountant()
    accountant.compose(event(q, sigma), int(steps))
    return float(accountant.get_epsilon(delta))


# -- PLD ---------------------------------------------------------------------

def _loss_range(q: float, sigma: float) -> float:
    """Width of one step's privacy-loss support (the larger of the remove and
    add directions), from dp-accounting's own truncation of the noise tails."""
    from dp_accounting.pld import privacy_loss_mechanism as plm  # deferred: as in event

    width = 0.0
    for adjacency in (plm.AdjacencyType.REMOVE, plm.AdjacencyType.ADD):
        loss = plm.GaussianPrivacyLoss(sigma, sampling_prob=q, adjacency_type=adjacency)
        tail = loss.privacy_loss_tail()
        width = max(width, abs(loss.privacy_loss(tail.lower_x_truncation)
                               - loss.privacy_loss(tail.upper_x_truncation)))
        if q == 1.0:
            break  # one direction: the PLD is symmetric
    return width


#: dp-accounting's tail mass truncation of a composition (``self_compose``'s default).
_TAIL_MASS = 1e-15


def _pmfs(step) -> list | None:
    """``step``'s PMFs (a dp-accounting PLD): remove, then add unless it is
    symmetric; None where the PLD is not laid out as expected."""
    first = getattr(step, "_pmf_remove", None)
    if first is None:
        return None
    return [first] if getattr(step, "_symmetric", False) else [first, step._pmf_add]


def _as_composed(pmf, steps: int):
    """``pmf`` as dense where composing it ``steps`` times goes dense (the
    library's sparse test, on logarithms), else ``pmf`` itself.

    dp-accounting composes a sparse PMF (what ``from_gaussian_mechanism``
    gives for a short grid) by first computing ``size ** steps`` as an exact
    integer, to see whether the result is too large for a sparse PMF (then
    it goes dense): 10^7 steps took 33 s in that one power, 10^8 longer
    than anyone waits, and ``mpidp privacy`` may be asked any number of
    steps. The same test on logarithms costs nothing; a dense PMF stays
    dense, as the library keeps it."""
    from dp_accounting.pld import pld_pmf  # deferred: as in event

    if not isinstance(pmf, pld_pmf.SparsePLDPmf) or steps <= 1 or pmf.size <= 1:
        return pmf
    cap = math.log(getattr(pld_pmf, "_MAX_PMF_SPARSE_SIZE", 1000))
    return pmf.to_dense_pmf() if steps * math.log(pmf.size) > cap + 1 else pmf


def _as_composed_pld(step, steps: int):
    """``step`` (a dp-accounting PLD) with each PMF as the library would compose
    it ``steps`` times (:func:`_as_composed`): the same composition, in time
    that does not grow with the number of digits of ``steps``."""
    from dp_accounting.pld import privacy_loss_distribution as pld  # deferred: as in event

    pmfs = _pmfs(step)
    if pmfs is None:
        return step
    return pld.PrivacyLossDistribution(*(_as_composed(pmf, steps) for pmf in pmfs))


def _dense_length(prepared, steps: int) -> int | None:
    """Points of ``prepared`` (:func:`_as_composed_pld`) composed ``steps`` times
    (the longest of its PMFs), where every PMF is dense: the length
    dp-accounting's FFT allocates, from its own Chernoff bound, without
    composing. None otherwise (a short sparse composition, or a PLD laid out
    otherwise)."""
    from dp_accounting.pld import common, pld_pmf  # deferred: as in event

    pmfs = _pmfs(prepared)
    if pmfs is None or steps <= 1 or not all(
            isinstance(pmf, pld_pmf.DensePLDPmf) and hasattr(pmf, "_probs") for pmf in pmfs):
        return None
    bounds = [common.compute_self_convolve_bounds(pmf._probs, int(steps), _TAIL_MASS)
              for pmf in pmfs]
    return max(upper - lower + 1 for lower, upper in bounds)


@lru_cache(maxsize=64)
def _composed_width(q: float, sigma: float, steps: int) -> float:
    """Width, in privacy-loss units, of the grid dp-accounting keeps after
    composing ``steps`` steps (its tails truncated at :data:`_TAIL_MASS` by a
    Chernoff bound), measured on a coarse grid of :data:`_PROBE_POINTS` per
    step: the width barely depends on the interval, so a finer grid of
    interval ``d`` needs about ``width / d`` points.

    Where the composition goes dense (:func:`_dense_length`), its length is the
    library's own bound on it (``common.compute_self_convolve_bounds``, what
    its FFT composition allocates), computed without composing: composing
    on the coarse grid took minutes at 10^9 steps. Otherwise the
    composition's ``size`` (a private attribute of dp-accounting's PLD,
    checked by a test); without it, the single step's width times the steps
    stands in (the most the composition can span: safe, and very coarse).
    """
    width = _loss_range(q, sigma)
    if steps <= 1 or width == 0:
        return width
    coarse = width / _PROBE_POINTS
    prepared = _as_composed_pld(_step_pld(q, sigma, coarse), steps)
    points = _dense_length(prepared, steps)
    if points is not None:
        return points * coarse
    composed = prepared.self_compose(int(steps), _TAIL_MASS)
    sizes = [getattr(getattr(composed, name, None), "size", None)
             for name in ("_pmf_remove", "_pmf_add")]
    sizes = [size for size in sizes if isinstance(size, int)]
    if not sizes:
        return width * steps
    return max(sizes) * coarse


def effective_interval(q: float, sigma: float, steps: int, interval: float) -> float:
    """``interval``, coarsened where the single-step grid or the composed one
    would be longer than :data:`MAX_STEP_POINTS` / :data:`MAX_COMPOSED_POINTS`."""
    width = _loss_range(q, sigma)
    return max(interval, width / MAX_STEP_POINTS,
               1.25 * _composed_width(q, sigma, steps) / MAX_COMPOSED_POINTS)


@lru_cache(maxsize=8)
def _step_pld(q: float, sigma: float, interval: float):
    """One step's PLD (pessimistic, connect-the-dots), cached: building it costs
    more than composing it, and each epoch's report composes the same one."""
    from dp_accounting.pld import privacy_loss_distribution as pld  # deferred: as in event

    return pld.from_gaussian_mechanism(standard_deviation=sigma, sampling_prob=q,
                                       value_discretization_interval=interval,
                                       pessimistic_estimate=True)


#: What dp-accounting's PLD raises where its arithmetic gives up (a noise
#: multiplier so small that one step's privacy loss overflows a float, say).
_PLD_FAILURES = (MemoryError, ValueError, OverflowError, FloatingPointError,
                 ZeroDivisionError)


def _pld_failed(q: float, sigma: float, steps: int, exc: BaseException) -> PrivacyError:
    """The one-line error for a failure inside dp-accounting's PLD: no
    traceback from inside the library may reach the user."""
    reason = (str(exc).splitlines() or [""])[0][:120]
    return PrivacyError(
        f"PLD accounting failed at noise multiplier {sigma:.4g}, sampling rate {q:.3g}, "
        f"{steps} steps ({type(exc).__name__}: {reason}); use --accountant rdp")


def run_pld(q: float, sigma: float, steps: int, interval: float):
    """The run's PLD on the grid ``interval`` (coarsened where it would be too
    long: :func:`effective_interval`); dp-accounting's failures as one line.

    Raises:
        PrivacyError: dp-accounting fails, or the composition would be longer
            than :data:`MAX_RUN_POINTS` (billions of steps: the coarse grid's
            rounding widens each step's loss, so coarsening no longer keeps
            the composition short, and its FFT would take minutes).
    """
    try:
        effective = effective_interval(q, sigma, steps, interval)
        prepared = _as_composed_pld(_step_pld(q, sigma, effective), steps)
        points = _dense_length(prepared, steps)
        if points is not None and points > MAX_RUN_POINTS:
            raise PrivacyError(
                f"PLD accounting of {steps:,} steps at noise multiplier {sigma:.4g}, sampling "
                f"rate {q:.3g} would compose a grid of {points:,} points, too long to be "
                "useful over so many steps; use --accountant rdp")
        return prepared.self_compose(int(steps), _TAIL_MASS)
    except _PLD_FAILURES as exc:
        raise _pld_failed(q, sigma, steps, exc) from None


@lru_cache(maxsize=512)
def pld_epsilon(q: float, sigma: float, steps: int, delta: float, interval: float) -> float:
    """The PLD's epsilon on the grid ``interval`` (:func:`run_pld`)."""
    if steps <= 0:
        return 0.0
    composed = run_pld(q, sigma, steps, interval)
    try:
        return float(composed.get_epsilon_for_delta(delta))
    except _PLD_FAILURES as exc:
        raise _pld_failed(q, sigma, steps, exc) from None


def _refinable(q: float, sigma: float, steps: int, interval: float) -> bool:
    """Whether halving ``interval`` gives a finer grid (not at a floor or cap)."""
    half = interval / 2
    return half >= PLD_MIN_INTERVAL and effective_interval(q, sigma, steps, half) == half


@remembered("pld_grid")
def pld_grid(q: float, sigma: float, steps: int, delta: float,
             interval: float | None = None) -> float:
    """The PLD grid interval on which epsilon has converged to
    :data:`PLD_TOLERANCE`: halving it changes epsilon by less than that
    (relative), or it cannot be halved (memory caps).

    Args:
        interval: the first guess (default :func:`pld_interval` of the RDP
            epsilon, an upper bound of the answer's scale).
    """
    if interval is None:
        interval = pld_interval(rdp_epsilon(q, sigma, steps, delta), steps)
    for _ in range(_MAX_REFINEMENTS):
        try:  # measures the composed width with dp-accounting
            refinable = _refinable(q, sigma, steps, interval)
        except _PLD_FAILURES as exc:
            raise _pld_failed(q, sigma, steps, exc) from None
        if not refinable:
            break
        coarse = pld_epsilon(q, sigma, steps, delta, interval)
        fine = pld_epsilon(q, sigma, steps, delta, interval / 2)
        if coarse - fine <= PLD_TOLERANCE * fine or not math.isfinite(fine):
            break
        interval /= 2
    return interval
