"""DP-SGD throughput of the built-in models on one device, beside their peers.

``mpidp bench dpsgd --device cuda`` (or ``--models``): for each model of
``--models`` (the seed's ``mlp``, ``embedding-mlp``, ``mnist-small``,
``resnet20``), on synthetic data of its kind held on the device, the same
pre-drawn Poisson batches go through

* ``mpidp-dp`` / ``mpidp-nondp``: the step ``mpidp train`` runs by default
  (``--cuda-graph auto``: the fixed-shape step as one CUDA graph where it
  can be captured, :mod:`engine.fixed_step`; the eager step where not, and
  the header says so), DP (clipping C = 1 and noise sigma = 1) or not;
* ``mpidp-dp-eager`` / ``mpidp-nondp-eager``: the eager step
  (``--cuda-graph off``; on a CPU these are the same as the two above);
* ``torch-sgd``: plain PyTorch, ``nn.Module`` + autograd + ``torch.optim.SGD``;
* ``opacus-ghost``, ``opacus-hooks``: Opacus' ghost clipping and its
  per-sample hooks (when installed).

Methods are interleaved over ``--repeats`` rounds of ``--steps`` steps, each
round timed to the device's last kernel (``torch.cuda.synchronize``), and
the median per method is reported; ratios (time per example, one over the
other) are medians of the per-round ratios, so a change of load hits both
alike. The header and ``--json`` name the device (GPU model), the CPU, the
CPU threads (torch's and Numba's, :func:`engine.run.threads.thread_facts`)
and the step each ``mpidp`` method ran. The MLP benchmark's ``--data``,
``--features``, ``--hidden``, ``--naive-steps`` and ``--block`` are refused
here (:func:`engine.bench.dpsgd.refuse_ignored`): nothing reads them.
"""
from __future__ import annotations

import statistics
import time

import numpy as np

from collectives import MPI, machine
from engine import outputs
from engine.bench import synthetic, synthetic_images

#: The models, with the expected batch of each and the rows of its data.
MODELS = {
    "mlp": {"batch": 256, "rows": 790_000},
    "embedding-mlp": {"batch": 256, "rows": 790_000},
    "mnist-small": {"batch": 256, "rows": 60_000, "image": (1, 28, 28)},
    "resnet20": {"batch": 32, "rows": 50_000, "image": (3, 32, 32)},
}
METHODS = ("mpidp-dp", "mpidp-nondp", "mpidp-dp-eager", "mpidp-nondp-eager", "torch-sgd",
           "opacus-ghost", "opacus-hooks")
#: (JSON key, slower method, faster method, label): time per example, slower / faster.
RATIOS = (
    ("dp_over_nondp", "mpidp-dp", "mpidp-nondp", "DP / non-DP"),
    ("dp_over_nondp_eager", "mpidp-dp-eager", "mpidp-nondp-eager", "DP / non-DP, eager"),
    ("eager_over_graph_dp", "mpidp-dp-eager", "mpidp-dp", "eager / graph, DP"),
    ("opacus_ghost_over_dp", "opacus-ghost", "mpidp-dp", "Opacus ghost / mpidp DP"),
    ("opacus_hooks_over_dp", "opacus-hooks", "mpidp-dp", "Opacus hooks / mpidp DP"),
    ("torch_sgd_over_nondp", "torch-sgd", "mpidp-nondp", "PyTorch SGD / mpidp non-DP"),
)
C, SIGMA, LR, MOMENTUM = 1.0, 1.0, 0.05, 0.9


def model_data(name: str, rows: int, seed: int):
    """(X with the ones column, y, classes, code columns, image shape) of ``name``'s
    synthetic data: the seed's tabular rows (their one-hot groups as integer
    codes for ``embedding-mlp``), or images normalised per channel."""
    spec = MODELS[name]
    if "image" in spec:
        shape = spec["image"]
        templates = synthetic_images.image_templates(shape, 10, seed)
        pixels, labels = synthetic_images.image_rows(np.random.default_rng([seed, 0]), rows,
                                                     templates)
        c = shape[0]
        planes = pixels.reshape(rows, c, -1).astype(np.float32) / 255.0
        mean = planes.mean(axis=(0, 2), keepdims=True)
        std = planes.std(axis=(0, 2), keepdims=True) + 1e-6
        X = np.ones((rows, pixels.shape[1] + 1), dtype=np.float32)
        X[:, :-1] = ((planes - mean) / std).reshape(rows, -1)
        return X, labels.astype(np.int64), 10, (), shape
    X, y = synthetic.rows_in_memory(rows, 100, seed)
    if name == "embedding-mlp":
        body, codes = synthetic.onehot_to_codes(X[:, :-1], synthetic.feature_names(100))
        X = np.column_stack([body, X[:, -1]]).astype(np.float32)
        return X, y, 2, tuple(codes), ()
    return X, y, 2, (), ()


