"""DP-SGD throughput, side by side in one process on the same data, model and batches.

Methods (each runs the same Poisson batches, same MLP, same optimizer):

* ``mpidp-dp``      our DP-SGD step: book-keeping clipping, noise, all-reduce, update;
* ``mpidp-nondp``   the same loop without clipping and noise (``--no-dp``);
* ``mpidp-generic`` our DP-SGD step with the MLP as a ``torch.nn.Module`` through
  the generic path (:mod:`engine.dp.module_engine`: per-layer rules, autograd),
  what any model of a user's runs; the fused kernels are ``mpidp-dp``;
* ``mpidp-household`` our DP-SGD step with ``--privacy-unit household``: whole
  households sampled (rate chosen for the same expected rows per step), one
  clip per household (the file's households with ``--data``, else synthetic
  PUMS-like ones);
* ``mpidp-secure``  ``mpidp-dp`` with ``--secure-noise`` (noise keyed from the OS,
  four draws per coordinate);
* ``torch-sgd``     plain PyTorch: nn.Module, autograd, torch.optim.SGD (non-private);
* ``naive``         the per-example loop (run on ``--naive-steps`` steps, extrapolated);
* ``opacus-hooks``  Opacus' default mode (per-sample gradients from hooks), when installed;
* ``opacus-ghost``  Opacus' ghost clipping (its fastest mode), when installed;
* ``embedding-dp``, ``embedding-nondp`` our DP-SGD step, and the same without
  clipping and noise, on ``--model embedding-mlp``
  (:class:`engine.nn.embedding_mlp.EmbeddingMLP`, through the per-layer rules)
  over the same rows with each one-hot group turned into its integer code;
* ``opacus-ghost-embedding`` Opacus' ghost clipping on that same EmbeddingMLP.

Prints examples/s, the time an epoch would take, and ratios; ``--json FILE``
writes examples/s per method, ``dp_over_nondp`` (DP time per example over
non-DP time per example, the median of its per-round values) and the
speed-ups. Each of ``--repeats`` rounds runs every method's ``--steps`` steps
in blocks of ``--block``, the methods taking turns block by block (each block
after :data:`SETTLE_STEPS` untimed steps), and the median over rounds is
reported, so a load change on the machine hits all of them alike.
Run it on one rank (``mpidp bench dpsgd``). The ``mpidp-*`` methods run
:class:`engine.step.DPStep`, the step ``mpidp train`` runs.

With ``--device cuda`` or ``--models`` it benchmarks the built-in models
instead (the MLP, embedding-mlp, mnist-small, resnet20), graph and eager
step beside plain PyTorch and Opacus: :mod:`engine.bench.dpsgd_models`.
Options the chosen benchmark would ignore are refused (:func:`refuse_ignored`):
``--data``, ``--features``, ``--hidden``, ``--naive-steps`` and ``--block``
with the built-in models, ``--rows`` and ``--features`` with ``--data``.
The header gives torch's and Numba's threads apart where Numba's pool
(``NUMBA_NUM_THREADS``) is smaller than ``--threads``, and a ``--threads``
above the cores prints the oversubscription note (``--json``: ``threads``,
``numba_threads``, ``numba_pool``, ``threads_note``).
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings
from dataclasses import asdict

import numpy as np

from collectives import MPI, machine
from engine.choices import seed_value, thread_count
from engine import outputs
from engine.bench import synthetic
from engine.bench.dpsgd_models import METHODS as MODEL_METHODS
from engine.bench.dpsgd_models import MODELS
from engine.errors import ConfigError, OutputError
from engine.shard import read_info, read_shard

METHODS = ("mpidp-dp", "mpidp-nondp", "mpidp-generic", "mpidp-household", "mpidp-secure",
           "torch-sgd", "naive",
           "opacus-hooks", "opacus-ghost", "embedding-dp", "embedding-nondp",
           "opacus-ghost-embedding")
#: Methods on the embedding-mlp model (the others train the MLP).
EMBEDDING_METHODS = ("embedding-dp", "embedding-nondp", "opacus-ghost-embedding")
#: Ratios of time per example printed and written: (JSON key, the slower
#: method, the faster one, the printed label).
RATIOS = (
    ("dp_over_nondp", "mpidp-dp", "mpidp-nondp", "DP / non-DP"),
    ("generic_over_fused", "mpidp-generic", "mpidp-dp", "generic / fused DP"),
    ("secure_over_dp", "mpidp-secure", "mpidp-dp", "secure-noise / plain DP"),
    ("household_over_person", "mpidp-household", "mpidp-dp", "household / person DP"),
    ("embedding_dp_over_nondp", "embedding-dp", "embedding-nondp",
     "embedding-dp / embedding-nondp"),
    ("embedding_over_opacus_ghost", "opacus-ghost-embedding", "embedding-dp",
     "opacus-ghost-embedding / embedding-dp"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", default=None,
                        help="prepared HDF5 file; default: synthetic rows in memory (not "
                        "with --rows, --features or --models)")
    parser.add_argument("--rows", type=int, default=None,
                        help="synthetic training rows (default: 790000, what prep makes of "
                        "the 1.2M-row file; with --models, each model's own)")
    parser.add_argument("--features", type=int, default=None,
                        help="synthetic features (default: 100; not with --data or --models)")
    parser.add_argument("--hidden", default=None,
                        help="hidden widths (default: 128,128; not with --models)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="expected batch size (default: 256; with --models, each "
                        "model's own: 32 for resnet20)")
    parser.add_argument("--steps", type=int, default=100,
                        help="steps per method and round (default: 100)")
    parser.add_argument("--repeats", type=int, default=9,
                        help="interleaved rounds (median) (default: 9)")
    parser.add_argument("--block", type=int, default=None,
                        help="timed steps a method runs before the next takes its turn "
                        "(default: 20; not with --models)")
    parser.add_argument("--naive-steps", type=int, default=None,
                        help="steps of the naive loop per round (default: 3; it is ~100x "
                        "slower; at least 1: leave naive out of --methods to skip it; not "
                        "with --models)")
    parser.add_argument("--methods", default=None,
                        help=f"comma-separated subset of {', '.join(METHODS)} (with --models: "
                        f"of {', '.join(MODEL_METHODS)}) (default: all)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu, or cuda: the built-in models on one GPU (default: cpu)")
    parser.add_argument("--models", default=None,
                        help=f"comma-separated subset of {', '.join(MODELS)}: benchmark "
                        "these models instead of the MLP's methods (default with --device "
                        "cuda: all of them)")
    parser.add_argument("--threads", type=thread_count, default=None,
                        help="torch/numba threads (default: as mpidp train: cores // ranks; "
                        "Numba's at most its pool, NUMBA_NUM_THREADS)")
    parser.add_argument("--seed", type=seed_value, default=0,
                        help="seed of the synthetic data, the model and the noise (default: 0)")
    parser.add_argument("--json", default=None, metavar="FILE", help="write results as JSON")


#: The MLP methods' defaults of the options :func:`refuse_ignored` checks
#: (None in the parser, so that a given value can be told from a default).
DEFAULTS = {"rows": 790_000, "features": 100, "hidden": "128,128", "batch_size": 256,
            "block": 20, "naive_steps": 3}
#: Options the built-in models' benchmark (--models, --device cuda) does not
#: read: each model has its own synthetic data, widths and features, no naive
#: loop, and its methods take turns round by round, not in blocks.
NOT_WITH_MODELS = ("--data", "--features", "--hidden", "--naive-steps", "--block")
#: Options a --data file decides: its rows and its features.
NOT_WITH_DATA = ("--rows", "--features")


def refuse_ignored(args: argparse.Namespace) -> None:
    """Refuse an option the chosen benchmark would ignore: one of
    :data:`NOT_WITH_MODELS` with ``--models`` (or ``--device cuda``, which
    benchmarks the models), one of :data:`NOT_WITH_DATA` with ``--data``,
    ``--naive-steps`` with a ``--methods`` list that leaves ``naive`` out.

    Raises:
        ConfigError: (collective) naming the options and what overrides them.
    """
    def given(options: tuple[str, ...]) -> list[str]:
        return [o for o in options if getattr(args, o[2:].replace("-", "_")) is not None]

    if (args.naive_steps is not None and args.models is None and args.device != "cuda"
            and args.methods is not None and "naive" not in args.methods.split(",")):
        raise ConfigError(f"--naive-steps {args.naive_steps} would be ignored: --methods "
                          f"{args.methods} leaves the naive loop out; add naive to --methods "
                          "or drop --naive-steps", collective=True)
    if args.models is not None or args.device == "cuda":
        ignored, why = given(NOT_WITH_MODELS), ("--models" if args.models is not None else
                                                "--device cuda (the built-in models)")
        reason = "each model has its own data, widths and features, no naive loop or blocks"
    elif args.data is not None:
        ignored, why = given(NOT_WITH_DATA), f"--data {args.data}"
        reason = "the file's rows and features are used"
    else:
        return
    if ignored:
        raise ConfigError(f"{', '.join(ignored)} would be ignored with {why}: {reason}; "
                          f"drop {'it' if len(ignored) == 1 else 'them'}", collective=True)


#: Untimed steps at the start of each block: the first steps after another
#: method ran pay for caches and buffers that method displaced, a cost a
#: training run (one method throughout) does not have.
SETTLE_STEPS = 2


def _interleaved_round(steps: dict, batches, args) -> dict[str, float]:
    """One round: examples/s of each method over its ``args.steps`` timed steps,
    run in blocks of ``args.block`` (each after :data:`SETTLE_STEPS` untimed
    ones), the methods taking turns block by block; the naive loop runs its
    few steps in one block at the end. A machine whose speed drifts over
    seconds then slows every method of a round alike."""
    done = {name: [0, 0.0] for name in steps}  # examples, seconds
    regular = [name for name in steps if name != "naive"]
    for first in range(0, args.steps, args.block):
        count = min(args.block, args.steps - first)
        for name in regular:
            for rows in batches(SETTLE_STEPS):
                steps[name](rows)
            _run_block(steps[name], batches(count), done[name])
    if "naive" in steps:
        _run_block(steps["naive"], batches(args.naive_steps), done["naive"])
    return {name: examples / seconds for name, (examples, seconds) in done.items()}


def _run_block(fn, todo: list, tally: list) -> None:
    """Time ``fn`` over the batches ``todo``; add (examples, seconds) to ``tally``."""
    examples, start = 0, time.perf_counter()
    for rows in todo:
        examples += fn(rows)
    tally[0] += examples
    tally[1] += time.perf_counter() - start


def _load(args) -> tuple[np.ndarray, np.ndarray, int, str, np.ndarray | None, list[str]]:
    """(X with the ones column, y, classes, description, household starts, feature
    names) of --data or of synthetic rows (starts: None for a file without
    household keys)."""
    if args.data:
        info = read_info(args.data)
        if info.code_columns:
            raise ConfigError(f"{args.data} holds integer category codes; mpidp bench dpsgd "
                              "takes a one-hot file (it derives the codes of the "
                              "embedding-mlp rows itself)", collective=True)
        if info.rows["train"] == 0:  # else: "0 rows, fewer than the 1 ranks of this job"
            raise ConfigError(f"{args.data} has no training rows (a file only for scoring, "
                              "made with mpidp prep --test-fraction 1?): benchmark on a file "
                              "with a training split", collective=True)
        shard = read_shard(info, "train", MPI.COMM_SELF, min_rows_per_rank=1,
                           unit="household" if info.households else "person")
        return (shard.X, shard.y, info.n_classes, args.data, shard.groups,
                info.feature_names)
    X, y = synthetic.rows_in_memory(args.rows, args.features, args.seed)
    keys = synthetic.household_keys(np.random.default_rng(args.seed), args.rows)
    starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
    groups = np.append(starts, args.rows).astype(np.int64)
    return (X, y, 2, f"synthetic {args.rows}x{args.features}", groups,
            synthetic.feature_names(args.features))


def _steppers(args, spec, X, y, groups=None, names=()):
    """name -> (one-step function taking a row tensor and returning its batch size)."""
    # deferred: torch, kept out of `mpidp bench --help`
    import torch

    from engine.dp.naive import naive_clipped_sum
    from engine.dp.sampler import HouseholdSampler
    from engine.dp.fast_mlp import FastMLP
    from engine.nn.embedding_mlp import EmbeddingMLP
    from engine.nn.mlp import init_params, to_module
    from engine.dp.module_engine import ModuleEngine
    from engine.step import PHASES
    from engine.step_builder import StepSettings, build, engine_capacity, step_buffer

    C, sigma, lr, momentum, B = 1.0, 1.0, 0.05, 0.9, args.batch_size
    Xt, yt = torch.from_numpy(X), torch.from_numpy(y)
    Xf = torch.from_numpy(X[:, :-1].copy())
    wanted = set(args.methods.split(","))
    steps = {}

    if wanted & set(EMBEDDING_METHODS):
        body, code_columns = synthetic.onehot_to_codes(X[:, :-1], list(names))
        Xc = np.column_stack([body, X[:, -1]])  # the ones column of a shard's rows
        if not code_columns:
            raise ConfigError("the embedding methods need one-hot groups (columns named "
                              "NAME=VALUE, one 1 per row); the data has none", collective=True)
        Xct = torch.from_numpy(Xc)
        Xcf = torch.from_numpy(Xc[:, :-1].copy())

    def embedding_mlp():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(args.seed)
            return EmbeddingMLP(Xc.shape[1] - 1, spec.dims[-1], code_columns,
                                spec.dims[1:-1])

    def ours(dp: bool, households: np.ndarray | None = None, generic: bool = False,
             embedding: bool = False, secure: bool = False):
        # The trainer's step, built as the trainer builds it (engine.step_builder),
        # on the trainer's buffer layout: gradient + one control float.
        rows_x = Xct if embedding else Xt
        module = embedding_mlp() if embedding else None
        n_params = sum(p.numel() for p in module.parameters()) if embedding else spec.n_params
        buffer, grad, _ = step_buffer(n_params, torch.device("cpu"), host=True)
        params = init_params(spec, args.seed)
        if generic or embedding:
            module = module if embedding else to_module(spec, params)
            engine = ModuleEngine(module, grad, (rows_x[:4], yt[:4]), spec.dims[-1],
                                  capacity=engine_capacity(B))
        else:
            engine = FastMLP(spec, params, grad, capacity=engine_capacity(B))
        settings = StepSettings(batch_size=B, max_norm=C if dp else None,
                                noise_std=sigma * C if dp else None, seed=args.seed,
                                secure_noise=secure, lr=lr, momentum=momentum)
        dp_step = build(engine, rows_x, yt, buffer, grad, settings, MPI.COMM_SELF).step
        times = dict.fromkeys(PHASES, 0.0)  # timed as in the trainer, read by nobody
        if households is not None:
            # Households at the rate giving the same expected rows per step; the
            # rows handed in are the person-level batch, not used here.
            sampler = HouseholdSampler(households, min(1.0, B / len(yt)), args.seed, 0)
            count = iter(range(1 << 62))

            def household_step(rows):
                mine = torch.from_numpy(sampler.sample(next(count)))
                return dp_step(mine, times, None, torch.from_numpy(sampler.groups))[0]
            return household_step

        def step(rows):
            return dp_step(rows, times)[0]
        return step

    if "mpidp-dp" in wanted:
        steps["mpidp-dp"] = ours(True)
    if "mpidp-nondp" in wanted:
        steps["mpidp-nondp"] = ours(False)
    if "mpidp-generic" in wanted:
        steps["mpidp-generic"] = ours(True, generic=True)
    if "mpidp-household" in wanted and groups is not None:
        steps["mpidp-household"] = ours(True, groups)
    if "mpidp-secure" in wanted:
        steps["mpidp-secure"] = ours(True, secure=True)
    if "embedding-dp" in wanted:
        steps["embedding-dp"] = ours(True, embedding=True)
    if "embedding-nondp" in wanted:
        steps["embedding-nondp"] = ours(False, embedding=True)
    if "torch-sgd" in wanted:
        model = to_module(spec, init_params(spec, args.seed))
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)

        def torch_step(rows):
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(Xf[rows]), yt[rows]).backward()
            opt.step()
            return rows.shape[0]
        steps["torch-sgd"] = torch_step
    if "naive" in wanted:
        model = to_module(spec, init_params(spec, args.seed))
        flat = [p for p in model.parameters()]
        gen = torch.Generator().manual_seed(args.seed)

        def naive_step(rows):
            total, _, _ = naive_clipped_sum(model, Xf[rows], yt[rows], C)
            total += torch.randn(total.shape, generator=gen) * sigma * C
            offset = 0
            with torch.no_grad():
                for p in flat:
                    p -= lr / B * total[offset:offset + p.numel()].view_as(p)
                    offset += p.numel()
            return rows.shape[0]
        steps["naive"] = naive_step
    opacus_methods = {"opacus-hooks", "opacus-ghost", "opacus-ghost-embedding"}
    have_opacus = not wanted & opacus_methods  # "missing" only if asked
    if not have_opacus:
        try:
            import opacus  # noqa: F401  (optional, and slow to import: only when asked for)
            have_opacus = True
        except ImportError:
            pass
    if have_opacus and "opacus-hooks" in wanted:
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer

        gsm = GradSampleModule(to_module(spec, init_params(spec, args.seed)))
        dpo = DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=lr, momentum=momentum),
                          noise_multiplier=sigma, max_grad_norm=C, expected_batch_size=B)

        def hooks_step(rows):
            dpo.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(gsm(Xf[rows]), yt[rows]).backward()
            dpo.step()
            return rows.shape[0]
        steps["opacus-hooks"] = hooks_step
    def opacus_ghost(module, inputs):
        from opacus.grad_sample import GradSampleModuleFastGradientClipping
        from opacus.optimizers import DPOptimizerFastGradientClipping
        from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

        gm = GradSampleModuleFastGradientClipping(module, max_grad_norm=C,
                                                  use_ghost_clipping=True)
        go = DPOptimizerFastGradientClipping(
            torch.optim.SGD(gm.parameters(), lr=lr, momentum=momentum),
            noise_multiplier=sigma, max_grad_norm=C, expected_batch_size=B)
        crit = DPLossFastGradientClipping(gm, go, torch.nn.CrossEntropyLoss())

        def ghost_step(rows):
            go.zero_grad(set_to_none=True)
            crit(gm(inputs[rows]), yt[rows]).backward()
            go.step()
            return rows.shape[0]
        return ghost_step

    if have_opacus and "opacus-ghost" in wanted:
        steps["opacus-ghost"] = opacus_ghost(to_module(spec, init_params(spec, args.seed)), Xf)
    if have_opacus and "opacus-ghost-embedding" in wanted:
        steps["opacus-ghost-embedding"] = opacus_ghost(embedding_mlp(), Xcf)
    return steps, have_opacus


def run(args: argparse.Namespace) -> int:
    """Rank 0 alone: every method on the same batches; prints the table (and --json)."""
    # deferred: torch and Numba, kept out of `mpidp bench --help`
    import torch

    from engine.choices import parse_hidden
    from engine.nn.mlp import MLPSpec
    from engine.run.threads import configure_threads, thread_facts, thread_label

    if MPI.COMM_WORLD.Get_size() > 1:
        raise ConfigError("mpidp bench dpsgd compares methods in one process: run it "
                          "without mpiexec (or with -n 1)", collective=True)
    refuse_ignored(args)
    if args.device == "cuda" and args.models is None:
        args.models = ",".join(MODELS)
    for option, value, least in (("--rows", args.rows, 1), ("--features", args.features, 1),
                                 ("--batch-size", args.batch_size, 1), ("--steps", args.steps, 1),
                                 ("--repeats", args.repeats, 1), ("--block", args.block, 1),
                                 ("--naive-steps", args.naive_steps, 1)):
        if value is not None and value < least:
            raise ConfigError(f"{option} {value} must be at least {least}", collective=True)
    choices = METHODS if args.models is None else MODEL_METHODS
    unknown = set((args.methods or ",".join(choices)).split(",")) - set(choices)
    if unknown:
        raise ConfigError(f"unknown --methods {', '.join(sorted(unknown))}; choose from "
                          f"{', '.join(choices)}", collective=True)
    bad = set((args.models or "").split(",")) - set(MODELS) - {""}
    if bad:
        raise ConfigError(f"unknown --models {', '.join(sorted(bad))}; choose from "
                          f"{', '.join(MODELS)}", collective=True)
    try:
        outputs.check_all({"--json": args.json})  # before any work (engine.outputs)
        outputs.check_apart({"--json": args.json}, {"--data": args.data})
    except OutputError as exc:
        exc.collective = True  # one rank: the command refuses to run on more
        raise
    if args.models is not None:
        from engine.bench import dpsgd_models  # deferred: torch

        return dpsgd_models.run(args)
    for name, default in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    args.methods = args.methods or ",".join(METHODS)
    configured = configure_threads(args.threads)
    threads = thread_facts(configured.threads, configured.note)
    warnings.filterwarnings("ignore", category=UserWarning, message=".*backward hook.*")
    warnings.filterwarnings("ignore", module="opacus")
    X, y, n_classes, source, groups, names = _load(args)
    n = y.shape[0]
    if args.batch_size > n:
        raise ConfigError(f"--batch-size {args.batch_size} is more than the {n:,} training rows",
                          collective=True)
    spec = MLPSpec.build(X.shape[1] - 1, parse_hidden(args.hidden), n_classes)
    steps, have_opacus = _steppers(args, spec, X, y, groups, names)
    q = args.batch_size / n
    rng = np.random.default_rng(args.seed)

    def batches(count):
        out = []
        for _ in range(count):
            rows = rng.choice(n, size=int(rng.binomial(n, q)), replace=False)
            rows.sort()
            out.append(torch.from_numpy(rows))
        return out

    print(f"mpidp bench dpsgd: {spec.describe()}, {source}, expected batch "
          f"{args.batch_size}, {thread_label(threads)}, {args.steps} steps x {args.repeats} "
          f"rounds (naive: {args.naive_steps} steps)" + ("" if have_opacus else
                                                           "; Opacus not installed"))
    if threads["threads_note"]:
        print(threads["threads_note"])
    where = machine.describe()
    from kernels.numba_target import CHOICE  # deferred: Numba
    from kernels.probe import mlp_step_mode

    step_mode = mlp_step_mode()
    print(f"machine: {machine.one_line(where)}; {CHOICE.describe()}; {step_mode}")
    # Warm-up, one untimed round: compiles the kernels, faults pages in and binds
    # the engines to the batch sizes a round meets (the household step meets
    # more of them), so the first timed round is not an outlier.
    for name, fn in steps.items():
        for rows in batches(args.naive_steps if name == "naive" else args.steps):
            fn(rows)
    rates: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, value in _interleaved_round(steps, batches, args).items():
            rates[name].append(value)
    median = {name: statistics.median(values) for name, values in rates.items()}
    ref = median.get("mpidp-dp")
    print(f"{'method':<24} {'examples/s':>12} {'s/epoch':>9} {'mpidp-dp is':>12}")
    for name, rate in median.items():
        ratio = f"{ref / rate:.2f}x" if ref else "-"
        print(f"{name:<24} {rate:>12,.0f} {n / rate:>9.2f} {ratio:>12}")
    result = {"examples_per_s": median, "all_rounds": rates, "rows": n,
              "batch_size": args.batch_size, "model": spec.describe(), **threads,
              "data": source, "steps": args.steps, "repeats": args.repeats, "block": args.block,
              "machine": where,
              "numba_target": asdict(CHOICE), "mlp_step": step_mode,
              "provenance": machine.provenance(where)}
    # Median of the per-round ratios: both methods of a round ran seconds apart,
    # so a load change on a shared machine cancels out.
    width = "default" if CHOICE.width is None else f"{CHOICE.width}-bit"
    limit = f" limited to {machine.isa_limit()}" if "isa_limit" in where else ""
    cpu = f"{where.get('cpu', 'this CPU')}{limit}, {CHOICE.cpu}, {width} vectors"
    for key, slower, faster, label in RATIOS:
        if slower in median and faster in median:
            per_round = [f / sl for sl, f in zip(rates[slower], rates[faster])]
            result[key] = statistics.median(per_round)
            result[key + "_spread"] = [min(per_round), max(per_round)]
            print(f"{label} time per example: {result[key]:.3f} [{min(per_round):.3f}, "
                  f"{max(per_round):.3f} over {len(per_round)} rounds; {cpu}]")
    result["speedup"] = {name: ref / rate for name, rate in median.items()} if ref else {}
    if args.json:
        outputs.write_json(args.json, result, "--json")
    return 0
