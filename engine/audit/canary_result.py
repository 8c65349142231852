"""The result of a canary audit (:func:`engine.audit.canary.run_canary_audit`):
its bounds, the verdict and the report's text."""
from __future__ import annotations

from dataclasses import asdict, dataclass

#: Verdicts of the canary audit (:mod:`engine.audit.canary`).
VERDICTS = ("refuted", "cannot-refute", "not-refuted")


@dataclass(frozen=True)
class CanaryAudit:
    """The result of :func:`run_canary_audit` (the same on every rank)."""

    epsilon_lower_bound: float
    claimed_epsilon: float
    delta: float
    confidence: float
    m: int
    included: int
    k_in: int
    k_out: int
    guesses: int
    correct: int
    ceiling: float  # the most this audit can show: all guesses right at its largest k
    choices: int
    steps: int
    q: float
    sigma: float
    n_train: int
    ranks: int
    noise_scale: float
    noise_ranks: list[int] | None
    canary_samples: int  # canary inclusions over all steps and ranks
    test_accuracy: float | None
    # the f-DP analysis of the same scores (engine.audit.one_run_fdp): the
    # paper's empirical epsilon under the Gaussian-DP family, its guess size,
    # correct count and ceiling
    epsilon_fdp: float = 0.0
    k_in_fdp: int = 0
    k_out_fdp: int = 0
    correct_fdp: int = 0
    ceiling_fdp: float = 0.0
    # black-box: m canary rows (random inputs and labels) scored by their loss
    # under the final model only; both analyses
    epsilon_blackbox: float = 0.0
    epsilon_blackbox_fdp: float = 0.0
    correct_blackbox: int = 0
    guesses_blackbox: int = 0
    # the test of the claim: the white-box guesses reject the run's own
    # privacy curve (the accountant's PLD), at the audit's confidence
    claim_rejected: bool = False
    # the audit's power against the claim: the verdict (VERDICTS), the right
    # guesses the test of the claim needed (v of r; None: not even all right),
    # and what would let the audit reach the claim (None: it could)
    verdict: str = "not-refuted"
    needed_correct: int | None = None
    needed_guesses: int | None = None
    canaries_needed: int | None = None
    advice: str | None = None
    analysis: str = "Steinke, Nasr, Jagielski 2023 (exact binomial), white-box Dirac canaries"
    analysis_fdp: str = ("Mahloujifar, Melis, Chaudhuri 2025 (f-DP, Gaussian-DP hypotheses; "
                         "epsilon of the largest rejected mu at delta)")

    @property
    def detected(self) -> bool:
        """The guesses refute the claim (its privacy curve): the run leaked
        more than it says."""
        return self.claim_rejected

    def to_dict(self) -> dict:
        out = asdict(self)
        out["detected"] = self.detected
        return out

    @property
    def top(self) -> float:
        """The audit's ceiling: the larger of the two analyses' (all guesses right)."""
        return max(self.ceiling, self.ceiling_fdp)

    def verdict_text(self) -> tuple[str, list[str]]:
        """The verdict in words (:mod:`engine.audit.canary`): the headline, and the lines
        that explain it."""
        if self.verdict == "refuted":
            return "CLAIM REFUTED: this run leaks more than its epsilon says", []
        if self.verdict == "cannot-refute":
            need = ("its test of the claim would reject it only with "
                    f"{self.needed_correct} of {self.needed_guesses} guesses right"
                    if self.needed_correct is not None else
                    "its test of the claim would not reject it even with every guess right")
            return (f"CANNOT REFUTE epsilon={self.claimed_epsilon:.3f} with these settings "
                    f"(ceiling {self.top:.3f})",
                    [f"the most this audit can show (all guesses right) is epsilon "
                     f"{self.top:.3f}, below the claim, and {need}",
                     f"to be able to: {self.advice}"])
        return (f"not refuted (this audit could have shown up to epsilon {self.top:.3f})",
                [])

    def text(self) -> str:
        verdict, why = self.verdict_text()
        noise = ""
        if self.noise_scale != 1.0 or self.noise_ranks is not None:
            noise = (f"; TEST FAULT: noise x{self.noise_scale:g}"
                     + ("" if self.noise_ranks is None
                        else f" on ranks {self.noise_ranks} only"))
        return (f"canary audit (white-box, one run): epsilon >= "
                f"{self.epsilon_lower_bound:.3f} at {self.confidence:.0%} confidence; claimed "
                f"epsilon {self.claimed_epsilon:.3f} (delta {self.delta:g}) -> {verdict}\n"
                + "".join(f"  {line}\n" for line in why) +
                f"  test of the claim (the guesses against the run's own privacy curve, "
                f"its PLD): {'rejected' if self.claim_rejected else 'not rejected'}\n"
                f"  m={self.m} canaries ({self.included} included), guesses k+={self.k_in} "
                f"k-={self.k_out}, {self.correct}/{self.guesses} correct; ceiling (all "
                f"guesses right) {self.ceiling:.3f}\n"
                f"  run: {self.steps} steps, q={self.q:.4g} (N={self.n_train} rows; canaries "
                f"not counted), sigma={self.sigma:.4f}, {self.ranks} rank(s){noise}\n"
                f"  analysis: {self.analysis}\n"
                f"  f-DP analysis of the same guesses: epsilon >= {self.epsilon_fdp:.3f} as "
                f"Gaussian DP (k+={self.k_in_fdp} k-={self.k_out_fdp}, "
                f"{self.correct_fdp}/{self.k_in_fdp + self.k_out_fdp} correct; ceiling "
                f"{self.ceiling_fdp:.3f}): {self.analysis_fdp}\n"
                f"  black-box (final model only, {self.m} canary rows scored by their loss): "
                f"epsilon >= {self.epsilon_blackbox:.3f} (binomial), "
                f"{self.epsilon_blackbox_fdp:.3f} (f-DP); {self.correct_blackbox}/"
                f"{self.guesses_blackbox} correct")