def _ours(name: str, data, device, dp: bool, graph: bool, batch: int, n_local: int,
          seed: int):
    """One mpidp step function (rows -> k) and a line on the step it runs."""
    import torch

    from engine import models
    from engine.step_builder import StepSettings, build, engine_capacity, step_buffer

    X, y, classes, codes, shape = data
    model = models.resolve(name, (128, 128), X.shape[1] - 1, classes, seed, device,
                           code_columns=codes, image_shape=shape)
    buffer, grad, _ = step_buffer(model.n_params, device, host=device.type == "cpu")
    probe = (torch.from_numpy(X[:4]), torch.from_numpy(y[:4]))
    engine = model.build_engine(grad, seed, probe, classes, engine_capacity(batch), None)
    settings = StepSettings(batch_size=batch, max_norm=C if dp else None,
                            noise_std=SIGMA * C if dp else None, seed=seed, lr=LR,
                            momentum=MOMENTUM, cuda_graph="auto" if graph else "off")
    built = build(engine, X, y, buffer, grad, settings, MPI.COMM_SELF, n_local=n_local,
                  q=batch / n_local)
    chosen, line = built.step, built.note
    run = (lambda rows: chosen(rows)[0])
    run.replay = getattr(chosen, "_replay", None)  # the captured graph, for its own timing
    return run, line or "the eager step (CPU)"


def _peer(method: str, name: str, data, device, batch: int, seed: int):
    """Plain PyTorch or Opacus on the same model (rows -> k)."""
    import torch

    from engine import models
    from engine.nn.mlp import init_params

    X, y, classes, codes, shape = data
    model = models.resolve(name, (128, 128), X.shape[1] - 1, classes, seed, device,
                           code_columns=codes, image_shape=shape)
    if isinstance(model, models.MLPModel):
        module = model.module(init_params(model.spec, seed)).to(device)
    else:
        module = model.module_obj
    Xf = torch.from_numpy(np.ascontiguousarray(X[:, :-1])).to(device)
    yd = torch.from_numpy(y).to(device)
    loss_fn = torch.nn.CrossEntropyLoss()
    if method == "torch-sgd":
        opt = torch.optim.SGD(module.parameters(), lr=LR, momentum=MOMENTUM)

        def sgd_step(rows):
            index = rows.to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            loss_fn(module(Xf[index]), yd[index]).backward()
            opt.step()
            return rows.shape[0]
        return sgd_step
    if method == "opacus-hooks":
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer

        gsm = GradSampleModule(module)
        opt = DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=LR, momentum=MOMENTUM),
                          noise_multiplier=SIGMA, max_grad_norm=C, expected_batch_size=batch)

        def hooks_step(rows):
            index = rows.to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            loss_fn(gsm(Xf[index]), yd[index]).backward()
            opt.step()
            return rows.shape[0]
        return hooks_step
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    gm = GradSampleModuleFastGradientClipping(module, max_grad_norm=C, use_ghost_clipping=True)
    go = DPOptimizerFastGradientClipping(
        torch.optim.SGD(gm.parameters(), lr=LR, momentum=MOMENTUM),
        noise_multiplier=SIGMA, max_grad_norm=C, expected_batch_size=batch)
    crit = DPLossFastGradientClipping(gm, go, loss_fn)

    def ghost_step(rows):
        index = rows.to(device, non_blocking=True)
        go.zero_grad(set_to_none=True)
        crit(gm(Xf[index]), yd[index]).backward()
        go.step()
        return rows.shape[0]
    return ghost_step


def _device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (torch {torch.__version__})"
    return "CPU"


