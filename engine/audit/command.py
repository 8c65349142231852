"""Audit a trained model by attacking it: membership inference and model inversion.

Reads a checkpoint of `mpidp train` and the prepared file it was trained on,
and measures what an attacker learns about the training rows:

  membership   is a given person in the training set? Members are even rows
               of /train, non-members as many even rows of /test. Two
               attacks: the loss threshold (Yeom et al. 2018) and the loss
               calibrated by a reference model trained on other people of
               the same population (odd rows of both splits; Watson et al.
               2022).
               Reported: ROC AUC, advantage (max TPR - FPR; balanced accuracy
               = (1 + advantage) / 2), TPR at FPR 1% and 0.1%, each with a 95%
               stratified percentile bootstrap interval (widened to contain
               the estimate; --bootstrap 0: none), and p-values of "no
               leakage" (Mann-Whitney, Kolmogorov-Smirnov).
  inversion    recover a person's sensitive attribute (--attribute, one-hot
               encoded in the file) from the model, the other attributes and
               the label (Fredrikson et al. 2015), on members and on
               non-members, against guessing from the attribute's marginal;
               exact (Clopper-Pearson) intervals.

  canary       (``--attack canary``, alone, no checkpoint) trains its own run
               with --canaries m white-box gradient canaries and m canary
               rows, and gives statistical LOWER bounds on that run's
               epsilon, to compare with the claimed one: white-box (every
               step's sum) and black-box (the final model only), each by
               the one-run theorem of Steinke, Nasr and Jagielski 2023 and
               by the f-DP analysis of Mahloujifar, Melis and Chaudhuri
               2025 (:mod:`engine.audit.canary`); and tests the claim
               itself: the white-box guesses against the run's own privacy
               curve (the accountant's PLD). Refuted means the engine leaks
               more than it says (exit code 4). When the audit's ceiling
               (the most it can show, all guesses right) is below the
               claimed epsilon it says it cannot refute it with these
               settings, and how many canaries would (exit code 5).

An AUC near 0.5 and inversion accuracy near the baseline mean the attacks
learned nothing; they are lower bounds on what an attacker can do, not a
privacy guarantee (that is the epsilon of DP-SGD). Every rank scores its own
rows; scores are gathered where a statistic needs them all.

Examples:
  mpiexec -n 2 mpidp audit --checkpoint runs/a --data pums.h5
  mpiexec -n 2 mpidp audit --checkpoint runs/a/checkpoint.pt --data pums.h5 \\
      --attack inversion --attribute MAR --json audit.json
  mpiexec -n 2 mpidp audit --attack canary --data pums.h5 --canaries 1000 \
      --target-epsilon 4 --epochs 5 --batch-size 256 --hidden 64

Exit codes: 0 done, 2 bad input (missing or unreadable files, a checkpoint
and data file of different tasks, encodings or sizes, splits too small, an
attribute the file does not have, a --json file that cannot be written:
checked before the audit runs), 3 the reference model diverged (use
--no-calibration or fewer --reference-epochs), 4 the canary audit refuted
the run's privacy claim, 5 the canary audit cannot refute the claim with
its settings (its ceiling is below the claimed epsilon; the report says
what would), 74 the report could not be written at the end.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass

import numpy as np

from collectives import MPI, machine
from engine.choices import seed_value, thread_count
from engine import __version__, outputs
from engine.audit import membership, report as report_mod, stats
from engine.errors import (EXIT_CANNOT_REFUTE, EXIT_CLAIM_REFUTED, ConfigError, DataError,
                           MpidpError, WriteFailed, agree)
from engine.shard import read_shard

ATTACK_GROUPS = ("membership", "inversion")
#: The one-run canary audit: trains its own run, so it takes no checkpoint.
CANARY = "canary"
#: The options of the run ``--attack canary`` trains (argparse dest -> default).
#: argparse's defaults are None, so that one given with another attack, which
#: would ignore it, is refused (:func:`check_canary_options`).
CANARY_DEFAULTS: dict = {"canaries": 500, "guesses": None, "target_epsilon": None,
                         "noise_multiplier": None, "delta": 1e-5, "epochs": 5,
                         "batch_size": 256, "lr": 0.1, "hidden": "64", "max_grad_norm": 1.0}


@dataclass
class AuditConfig:
    """The settings of one audit (the options of ``mpidp audit``)."""

    checkpoint: str
    data: str
    attacks: tuple[str, ...] = ATTACK_GROUPS
    attribute: str = "SEX"
    calibration: bool = True
    reference_epochs: int | None = None
    max_rows: int | None = None
    resamples: int = 1000
    confidence: float = 0.95
    seed: int = 0
    json: str | None = None
    threads: int | None = None
    progress: bool | None = None

    def validate(self) -> None:
        def fail(message: str):
            raise ConfigError(message, collective=True)

        unknown = [a for a in self.attacks if a not in ATTACK_GROUPS + (CANARY,)]
        if unknown or not self.attacks:
            fail(f"--attack {','.join(self.attacks)}: choose from "
                 f"{','.join(ATTACK_GROUPS + (CANARY,))}")
        if CANARY in self.attacks:
            if len(self.attacks) > 1:
                fail("--attack canary trains its own run: give it alone")
            if self.checkpoint:
                fail("--attack canary trains its own run with canaries and audits that; a "
                     "checkpoint (trained without canaries) cannot be audited this way: drop "
                     "--checkpoint")
        elif not self.checkpoint:
            fail(f"--attack {','.join(self.attacks)} needs --checkpoint")
        if self.resamples < 0:
            fail(f"--bootstrap {self.resamples} must be 0 or more")
        if not 0 < self.confidence < 1:
            fail(f"--confidence {self.confidence} must be in (0, 1)")
        least = stats.min_resamples(self.confidence)
        if "membership" in self.attacks and 0 < self.resamples < least:
            fail(f"--bootstrap {self.resamples}: a {100 * self.confidence:g}% interval needs "
                 f"at least {least} resamples ({stats.TAIL_RESAMPLES} beyond each end); give "
                 f"--bootstrap {least} or more, or --bootstrap 0 for no intervals")
        if self.reference_epochs is not None and self.reference_epochs < 1:
            fail(f"--reference-epochs {self.reference_epochs} must be at least 1")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = AuditConfig(checkpoint="", data="")
    parser.add_argument("--checkpoint", default="",
                        help="checkpoint file (or the --checkpoint-dir of a training run); "
                        "required except with --attack canary")
    parser.add_argument("--data", required=True,
                        help="the prepared HDF5 file the model was trained on (its /train "
                        "rows are the members)")
    parser.add_argument("--attack", default=",".join(d.attacks),
                        help="comma-separated: membership, inversion (default: both); or canary "
                        "alone (the one-run canary audit, options below)")
    parser.add_argument("--attribute", default=None,  # None: not given (check_attack_options)
                        help="sensitive attribute for the inversion attack, one-hot encoded "
                        "in the file, e.g. SEX, MAR, DIS (default: SEX)")
    parser.add_argument("--no-calibration", dest="calibration", action="store_false",
                        help="skip the calibrated membership attack (and its reference model)")
    parser.add_argument("--reference-epochs", type=int, default=None,
                        help="epochs of the reference model (default: the target's)")
    parser.add_argument("--max-rows", type=int, default=None,
                        help="at most this many members and as many non-members "
                        "(default: as many as the smaller split allows)")
    parser.add_argument("--bootstrap", dest="resamples", type=int, default=None,
                        help=f"bootstrap resamples for the membership intervals, at least "
                        f"10 / (1 - confidence) ({stats.min_resamples(d.confidence)} at 95%%); "
                        f"0: no intervals (default: {d.resamples}, or that least number "
                        "when larger)")
    parser.add_argument("--confidence", type=float, default=d.confidence,
                        help=f"confidence level of the intervals (default: {d.confidence})")
    parser.add_argument("--seed", type=seed_value, default=d.seed,
                        help="seed of the reference model and the bootstrap (default: 0)")
    parser.add_argument("--json", default=None, metavar="FILE",
                        help="also write the full results as JSON to FILE ('-': stdout)")
    parser.add_argument("--threads", type=thread_count, default=None,
                        help="torch threads per rank (default: the cores the launcher bound "
                        "the rank to, else the node's cores // its ranks)")
    parser.add_argument("--progress", dest="progress", action="store_true", default=None,
                        help="progress bars on rank 0 (default: when stderr is a terminal)")
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    can = parser.add_argument_group(
        "canary audit (--attack canary only): the run it trains, with mpidp train's meaning")
    c = CANARY_DEFAULTS  # argparse's defaults are None: given with another attack, refused
    can.add_argument("--canaries", type=int, default=None, metavar="M",
                     help="gradient canaries, each included with probability 1/2 (at most "
                     f"the model's parameters; default {c['canaries']})")
    can.add_argument("--guesses", type=int, default=None, metavar="K",
                     help="guess on K canaries, half in, half out (default: try 1-50%% of m, "
                     "Bonferroni-corrected)")
    can.add_argument("--target-epsilon", type=float, default=None,
                     help="the run's target epsilon (give it or --noise-multiplier)")
    can.add_argument("--noise-multiplier", type=float, default=None,
                     help="the run's noise multiplier (give it or --target-epsilon)")
    can.add_argument("--delta", type=float, default=None,
                     help=f"at most 1/N for N training rows (default {c['delta']:g})")
    can.add_argument("--epochs", type=int, default=None, help=f"default {c['epochs']}")
    can.add_argument("--batch-size", type=int, default=None,
                     help=f"expected batch size (default {c['batch_size']})")
    can.add_argument("--lr", type=float, default=None, help=f"default {c['lr']:g}")
    can.add_argument("--hidden", default=None,
                     help=f"hidden widths, comma-separated (default {c['hidden']})")
    can.add_argument("--max-grad-norm", type=float, default=None,
                     help=f"default {c['max_grad_norm']:g}")


def _flag(dest: str) -> str:
    """The option of an argparse ``dest``: ``batch_size`` -> ``--batch-size``."""
    return "--" + dest.replace("_", "-")


def check_canary_options(attacks: tuple[str, ...], args: argparse.Namespace) -> None:
    """Refuse the options of the canary audit's run (:data:`CANARY_DEFAULTS`)
    given with another attack, which would ignore them.

    Raises:
        ConfigError: (collective) naming the options given and the attack they belong to.
    """
    if CANARY in attacks:
        return
    given = [_flag(dest) for dest in CANARY_DEFAULTS if getattr(args, dest, None) is not None]
    if given:
        them = "it" if len(given) == 1 else "them"
        raise ConfigError(f"{', '.join(given)}: {'an option' if len(given) == 1 else 'options'}"
                          f" of --attack canary (the run it trains), not used by --attack "
                          f"{','.join(attacks)}: drop {them}", collective=True)


def canary_settings(args: argparse.Namespace) -> dict:
    """The canary run's options (:data:`CANARY_DEFAULTS` keys), defaults filled in."""
    return {dest: default if getattr(args, dest, None) is None else getattr(args, dest)
            for dest, default in CANARY_DEFAULTS.items()}


