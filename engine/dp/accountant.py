"""Privacy accounting with Google's ``dp-accounting``: PLD (the default) and RDP.

One DP-SGD step on a Poisson sample of rate q with noise multiplier sigma is
the event ``PoissonSampledDpEvent(q, GaussianDpEvent(sigma))``; a run is that
event composed once per step. :class:`Accountant` keeps (q, sigma, delta,
steps, and the PLD's discretisation) — everything needed to recompute
epsilon — so its state is a few numbers in the checkpoint and a resumed run
continues from the steps already spent.

Two accountants, both dp-accounting's:

* ``pld`` (default): privacy loss distributions (Meiser & Mohammadi 2018;
  Koskela et al. 2020; Doroshenko et al. 2022, "Connect the dots"), with
  pessimistic discretisation, so the epsilon reported is an upper bound on
  the true epsilon whatever the grid, and tight (within a fraction of a
  percent) at the grid chosen here;
* ``rdp``: Renyi DP (Mironov 2017; Mironov, Talwar & Zhang 2019), fast and
  an upper bound too, but looser (docs/design/pld-accountant.md).

**The tighter bound.** Far below the deltas of practice (delta near
dp-accounting's tail truncation, 1e-15, or under about 1e-12 after 10^5
steps), the PLD's discretised tails dominate: its epsilon grows past the
RDP's, and at the truncation it is infinite. Both are upper bounds on the
true epsilon, so ``pld`` reports (and calibrates against) the smaller of
the two: the PLD's wherever it is the tighter, which covers every run of
the docs, the RDP's below that (:func:`pld_or_rdp`).

**Fast, bounded PLD calibration.** dp-accounting's PLD costs time and memory
in proportion to the privacy-loss range over the grid's interval, and the
range explodes as sigma shrinks, so :func:`calibrate` never evaluates far
below the answer: it starts at the RDP sigma (cheap to find, and close
above the PLD's) and moves by secant steps of at most a factor 2 until the
answer is bracketed, then narrows the bracket, always keeping an end whose
PLD epsilon was computed and is within the target. The grid follows the
target: an interval of ``sqrt(tolerance * epsilon / steps)`` (the
pessimistic rounding accumulates over the steps), checked at the answer by
halving it and refined where that changes epsilon by more than
:data:`~engine.dp.pld.PLD_TOLERANCE`. A grid that would still be too long
(a tiny sigma given with ``--noise-multiplier``) is coarsened instead: the
pessimistic estimate stays an upper bound, only looser. The grid's
machinery is :mod:`engine.dp.pld`.

The budget's arithmetic lives here too (:meth:`Accountant.fits`,
:meth:`Accountant.epochs_within`, :meth:`Accountant.check_plan`), so the
training loop asks questions instead of computing epsilons itself. Example::

    >>> acct, budget = Accountant.plan(q=256 / 131610, delta=1e-5, steps=2570,
    ...                                target_epsilon=1.0)  # PLD: sigma about 0.772
    >>> acct.step(2570); acct.epsilon() <= budget
    True
    >>> calibrate_sigma(256 / 131610, 2570, 1.0, 1e-5, kind="rdp")  # about 0.944
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from engine.dp.figure_cache import remembered
from engine.dp.pld import pld_epsilon, pld_grid, pld_interval, quiet_absl, rdp_epsilon, run_pld
from engine.errors import PrivacyError

#: Accountant names, the default first.
KINDS = ("pld", "rdp")
DEFAULT_KIND = "pld"
#: The largest noise multiplier a calibration considers; a target that needs
#: more is out of reach (such a run would learn nothing).
SIGMA_MAX = 1e3
_SIGMA_MIN_RDP = 1e-2
#: Relative slack of budget checks: epsilons are compared as floats computed
#: the same way, and a hair of rounding must not refuse a calibrated run.
BUDGET_SLACK = 1e-6
#: Calibration stops at this relative width of the sigma bracket (PLD; RDP,
#: whose evaluations cost little, narrows it to 1e-4).
CALIBRATION_RTOL = 2e-3
_RDP_RTOL = 1e-4


def check_kind(kind: str, option: str = "--accountant") -> None:
    """Raises :class:`PrivacyError` (one line) for an accountant not in :data:`KINDS`."""
    if kind not in KINDS:
        raise PrivacyError(f"{option} {kind!r} is not an accountant; choose "
                           f"{' or '.join(KINDS)} (default {DEFAULT_KIND})")


def check_delta(delta: float) -> None:
    """Raises :class:`PrivacyError` unless ``0 < delta < 1``."""
    if not 0.0 < delta < 1.0:
        raise PrivacyError(f"--delta {delta} must be in (0, 1)")


def _check_run(q: float, steps: int) -> None:
    if not 0.0 < q <= 1.0:
        raise PrivacyError(f"sampling rate {q} must be in (0, 1]")
    if steps < 0:
        raise PrivacyError(f"{steps} steps: must be >= 0")


def composed_pld(q: float, sigma: float, steps: int, delta: float):
    """dp-accounting's PLD of the whole run (pessimistic, on the grid where
    epsilon at ``delta`` has converged): the run's privacy curve, for
    questions beyond one epsilon (the canary audit's hypothesis).

    Raises:
        PrivacyError: as :func:`epsilon_for`.
    """
    check_delta(delta)
    _check_run(q, steps)
    if not sigma > 0 or steps < 1:
        raise PrivacyError(f"need a noise multiplier > 0 and steps >= 1, got {sigma}, {steps}")
    sigma, steps = float(sigma), int(steps)
    return run_pld(q, sigma, steps, pld_grid(q, sigma, steps, delta))


@remembered("epsilon_for")
def epsilon_for(q: float, sigma: float, steps: int, delta: float, kind: str = DEFAULT_KIND,
                interval: float | None = None) -> float:
    """Epsilon after ``steps`` DP-SGD steps at rate q and noise multiplier sigma.

    Args:
        interval: the PLD grid (ignored by RDP); None picks a converged one
            (:func:`pld_grid`). The PLD's value is an upper bound on any grid.

    Raises:
        PrivacyError: an unknown ``kind``, or q, steps, sigma or delta out of
            range (one line).
    """
    check_kind(kind)
    check_delta(delta)
    _check_run(q, steps)
    if not (sigma > 0 and math.isfinite(sigma)):
        raise PrivacyError(f"noise multiplier {sigma} must be a finite positive number")
    steps = int(steps)
    if kind == "rdp" or steps == 0:
        return rdp_epsilon(q, sigma, steps, delta)
    if interval is None:
        interval = pld_grid(q, sigma, steps, delta)
    return pld_or_rdp(q, sigma, steps, delta, float(interval))


def rdp_is_tighter(q: float, sigma: float, steps: int, delta: float) -> bool:
    """Whether ``pld``'s epsilon of this run is the RDP's, the PLD's being the
    looser bound (a delta far below practice: module docstring)."""
    return epsilon_for(q, sigma, steps, delta, "pld") == epsilon_for(q, sigma, steps, delta,
                                                                     "rdp")


def pld_or_rdp(q: float, sigma: float, steps: int, delta: float, interval: float) -> float:
    """The smaller of the PLD's epsilon on the grid ``interval`` and the RDP's:
    both are upper bounds, so the smaller one is (module docstring)."""
    return min(pld_epsilon(q, sigma, steps, delta, interval),
               rdp_epsilon(q, sigma, steps, delta))


# -- calibration -----------------------------------------------------------------

def _bracket(excess: Callable[[float], float], start: float, q: float, steps: int,
             target: float, first_step: float = 1.25) -> tuple[float, float, float, float]:
    """``(lo, hi, f_lo, f_hi)`` with ``excess(lo) > 0 >= excess(hi)``, searched from
    ``start`` (first a step of ``first_step``, then secant steps in (log sigma,
    excess), each at most a factor 2 and at least 3 % beyond the last point),
    so sigma never strays far below the answer (where the PLD grid is
    expensive).

    Raises:
        PrivacyError: the excess stays positive up to :data:`SIGMA_MAX`.
    """
    x0, f0 = start, excess(start)
    x1 = x0 / first_step if f0 <= 0 else min(SIGMA_MAX, x0 * first_step)
    if x1 == x0:
        raise _unreachable(q, steps, target)
    f1 = excess(x1)
    for _ in range(200):
        if (f0 > 0) != (f1 > 0):
            break
        down = f1 <= 0  # certified: the answer lies at a smaller sigma
        if f1 != f0 and math.isfinite(f1) and math.isfinite(f0):
            guess = math.exp(math.log(x1) - f1 * (math.log(x1) - math.log(x0)) / (f1 - f0))
        else:
            guess = x1 / 2 if down else x1 * 2
        x2 = (min(max(guess / 1.03, x1 / 2), x1 / 1.03) if down
              else min(max(guess * 1.03, x1 * 1.03), x1 * 2, SIGMA_MAX))
        if not down and x1 >= SIGMA_MAX:
            raise _unreachable(q, steps, target)
        x0, f0, x1, f1 = x1, f1, x2, excess(x2)
    if (f0 > 0) == (f1 > 0):
        raise _unreachable(q, steps, target)
    return (x1, x0, f1, f0) if f1 > 0 else (x0, x1, f0, f1)


def _bracketed_root(excess: Callable[[float], float], lo: float, hi: float, f_lo: float,
                    f_hi: float, rtol: float, max_evaluations: int = 100) -> float:
    """The upper end of the bracket around the root of a decreasing
    ``excess(sigma)``, narrowed to ``hi / lo - 1 <= rtol`` with
    ``excess(lo) > 0 >= excess(hi)`` kept throughout, so the answer is
    certified (its excess was computed and is <= 0).

    Illinois-style false position on (log sigma, excess), kept 2 % of the
    bracket away from its ends.
    """
    side = 0
    for _ in range(max_evaluations):
        if hi / lo - 1.0 <= rtol:
            break
        a, b = math.log(lo), math.log(hi)
        width = b - a
        x = b - f_hi * width / (f_hi - f_lo) if math.isfinite(f_lo) and f_lo != f_hi \
            else 0.5 * (a + b)
        x = min(max(x, a + 0.02 * width), b - 0.02 * width)
        sigma = math.exp(x)
        value = excess(sigma)
        if value > 0:
            lo, f_lo = sigma, value
            f_hi = f_hi / 2 if side == -1 else f_hi
            side = -1
        else:
            hi, f_hi = sigma, value
            f_lo = f_lo / 2 if side == 1 else f_lo
            side = 1
    return hi


def _log_excess(epsilon: float, target: float) -> float:
    return math.inf if epsilon == math.inf else math.log(max(epsilon, 1e-300) / target)


def _unreachable(q: float, steps: int, target: float) -> PrivacyError:
    return PrivacyError(
        f"epsilon={target:g} is out of reach: even noise multiplier {SIGMA_MAX:g} gives "
        f"more for {steps} steps at sampling rate {q:.3g}; use fewer epochs, a smaller "
        "batch, or a larger epsilon")


def _calibrate_rdp(q: float, steps: int, target: float, delta: float) -> float | None:
    """The RDP sigma, or None when RDP cannot reach the target below SIGMA_MAX."""
    excess = lambda s: _log_excess(rdp_epsilon(q, s, steps, delta), target)  # noqa: E731
    f_hi = excess(SIGMA_MAX)
    if f_hi > 0:
        return None
    f_lo = excess(_SIGMA_MIN_RDP)
    if f_lo <= 0:
        return _SIGMA_MIN_RDP
    return _bracketed_root(excess, _SIGMA_MIN_RDP, SIGMA_MAX, f_lo, f_hi, _RDP_RTOL)


@dataclass(frozen=True)
class Calibration:
    """A calibrated noise multiplier and the PLD grid it was certified on
    (None for RDP): the run reports its epsilons on that grid."""

    sigma: float
    interval: float | None


@remembered("calibrate", encode=lambda c: [c.sigma, c.interval],
            decode=lambda v: Calibration(float(v[0]), None if v[1] is None else float(v[1])))
def calibrate(q: float, steps: int, target_epsilon: float, delta: float,
              kind: str = DEFAULT_KIND) -> Calibration:
    """The smallest noise multiplier (to a relative :data:`CALIBRATION_RTOL`)
    whose run of ``steps`` steps stays within ``(target_epsilon, delta)``.

    RDP: bracketed in [0.01, :data:`SIGMA_MAX`]. PLD: searched on a grid
    from :func:`~engine.dp.pld.pld_interval`, which is then checked at the
    answer (halving it must change epsilon by less than
    :data:`~engine.dp.pld.PLD_TOLERANCE`) and, where it was too coarse,
    refined with one more search starting at the answer. A sigma below one
    the PLD has accounted for, where dp-accounting gives up (one step's loss
    overflows: a huge target), counts as over the target, so the answer only
    errs to more noise. Deterministic, so every rank may call it and get the
    same answer.

    Raises:
        PrivacyError: an unknown ``kind``, an invalid target, delta, q or
            steps, or a target out of reach with sigma up to :data:`SIGMA_MAX`
            (one line each; nothing from inside dp-accounting).
    """
    quiet_absl()
    check_kind(kind)
    if not (target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise PrivacyError(f"--target-epsilon {target_epsilon} must be a positive number")
    check_delta(delta)
    _check_run(q, steps)
    if steps < 1:
        raise PrivacyError("calibrating sigma needs at least one step")
    steps, target = int(steps), float(target_epsilon)
    sigma_rdp = _calibrate_rdp(q, steps, target, delta)
    if kind == "rdp":
        if sigma_rdp is None:
            raise _unreachable(q, steps, target)
        return Calibration(sigma_rdp, None)
    interval = pld_interval(target, steps)

    def search(grid: float, start: float, first_step: float) -> float:
        def excess(sigma: float) -> float:
            try:
                return _log_excess(pld_or_rdp(q, sigma, steps, delta, grid), target)
            except PrivacyError:  # dp-accounting gives up on so little noise
                if sigma < start:  # below a sigma it did account for: count it as
                    return math.inf  # over the target, which errs to more noise
                raise
        return _bracketed_root(excess, *_bracket(excess, start, q, steps, target, first_step),
                               rtol=CALIBRATION_RTOL)

    sigma = search(interval, SIGMA_MAX if sigma_rdp is None else sigma_rdp, 1.25)
    refined = pld_grid(q, sigma, steps, delta, interval)
    if refined != interval:  # the answer barely moves: search again from it
        interval = refined
        sigma = search(interval, sigma, 1.0 + 4 * CALIBRATION_RTOL)
    return Calibration(sigma, interval)


def calibrate_sigma(q: float, steps: int, target_epsilon: float, delta: float,
                    kind: str = DEFAULT_KIND) -> float:
    """:func:`calibrate`'s noise multiplier."""
    return calibrate(q, steps, target_epsilon, delta, kind).sigma


# -- the run's accountant ---------------------------------------------------------

@dataclass
class Accountant:
    """The privacy spent by a DP-SGD run so far.

    ``interval`` is the PLD grid its epsilons are computed on (None: chosen
    from each query's RDP epsilon); a calibrated run keeps the grid its sigma
    was certified on, so its reports agree with the calibration exactly.
    """

    q: float
    sigma: float
    delta: float
    kind: str = DEFAULT_KIND
    steps: int = 0
    interval: float | None = None

    @classmethod
    def plan(cls, q: float, delta: float, steps: int, kind: str = DEFAULT_KIND,
             target_epsilon: float | None = None,
             sigma: float | None = None) -> tuple["Accountant", float]:
        """A fresh run of ``steps`` steps: its accountant and budget.

        Either sigma is calibrated to ``target_epsilon`` (the budget), or
        ``sigma`` is given and the budget is the epsilon of ``steps`` steps.
        The PLD grid is the one the budget was computed on, kept for every
        later report.

        Raises:
            PrivacyError: as :func:`calibrate` and :func:`epsilon_for`.
        """
        check_kind(kind)
        if (target_epsilon is None) == (sigma is None):
            raise ValueError("give exactly one of target_epsilon and sigma")
        if target_epsilon is not None:
            found = calibrate(q, steps, target_epsilon, delta, kind)
            return (cls(q=q, sigma=found.sigma, delta=delta, kind=kind,
                        interval=found.interval), float(target_epsilon))
        acct = cls(q=q, sigma=float(sigma), delta=delta, kind=kind)
        if kind == "pld" and steps > 0:
            acct.interval = pld_grid(q, float(sigma), steps, delta)
        return acct, acct.epsilon(steps)

    def step(self, n: int = 1) -> None:
        self.steps += n

    def epsilon(self, steps: int | None = None, kind: str | None = None) -> float:
        """Epsilon at ``delta`` after ``steps`` (default: the steps taken)."""
        kind = kind or self.kind
        return epsilon_for(self.q, self.sigma, self.steps if steps is None else steps,
                           self.delta, kind, self.interval if kind == self.kind else None)

    def describe(self) -> str:
        """The accountant in words, e.g. ``pld (grid 0.0002)``."""
        return self.kind + (f" (grid {self.interval:.2g})" if self.kind == "pld"
                            and self.interval else "")

    def fits(self, budget: float, steps: int) -> bool:
        """Whether a run of ``steps`` steps in total spends at most ``budget``
        (up to :data:`BUDGET_SLACK`)."""
        return self.epsilon(steps) <= budget * (1 + BUDGET_SLACK)

    def epochs_within(self, budget: float, steps_per_epoch: int, epochs: int) -> int:
        """The most epochs, at most ``epochs``, whose steps stay within ``budget``.

        Counts up from the epochs already taken (``steps // steps_per_epoch``),
        which are spent whatever the answer.
        """
        fits = self.steps // steps_per_epoch
        while fits < epochs and self.fits(budget, (fits + 1) * steps_per_epoch):
            fits += 1
        return fits

    def check_plan(self, budget: float, epochs: int, steps_per_epoch: int) -> None:
        """Refuse a run of ``epochs`` epochs that would spend more than ``budget``.

        Every rank may call it: the answer is deterministic.

        Raises:
            PrivacyError: the planned epsilon exceeds the budget; the message
                says how many epochs fit.
        """
        total = epochs * steps_per_epoch
        if self.fits(budget, total):
            return
        raise PrivacyError(
            f"{epochs} epochs would spend epsilon={self.epsilon(total):.3f}, more than this "
            f"run's budget epsilon={budget:.3f} (delta={self.delta:g}); at most "
            f"{self.epochs_within(budget, steps_per_epoch, epochs)} epochs fit. A resumed "
            "run cannot raise its budget: start a new run in a new --checkpoint-dir to "
            "train longer")

    def state_dict(self) -> dict:
        return {"q": self.q, "sigma": self.sigma, "delta": self.delta, "kind": self.kind,
                "steps": self.steps, "interval": self.interval}

    @classmethod
    def from_state(cls, state: dict) -> "Accountant":
        """From :meth:`state_dict`; a checkpoint from before the PLD grid was
        kept had dp-accounting's default grid (1e-4)."""
        kind = str(state["kind"])
        interval = state.get("interval", 1e-4 if kind == "pld" else None)
        return cls(q=float(state["q"]), sigma=float(state["sigma"]),
                   delta=float(state["delta"]), kind=kind, steps=int(state["steps"]),
                   interval=None if interval is None else float(interval))
