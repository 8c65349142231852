"""A tighter lower bound from the same one-run guesses: the f-DP analysis.

Mahloujifar, Melis and Chaudhuri, "Auditing f-Differential Privacy in One
Run" (ICML 2025). The game is the one of :mod:`engine.audit.one_run` (m
canaries, each included with probability 1/2; r guesses, v correct). Instead
of bounding the correct count by a binomial (which only uses epsilon and
delta), their Theorem 3.1 bounds it with the whole trade-off curve f of a
hypothesised f-DP guarantee. Their Algorithm 3 decides, in O(v) steps,
whether v correct guesses of r are less likely than ``tau`` under f; if so,
the hypothesis is rejected. With f̄ = 1 - f and tau = 1 - confidence:

    h[v] = tau (r - v) / m,   r_[v] = tau v / m
    for i = v-1 .. 0:
        h[i]  = max(h[i+1], f̄^{-1}(r_[i+1]))
        r_[i] = r_[i+1] + i / (r - i) * (h[i] - h[i+1])
    reject  iff  r_[0] + h[0] > r / m

The hypotheses are the paper's: Gaussian DP, f̄(x) = Phi(Phi^{-1}(x) + mu),
one mu at a time; the bound is the epsilon, at the run's delta, of the
weakest (largest) mu the guesses reject, converted with the mu-GDP
formula delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2). Read
it as "the run is not as private as a Gaussian mechanism of that
epsilon": a claim about the trade-off curve's family, the paper's empirical
epsilon; :mod:`engine.audit.one_run` gives the bound that assumes nothing
beyond (epsilon, delta). DP-SGD with Poisson sampling is close to, not
exactly, Gaussian DP (exactly, at q = 1).

**The run's own claim as the hypothesis.** The accountant certifies more
than one epsilon: the whole privacy curve of the run (its PLD at q, sigma
and the steps). :func:`dpsgd_fbar_inverse` turns that curve into the f of
Algorithm 3, so the guesses can test the claim itself: if they reject it,
the run is not the mechanism its epsilon was computed for (a privacy bug).
Every approximation errs towards a weaker hypothesis, which is harder to
reject: dp-accounting's pessimistic PLD (delta(eps) rounded up), f as the
envelope over a finite epsilon grid, and the inverse read at the grid point
below.
"""
from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np

from engine.errors import PrivacyError

#: mu search range: a bound at the top is reported as this mu's epsilon.
MU_MAX = 30.0
_N = NormalDist()


def gdp_fbar_inverse(mu: float):
    """f̄^{-1}(y) = Phi(Phi^{-1}(y) - mu) for mu-GDP, on [0, 1]."""
    def inverse(y: float) -> float:
        if y <= 0.0:
            return 0.0
        if y >= 1.0:
            return 1.0
        return _N.cdf(_N.inv_cdf(y) - mu)
    return inverse


def rejects(m: int, r: int, v: int, fbar_inverse, tau: float) -> bool:
    """Algorithm 3: whether ``v`` correct of ``r`` guesses (m canaries) are
    less likely than ``tau`` for a mechanism with trade-off f (given by
    ``fbar_inverse``, the inverse of 1 - f).

    Raises ValueError unless 0 <= v <= r <= m, r >= 1 and 0 < tau < 1.
    """
    if not (0 <= v <= r <= m and r >= 1) or not 0 < tau < 1:
        raise ValueError(f"need 0 <= v <= r <= m, r >= 1, tau in (0, 1); got m={m}, r={r}, "
                         f"v={v}, tau={tau}")
    if v == 0:
        return False
    h, rr = tau * (r - v) / m, tau * v / m
    for i in range(v - 1, -1, -1):
        h_i = max(h, fbar_inverse(min(1.0, rr)))
        rr = rr + i / (r - i) * (h_i - h)
        h = h_i
    return rr + h > r / m


def gdp_epsilon(mu: float, delta: float) -> float:
    """The epsilon of mu-GDP at ``delta`` (0 for mu = 0)."""
    if mu <= 0:
        return 0.0

    from scipy.special import log_ndtr

    def delta_of(eps: float) -> float:
        # e^eps Phi(x) in logs: e^eps alone overflows past eps ~ 709 (mu near MU_MAX)
        return _N.cdf(-eps / mu + mu / 2) - math.exp(eps + float(log_ndtr(-eps / mu - mu / 2)))

    if delta_of(0.0) <= delta:
        return 0.0
    lo, hi = 0.0, 1.0
    while delta_of(hi) > delta:
        hi *= 2
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if delta_of(mid) > delta else (lo, mid)
    return hi


