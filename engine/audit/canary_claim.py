"""The test of a canary audit's claim, and what an audit of m canaries can show.

:func:`claim_rejected` is the test itself: the white-box guesses against the
run's own privacy curve (the accountant's PLD at q, sigma and the steps),
Bonferroni over the guess sizes. The rest says what a given audit could
ever show, all guesses right (its *ceiling*): :func:`reaches` whether it
reaches a claimed epsilon, :func:`canaries_to_reach` how many canaries
would, :func:`needed_correct` how many right guesses the test of the claim
needs, and :func:`advice` the options that would let the audit reach the
claim. :mod:`engine.audit.canary` runs the audit and uses them.
"""
from __future__ import annotations

import numpy as np

from engine.audit import one_run, one_run_fdp

#: Residuals kept (steps x canaries) before the audit refuses to run.
MAX_RESIDUALS = 50_000_000
#: The most canaries :func:`canaries_to_reach` considers.
MAX_CANARIES = 1 << 20


def reaches(m: int, epsilon: float, delta: float, confidence: float,
            guesses: int | None = None) -> bool:
    """Whether an audit of ``m`` canaries (guess sizes as :func:`run_canary_audit`
    chooses them) could report a lower bound of at least ``epsilon``: its
    ceiling, by either analysis, all guesses right, is at least ``epsilon``.

    One test per guess size and analysis, not a search: the binomial bound
    reaches ``epsilon`` iff all-right's p-value at ``epsilon`` is at most the
    size's error share; the f-DP bound iff all-right rejects mu-GDP at the mu
    whose epsilon at ``delta`` is ``epsilon`` (rejection only gets harder as
    mu grows).
    """
    ks = one_run.default_guess_sizes(m) if guesses is None else \
        [((guesses + 1) // 2, guesses // 2)]
    tau = (1.0 - confidence) / len(ks)
    mu = one_run_fdp.gdp_mu(epsilon, delta)
    for k_in, k_out in ks:
        r = k_in + k_out
        if one_run.p_value(m, r, r, min(epsilon, one_run.EPS_MAX), delta) <= tau:
            return True
        if mu is not None and one_run_fdp.rejects(m, r, r, one_run_fdp.gdp_fbar_inverse(mu),
                                                  tau):
            return True
    return False


def canaries_to_reach(epsilon: float, delta: float, confidence: float, start: int,
                      guesses: int | None = None) -> int | None:
    """About the fewest canaries (to 2 significant digits, rounded up) whose
    ceiling reaches ``epsilon`` (:func:`reaches`), searched from ``start`` up to
    :data:`MAX_CANARIES`; None when even that many do not."""
    lo, hi = max(1, int(start)), None
    m = lo
    while m <= MAX_CANARIES:
        if reaches(m, epsilon, delta, confidence, guesses):
            hi = m
            break
        lo, m = m, m * 2
    if hi is None:
        return None
    while hi - lo > max(1, hi // 20):  # the ceiling grows with m: bisect to ~5%
        mid = (lo + hi) // 2
        if reaches(mid, epsilon, delta, confidence, guesses):
            hi = mid
        else:
            lo = mid
    digits = max(0, len(str(hi)) - 2)
    return -(-hi // 10 ** digits) * 10 ** digits


def needed_correct(m: int, ks: list[tuple[int, int]], fbar_inverse, confidence: float
                   ) -> tuple[int, int] | None:
    """(v, r): the fewest right guesses v of r with which the test of the claim
    (:func:`claim_rejected`, Bonferroni over ``ks``) rejects it, at the guess
    size where that is the smallest share of r; None when no size can, even
    with every guess right."""
    tau = (1.0 - confidence) / len(ks)
    best = None
    for k_in, k_out in ks:
        r = k_in + k_out
        if not one_run_fdp.rejects(m, r, r, fbar_inverse, tau):
            continue
        lo, hi = 0, r  # rejection only gets easier with more right guesses
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if one_run_fdp.rejects(m, r, mid, fbar_inverse, tau) \
                else (mid, hi)
        if best is None or hi / r < best[0] / best[1]:
            best = (hi, r)
    return best


def advice(m: int, wanted: int | None, n_params: int, steps: int, n_features: int,
           n_classes: int, guesses: int | None) -> str:
    """What would let the audit reach the claim: more canaries, and what that
    needs (a wider model, fewer epochs), or why nothing this size would."""
    if wanted is None:
        return (f"no number of canaries up to {MAX_CANARIES:,} reaches it: a claim this large "
                "is beyond a one-run audit at this delta and confidence")
    parts = [f"--canaries {wanted}" + ("" if guesses is None else " (and drop --guesses)")]
    if wanted > n_params:
        width = -(-(wanted - n_classes) // (n_features + 1 + n_classes))
        parts.append(f"a model with at least {wanted} parameters (--hidden {width}: one "
                     f"coordinate per canary; it has {n_params})")
    if steps * wanted > MAX_RESIDUALS:
        parts.append(f"at most {MAX_RESIDUALS // wanted} steps (fewer --epochs or a larger "
                     "--batch-size)")
    return ", ".join(parts)


def claim_rejected(evidence: np.ndarray, included: np.ndarray, ks: list[tuple[int, int]],
                   q: float, sigma: float, steps: int, delta: float, confidence: float,
                   fbar_inverse=None) -> bool:
    """Whether the guesses at any size of ``ks`` reject, at ``confidence``
    (Bonferroni over ``ks``), that the run has the privacy curve of DP-SGD at
    (q, sigma, steps): :func:`engine.audit.one_run_fdp.rejects` with
    :func:`engine.audit.one_run_fdp.dpsgd_fbar_inverse` (or the
    ``fbar_inverse`` given, computed from the same)."""
    if fbar_inverse is None:
        fbar_inverse = one_run_fdp.dpsgd_fbar_inverse(q, sigma, steps, delta)
    tau = (1.0 - confidence) / len(ks)
    m = int(np.asarray(evidence).size)
    return any(one_run_fdp.rejects(m, k_in + k_out, v, fbar_inverse, tau)
               for (k_in, k_out), v in zip(ks, one_run.correct_guesses(evidence, included, ks)))
