"""A lower bound on epsilon from one training run (Steinke, Nasr and Jagielski, NeurIPS 2023).

m canaries are each included in the training data independently with
probability 1/2. After training, the auditor scores every canary and
guesses "included" for the k+ highest scores and "excluded" for the k-
lowest, abstaining on the rest: r = k+ + k- guesses, v of them correct. If
the training run is (epsilon, delta)-DP, the number of correct guesses is
dominated by a binomial with the success rate of epsilon-randomised
response, q = e^eps / (1 + e^eps), plus a delta term (their Theorem 3.1 and
its delta extension):

    P[V >= v] <= P[Binomial(r, q) >= v] + 2 m delta * max_{1<=i<=v} P[v > Binomial(r, q) >= v - i] / i

So an observed v that is unlikely (p-value below 1 - confidence) under a
claimed epsilon refutes it: the largest epsilon that v refutes is a lower
bound, at that confidence, on the epsilon the run really has. Exact
binomial tails (scipy), no normal approximation. Trying several (k+, k-)
and keeping the best would overstate the bound; :func:`audit` divides the
allowed error among the choices it tries (Bonferroni).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

#: epsilon search range: beyond it the bound is reported as the ceiling.
EPS_MAX = 50.0


def p_value(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """P[at least v correct of r guesses] for an (eps, delta)-DP run with m canaries.

    Raises ValueError unless 0 <= v <= r <= m, eps >= 0 and 0 <= delta <= 1.
    """
    if not (0 <= v <= r <= m) or eps < 0 or not 0 <= delta <= 1:
        raise ValueError(f"need 0 <= v <= r <= m, eps >= 0, delta in [0, 1]; got m={m}, "
                         f"r={r}, v={v}, eps={eps}, delta={delta}")
    if v == 0:
        return 1.0
    from scipy import stats  # deferred: scipy loads slowly (a second per MPI test rank)

    q = 1.0 / (1.0 + math.exp(-eps))
    tail = float(stats.binom.sf(v - 1, r, q))  # P[Binomial(r, q) >= v]
    if delta == 0:
        return min(1.0, tail)
    # P[v > B >= v - i] for i = 1..v: cumulative sums of the pmf below v.
    pmf = stats.binom.pmf(np.arange(v - 1, -1, -1), r, q)
    windows = np.cumsum(pmf) / np.arange(1, v + 1)
    return min(1.0, tail + 2 * m * delta * float(windows.max()))


def epsilon_lower_bound(m: int, r: int, v: int, delta: float,
                        confidence: float = 0.95) -> float:
    """The largest epsilon that ``v`` correct guesses of ``r`` refute at
    ``confidence`` (0 when even epsilon = 0 is not refuted)."""
    alpha = 1.0 - confidence
    if not 0 < alpha < 1:
        raise ValueError(f"confidence {confidence} must be in (0, 1)")
    if p_value(m, r, v, 0.0, delta) > alpha:
        return 0.0
    if p_value(m, r, v, EPS_MAX, delta) <= alpha:
        return EPS_MAX
    lo, hi = 0.0, EPS_MAX  # p_value grows with eps: bisect on the crossing
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if p_value(m, r, v, mid, delta) <= alpha:
            lo = mid
        else:
            hi = mid
    return lo


def ceiling(m: int, r: int, delta: float, confidence: float = 0.95) -> float:
    """The bound a perfect attack (all r guesses right) would give: the most
    this many canaries can show."""
    return epsilon_lower_bound(m, r, r, delta, confidence)


def largest_ceiling(m: int, ks: list[tuple[int, int]], delta: float, confidence: float = 0.95,
                    bound=None) -> float:
    """What all guesses right would show at the largest guess size of ``ks``,
    at the confidence :func:`audit` tests each size at (``bound`` as there)."""
    bound = epsilon_lower_bound if bound is None else bound
    each = 1.0 - (1.0 - confidence) / len(ks)
    return max(bound(m, k_in + k_out, k_in + k_out, delta, each) for k_in, k_out in ks)


def default_guess_sizes(m: int) -> list[tuple[int, int]]:
    """The (k+, k-) pairs :func:`audit` tries by default: guesses on 1%, 2%, 5%,
    10%, 20% and 50% of m canaries, split evenly between "in" and "out" (one of
    each at the least).

    Raises:
        ValueError: m below 2, which no such pair fits.
    """
    if m < 2:
        raise ValueError(f"{m} canaries: the default guesses (one \"in\" and one \"out\" "
                         "at the least) need at least 2")
    return sorted({(max(1, int(m * f / 2)), max(1, int(m * f / 2)))
                   for f in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5)})


def correct_guesses(scores: np.ndarray, included: np.ndarray,
                    ks: list[tuple[int, int]]) -> list[int]:
    """Correct guesses at each (k+, k-) of ``ks``: "in" for the k+ highest
    scores, "out" for the k- lowest (ties broken by position, stably)."""
    order = np.argsort(-np.asarray(scores, float), kind="stable")
    included = np.asarray(included, bool)
    m = order.size
    return [int(included[order[:k_in]].sum())
            + (int((~included[order[m - k_out:]]).sum()) if k_out else 0) for k_in, k_out in ks]


@dataclass(frozen=True)
class Audit:
    """The result of :func:`audit`."""

    epsilon: float  # the lower bound
    m: int
    guesses: int  # r
    correct: int  # v
    k_in: int
    k_out: int
    ceiling: float  # what all r guesses right would have shown
    confidence: float
    choices: int  # (k+, k-) pairs tried (the Bonferroni factor)


def audit(scores: np.ndarray, included: np.ndarray, delta: float, confidence: float = 0.95,
          ks: list[tuple[int, int]] | None = None, bound=None) -> Audit:
    """The best lower bound over the guess sizes ``ks`` = [(k+, k-), ...].

    Args:
        scores: one score per canary, higher = more likely included.
        included: bool per canary, the truth (the coin flips).
        delta: the run's delta.
        confidence: of the whole audit (each of the len(ks) choices is tested
            at 1 - (1 - confidence) / len(ks)).
        ks: guess sizes to try; default: guess on 1%, 2%, 5%, 10%, 20% and 50%
            of the canaries, split evenly between "in" and "out".
        bound: ``(m, r, v, delta, confidence) -> epsilon``, the analysis;
            default :func:`epsilon_lower_bound` (this module's theorem);
            :func:`engine.audit.one_run_fdp.epsilon_lower_bound` is the f-DP one.
    """
    bound = epsilon_lower_bound if bound is None else bound
    scores, included = np.asarray(scores, float), np.asarray(included, bool)
    m = int(scores.size)
    if m == 0 or included.shape != scores.shape:
        raise ValueError("need one score and one inclusion flag per canary")
    if ks is None:
        ks = default_guess_sizes(m)
    for k_in, k_out in ks:
        if k_in < 0 or k_out < 0 or k_in + k_out > m or k_in + k_out == 0:
            raise ValueError(f"guess sizes k+={k_in}, k-={k_out} do not fit {m} canaries")
    each = 1.0 - (1.0 - confidence) / len(ks)
    best = None
    for (k_in, k_out), correct in zip(ks, correct_guesses(scores, included, ks)):
        r = k_in + k_out
        found = bound(m, r, correct, delta, each)
        if best is None or found > best.epsilon:
            best = Audit(found, m, r, correct, k_in, k_out, bound(m, r, r, delta, each),
                         confidence, len(ks))
    return best
