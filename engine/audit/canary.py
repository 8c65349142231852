"""White-box one-run canary audit: a lower bound on the epsilon of a real training run.

Steinke, Nasr and Jagielski, "Privacy Auditing with One (1) Training Run"
(NeurIPS 2023), white-box setting with gradient canaries. The run is an
ordinary ``mpidp train`` run (:class:`engine.trainer.Trainer`, the one
:class:`engine.step.DPStep`, the run's accountant, sampler and noise), plus:

* **m canaries**, each a *Dirac* gradient: ``C`` times a unit vector on one
  coordinate of the flat parameter vector, m distinct coordinates drawn at
  random (so the canaries are exactly orthogonal and each has the norm of a
  clipped row's largest contribution, ``C``). Which coordinates, and which
  canaries are included (each independently with probability 1/2), are the
  audit's secrets, drawn from the audit's seed alike on every rank.
* Canary j belongs to rank ``j % p``, like a row of that rank's shard. At
  every step each rank Poisson-samples its included canaries at the run's
  rate q (its own stream) and adds ``C`` at their coordinates to its clipped
  sum, after the clipping and before the noise: the ``extra`` hook of
  :class:`~engine.step.DPStep`; the rest of the step is untouched.
* **The auditor** sees every step's all-reduced noisy sum (every rank holds
  it) and, being white-box, also the data rows' clipped sum at the canary
  coordinates (each rank's before canaries and noise, summed over the ranks
  by one extra all-reduce of m floats per step, the auditor's instrument,
  outside the step). Their difference is, per canary and step, the canary's
  own contribution (0 or 1, in units of C) plus the noise at its coordinate.
  Knowing the data's contribution does not weaken the guarantee being
  tested: the rows' sampling is independent of the canaries' coins, and the
  accountant's analysis (Poisson-subsampled Gaussian, adaptive composition)
  holds for each canary conditionally on everything else.
* **Score** of canary j: the sum over steps of the log-likelihood ratio of
  a Poisson-subsampled Gaussian, ``log(1 - q + q exp((r - 1/2) / s_j^2))``,
  at the noise level ``s_j`` of :func:`noise_levels`: each canary's robust
  estimate (1.4826 x the median absolute deviation of its residuals), then
  pooled over the canaries whose estimates lie within a factor 4 of its own.
  With the engine's noise every canary pools with all others and the score
  is the Neyman-Pearson test of one canary; a short run (few residuals per
  canary) would otherwise rank by the noise in its own estimates. With
  broken noise (too little, or none at some coordinates) the levels follow
  the noise the run really had, group by group. Any score computed from the
  run's output gives a valid bound; this one gives a strong one.
* :func:`engine.audit.one_run.audit` turns the scores and the secret
  inclusion vector into the bound (exact binomial tails; Bonferroni over the
  guess sizes it tries); the same guesses also go through the f-DP analysis
  (:mod:`engine.audit.one_run_fdp`, Gaussian-DP hypotheses), reported beside
  it. ``detected`` is the test of the claim itself: the same guesses against
  the run's own privacy curve (the accountant's PLD at q, sigma and the
  steps; Algorithm 3 of the f-DP paper, Bonferroni over the guess sizes).
  The claimed (epsilon, delta) was computed from that curve, so rejecting it
  refutes the claim, with a test at least as strong as the binomial one.

The bound is a LOWER bound on the run's true epsilon, at the audit's
confidence: a correct engine never exceeds its claim (but for the
1 - confidence chance the theorem allows), and a bound above the claim means
the run leaked more than it says. It can never exceed its own ceiling (what
all guesses right would show), which grows with m: a few hundred canaries
cannot show much more than epsilon ~ 4 (binomial) or ~ 7 (f-DP).

**The verdict** (:attr:`CanaryAudit.verdict`) is one of three, each with its
exit code of ``mpidp audit``: ``refuted`` (the test of the claim rejects it:
exit 4); ``cannot-refute`` (the audit's ceiling, the larger of the two
analyses', is below the claimed epsilon: no outcome of these settings could
show an epsilon as large as the claim; the report says how many right
guesses the test of the claim itself would need, :func:`needed_correct`,
and how many canaries would reach the claim, :func:`canaries_to_reach`:
exit 5);
``not-refuted`` (the audit could have shown the claim and did not: exit 0).
The test of the claim and the audit's reach are in
:mod:`engine.audit.canary_claim`, the result and its text in
:mod:`engine.audit.canary_result`.

How N is counted: the claim is the run's accountant at the run's q =
batch_size / N with N the file's training rows (canaries not counted),
sigma and steps; canaries are sampled at the same q, so a step's expected
batch is q (N + m/2) rows and canaries, and the update still divides by the
public batch_size. The claim depends on q, sigma and steps only, so it is the
claim for every canary as for every row.

Test-only fault hooks (parameters of :func:`run_canary_audit`, never options
of ``mpidp train``): ``noise_scale`` multiplies every rank's noise standard
deviation (a bug that adds too little noise), ``noise_ranks`` lets only those
ranks add their share (a bug that skips the noise on the other ranks).
"""
from __future__ import annotations

