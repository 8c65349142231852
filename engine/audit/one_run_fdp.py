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
exactly, Gaussian DP.
"""
from __future__ import annotations

import math
from statistics import NormalDist

#: mu search range: a bound at the top is reported as this mu's epsilon.
MU_MAX = 30.0
_N = NormalDist()


def _gdp_fbar_inverse(mu: float):
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

    def delta_of(eps: float) -> float:
        return _N.cdf(-eps / mu + mu / 2) - math.exp(eps) * _N.cdf(-eps / mu - mu / 2)

    if delta_of(0.0) <= delta:
        return 0.0
    lo, hi = 0.0, 1.0
    while delta_of(hi) > delta:
        hi *= 2
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if delta_of(mid) > delta else (lo, mid)
    return hi


def mu_lower_bound(m: int, r: int, v: int, confidence: float = 0.95) -> float:
    """The largest mu whose mu-GDP the guesses reject at ``confidence`` (0 when
    none is rejected; :data:`MU_MAX` when every mu up to it is)."""
    tau = 1.0 - confidence
    if not 0 < tau < 1:
        raise ValueError(f"confidence {confidence} must be in (0, 1)")
    if not rejects(m, r, v, _gdp_fbar_inverse(1e-9), tau):
        return 0.0
    if rejects(m, r, v, _gdp_fbar_inverse(MU_MAX), tau):
        return MU_MAX
    lo, hi = 0.0, MU_MAX  # rejection gets harder as mu grows: bisect on the crossing
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if rejects(m, r, v, _gdp_fbar_inverse(mid), tau) else (lo, mid)
    return lo


def epsilon_lower_bound(m: int, r: int, v: int, delta: float,
                        confidence: float = 0.95) -> float:
    """:func:`mu_lower_bound` as epsilon at ``delta`` (the module docstring's reading)."""
    return gdp_epsilon(mu_lower_bound(m, r, v, confidence), delta)