def config_from_args(args: argparse.Namespace) -> AuditConfig:
    """The audit ``args`` ask for, checked (:meth:`AuditConfig.validate`,
    :func:`check_canary_options`); ``--bootstrap`` not given is 1000, or
    :func:`stats.min_resamples` of the confidence when larger.

    Raises:
        ConfigError: (collective) options that contradict each other or cannot work.
    """
    resamples = args.resamples
    if resamples is None:
        resamples = AuditConfig.resamples
        if 0 < args.confidence < 1:  # else validate() refuses the confidence
            resamples = max(resamples, stats.min_resamples(args.confidence))
    cfg = AuditConfig(
        checkpoint=args.checkpoint, data=args.data,
        attacks=tuple(a.strip() for a in args.attack.split(",") if a.strip()),
        attribute=args.attribute or AuditConfig.attribute, calibration=args.calibration,
        reference_epochs=args.reference_epochs, max_rows=args.max_rows,
        resamples=resamples, confidence=args.confidence, seed=args.seed,
        json=args.json, threads=args.threads, progress=args.progress)
    cfg.validate()
    check_canary_options(cfg.attacks, args)
    check_attack_options(cfg.attacks, args)
    return cfg


#: The options of one attack or two (option -> (argparse dest, the attacks that
#: read it)): given with none of them, they would be ignored.
ATTACK_OPTIONS = {"--attribute": ("attribute", ("inversion",)),
                  "--no-calibration": ("calibration", ("membership",)),
                  "--reference-epochs": ("reference_epochs", ("membership",)),
                  "--bootstrap": ("resamples", ("membership",)),
                  "--max-rows": ("max_rows", ("membership", "inversion"))}


