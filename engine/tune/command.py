"""Search hyperparameters: trials trained with the engine side by side, chosen on val.

Every trial is `mpidp train` on the training split with one point of the
space; the trials run side by side (--parallel P groups of ranks, each a
sub-communicator of the job, one trial at a time each), every trained model
is scored on the file's val split (`mpidp prep --val-fraction`), and the
trial with the best val accuracy is chosen (--select-on
worst_group_val_accuracy: the best accuracy of its worst --group-by
group). The test split is never used to choose. Rank 0 prints a line per
finished trial, then a table, the privacy the tuning itself costs, and the
chosen settings as an `mpidp train` command; OUT/tune.json holds it all,
and the chosen trial's model is kept in OUT/trials/trial-NNNN/best.pt, the
file to publish: its epsilon is the one including the tuning, and it holds
no exact score (`mpidp eval
--checkpoint OUT/trials/trial-NNNN` scores it and prints that epsilon).

Examples:
  mpiexec -n 2 mpidp tune --data pums.h5 --no-dp --out runs/tune \\
      --space 'lr=0.01,0.05,0.2;batch_size=256,1024;hidden=128,128|64;epochs=3'
  mpiexec -n 4 mpidp tune --data pums.h5 --target-epsilon 1 --trials 12 --parallel 4 \\
      --space-file space.toml --out runs/tune-dp            # private random search
  mpiexec -n 2 mpidp tune --data pums.h5 --target-epsilon 1 --tuning-privacy public \\
      --public-split val --space 'lr=0.02,0.1;optimizer=sgd,adam;epochs=2' --out runs/t

The space: KEY=VALUES separated by ';', values by ',' (hidden: width lists
separated by '|', 'none' for no hidden layer); tunable keys: lr, batch_size,
max_grad_norm, epochs, optimizer, momentum, weight_decay, lr_schedule,
model, hidden, noise_multiplier. --space-file: the same as TOML (key =
[values]). A key with one value is fixed for every trial. Each value is
checked as `mpidp train` checks it on the file, before any trial runs.
hidden shapes mlp and embedding-mlp only: refused in a space of other models
(logreg, the image models, MODULE:FACTORY), left out of the points of those
models in a mixed one (each such point trained once).

The search: grid (every valid point) unless --trials N is given (N points
drawn at random without replacement), or the tuning privacy is
random-search (then the number of trials K is itself random, with mean N,
and each trial draws its point uniformly: Papernot & Steinke's private
random search).

The privacy of the tuning (DP runs; docs/training.md#tuning): choosing the
best of several private runs by a score of private data is not free.
  random-search (default)  K ~ truncated negative binomial (--eta 1:
                geometric) or Poisson (--trials-distribution poisson), the
                released val scores noised (--score-noise, unless
                --public-split val declares the val split public); the
                report's "epsilon incl. tuning" bounds releasing the chosen
                trial (Papernot & Steinke 2022, Theorems 2 and 6).
  public        scores on a split the user declares public (--public-split
                val: the val split of a private file is NOT public unless
                you say so); the choice still depends on every trial's
                model, so "epsilon incl. tuning" is all trials composed.
Training the printed command again spends its own epsilon on top of the
tuning's (the settings were chosen on private data); the chosen trial's
model needs no retraining.

Resuming: every finished trial is a line of OUT/trials.jsonl; the same
command again (same space and options, same --out) skips them, and keeps
a random search's drawn trials. Another search in the same --out is refused.

Not done: one Slurm job per trial (--launcher, as `mpidp bench scaling`
has): trials run inside this job only; continuous ranges (values are lists).

Exit codes: 0 done, 2 bad input (nothing run or written), 3 no trial
finished (every trial failed; the report is written), 73 --out in use by
another search, 74 an output could not be written, 75 stopped by a signal
(finished trials kept: run the same command again to continue), 128+n
stopped by signal n before the first trial.
"""
from __future__ import annotations

import argparse
import os
import time

