"""The state a run trains: the sampler, the model's engine and the step, built
fresh or restored from a checkpoint, the same way on every rank."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine import checkpoint as ckpt
from engine.config import TrainConfig
from engine.dp.module_engine import buffer_digests, parameter_digest
from engine.dp.sampler import HouseholdSampler, PoissonSampler, ShuffleSampler
from engine.errors import CheckpointError, ConfigError, MpidpError, agree
from engine.step_builder import StepSettings, build, engine_capacity, step_buffer


@dataclass
class RunState:
    """What the loop reads and a checkpoint saves (see :func:`build_state`)."""

    buffer: object
    grad: torch.Tensor
    #: the buffer's last float: stop requests, all-reduced with the gradient
    control: object
    sampler: object
    engine: object
    params: torch.Tensor
    noise: object
    optimizer: object
    X: torch.Tensor
    y: torch.Tensor
    #: the step the loop calls, and the line that says which step it is
    dp_step: object
    step_note: str | None
    #: the steps taken and this epoch's sums (restored on resume)
    step: int = 0
    local: dict = field(default_factory=lambda: {"loss_sum": 0.0, "examples": 0,
                                                   "clipped": 0})


def make_sampler(cfg: TrainConfig, train, q: float, seed: int, rank: int, size: int,
                 steps_per_epoch: int):
    """The rank's sampler: households, Poisson rows, or shuffled batches."""
    if train.groups is not None:
        return HouseholdSampler(train.groups, q, seed, rank)
    if cfg.sampling == "poisson":
        return PoissonSampler(train.n_local, q, seed, rank)
    b = cfg.batch_size
    local_batch = b * (rank + 1) // size - b * rank // size
    return ShuffleSampler(train.n_local, local_batch, steps_per_epoch, seed, rank)


def check_ranks_agree(params: torch.Tensor, comm, frozen: str = "",
                      module: torch.nn.Module | None = None) -> None:
    """Collective: every rank must start from the same parameters (a user's
    factory that draws without the run's seed would train a different model
    per rank, and the all-reduced sum would fit none of them), and hold the
    same frozen ones (``frozen``: their digest, :attr:`TorchModel.frozen_sha256`)
    and the same buffers (``module``'s: a constant the forward pass reads, set
    by rank, trains a different function on each rank).

    Raises:
        ConfigError: (collective) naming the first rank that differs (and the
            first buffer, where a buffer differs).
    """
    buffers = buffer_digests(module) if module is not None else {}
    digests = comm.allgather((parameter_digest(params), frozen, buffers))
    odd = [r for r, d in enumerate(digests) if d != digests[0]]
    if not odd:
        return
    first, theirs = odd[0], digests[odd[0]][2]
    names = [n for n in {**digests[0][2], **theirs} if theirs.get(n) != digests[0][2].get(n)]
    if digests[first][:2] == digests[0][:2]:  # the parameters agree: a buffer differs
        what = f"buffers differ between ranks (rank {first}'s {names[0]!r} differs from rank 0's)"
    else:
        what = f"parameters differ between ranks (rank {first} differs from rank 0)"
    raise ConfigError(f"the model's initial {what}: build it the same way on every rank (a "
                      "factory is called after seeding torch with the run's seed; draw with "
                      "torch's default generator)", collective=True)


def model_identity(model) -> tuple[str, list[str], bool]:
    """What the ranks compare of a run's model (:func:`check_same_model`):
    its label (``mlp``, ``MODULE:FACTORY``, ``python:CLASS`` or
    ``python:FACTORY``: :func:`engine.models.label_of`), its structure (each
    module's name and class, in ``named_modules`` order; the MLP's widths)
    and whether the fused MLP kernels run it. Not its ``forward``'s code:
    that is the label's to name."""
    module = getattr(model, "module_obj", None)
    if module is None:  # the built-in MLP: its widths
        return model.name, [model.describe()], True
    structure = [f"{name!r} ({type(m).__qualname__})" if name else
                 f"the model itself ({type(m).__qualname__})"
                 for name, m in module.named_modules()]
    return model.name, structure, getattr(model, "mlp_spec", None) is not None


def check_same_model(model, comm) -> None:
    """Collective: every rank must train the same model, which the parameters'
    and buffers' digests (:func:`check_ranks_agree`) do not show where two
    classes hold the same layers with the same seeded values; and before the
    engine is built, since two ranks' engines of two models could call
    different collectives and wait for each other for ever.

    Raises:
        ConfigError: (collective) naming each differing rank's model and
            rank 0's (and, where their labels agree, the first module that
            differs).
    """
    every = comm.allgather(model_identity(model))
    odd = [r for r, identity in enumerate(every) if identity != every[0]]
    if not odd:
        return

    def said(rank: int) -> str:
        label, structure, fused = every[rank]
        theirs = every[odd[0]] if rank == 0 else every[0]
        if label != theirs[0]:
            return label
        if structure != theirs[1]:
            at = next((i for i, (a, b) in enumerate(zip(structure, theirs[1])) if a != b),
                      min(len(structure), len(theirs[1])))
            part = f"is {structure[at]}" if at < len(structure) else \
                f"is none (it has {len(structure)} modules)"
            return f"{label}, whose module #{at} {part}"
        return f"{label}, {'the fused MLP kernels' if fused else 'the generic path'}"

    shown = "; ".join(f"rank {r}: {said(r)}" for r in odd[:3])
    more = f" (and {len(odd) - 3} more ranks)" if len(odd) > 3 else ""
    raise ConfigError(f"the ranks build different models (rank 0: {said(0)}; {shown}{more}): "
                      "give every rank the same model (one class or factory, building the "
                      "same layers)", collective=True)