import dataclasses
import io
import math
import signal
from typing import TYPE_CHECKING

import numpy as np

from engine.audit import one_run, one_run_fdp
from engine.audit.canary_claim import (MAX_RESIDUALS, advice, canaries_to_reach,
                                       claim_rejected, needed_correct)
from engine.audit.canary_result import CanaryAudit
from engine.dp.streams import (STREAM_CANARY_COINS, STREAM_CANARY_ROWS, STREAM_CANARY_SECRETS,
                               seed_sequence)
from engine.errors import ConfigError, MpidpError, PrivacyError, agree
from engine.stopping import Interrupted

if TYPE_CHECKING:
    import torch

#: Fewest canaries an audit takes: its default guesses are one "in" and one
#: "out" at the least (:func:`engine.audit.one_run.default_guess_sizes`).
MIN_CANARIES = 2
#: Smallest noise level the score assumes for a canary (in units of C):
#: residuals without noise differ from 0 or 1 by float32 rounding only.
SIGMA_FLOOR = 1e-3
#: Canaries whose estimated noise levels are within this factor pool them.
POOL_FACTOR = 4.0
#: Rounds of the median shift at most (it settles in a few).
POOL_ROUNDS = 50
#: Advice in the training code's errors that names options of ``mpidp train``
#: which ``mpidp audit --attack canary`` does not have, and what the audit says
#: instead (:func:`in_audit_terms`). The audit tests the claim against the PLD
#: accountant's privacy curve, and a delta above 1/N protects nobody: it has
#: neither ``--accountant`` nor ``--allow-large-delta``.
TRAIN_ONLY_ADVICE = (
    (" (or --allow-large-delta, if you know why you need it)", ""),
    ("; use --accountant rdp", "; the canary audit tests the claim against the PLD "
     "accountant's privacy curve and cannot use another: give a larger --noise-multiplier "
     "(or a --target-epsilon)"),
)