from collectives import MPI
from engine.choices import seed_value, thread_count
from engine.config import TrainConfig, add_group_selection
from engine.dp.accountant import DEFAULT_KIND, KINDS
from engine.errors import EXIT_CHECKPOINTED, MpidpError, PrivacyError, agree
from engine.tune import space as space_mod
from engine.tune.options import (DEFAULT_MEAN_TRIALS, DEFAULT_SCORE_NOISE, MODES, Options,
                                 check_file, check_space, check_values, fail, privacy_key,
                                 privacy_plans, training_units, valid_points,
                                 without_unused_hidden)
from engine.tune.privacy import DISTRIBUTIONS
from engine.tune.report import write_report
from engine.tune.state import FORMAT, VERSION, load_state, open_out, plan_trials

#: Stop signals are acted on between trials and at the trainer's steps (not raised).
STOPS_AT_STEPS = True
#: The score noise's std in accuracy (std / val rows) above which the start says
#: that a private random search's choice is mostly noise: 5 points of accuracy.
NOISY_CHOICE = 0.05


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = TrainConfig(data="")
    what = parser.add_argument_group("data, space and search")
    what.add_argument("--data", required=True,
                      help="prepared HDF5 file with a val split (mpidp prep --val-fraction)")
    what.add_argument("--space", default=None, metavar="SPEC",
                      help="KEY=V1,V2;KEY=... (hidden: 128,128|64); see above")
    what.add_argument("--space-file", default=None, metavar="FILE.toml",
                      help="the space as TOML (key = [values]); may be combined with --space")
    what.add_argument("--search", choices=("grid", "random"), default=None,
                      help="grid: every valid point; random: --trials points drawn without "
                      "replacement (default: grid, random with --trials; always random for "
                      "--tuning-privacy random-search)")
    what.add_argument("--trials", type=int, default=None, metavar="N",
                      help="random search: points to draw; private random search: the "
                      f"expected number of trials E[K] (default {DEFAULT_MEAN_TRIALS})")
    what.add_argument("--parallel", type=int, default=None, metavar="P",
                      help="trials side by side: the ranks split into P groups of contiguous "
                      "ranks, one trial each at a time (default: one group per rank, at most "
                      "one per trial); every rank holds its group's copy of the data")
    what.add_argument("--seed", type=seed_value, default=None,
                      help="seed of the plan, of each trial (derived from it) and of the score "
                      "noise (default: random; experiments only)")
    what.add_argument("--select-on", choices=("val_accuracy", "worst_group_val_accuracy"),
                      default="val_accuracy",
                      help="the score a trial is chosen by, on the val split: its accuracy, "
                      "or the accuracy of its worst --group-by group of at least "
                      "--min-group-size val rows (default: val_accuracy)")
    add_group_selection(what, "val groups with fewer rows (noisy rows, in a private random "
                        "search) are not scored")
    what.add_argument("--out", default="tune", metavar="DIR",
                      help="the search's directory: search.json, trials.jsonl, tune.json and "
                      "the chosen trial's checkpoint; created if missing (its parent must "
                      "exist); the same DIR again continues the search (default: tune)")
    privacy = parser.add_argument_group("privacy of every trial (as mpidp train)")
    sigma = privacy.add_mutually_exclusive_group()
    sigma.add_argument("--target-epsilon", type=float, default=None,
                       help="each trial calibrates sigma to spend this epsilon")
    sigma.add_argument("--noise-multiplier", type=float, default=None,
                       help="sigma of every trial (or tune noise_multiplier in the space)")
    privacy.add_argument("--no-dp", dest="dp", action="store_false",
                         help="non-private trials (no tuning privacy either)")
    privacy.add_argument("--delta", type=float, default=None,  # None: refused with --no-dp
                         help=f"delta of each trial and of the tuning (default: {d.delta})")
    privacy.add_argument("--accountant", default=None, choices=KINDS,
                         help=f"each trial's accountant (default: {DEFAULT_KIND}); the tuning's "
                         "cost is "
                         "computed in RDP")
    privacy.add_argument("--privacy-unit", default="person", choices=("person", "household"),
                         help="whom epsilon protects (default: person)")
    tuning = parser.add_argument_group("privacy of the tuning (DP runs)")
    tuning.add_argument("--tuning-privacy", choices=MODES, default=None,
                        help="random-search (default): Papernot & Steinke's private random "
                        "search; public: score on --public-split, cost = the trials composed")
    tuning.add_argument("--public-split", default=None, metavar="NAME",
                        help="a split of the file you declare public (val): its scores are "
                        "exact and cost nothing. The val split of a private file is NOT public "
                        "unless you say so")
    tuning.add_argument("--trials-distribution", choices=DISTRIBUTIONS, default=None,
                        help="law of the number of trials K of a private random search "
                        "(default: negative-binomial)")
    tuning.add_argument("--eta", type=float, default=None,
                        help="shape eta >= 0 of the truncated negative binomial: 1 geometric "
                        "(default), 0 logarithmic")
    tuning.add_argument("--score-noise", type=float, default=None, metavar="STD",
                        help="std of the Gaussian noise on each released val score, in correct "
                        "predictions (persons, or households' shares) (default: "
                        f"{DEFAULT_SCORE_NOISE:g}; private random search with a private val)")
    system = parser.add_argument_group("system")
    system.add_argument("--threads", type=thread_count, default=None,
                        help="torch/numba threads per rank (default: as mpidp train)")
    system.add_argument("--allreduce", default="auto",
                        help="all-reduce algorithm of the trials (default: auto)")