def _build_engine(model, grad, seed: int, probe, n_classes: int, capacity: int,
                  kernels: str | None, comm):
    """Collective: ``model.build_engine`` on every rank. Each rank probes the
    model with its own first rows, so a model may fail on some ranks only; a
    refusal on any rank is raised on every rank (:func:`engine.errors.agree`),
    printed once instead of once per rank."""
    engine, error = None, None
    try:
        engine = model.build_engine(grad, seed, probe, n_classes, capacity, kernels)
    except MpidpError as exc:
        error = exc
    agree(comm, error)
    return engine


def build_state(cfg: TrainConfig, *, model, train, n_classes: int, placement, seed: int,
                q: float, steps_per_epoch: int, sigma: float | None, kernels: str | None,
                comm, payload: dict | None) -> RunState:
    """Collective: the run's state, fresh or (with the checkpoint's ``payload``)
    as it was when the checkpoint was written.

    Raises (on every rank):
        ConfigError: the ranks build different models (:func:`check_same_model`);
            the model is refused on any rank (its forward pass fails on
            that rank's first rows, it changes its state, ...); the ranks'
            initial parameters or buffers differ; ``--cuda-graph on``
            where the graph cannot run.
        CheckpointError: the checkpoint's generator states do not fit.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    device = placement.device
    buffer, grad, control = step_buffer(model.n_params, device, placement.host_buffer)
    sampler = make_sampler(cfg, train, q, seed, rank, size, steps_per_epoch)
    expected = sampler.expected_local_batch()
    probe = (torch.from_numpy(train.X[:4]), torch.from_numpy(train.y[:4]))
    check_same_model(model, comm)
    engine = _build_engine(model, grad, seed, probe, n_classes, engine_capacity(expected),
                           kernels, comm)
    params = engine.params
    if payload is not None:
        with torch.no_grad():
            params.copy_(payload["params"].to(device))
    check_ranks_agree(params, comm, getattr(model, "frozen_sha256", ""),
                      getattr(model, "module_obj", None))
    settings = StepSettings(
        batch_size=cfg.batch_size, max_norm=cfg.max_grad_norm if cfg.dp else None,
        noise_std=sigma * cfg.max_grad_norm if cfg.dp else None, seed=seed,
        noise_scheme=cfg.noise_scheme, secure_noise=cfg.secure_noise,
        optimizer=cfg.optimizer, lr=cfg.lr, momentum=cfg.momentum,
        weight_decay=cfg.weight_decay, nesterov=cfg.nesterov, algorithm=cfg.allreduce,
        kernels=kernels, cuda_graph=cfg.cuda_graph)
    restored: dict = {}

    def resume(parts) -> None:  # before a graph is captured from them
        if payload is not None:
            restored.update(restore(parts.optimizer, parts.noise, sampler, payload, rank, cfg))

    built = build(engine, train.X, train.y, buffer, grad, settings, comm,
                  n_local=train.n_local, q=q,
                  fixed_batch=int(expected) if isinstance(sampler, ShuffleSampler) else None,
                  households=train.groups is not None, restore=resume)
    state = RunState(buffer=buffer, grad=grad, control=control, sampler=sampler,
                     engine=engine, params=params, noise=built.noise,
                     optimizer=built.optimizer, X=built.X, y=built.y, dp_step=built.step,
                     step_note=built.note)
    state.__dict__.update(restored)
    return state


def restore(optimizer, noise, sampler, payload: dict, rank: int, cfg: TrainConfig) -> dict:
    """The checkpoint's optimizer state and this rank's generator states, put
    back; returns its step count and epoch sums (``step``, ``local``).

    Raises:
        CheckpointError: (collective) generator states of another kind.
    """
    optimizer.load_state_dict(payload["optimizer"])
    mine = payload["ranks"][rank]
    try:
        sampler.set_state(mine["sampler"])
        if noise is not None:
            noise.set_state(mine["noise"])
    except (ValueError, TypeError, KeyError) as exc:
        before = payload["config"].get("kernels")
        if before != cfg.kernels:  # the noise generator is the kernels' own
            raise CheckpointError(
                f"--kernels {cfg.kernels or '(default)'}: the run drew its noise with "
                + (f"--kernels {before}" if before else "the default kernels (no --kernels)")
                + ", whose generator state this back-end "
                "cannot continue, and a resume continues the run's noise stream: "
                + (f"give --kernels {before}" if before else "leave --kernels out"),
                collective=True) \
                from None
        raise CheckpointError(f"{ckpt.path_in(cfg.checkpoint_dir)}: its random generator "
                              f"states do not fit this mpidp ({exc})", collective=True) from None
    return {"step": int(payload["step"]), "local": dict(mine["local"])}
