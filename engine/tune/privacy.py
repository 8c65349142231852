r"""The privacy cost of a hyperparameter search, in Renyi DP.

Every trial of ``mpidp tune`` is a DP-SGD run: T steps of the Poisson
subsampled Gaussian mechanism at rate q = B/N and noise multiplier sigma,
whose RDP curve eps(lambda) at the orders :data:`ORDERS` comes from
dp-accounting's RDP accountant (:func:`trial_curve`). Choosing among trials
by their validation score is itself a computation on the private data, so
the model (or the settings) a search picks is *not* as private as one trial.
Two ways to bound it are implemented:

**Private random search** (``--tuning-privacy random-search``): Papernot &
Steinke, "Hyperparameter Tuning with Renyi Differential Privacy", ICLR 2022
(arXiv:2110.03620; theorem numbers as in its v2, the version dp-accounting
cites). The base algorithm Q draws one point of the space uniformly at
random, trains it and scores it; the search runs Q K times, K random and
independent of the data, and releases only the best run (its settings,
model and score). If Q is (lambda, eps(lambda))-RDP, then:

* **Theorem 2** (truncated negative binomial K, Definition 1, with
  eta in [0, inf) here — the paper allows (-1, inf) — and gamma in (0, 1);
  eta = 1 is the geometric distribution P[K = k] = gamma (1-gamma)^(k-1),
  eta = 0 the logarithmic one): if Q is also (lambda_hat, eps_hat)-RDP, the
  search is (lambda, eps')-RDP with

      eps' = eps(lambda) + (1 + eta) (1 - 1/lambda_hat) eps_hat
             + (1 + eta) log(1/gamma) / lambda_hat + log(E[K]) / (lambda - 1),

  E[K] = eta (1-gamma) / (gamma (1 - gamma^eta)) for eta > 0 and
  (1/gamma - 1) / log(1/gamma) for eta = 0. The bound holds for every
  lambda_hat >= 1 and eps_hat = eps(lambda_hat), so :func:`tnb_curve` takes
  the smallest over the orders of the grid (the form with lambda in place
  of lambda_hat, often quoted, is the special case lambda_hat = lambda).
* **Theorem 6** (K ~ Poisson(mu)): if Q is also (eps_hat, delta_hat)-DP with
  e^eps_hat <= 1 + 1/(lambda - 1), the search is (lambda, eps')-RDP with

      eps' = eps(lambda) + mu delta_hat + log(mu) / (lambda - 1);

  :func:`poisson_curve` takes eps_hat = log(1 + 1/(lambda - 1)), the largest
  the condition allows, and delta_hat from Q's RDP curve at eps_hat
  (dp-accounting's conversion). For DP-SGD runs with epsilon near 1 that
  delta_hat is large, which is why the negative binomial is the default.

Both then use that RDP is non-decreasing in the order: a bound at a higher
order is one at every lower order. dp-accounting implements the same
theorems (``RepeatAndSelectDpEvent``); the tests check this module against
it and against values computed by hand.

Q's curve is the largest over the points of the space of the trials'
curves (Q mixes them with data-independent weights, and a Renyi divergence
of mixtures is at most the largest of the components'), plus, when the
validation split is private, the curve of the Gaussian noise on the score
(:func:`gaussian_curve`; the score's sensitivity is one person, or one
household's share of correct predictions, see :mod:`engine.tune.search`).

**Composition** (``--tuning-privacy public``): the trials scored on a split
the user declares public. The scores then cost nothing, but which model is
chosen still depends on every trial's model, and so on the private training
data: choosing the best of K fixed trials is a post-processing of all K
models, hence as private as the K runs composed (the sum of their curves,
:func:`composition_curve`). Only a search that never reads private data
(train and score on a public file, then train once on the private one) is
free for the private data.

An RDP curve becomes (epsilon, delta) by :func:`to_epsilon`
(dp-accounting's ``compute_epsilon``: Canonne, Kamath & Steinke 2020,
Proposition 12, the improved conversion).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

#: The RDP orders of every curve (dp-accounting's defaults: 1.1 to 10.9 by 0.1,
#: 11 to 63, 128, 256, 512, 1024).
ORDERS = np.array([1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64))
                  + [128, 256, 512, 1024], dtype=np.float64)

#: Distributions of the number of trials K.
DISTRIBUTIONS = ("negative-binomial", "poisson")


def _quiet() -> None:
    from engine.dp.pld import quiet_absl

    quiet_absl()


@lru_cache(maxsize=256)
def _trial_curve(q: float, sigma: float, steps: int) -> tuple:
    from dp_accounting import PoissonSampledDpEvent, GaussianDpEvent
    from dp_accounting.rdp import RdpAccountant

    _quiet()
    accountant = RdpAccountant(orders=list(ORDERS))
    if steps > 0:
        accountant.compose(PoissonSampledDpEvent(q, GaussianDpEvent(sigma)), int(steps))
    return tuple(accountant.rdp)


def trial_curve(q: float, sigma: float, steps: int) -> np.ndarray:
    """RDP eps(lambda) at :data:`ORDERS` of ``steps`` DP-SGD steps at rate q and
    noise multiplier sigma (dp-accounting's RDP accountant)."""
    return np.array(_trial_curve(float(q), float(sigma), int(steps)))


def gaussian_curve(std: float, sensitivity: float = 1.0, orders=ORDERS) -> np.ndarray:
    """RDP of the Gaussian mechanism: lambda * sensitivity^2 / (2 std^2)
    (Mironov 2017, Proposition 7); zero for ``std`` = inf (nothing released)."""
    orders = np.asarray(orders, dtype=np.float64)
    if math.isinf(std):
        return np.zeros_like(orders)
    return orders * sensitivity ** 2 / (2.0 * std ** 2)


def tnb_mean(eta: float, gamma: float) -> float:
    """E[K] of the truncated negative binomial D_{eta,gamma} (module docstring)."""
    if not 0 < gamma <= 1:
        raise ValueError(f"gamma {gamma} must be in (0, 1]")
    if eta < 0:
        raise ValueError(f"eta {eta} must be >= 0")
    if gamma == 1:
        return 1.0
    if eta == 0:
        return (1 / gamma - 1) / math.log(1 / gamma)
    return eta * (1 - gamma) / (gamma * -math.expm1(eta * math.log(gamma)))


def tnb_gamma(eta: float, mean: float) -> float:
    """The gamma whose D_{eta,gamma} has expectation ``mean`` (>= 1), by bisection
    (E[K] falls as gamma grows); exact 1/mean for the geometric (eta = 1)."""
    if not mean >= 1:
        raise ValueError(f"the expected number of trials {mean} must be at least 1")
    if mean == 1:
        return 1.0
    if eta == 1:
        return 1.0 / mean
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if mid == lo or mid == hi:
            break
        if tnb_mean(eta, mid) > mean:
            lo = mid
        else:
            hi = mid
    return hi


def _monotone(orders: np.ndarray, curve: np.ndarray) -> np.ndarray:
    """A bound at a higher order is one at every lower order (RDP is
    non-decreasing in the order): each value becomes the smallest at its
    order or above."""
    order = np.argsort(orders)
    best = np.minimum.accumulate(curve[order][::-1])[::-1]
    out = np.empty_like(curve)
    out[order] = best
    return out


def tnb_curve(orders, curve, eta: float, gamma: float) -> np.ndarray:
    """RDP of the best of K ~ D_{eta,gamma} runs of a (lambda, curve)-RDP algorithm
    (Papernot & Steinke, Theorem 2; module docstring), lambda_hat chosen over
    ``orders``. Orders at or below 1 get inf (the theorem needs lambda > 1)."""
    orders = np.asarray(orders, dtype=np.float64)
    curve = np.asarray(curve, dtype=np.float64)
    mean = tnb_mean(eta, gamma)
    usable = orders >= 1
    hat = (1 - 1 / orders[usable]) * curve[usable] + math.log(1 / gamma) / orders[usable]
    constant = (1 + eta) * float(np.min(hat))
    out = np.full_like(curve, np.inf)
    above = orders > 1
    out[above] = curve[above] + constant + math.log(mean) / (orders[above] - 1)
    return _monotone(orders, out)


def poisson_curve(orders, curve, mu: float) -> np.ndarray:
    """RDP of the best of K ~ Poisson(mu) runs of a (lambda, curve)-RDP algorithm
    (Papernot & Steinke, Theorem 6; module docstring)."""
    from dp_accounting.rdp.rdp_privacy_accountant import compute_delta

    _quiet()
    orders = np.asarray(orders, dtype=np.float64)
    curve = np.asarray(curve, dtype=np.float64)
    if not mu > 0:
        raise ValueError(f"the Poisson mean {mu} must be positive")
    out = np.full_like(curve, np.inf)
    for i, lam in enumerate(orders):
        if lam <= 1:
            continue
        eps_hat = math.log1p(1 / (lam - 1))
        delta_hat, _ = compute_delta(orders, curve, eps_hat)
        out[i] = curve[i] + mu * delta_hat + math.log(mu) / (lam - 1)
    return _monotone(orders, out)


def composition_curve(curves) -> np.ndarray:
    """RDP of running every trial (curves add: Mironov 2017, Proposition 1)."""
    curves = list(curves)
    return np.sum(curves, axis=0) if curves else np.zeros_like(ORDERS)


def to_epsilon(orders, curve, delta: float) -> tuple[float, float]:
    """(epsilon, best order) of an RDP curve at ``delta`` (dp-accounting's
    improved conversion)."""
    from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

    _quiet()
    eps, order = compute_epsilon(np.asarray(orders, dtype=np.float64),
                                 np.asarray(curve, dtype=np.float64), delta)
    return float(eps), float(order)


def draw_trials(rng: np.random.Generator, distribution: str, mean: float,
                eta: float = 1.0) -> int:
    """K, the number of trials of a private random search: from D_{eta,gamma} with
    E[K] = ``mean`` (K >= 1), or from Poisson(``mean``) (K may be 0)."""
    if distribution == "poisson":
        return int(rng.poisson(mean))
    gamma = tnb_gamma(eta, mean)
    if gamma >= 1:
        return 1
    if eta == 1:
        return int(rng.geometric(gamma))
    if eta == 0:
        return int(rng.logseries(1 - gamma))
    while True:  # the negative binomial conditioned on K >= 1
        k = int(rng.negative_binomial(eta, gamma))
        if k >= 1:
            return k


@dataclass
class Statement:
    """The tuning's privacy, for the report."""

    mode: str
    delta: float
    epsilon: float  # epsilon incl. tuning, at delta
    order: float  # the RDP order that gave it
    trial_rdp_epsilon: float  # the largest single trial's epsilon by RDP, at delta
    score_std: float | None  # std of the noise on the val score (None: exact scores)
    distribution: str | None = None
    eta: float | None = None
    gamma: float | None = None
    mean_trials: float | None = None
    trials: int | None = None  # trials composed (public)
    text: str = ""

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}


