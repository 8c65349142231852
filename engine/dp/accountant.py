"""Privacy accounting with Google's ``dp-accounting`` (RDP and PLD).

One DP-SGD step on a Poisson sample of rate q with noise multiplier sigma is
the event ``PoissonSampledDpEvent(q, GaussianDpEvent(sigma))``; a run is that
event composed once per step. :class:`Accountant` keeps (q, sigma, delta,
steps) — everything needed to recompute epsilon — so its state is four
numbers in the checkpoint and a resumed run continues from the steps already
spent. ``rdp`` (Mironov 2017, and the subsampled-Gaussian bound of Mironov,
Talwar & Zhang 2019) is fast and an upper bound; ``pld`` (privacy loss
distributions, Koskela et al. 2020, Doroshenko et al. 2022) is tighter and
slower.

The budget's arithmetic lives here too (:meth:`Accountant.fits`,
:meth:`Accountant.epochs_within`, :meth:`Accountant.check_plan`), so the
training loop asks questions instead of computing epsilons itself.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import lru_cache

from engine.errors import PrivacyError

KINDS = ("rdp", "pld")
_SIGMA_BRACKET = (1e-2, 1e3)
#: Relative slack of budget checks: :func:`calibrate_sigma` stops within a
#: tolerance, so a calibrated run may spend a hair more than its target.
BUDGET_SLACK = 1e-6


def _quiet_absl() -> None:
    # dp-accounting logs a warning per excluded RDP order; not useful to users.
    logging.getLogger("absl").setLevel(logging.ERROR)


def _event(q: float, sigma: float):
    import dp_accounting  # deferred: slow to load; keeps `mpidp train --help` fast

    return dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))


def _fresh(kind: str):
    from dp_accounting import pld, rdp  # deferred: as in _event

    if kind == "rdp":
        return rdp.RdpAccountant()
    if kind == "pld":
        return pld.PLDAccountant()
    raise ValueError(f"accountant {kind!r} not in {KINDS}")


@lru_cache(maxsize=256)
def epsilon_for(q: float, sigma: float, steps: int, delta: float, kind: str = "rdp") -> float:
    """Epsilon after ``steps`` DP-SGD steps at rate q and noise multiplier sigma."""
    _quiet_absl()
    if steps <= 0:
        return 0.0
    accountant = _fresh(kind)
    accountant.compose(_event(q, sigma), int(steps))
    return float(accountant.get_epsilon(delta))


def calibrate_sigma(q: float, steps: int, target_epsilon: float, delta: float,
                    kind: str = "rdp") -> float:
    """The smallest noise multiplier whose run of ``steps`` steps stays within
    ``(target_epsilon, delta)`` (``dp_accounting.calibrate_dp_mechanism``).

    Raises:
        PrivacyError: the target is impossible with sigma up to 1000, or invalid.
    """
    import dp_accounting  # deferred: as in _event

    _quiet_absl()
    if not target_epsilon > 0:
        raise PrivacyError(f"--target-epsilon {target_epsilon} must be positive")
    check_delta(delta)
    if epsilon_for(q, _SIGMA_BRACKET[1], steps, delta, kind) > target_epsilon:
        raise PrivacyError(
            f"epsilon={target_epsilon} is out of reach: even noise multiplier "
            f"{_SIGMA_BRACKET[1]:g} gives more for {steps} steps at sampling rate {q:.3g}; "
            "use fewer epochs, a smaller batch, or a larger epsilon")
    if epsilon_for(q, _SIGMA_BRACKET[0], steps, delta, kind) <= target_epsilon:
        return _SIGMA_BRACKET[0]
    sigma = dp_accounting.calibrate_dp_mechanism(
        lambda: _fresh(kind), lambda s: dp_accounting.SelfComposedDpEvent(_event(q, s), steps),
        target_epsilon, delta,
        bracket_interval=dp_accounting.ExplicitBracketInterval(*_SIGMA_BRACKET), tol=1e-4)
    return float(sigma)


def check_delta(delta: float) -> None:
    if not 0.0 < delta < 1.0:
        raise PrivacyError(f"--delta {delta} must be in (0, 1)")


@dataclass
class Accountant:
    """The privacy spent by a DP-SGD run so far."""

    q: float
    sigma: float
    delta: float
    kind: str = "rdp"
    steps: int = 0

    def step(self, n: int = 1) -> None:
        self.steps += n

    def epsilon(self, steps: int | None = None, kind: str | None = None) -> float:
        """Epsilon at ``delta`` after ``steps`` (default: the steps taken)."""
        return epsilon_for(self.q, self.sigma, self.steps if steps is None else steps,
                           self.delta, kind or self.kind)

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
                "steps": self.steps}

    @classmethod
    def from_state(cls, state: dict) -> "Accountant":
        return cls(q=float(state["q"]), sigma=float(state["sigma"]),
                   delta=float(state["delta"]), kind=str(state["kind"]),
                   steps=int(state["steps"]))