def gdp_mu(epsilon: float, delta: float) -> float | None:
    """The mu whose mu-GDP has exactly ``epsilon`` at ``delta`` (the inverse of
    :func:`gdp_epsilon`, by bisection); None beyond :data:`MU_MAX`'s epsilon."""
    if epsilon <= 0:
        return 0.0
    if gdp_epsilon(MU_MAX, delta) < epsilon:
        return None
    lo, hi = 0.0, MU_MAX  # gdp_epsilon grows with mu
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if gdp_epsilon(mid, delta) < epsilon else (lo, mid)
    return hi


def mu_lower_bound(m: int, r: int, v: int, confidence: float = 0.95) -> float:
    """The largest mu whose mu-GDP the guesses reject at ``confidence`` (0 when
    none is rejected; :data:`MU_MAX` when every mu up to it is)."""
    tau = 1.0 - confidence
    if not 0 < tau < 1:
        raise ValueError(f"confidence {confidence} must be in (0, 1)")
    if not rejects(m, r, v, gdp_fbar_inverse(1e-9), tau):
        return 0.0
    if rejects(m, r, v, gdp_fbar_inverse(MU_MAX), tau):
        return MU_MAX
    lo, hi = 0.0, MU_MAX  # rejection gets harder as mu grows: bisect on the crossing
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if rejects(m, r, v, gdp_fbar_inverse(mid), tau) else (lo, mid)
    return lo


def epsilon_lower_bound(m: int, r: int, v: int, delta: float,
                        confidence: float = 0.95) -> float:
    """:func:`mu_lower_bound` as epsilon at ``delta`` (the module docstring's reading)."""
    return gdp_epsilon(mu_lower_bound(m, r, v, confidence), delta)


def curve_fbar_inverse(epsilons: np.ndarray, deltas: np.ndarray, points: int = 2000):
    """f̄^{-1} of the trade-off curve of a mechanism that is (eps, delta(eps))-DP
    for every pair given (eps >= 0, both directions):
    f(a) = max over the pairs of max(0, 1 - delta - e^eps a, e^-eps (1 - delta - a)).
    ``points`` type-I errors, log-spaced down to 1e-16, tabulate it."""
    eps = np.asarray(epsilons, dtype=np.float64)[None, :]
    dl = np.asarray(deltas, dtype=np.float64)[None, :]
    alpha = np.concatenate([[0.0], np.logspace(-16, 0, points)])[:, None]
    f = np.maximum(1 - dl - np.exp(eps) * alpha, np.exp(-eps) * (1 - dl - alpha)).max(axis=1)
    fbar = np.maximum.accumulate(1 - np.clip(f, 0.0, 1.0))
    alpha = alpha[:, 0]

    def inverse(y: float) -> float:
        if y <= 0.0:
            return 0.0
        if y >= 1.0:
            return 1.0
        i = int(np.searchsorted(fbar, y, side="left"))  # first fbar >= y
        return float(alpha[max(i - 1, 0)])  # the grid point below: the weaker claim
    return inverse


def dpsgd_fbar_inverse(q: float, sigma: float, steps: int, delta: float, points: int = 1500):
    """f̄^{-1} of a DP-SGD run's privacy curve: Poisson rate ``q``, noise
    multiplier ``sigma``, ``steps`` steps, from the accountant's PLD
    (:func:`engine.dp.accountant.composed_pld`; ``delta`` picks its grid).

    Raises:
        engine.errors.PrivacyError: as the accountant.
    """
    from engine.dp.accountant import composed_pld

    pld = composed_pld(q, sigma, steps, delta)
    top = math.inf
    # the curve up to the epsilon of a tiny delta; dp-accounting truncates its
    # tails near 1e-15, where epsilon is infinite: then up to a larger one's
    for tail in sorted({min(1e-12, delta), 1e-12, 1e-10, 1e-8}):
        top = float(pld.get_epsilon_for_delta(tail))
        if math.isfinite(top):
            break
    if not math.isfinite(top):
        raise PrivacyError(f"the PLD of q={q:.3g}, noise multiplier {sigma:.4g}, {steps} steps "
                           "has no finite epsilon at delta 1e-8: too little noise to audit")
    epsilons = np.linspace(0.0, max(top, 1e-6) * 1.05, points)
    deltas = np.asarray(pld.get_delta_for_epsilon(epsilons), dtype=np.float64)
    return curve_fbar_inverse(epsilons, deltas)