def secrets(m: int, n_params: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The audit's secrets, the same on every rank: m distinct coordinates
    (int64) of the flat parameter vector, and which canaries are included
    (bool, each with probability 1/2)."""
    rng = np.random.Generator(np.random.PCG64(seed_sequence(seed, 0, STREAM_CANARY_SECRETS)))
    coords = rng.choice(n_params, size=m, replace=False).astype(np.int64)
    included = rng.random(m) < 0.5
    return coords, included


def canary_rows(m: int, n_features: int, n_classes: int, seed: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The black-box canaries, the same on every rank: m rows ``X`` (float32
    ``[m, n_features + 1]``, standard normal features and the ones column:
    out of the data's distribution, so only training on a row fits it), a
    uniformly random label each (int64), and which rows are included (bool,
    probability 1/2 each)."""
    rng = np.random.Generator(np.random.PCG64(seed_sequence(seed, 0, STREAM_CANARY_ROWS)))
    X = np.ones((m, n_features + 1), dtype=np.float32)
    X[:, :-1] = rng.standard_normal((m, n_features), dtype=np.float32)
    y = rng.integers(0, n_classes, size=m, dtype=np.int64)
    included = rng.random(m) < 0.5
    return X, y, included


def row_scores(logits: "torch.Tensor", y: np.ndarray) -> np.ndarray:
    """Black-box score per canary row: minus its cross-entropy loss under the
    final model (a row trained on tends to be fitted: lower loss)."""
    import torch

    loss = torch.nn.functional.cross_entropy(logits.double(), torch.from_numpy(y),
                                             reduction="none")
    return -loss.numpy()


def noise_levels(residuals: np.ndarray) -> np.ndarray:
    """The noise level at each canary's coordinate (in units of C), from
    ``residuals`` [steps, m]: each canary's robust estimate (1.4826 x MAD,
    at least :data:`SIGMA_FLOOR`), moved to the median of the estimates
    within a factor :data:`POOL_FACTOR` of where it stands, until it stops
    (a median shift: each canary climbs to the mode of its group). Canaries
    that share a noise level pool their evidence; those that do not (no
    noise at some coordinates, say) stay apart. Each group's level is then
    the robust estimate over all its residuals (a little low for short runs,
    the deviations being from each canary's own median: 5% at 25 steps; the
    bound stays valid, the score only a little less sharp)."""
    r = np.asarray(residuals, dtype=np.float64)
    med = np.median(r, axis=0)
    own = np.log(np.maximum(1.4826 * np.median(np.abs(r - med), axis=0), SIGMA_FLOOR))
    ranked = np.sort(own)
    width = math.log(POOL_FACTOR)
    level = own
    for _ in range(POOL_ROUNDS):
        lo = np.searchsorted(ranked, level - width, side="left")
        hi = np.searchsorted(ranked, level + width, side="right")
        moved = ranked[(lo + hi - 1) // 2]
        if np.array_equal(moved, level):
            break
        level = moved
    # each group's level from all its residuals at once (one canary's few
    # residuals give a biased MAD; the group's many do not)
    out = np.empty_like(level)
    deviation = np.abs(r - med)
    for value in np.unique(level):
        group = level == value
        out[group] = max(1.4826 * float(np.median(deviation[:, group])), SIGMA_FLOOR)
    return out


def scores(residuals: np.ndarray, q: float) -> np.ndarray:
    """One score per canary from ``residuals`` [steps, m] (reduced sum minus
    the data's sum at each canary's coordinate, in units of C): the summed
    log-likelihood ratio of "included" at its :func:`noise_levels`."""
    r = np.asarray(residuals, dtype=np.float64)
    s = noise_levels(r)
    a = (r - 0.5) / (s * s)
    return np.logaddexp(math.log1p(-q) if q < 1 else -np.inf, math.log(q) + a).sum(axis=0)


class CanaryHook:
    """This rank's canaries in the step (DPStep's ``extra``), and the auditor's record.

    Args:
        coords, included: :func:`secrets`.
        rank, size: the communicator's.
        q: the run's sampling rate; max_norm: C.
        seed: the audit's seed (this rank's coin stream is drawn from it).
    """

    def __init__(self, coords: np.ndarray, included: np.ndarray, rank: int, size: int,
                 q: float, max_norm: float, seed: int):
        import torch

        self.m, self.q, self.C = int(coords.size), float(q), float(max_norm)
        mine = np.flatnonzero((np.arange(self.m) % size == rank) & included)
        self.mine = torch.from_numpy(coords[mine].copy())
        self.coords = torch.from_numpy(coords.copy())
        self.rng = np.random.Generator(np.random.PCG64(
            seed_sequence(seed, rank, STREAM_CANARY_COINS)))
        #: this step's data-only clipped sum at every canary's coordinate (this rank's)
        self.data = np.zeros(self.m, dtype=np.float64)
        self.sampled = 0  # canary inclusions in steps, on this rank

    def __call__(self, grad) -> None:
        """After the clipped sum, before the noise: record the data's sum at the
        canary coordinates, then add C at each sampled canary's coordinate."""
        self.data[:] = grad[self.coords].double().cpu().numpy()
        coins = self.rng.random(self.mine.shape[0]) < self.q
        if coins.any():
            chosen = self.mine[coins].to(grad.device)
            grad[chosen] += self.C  # distinct coordinates: one add each
            self.sampled += int(coins.sum())


def check_request(m: int, guesses: int | None, confidence: float) -> None:
    """Raise ConfigError (collective) for an impossible audit request."""
    def fail(message: str):
        raise ConfigError(message, collective=True)

    if m < MIN_CANARIES:
        fail(f"--canaries {m}: the audit needs at least {MIN_CANARIES} canaries (it guesses "
             f"one \"in\" and one \"out\" at the least); give --canaries {MIN_CANARIES} or more")
    if not 0 < confidence < 1:
        fail(f"--confidence {confidence} must be in (0, 1)")
    if guesses is not None and not 1 <= guesses <= m:
        fail(f"--guesses {guesses} must be between 1 and the {m} canaries")


def check_privacy(epsilon: float | None, noise_multiplier: float | None) -> None:
    """Raise ConfigError (collective) unless the run is private: exactly one of
    ``epsilon`` and ``noise_multiplier``, the latter finite and positive
    (checked here: the training code's messages for these point to
    ``--no-dp``, which the audit does not have)."""
    if (epsilon is None) == (noise_multiplier is None):
        raise ConfigError("--attack canary trains a DP-SGD run and tests its claim: give "
                          "exactly one of --noise-multiplier SIGMA and --target-epsilon EPS",
                          collective=True)
    if noise_multiplier is not None and not (noise_multiplier > 0
                                             and math.isfinite(noise_multiplier)):
        raise ConfigError(f"--noise-multiplier {noise_multiplier} must be a finite positive "
                          "number: the canary audit tests a DP-SGD run's claim",
                          collective=True)


def in_audit_terms(exc: PrivacyError) -> PrivacyError:
    """``exc`` (from the training code) with :data:`TRAIN_ONLY_ADVICE` replaced by
    what the audit says instead: the same class, ``collective`` flag and one line."""
    message = str(exc)
    for theirs, ours in TRAIN_ONLY_ADVICE:
        message = message.replace(theirs, ours)
    if message == str(exc):
        return exc
    return type(exc)(message, collective=exc.collective)


def stopped(code: int) -> BaseException:
    """What the audit raises when its run's ``Trainer.run`` returned ``code``
    instead of 0: :class:`engine.stopping.Interrupted` for a stop by signal n
    (``128 + n``: the run ended at a step boundary, every rank alike), which
    ``mpidp`` reports as ``mpidp: stopped by SIGTERM (exit code 143)``; a
    RuntimeError for any other code (none is expected: the run has no
    checkpoint directory)."""
    if code > 128 and code - 128 in {int(s) for s in signal.Signals}:
        return Interrupted(code - 128)
    return RuntimeError(f"the audited run ended with exit code {code}")


def run_canary_audit(data: str, comm=None, *, m: int = 500, epsilon: float | None = None,
                     noise_multiplier: float | None = None, epochs: int = 5,
                     batch_size: int = 100, lr: float = 0.1, hidden: tuple[int, ...] = (32,),
                     max_grad_norm: float = 1.0, delta: float = 1e-5,
                     confidence: float = 0.95, guesses: int | None = None, seed: int = 0,
                     threads: int | None = None, noise_scale: float = 1.0,
                     noise_ranks: list[int] | None = None, out=None) -> CanaryAudit:
    """Collective over ``comm``: train once on ``data`` with m canaries and audit.

    Args:
        data: a prepared HDF5 file (its /train rows are the data).
        m: canaries (at most the model's parameter count: one coordinate each).
        epsilon / noise_multiplier: the run's target epsilon (sigma calibrated
            by the accountant) or its sigma; exactly one.
        epochs, batch_size, lr, hidden, max_grad_norm, delta: the run's
            settings (``mpidp train``'s, SGD with momentum 0.9, Poisson sampling).
        confidence: of the bound; guesses: total guesses r (split evenly
            between "in" and "out"), default: the sizes of
            :func:`one_run.audit` (Bonferroni over them).
        seed: the run's seed and the audit's secrets.
        noise_scale, noise_ranks: TEST-ONLY faults (module docstring).
        out: where rank 0 writes the trainer's log (default: discarded).

    Raises (every rank): ConfigError for m below :data:`MIN_CANARIES` or larger
    than the model allows, guesses outside 1..m, a confidence outside (0, 1),
    not exactly one of epsilon and noise_multiplier, or bad run settings;
    PrivacyError for a delta above 1/N or a run the accountant cannot analyse
    (in the audit's words: :func:`in_audit_terms`); all before training.
    :class:`engine.stopping.Interrupted` when a signal stopped the run
    (:func:`stopped`).
    """
    import torch

    from collectives import MPI
    from engine.config import TrainConfig
    from engine.run.hooks import RunHooks
    from engine.trainer import Trainer

    comm = MPI.COMM_WORLD if comm is None else comm
    check_request(m, guesses, confidence)
    check_privacy(epsilon, noise_multiplier)
    if not noise_scale >= 0:
        raise ValueError(f"noise_scale {noise_scale} must be >= 0")
    size, rank = comm.Get_size(), comm.Get_rank()
    if noise_ranks is not None:
        noise_ranks = sorted({int(r) for r in noise_ranks})
        if any(not 0 <= r < size for r in noise_ranks):
            raise ValueError(f"noise_ranks {noise_ranks} outside 0..{size - 1}")
    cfg = TrainConfig(data=data, epochs=epochs, batch_size=batch_size, lr=lr,
                      hidden=tuple(hidden), max_grad_norm=max_grad_norm,
                      target_epsilon=epsilon, noise_multiplier=noise_multiplier, delta=delta,
                      seed=seed, eval_every=epochs, progress=False, threads=threads)
    cfg.validate()
    state: dict = {}

    def check_fits(trainer):
        # before any canary is made: a million times too many would fill the memory
        n_params = trainer.model.n_params
        if m > n_params:
            raise ConfigError(f"--canaries {m} exceeds what the model allows: one "
                              f"parameter coordinate per canary, and it has {n_params}",
                              collective=True)
        steps = trainer.total_steps
        if steps * m > MAX_RESIDUALS:
            raise ConfigError(f"{steps} steps x {m} canaries: too many residuals to "
                              f"keep (at most {MAX_RESIDUALS:,}); fewer epochs or "
                              "canaries", collective=True)

    def add_canary_rows(train, trainer):
        # the black-box canary rows: canary j joins rank j % p's shard when
        # included, before the sampler is built, so it is sampled as a row
        check_fits(trainer)
        X_c, y_c, in_c = canary_rows(m, train.X.shape[1] - 1, trainer.info.n_classes, seed)
        mine = np.flatnonzero(in_c & (np.arange(m) % trainer.size == trainer.rank))
        state.update(rows=(X_c, y_c, in_c))
        return dataclasses.replace(train, X=np.concatenate([train.X, X_c[mine]]),
                                   y=np.concatenate([train.y, y_c[mine]]))

    def audit_step(inner, trainer):
        n_params, steps = trainer.model.n_params, trainer.total_steps
        coords, included = secrets(m, n_params, seed)
        hook = CanaryHook(coords, included, trainer.rank, trainer.size, trainer.q,
                          cfg.max_grad_norm, seed)
        noise = trainer.noise
        if noise is not None:  # the test-only faults
            noise.local_std *= noise_scale
            if noise_ranks is not None and trainer.rank not in noise_ranks:
                noise.local_std = 0.0
            inner.set_noise(noise)  # the step binds the deviation
        inner.extra = hook  # added as clipped rows are, before the noise
        residuals = np.zeros((steps, m), dtype=np.float32)
        data_sum = np.zeros(m, dtype=np.float64)
        reduced_at = hook.coords
        grad, comm_, C = trainer.grad, trainer.comm, cfg.max_grad_norm
        counter = [0]

        def step(rows, times=None, started=None, groups=None):
            result = inner(rows, times, started, groups)
            # the auditor: reduced noisy sum minus the data's, at the canaries
            comm_.Allreduce(hook.data, data_sum, op=MPI.SUM)
            reduced = grad[reduced_at].double().cpu().numpy()
            residuals[counter[0]] = (reduced - data_sum) / C
            counter[0] += 1
            return result

        step.settle = inner.settle  # the trainer reads what a step kept on the device
        state.update(hook=hook, included=included, residuals=residuals, counter=counter)
        return step

    trainer = Trainer(cfg, comm, out=io.StringIO() if out is None else out,
                      hooks=RunHooks(train_shard=add_canary_rows, step=audit_step))
    try:  # the delta's check and the accountant's plan are the trainer's
        code = trainer.run()
    except PrivacyError as exc:
        raise in_audit_terms(exc) from None
    if code != 0:  # stopped by a signal (no checkpoint directory: 128 + n), every rank alike
        raise stopped(code)
    used = state["counter"][0]
    if used != trainer.total_steps:
        raise RuntimeError(f"the audited run took {used} of {trainer.total_steps} steps")
    sampled = int(comm.allreduce(state["hook"].sampled, op=MPI.SUM))
    result, error = None, None
    if rank == 0:  # the same inputs on every rank; one computes, all receive
        try:
            ks = (one_run.default_guess_sizes(m) if guesses is None
                  else [((guesses + 1) // 2, guesses // 2)])
            analyses = (one_run.epsilon_lower_bound, one_run_fdp.epsilon_lower_bound)

            def audited(evidence: np.ndarray, included: np.ndarray) -> list:
                return [one_run.audit(evidence, included, delta, confidence, ks, bound=bound)
                        for bound in analyses]

            evidence = scores(state["residuals"], trainer.q)
            found, fdp = audited(evidence, state["included"])
            fbar_inverse = one_run_fdp.dpsgd_fbar_inverse(trainer.q, trainer.accountant.sigma,
                                                          trainer.total_steps, delta)
            refuted = claim_rejected(evidence, state["included"], ks, trainer.q,
                                     trainer.accountant.sigma, trainer.total_steps, delta,
                                     confidence, fbar_inverse)
            needed = needed_correct(m, ks, fbar_inverse, confidence)
            X_c, y_c, in_c = state["rows"]
            black, black_fdp = audited(row_scores(trainer.engine.logits(torch.from_numpy(X_c)),
                                                  y_c), in_c)
            top, top_fdp = (one_run.largest_ceiling(m, ks, delta, confidence, bound)
                            for bound in analyses)
            claimed = trainer.accountant.epsilon()
            verdict, wanted, told = "not-refuted", None, None
            if refuted:
                verdict = "refuted"
            elif max(top, top_fdp) < claimed:
                verdict = "cannot-refute"
                # with the default guess sizes, which grow with m (a fixed --guesses
                # need not gain from more canaries): the advice says to drop it
                wanted = canaries_to_reach(claimed, delta, confidence, m)
                told = advice(m, wanted, trainer.model.n_params, trainer.total_steps,
                              trainer.info.n_features, trainer.info.n_classes, guesses)
            last = trainer.history[-1] if trainer.history else {}
            result = CanaryAudit(
                epsilon_lower_bound=found.epsilon, claimed_epsilon=claimed,
                delta=delta, confidence=confidence, m=m, included=int(state["included"].sum()),
                k_in=found.k_in, k_out=found.k_out, guesses=found.guesses,
                correct=found.correct, ceiling=top, choices=found.choices,
                steps=trainer.total_steps, q=trainer.q, sigma=trainer.accountant.sigma,
                n_train=trainer.n_train, ranks=size, noise_scale=float(noise_scale),
                noise_ranks=noise_ranks, canary_samples=sampled,
                test_accuracy=last.get("test_accuracy"), epsilon_fdp=fdp.epsilon,
                k_in_fdp=fdp.k_in, k_out_fdp=fdp.k_out, correct_fdp=fdp.correct,
                ceiling_fdp=top_fdp, epsilon_blackbox=black.epsilon,
                epsilon_blackbox_fdp=black_fdp.epsilon, correct_blackbox=black.correct,
                guesses_blackbox=black.guesses, claim_rejected=refuted, verdict=verdict,
                needed_correct=None if needed is None else needed[0],
                needed_guesses=None if needed is None else needed[1], canaries_needed=wanted,
                advice=told)
        except MpidpError as exc:  # one line on every rank, not rank 0's abort
            error = exc
    agree(comm, error)
    return comm.bcast(result, root=0)