def random_search(trial_curves, delta: float, distribution: str, mean: float,
                  eta: float, score_std: float | None,
                  score_sensitivity: float = 1.0) -> Statement:
    """The statement of a private random search whose base algorithm's trial
    is any of ``trial_curves`` (one per distinct privacy setting of the space);
    ``score_sensitivity``: the L2 sensitivity of the noised score (1 for the
    count of correct predictions; sqrt(2) for the per-group counts of rows and
    correct predictions of a worst-group score, :mod:`engine.tune.search`)."""
    base = np.max(np.stack(list(trial_curves)), axis=0)
    single, _ = to_epsilon(ORDERS, base, delta)
    if score_std is not None:
        base = base + gaussian_curve(score_std, score_sensitivity)
    if distribution == "poisson":
        tuned, gamma, eta_used = poisson_curve(ORDERS, base, mean), None, None
        what = f"K ~ Poisson({mean:g}) trials (Theorem 6)"
    else:
        gamma = tnb_gamma(eta, mean)
        eta_used = eta
        tuned = tnb_curve(ORDERS, base, eta, gamma)
        name = {1.0: "geometric", 0.0: "logarithmic"}.get(float(eta), "truncated negative "
                                                          "binomial")
        what = (f"K ~ {name} (eta={eta:g}, gamma={gamma:.4g}, E[K]={tnb_mean(eta, gamma):.3g}) "
                "trials (Theorem 2)")
    eps, order = to_epsilon(ORDERS, tuned, delta)
    score = ("the val scores noised (Gaussian, std %g%s)"
             % (score_std, "" if score_sensitivity == 1.0 else
                ", on each group's counts of rows and correct predictions, L2 sensitivity "
                f"{score_sensitivity:.3g}") if score_std is not None
             else "the val split declared public (exact scores)")
    text = (f"private random search (Papernot & Steinke, ICLR 2022): {what}, {score}; "
            f"releasing the chosen trial (settings, model, score) is ({eps:.3f}, {delta:g})-DP "
            f"(RDP order {order:g}); one trial alone: {single:.3f} by RDP. The other trials' "
            "results are not covered: keep them private")
    return Statement(mode="random-search", delta=delta, epsilon=eps, order=order,
                     trial_rdp_epsilon=single, score_std=score_std, distribution=distribution,
                     eta=eta_used, gamma=gamma, mean_trials=mean, text=text)


def public_search(trial_curves, delta: float, public_split: str) -> Statement:
    """The statement of a search scored on a public split: its trials composed."""
    curves = list(trial_curves)
    total = composition_curve(curves)
    eps, order = to_epsilon(ORDERS, total, delta)
    single = max(to_epsilon(ORDERS, c, delta)[0] for c in curves) if curves else 0.0
    text = (f"scored on the public split {public_split!r} (exact scores, no cost); the choice "
            f"still depends on all {len(curves)} trials' models, so the chosen one is as "
            f"private as the {len(curves)} runs composed: ({eps:.3f}, {delta:g})-DP by RDP "
            f"(order {order:g}); one trial alone: {single:.3f} by RDP")
    return Statement(mode="public", delta=delta, epsilon=eps, order=order,
                     trial_rdp_epsilon=single, score_std=None, trials=len(curves), text=text)