def run(args: argparse.Namespace) -> int:
    """Collective: the search (module docstring); returns the exit code."""
    from engine import checkpoint_lock, stopping
    from engine.shard import read_info
    from engine.tune import privacy, search

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    say = (lambda text: print(text, flush=True)) if rank == 0 else (lambda text: None)
    started = time.perf_counter()
    opts = Options(args, size)
    space = space_mod.parse(args.space, args.space_file)
    check_space(space, opts)
    info = read_info(args.data, comm)
    check_file(info, opts)
    units = training_units(info, opts.privacy["privacy_unit"], comm)
    check_values(space, info, units, opts)
    if opts.dp:
        from engine.dp.privacy import check_delta_for_rows
        try:
            check_delta_for_rows(opts.privacy["delta"], units, where=opts.data,
                                 escape=False,  # tune has no --allow-large-delta
                                 unit=opts.privacy["privacy_unit"])
        except PrivacyError as exc:
            fail(str(exc), PrivacyError)
    points, dropped, reason = valid_points(space, opts)
    if not points:
        fail(f"the space has no valid point ({space.size} tried; e.g. {reason})")
    points, merged = without_unused_hidden(points)
    identity = opts.identity(space, info)
    error, state = None, None
    if rank == 0:
        try:
            state = load_state(opts.out, identity)
            if state is None:
                trials = [search.Trial.make(i + 1, point, opts.seed)
                          for i, point in enumerate(plan_trials(points, opts))]
                state = {"format": FORMAT, "version": VERSION, "identity": identity,
                         "trials": [t.to_json() for t in trials], "new": True}
        except MpidpError as exc:
            error = exc
    agree(comm, error)
    state = comm.bcast(state, root=0)
    trials = [search.Trial.from_json(t) for t in state["trials"]]
    created_state = bool(state.pop("new", False))
    # What the tuning costs, stated before any trial spends it.
    statement = None
    if opts.dp:
        keys = sorted({privacy_key(p, opts) for p in points},
                      key=lambda k: (k[0], k[1], -1 if k[2] is None else k[2]))
        if opts.mode == "public":
            keys = sorted({privacy_key(space_mod.from_plain(t.settings), opts) for t in trials},
                          key=lambda k: (k[0], k[1], -1 if k[2] is None else k[2]))
        plans = privacy_plans(keys, units, opts, comm)
        if opts.mode == "random-search":
            curves = [privacy.trial_curve(*plans[k]) for k in keys]
            from engine.tune.search import GROUP_SENSITIVITY

            statement = privacy.random_search(
                curves, opts.privacy["delta"], opts.distribution, float(opts.trials), opts.eta,
                opts.score_std, GROUP_SENSITIVITY if opts.objective != "val_accuracy" else 1.0)
        else:
            curves = [privacy.trial_curve(*plans[privacy_key(space_mod.from_plain(t.settings),
                                                              opts)]) for t in trials]
            statement = privacy.public_search(curves, opts.privacy["delta"], opts.public_split)
    stopping.check_startup(comm, stop_on_any=True)
    error, lock, finished = None, None, {}
    if rank == 0:
        try:
            keys_planned = {t.key for t in trials}
            finished = {k: r for k, r in search.read_results(
                os.path.join(opts.out, search.TRIALS_FILE)).items() if k in keys_planned}
            lock = open_out(opts.out, {**state, "statement": None if statement is None
                                        else statement.to_json()},
                             created_state, trials, finished)
        except MpidpError as exc:
            error = exc
    agree(comm, error)
    try:
        done_keys = comm.bcast(set(finished), root=0)
        pending = [t for t in trials if t.key not in done_keys]
        parallel = min(opts.parallel or size, max(1, len(pending)))
        shown = space.varied
        kind = ("grid" if opts.search == "grid" else "random search" if opts.mode !=
                "random-search" else "private random search")
        drop = (f"; {dropped} invalid combination(s) left out, e.g. {reason}" if dropped
                else "")
        if merged:
            drop += (f"; {merged} point(s) alike but for hidden, which their model ignores, "
                     "trained once")
        chosen_on = ("val accuracy" if opts.objective == "val_accuracy" else
                     f"the val accuracy of the worst {opts.group_by} group of at least "
                     f"{opts.min_group_size} rows")
        say(f"mpidp tune: {len(trials)} trial(s) ({kind} over {len(points)} valid point(s) of "
            f"{space.size}{drop}) on {opts.data}; {size} rank(s) in {parallel} group(s); "
            f"chosen on {chosen_on} ({info.rows['val']:,} val rows), never on test")
        # the score's base: every val row, or for the worst group a group as
        # small as may be scored (its accuracy is a ratio of two noisy counts)
        worst = opts.objective != "val_accuracy"
        base = opts.min_group_size if worst else info.rows["val"]
        if opts.score_std is not None and base and opts.score_std / base > NOISY_CHOICE:
            rows = (f"a {opts.group_by} group of --min-group-size {base:,} val rows" if worst
                    else f"{base:,} val rows")
            say(f"note: the score noise (std {opts.score_std:g} correct predictions) is "
                f"{opts.score_std / base:.2f} in accuracy on {rows}, more than trials' "
                "scores usually differ: the choice is mostly noise; prepare a larger val "
                "split (mpidp prep --val-fraction)"
                + (", raise --min-group-size" if worst else "")
                + ", or give --score-noise a smaller std (a higher tuning epsilon)")
        if len(pending) < len(trials):
            say(f"mpidp tune: {len(trials) - len(pending)} trial(s) already done in "
                f"{opts.out}/{search.TRIALS_FILE}: skipped")
        if statement is not None:
            say(f"privacy of the tuning: {statement.text}")
        elif not opts.dp:
            say("non-private trials (--no-dp): no privacy to account")
        fixed = {k: v[0] for k, v in space.values.items() if len(v) == 1}
        if fixed:
            say(f"fixed for every trial: {space_mod.describe_point(fixed)}")
        records, stopped = [], False
        if pending:
            settings = search.Settings(data=opts.data, out=opts.out, base=opts.base,
                                       score_std=opts.score_std, seed=opts.seed,
                                       total=len(trials), shown=shown,
                                       unit=opts.privacy["privacy_unit"],
                                       objective=opts.objective, group_by=opts.group_by,
                                       min_group_size=opts.min_group_size)
            records, stopped = search.run_search(settings, info, pending, parallel, comm)
        if stopped:
            left = len(pending) - len(records) if rank == 0 else 0
            kept = (f"the finished ones are kept in {opts.out}/{search.TRIALS_FILE}"
                    if records or finished else "none had finished")
            say(f"mpidp tune: stopped by a signal with {left} trial(s) not finished; {kept}: "
                f"run the same command again to continue (exit code {EXIT_CHECKPOINTED})")
            checkpoint_lock.release_everywhere(lock, comm)
            return EXIT_CHECKPOINTED
        code = 0
        if rank == 0:
            code = write_report(opts, space, info, trials, {**finished, **{r["key"]: r
                                                                        for r in records}},
                           statement, size, parallel, time.perf_counter() - started)
        checkpoint_lock.release_everywhere(lock, comm)
        return int(comm.bcast(code, root=0))
    finally:
        if lock is not None:
            lock.release()