def check_attack_options(attacks: tuple[str, ...], args: argparse.Namespace) -> None:
    """Refuse an option of :data:`ATTACK_OPTIONS` given without an attack that
    reads it (``--attribute`` with ``--attack membership`` alone, ...).

    Raises:
        ConfigError: (collective) naming the option and the attacks it is for.
    """
    for option, (dest, readers) in ATTACK_OPTIONS.items():
        value = getattr(args, dest, None)
        given = value is False if dest == "calibration" else value is not None
        if given and not set(readers) & set(attacks):
            raise ConfigError(f"{option} is for --attack {' or '.join(readers)}, not used by "
                              f"--attack {','.join(attacks)}: drop it", collective=True)


def _finite(value):
    """JSON-safe plain types: NaN and infinities become None, numpy becomes
    Python, recursively."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_json(path: str, report: dict) -> None:
    """Write ``report`` to ``path`` atomically (temporary file, rename).

    Raises:
        WriteFailed: the file cannot be written (checked before the audit, so
            only when the disk filled or the directory changed meanwhile).
    """
    text = json.dumps(_finite(report), indent=1, sort_keys=True, allow_nan=False)
    if path == "-":
        print(text)
        return
    outputs.replace_file(path, text + "\n",
                         lambda reason: f"--json {path}: cannot write the report: {reason}")


def check_output(cfg: AuditConfig, comm) -> None:
    """Collective: check ``--json`` before any work (:mod:`engine.outputs`): a
    file that can be written, not a directory, not the ``--data`` file.

    Raises (on every rank): OutputError, exit code 2.
    """
    error = None
    if comm.Get_rank() == 0:  # the rank that writes it
        try:
            outputs.check_all({"--json": cfg.json})
            outputs.check_apart({"--json": cfg.json}, {"--data": cfg.data})
        except MpidpError as exc:
            error = exc
    agree(comm, error)


def privacy_of(payload: dict, is_image: bool = False) -> dict:
    """What the audited model's file states of its privacy, for the report's
    ``target``: the statement ``mpidp eval`` reads
    (:func:`engine.checkpoint.statement_of`) and its words
    (:func:`engine.checkpoint.epsilon_text`), as ``mpidp eval``'s JSON names
    them: ``epsilon`` (the stated one), ``epsilon_is_guarantee``,
    ``not_a_guarantee`` (why not, or None), ``privacy_unit``, ``epsilon_text``.
    Empty for a non-private model."""
    from engine import checkpoint as ckpt  # deferred: kept out of `mpidp audit --help`

    statement = ckpt.statement_of(payload)
    if statement.get("epsilon") is None:
        return {}
    unit = ckpt.stated_unit(statement, is_image)  # as mpidp eval says it
    guarantee = statement.get("guarantee") is not False
    return {"epsilon": statement["epsilon"], "epsilon_is_guarantee": guarantee,
            "not_a_guarantee": None if guarantee else statement.get("not_a_guarantee"),
            "privacy_unit": unit, "epsilon_text": ckpt.epsilon_text(statement, unit)}


def run_audit(cfg: AuditConfig, comm, out=None) -> dict:
    """Collective: run the audit ``cfg`` over ``comm``; returns the report (every rank).

    Rank 0 prints the report to ``out`` (default stdout; None-like objects
    with ``write`` are fine) and writes ``cfg.json``.

    Raises (on every rank): CheckpointError, DataError (AuditMismatch,
    SplitTooSmall, AttributeNotFound), ConfigError, DivergedError.
    """
    # deferred: torch, Numba and the trainer, kept out of `mpidp audit --help`
    from engine.audit import inversion
    from engine.audit.inputs import (MIN_ROWS, SplitTooSmall, load_target, local_rows,
                                     plan_rows, reference_rows)
    from engine.audit.reference import Part, train_reference, training_plan
    from engine.audit.scoring import allgather_rows, score_rows
    from engine.run.threads import configure_threads

    out = sys.stdout if out is None else out
    rank, n_ranks = comm.Get_rank(), comm.Get_size()
    check_output(cfg, comm)
    progress = (sys.stderr.isatty() if cfg.progress is None else cfg.progress) and rank == 0
    threads = configure_threads(cfg.threads, comm).threads
    target = load_target(cfg.checkpoint, cfg.data, comm)
    info, spec, params = target.info, target.spec, target.params
    plan = plan_rows(info.rows["train"], info.rows["test"], cfg.max_rows, info.path)
    if "inversion" in cfg.attacks:
        cols, values = inversion.attribute_columns(info.feature_names, cfg.attribute,
                                                   info.path)
    train = read_shard(info, "train", comm, min_rows_per_rank=0)
    test = read_shard(info, "test", comm, min_rows_per_rank=0)
    mine_m = local_rows(plan.members, train.offset, train.n_local)
    mine_n = local_rows(plan.nonmembers, test.offset, test.n_local)
    Xm, ym = train.X[mine_m], train.y[mine_m]
    Xn, yn = test.X[mine_n], test.y[mine_n]

    described = {**target.summary(), **privacy_of(target.payload, info.is_image)}
    result: dict = {"mpidp": __version__, "target": described, "data": info.summary(),
                    "rows": plan.summary(), "notes": list(target.notes), "ranks": n_ranks,
                    "threads": threads, "seed": cfg.seed}
    logp_m, right_m = score_rows(spec, params, Xm, ym)
    logp_n, right_n = score_rows(spec, params, Xn, yn)
    sums = np.array([-logp_m.sum(), right_m.sum(), -logp_n.sum(), right_n.sum()])
    sums = np.sum(comm.allgather(sums), axis=0)
    result["fit"] = {"member_loss": sums[0] / plan.m, "member_accuracy": sums[1] / plan.m,
                     "nonmember_loss": sums[2] / plan.m, "nonmember_accuracy": sums[3] / plan.m}

    if "membership" in cfg.attacks:
        observed = membership.Observations(allgather_rows(comm, logp_m),
                                           allgather_rows(comm, logp_n))
        names = ["loss"]
        if cfg.calibration:
            n_ref = min(plan.population, info.rows["train"])
            if n_ref < MIN_ROWS:
                raise SplitTooSmall(f"{info.path}: only {plan.population} population rows "
                                    f"(odd rows) for the reference model; need {MIN_ROWS} "
                                    "(or pass --no-calibration)", collective=True)
            parts = []
            for shard, chosen in zip((train, test), reference_rows(plan, n_ref)):
                mine = local_rows(chosen, shard.offset, shard.n_local)
                offset = comm.exscan(int(mine.size)) if n_ranks > 1 else 0
                parts.append(Part(shard.X[mine], shard.y[mine], int(offset or 0),
                                  int(chosen.size)))
            epochs = cfg.reference_epochs or int(target.config.get("epochs", 10))
            ref = train_reference(spec, target.config, parts, comm, cfg.seed, epochs,
                                  progress)
            observed.member_ref_logp = allgather_rows(comm, score_rows(spec, ref, Xm, ym)[0])
            observed.nonmember_ref_logp = allgather_rows(comm,
                                                         score_rows(spec, ref, Xn, yn)[0])
            batch, _, steps = training_plan(n_ref, target.config.get("batch_size", 256),
                                            epochs)
            result["reference"] = {
                "rows": n_ref, "rows_from_train": parts[0].n, "rows_from_test": parts[1].n,
                "from": "odd rows of /train and /test", "epochs": epochs,
                "batch_size": batch, "steps": steps, "private": False,
                "optimizer": target.config.get("optimizer"), "lr": target.config.get("lr"),
                "member_loss": float(-observed.member_ref_logp.mean()),
                "nonmember_loss": float(-observed.nonmember_ref_logp.mean())}
            names.append("calibrated")
        result["membership"] = {
            "members": plan.m, "nonmembers": plan.m,
            "ci_method": ("stratified percentile bootstrap (thresholds re-chosen per "
                          "resample; widened to contain the estimate)"),
            "attacks": [membership.evaluate(membership.ATTACKS[name], observed, comm,
                                            cfg.resamples, cfg.confidence, cfg.seed, progress)
                        for name in names]}

    if "inversion" in cfg.attacks:
        population = np.concatenate([
            train.X[local_rows(plan.population_train, train.offset, train.n_local)],
            test.X[local_rows(plan.population_test, test.offset, test.n_local)]])
        error, truth = None, {}
        for name, X in (("members", Xm), ("nonmembers", Xn), ("population", population)):
            try:
                truth[name] = inversion.attribute_values(X, cols)
            except ValueError as exc:
                error = DataError(f"{info.path}: attribute {cfg.attribute} is not one-hot "
                                  f"encoded in the {name} rows ({exc})")
                break
        agree(comm, error)
        found = inversion.attack(spec, params, cols, values,
                                 {"members": (Xm, ym, truth["members"]),
                                  "nonmembers": (Xn, yn, truth["nonmembers"])},
                                 truth["population"], comm, cfg.confidence)
        result["inversion"] = {"attribute": cfg.attribute, "title": inversion.TITLE,
                               "ci_method": "exact Clopper-Pearson", **found}

    if "membership" in result:
        result["membership"]["verdict"] = report_mod.membership_verdict(
            _finite(result["membership"]), _finite(result["target"]))
    if "inversion" in result:
        result["inversion"]["verdict"] = report_mod.inversion_verdict(
            _finite(result["inversion"]))
    result = _finite(result)
    error = None
    if rank == 0:
        if cfg.json != "-":
            out.write(report_mod.text(result) + "\n")
            out.flush()
        if cfg.json:
            try:
                write_json(cfg.json, result)
            except WriteFailed as exc:
                error = exc
    agree(comm, error)
    return result


def run_canary(cfg: AuditConfig, args: argparse.Namespace, comm, out=None) -> dict:
    """Collective: ``mpidp audit --attack canary``; returns the report (every rank).

    ``--json`` is checked before the run it trains (:func:`check_output`); a
    report that cannot be written at the end raises WriteFailed on every rank.
    """
    from engine.audit.canary import run_canary_audit

    run = canary_settings(args)
    try:
        hidden = tuple(int(w) for w in str(run["hidden"]).split(",") if w.strip())
    except ValueError:
        raise ConfigError(f"--hidden {run['hidden']}: comma-separated integers",
                          collective=True) from None
    check_output(cfg, comm)  # before the run it trains
    result = run_canary_audit(
        cfg.data, comm, m=run["canaries"], guesses=run["guesses"],
        epsilon=run["target_epsilon"], noise_multiplier=run["noise_multiplier"],
        delta=run["delta"], epochs=run["epochs"], batch_size=run["batch_size"], lr=run["lr"],
        hidden=hidden, max_grad_norm=run["max_grad_norm"], confidence=cfg.confidence,
        seed=cfg.seed, threads=cfg.threads)
    report = _finite({"version": __version__, "data": cfg.data, "ranks": comm.Get_size(),
                      "canary": result.to_dict()})
    error = None
    if comm.Get_rank() == 0:
        out = sys.stdout if out is None else out
        if cfg.json != "-":
            out.write(result.text() + "\n")
            out.flush()
        if cfg.json:  # the file also says how it was made (rank 0's git call alone)
            try:
                write_json(cfg.json, {**report, "provenance": machine.provenance()})
            except WriteFailed as exc:  # one line, exit 74, on every rank
                error = exc
    agree(comm, error)
    return report


def run(args: argparse.Namespace) -> int:
    """Collective: ``mpidp audit`` on every rank of COMM_WORLD."""
    cfg = config_from_args(args)
    if CANARY in cfg.attacks:
        report = run_canary(cfg, args, MPI.COMM_WORLD)
        verdict = report["canary"]["verdict"]
        return {"refuted": EXIT_CLAIM_REFUTED, "cannot-refute": EXIT_CANNOT_REFUTE}.get(verdict, 0)
    else:
        run_audit(cfg, MPI.COMM_WORLD)
    return 0