def bench_model(args, name: str, device, methods: list[str], out: dict) -> None:
    """Every method on ``name``'s batches: prints its table, fills ``out[name]``."""
    import torch

    spec = MODELS[name]
    batch = spec["batch"] if args.batch_size is None else args.batch_size
    rows = spec["rows"] if args.rows is None else args.rows
    data = model_data(name, rows, args.seed)
    n = data[1].shape[0]
    steps, notes = {}, {}
    for method in methods:
        try:
            if method.startswith("mpidp-"):
                steps[method], notes[method] = _ours(
                    name, data, device, dp="-dp" in method, graph=not method.endswith("eager"),
                    batch=batch, n_local=n, seed=args.seed)
            else:
                steps[method] = _peer(method, name, data, device, batch, args.seed)
        except ImportError as exc:  # Opacus not installed
            notes[method] = f"not run ({exc})"
    rng = np.random.default_rng(args.seed)
    q = batch / n

    def batches(count):
        drawn = []
        for _ in range(count):
            picked = np.flatnonzero(rng.random(n) < q)
            drawn.append(torch.from_numpy(picked.astype(np.int64)))
        return drawn

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for fn in steps.values():  # warm-up: compile, capture, allocate
        for rows in batches(3):
            fn(rows)
    sync()
    rates: dict[str, list[float]] = {m: [] for m in steps}
    for _ in range(args.repeats):
        todo = batches(args.steps)
        for method, fn in steps.items():
            sync()
            start, examples = time.perf_counter(), 0
            for rows in todo:
                examples += fn(rows)
            sync()
            rates[method].append(examples / (time.perf_counter() - start))
    median = {m: statistics.median(v) for m, v in rates.items()}
    replay_us = {}
    for method, fn in steps.items():  # the device's own time for the step's graph
        replay = getattr(fn, "replay", None)
        if replay is not None and device.type == "cuda":
            sync()
            start = time.perf_counter()
            for _ in range(args.steps):
                replay()
            sync()
            replay_us[method] = 1e6 * (time.perf_counter() - start) / args.steps
    print(f"\n{name}: {n:,} rows, expected batch {batch}")
    for method, note in notes.items():
        if method.startswith("mpidp-") or method not in steps:
            alone = (f"; the graph replayed alone: {replay_us[method]:.1f} us a step"
                     if method in replay_us else "")
            print(f"  {method}: {note}{alone}")
    ref = median.get("mpidp-dp")
    print(f"  {'method':<20} {'examples/s':>12} {'s/epoch':>9} {'over mpidp-dp':>14}")
    for method, rate in median.items():
        ratio = f"{ref / rate:.2f}x" if ref else "-"
        print(f"  {method:<20} {rate:>12,.0f} {n / rate:>9.3f} {ratio:>14}")
    result = {"rows": n, "batch_size": batch, "examples_per_s": median, "all_rounds": rates,
              "steps_run": {m: notes.get(m) for m in steps if m.startswith("mpidp-")},
              "graph_replay_us": replay_us,
              "not_run": {m: notes[m] for m in methods if m not in steps}}
    for key, slower, faster, label in RATIOS:
        if slower in rates and faster in rates:
            values = [f / s for s, f in zip(rates[slower], rates[faster])]
            result[key] = statistics.median(values)
            result[key + "_spread"] = [min(values), max(values)]
            print(f"  {label} (time per example): {result[key]:.3f} "
                  f"[{min(values):.3f}, {max(values):.3f} over the rounds]")
    out[name] = result


def run(args) -> int:
    """Rank 0 alone: each model of ``args.models`` in turn (see module docstring)."""
    import torch

    from engine.nn.device import select as select_device
    from engine.run.threads import configure_threads, thread_facts, thread_label

    configured = configure_threads(args.threads)
    threads = thread_facts(configured.threads, configured.note)
    placement = select_device(args.device, MPI.COMM_SELF)
    device = placement.device
    names = args.models.split(",")
    methods = [m for m in (args.methods or ",".join(METHODS)).split(",") if m]
    where = machine.describe()
    gpu = _device_name(device)
    print(f"mpidp bench dpsgd: {', '.join(names)} on {gpu}, {thread_label(threads)} on the "
          f"CPU, {args.steps} steps x {args.repeats} rounds")
    if threads["threads_note"]:
        print(threads["threads_note"])
    print(f"machine: {machine.one_line(where)}")
    warnings_off()
    out: dict = {}
    for name in names:
        bench_model(args, name, device, methods, out)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        outputs.write_json(args.json, {"device": gpu, "machine": where, **threads,
                                       "steps": args.steps, "repeats": args.repeats,
                                       "models": out,
                                       "provenance": machine.provenance(where)}, "--json")
    return 0


def warnings_off() -> None:
    """Opacus' and torch's warnings about hooks would drown the table."""
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning, message=".*backward hook.*")
    warnings.filterwarnings("ignore", module="opacus")
    from engine.dp.rules import SlowPathWarning

    warnings.filterwarnings("ignore", category=SlowPathWarning)
