"""Any torch model behind the interface of :class:`~engine.dp.fast_mlp.FastMLP`.

:class:`engine.step.DPStep` drives an *engine*: ``load(X, y, rows) -> k``,
``clipped_sum(k, max_norm, groups=None) -> (loss_sum, n_clipped)`` writing
into the flat ``grad``, ``logits(X)`` for evaluation, and ``params``, the
flat parameter vector the optimizer updates in place. The MLPs that
``mpidp train`` builds use the fused kernels of FastMLP; every other model
(a user's ``nn.Module``, a factory named by ``--model MODULE:FACTORY``) runs
through :class:`ModuleEngine`, which wraps the per-layer clippers of
:mod:`engine.dp.clipping`: the book-keeping rules of
:mod:`engine.dp.rules` where every parameterised layer is a leaf
used once per forward and its parameters are used in its own call only
(the rules' gradients of the probe rows equal autograd's), ``torch.func``
over the whole model otherwise.

The model's parameters become views into one flat vector (``params``), so
the optimizer, the checkpoint and the all-reduce see one buffer while the
module is trained in place. Rows of ``X`` carry the trailing ones column of
:mod:`engine.shard` (the fused MLP's bias trick); the module sees ``X``
without it.
"""
from __future__ import annotations

import hashlib
import warnings

import torch
from torch import nn

from engine.dp.clipping import FuncClipper, LayerClipper
from engine.dp.flat_model import layer_label, leaf_layers, mixed_module, shared_parameter
from engine.dp.rules import SlowPathWarning, refusal
from engine.errors import ConfigError
from engine.nn.batch_gather import BatchGather


def check_model(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse, with a message a user can act on, a model DP-SGD cannot train here.

    Raises:
        ConfigError: not an ``nn.Module``, no trainable parameters, a layer
            that breaks per-example privacy (:func:`engine.dp.rules.refusal`:
            BatchNorm, an Embedding with ``max_norm`` or ``scale_grad_by_freq``,
            ...), parameters or buffers on another device
            or of another dtype than the run's, frozen parameters (not yet
            turned into buffers: :func:`frozen_to_buffers`).
    """
    if not isinstance(model, nn.Module):
        raise ConfigError(f"the model must be a torch.nn.Module, got {type(model).__name__}")
    params = list(model.named_parameters())
    if not params:
        raise ConfigError(f"the model {type(model).__name__} has no parameters to train")
    for name, module in model.named_modules():
        reason = refusal(module)
        if reason is not None:
            raise ConfigError(f"{layer_label(name, module)} {reason}")
    for name, p in params:
        if p.device != device:
            raise ConfigError(f"parameter {name!r} is on {p.device}, the run on {device}: "
                              "build the model on the run's device (or pass --device)")
        if p.dtype != dtype:
            raise ConfigError(f"parameter {name!r} is {p.dtype}, the run trains {dtype}: "
                              "convert the model (model.float())")
        if not p.requires_grad:
            raise ConfigError(f"parameter {name!r} is frozen (requires_grad=False): DP-SGD "
                              "here trains every parameter; remove it from the model")


class UntrainedParameterWarning(UserWarning):
    """Parameters that get no gradient: DP-SGD adds noise to them at every
    step, so they drift at random instead of staying put."""


def warn_unreached(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[str]:
    """Warn (:class:`UntrainedParameterWarning`) about the parameters the loss
    on the rows ``x``, ``y`` does not reach (unused, or behind
    ``torch.no_grad()`` or ``detach()`` in the forward pass), and return
    their names. One forward and backward pass, with torch's generators
    left as they were."""
    named = list(model.named_parameters())
    devices = [x.device] if x.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.enable_grad():
        loss = nn.functional.cross_entropy(model(x.clone()), y.long(), reduction="sum")
        grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True) \
            if loss.requires_grad else [None] * len(named)
    unreached = [name for (name, _), g in zip(named, grads) if g is None]
    if unreached:
        shown = ", ".join(repr(n) for n in unreached[:3]) + (", ..." if len(unreached) > 3
                                                             else "")
        warnings.warn(f"parameters {shown} of the model get no gradient on the first rows "
                      "(unused, or behind torch.no_grad() or detach() in forward): DP-SGD "
                      "adds noise to them at every step, so they drift; freeze them "
                      "(requires_grad_(False)) to keep them as built, or remove them",
                      UntrainedParameterWarning, stacklevel=3)
    return unreached


def frozen_to_buffers(model: nn.Module) -> list[str]:
    """Turn every frozen parameter (``requires_grad=False``) of ``model`` into
    a buffer of the same name and value, in place; their names (in
    ``named_parameters`` order). Idempotent.

    DP-SGD trains the parameters; a frozen one (a pretrained feature
    extractor) is a constant of the model like a buffer: no gradient, no
    clipping, no noise, and it stays as the model was built (it is no data
    of the run's, so nothing to protect). ``state_dict()`` keeps its key.
    A layer with frozen and trainable parameters of its own (a Linear whose
    weight alone is frozen) is named in ``model._mpidp_partly_frozen``: the
    per-layer rules compute a layer's parameters together, so such a model
    is clipped through ``torch.func`` (:func:`_whole_model_reason`).
    """
    names, partly = [], []
    for prefix, module in model.named_modules():
        own = list(module.named_parameters(recurse=False))
        frozen = [(name, p) for name, p in own if not p.requires_grad]
        for name, p in frozen:
            delattr(module, name)
            module.register_buffer(name, p.detach())
            names.append(f"{prefix}.{name}" if prefix else name)
        if frozen and len(frozen) < len(own):
            partly.append(layer_label(prefix, module))
    if partly:
        model._mpidp_partly_frozen = partly
    return names


def parameter_digest(params: torch.Tensor) -> str:
    """SHA-256 of a flat parameter vector's bytes (to check ranks agree)."""
    return hashlib.sha256(params.detach().cpu().numpy().tobytes()).hexdigest()


def buffer_digests(module: nn.Module, skip: tuple[str, ...] = ()) -> dict[str, str]:
    """SHA-256 of each of ``module``'s buffers but those named in ``skip``
    (name -> digest of its dtype, shape and bytes, in ``named_buffers``
    order), frozen parameters included once :func:`frozen_to_buffers` made
    them buffers. What the ranks compare, and what a checkpoint records so
    that a rebuilt model is refused when its buffers differ."""
    digests = {}
    for name, tensor in module.named_buffers():
        if name in skip:
            continue
        data = tensor.detach().cpu().contiguous().reshape(-1)
        digest = hashlib.sha256(repr((str(data.dtype), tuple(tensor.shape))).encode())
        digest.update(data.view(torch.uint8).numpy().tobytes())
        digests[name] = digest.hexdigest()
    return digests


def _whole_model_reason(model: nn.Module, x: torch.Tensor) -> str | None:
    """Why the per-layer rules cannot serve ``model`` (None when they can):
    parameters outside leaf layers, one parameter in two layers (tied
    weights: :func:`~engine.dp.flat_model.shared_parameter`), or a layer that
    does not run exactly once per forward pass, whose inputs are not batch
    first or whose output is not one tensor (an LSTM's tuple). Tried on the
    probe rows, and on one row fewer (so a length that equals the batch by
    chance is not taken for it)."""
    reason = mixed_module(model) or shared_parameter(model)
    if reason is not None:
        return reason
    partly = getattr(model, "_mpidp_partly_frozen", None)
    if partly:
        return f"{partly[0]} has frozen and trainable parameters"
    layers = leaf_layers(model)
    n = x.shape[0]
    for rows in [n, n - 1] if n > 1 else [n]:
        seen: dict[nn.Module, list] = {m: [] for _, m in layers}

        def record(module, inputs, output):
            seen[module].append((all(t.dim() > 0 and t.shape[0] == rows
                                     for t in inputs if torch.is_tensor(t)),
                                 type(output).__name__))

        hooks = [m.register_forward_hook(record) for _, m in layers]
        try:
            with torch.no_grad():
                model(x[:rows].clone())
        finally:
            for h in hooks:
                h.remove()
        for name, m in layers:
            if len(seen[m]) != 1:
                return (f"{layer_label(name, m)} runs {len(seen[m])} times in one forward "
                        "pass (shared or unused weights)")
            batch_first, output = seen[m][0]
            if not batch_first:
                return f"{layer_label(name, m)} takes inputs that are not batch first"
            if output != "Tensor":  # the rules need the gradient at one output tensor
                return f"{layer_label(name, m)} returns a {output}, not one tensor"
    return None


def _state(model: nn.Module) -> dict[str, bytes]:
    """The bytes of every parameter and buffer of ``model``, by name."""
    # contiguous: an expanded buffer (stride 0) cannot be viewed as bytes
    return {name: t.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes()
            for named in (model.named_parameters(), model.named_buffers())
            for name, t in named}


def _refuse_changed_state(model: nn.Module, before: dict[str, bytes]) -> None:
    """Refuse (ConfigError) a model whose probe passes changed one of its
    buffers or parameters (``before``: :func:`_state` before them): a running
    statistic of the rows it sees (a running mean, a count), or a weight
    moved by the data, leaves the run in the model with no clipping and no
    noise, outside the (epsilon, delta) the run reports. Checked after every
    probe, with gradients off (the output's check, the mixing probe, in
    eval mode too) and on (the forward and backward passes of the
    unreached-parameter and missed-use probes), so a model that changes its
    state only where ``torch.is_grad_enabled()`` is caught too."""
    after = _state(model)
    for name, value in after.items():
        if before.get(name) != value:
            kind = "parameter" if name in dict(model.named_parameters()) else "buffer"
            raise ConfigError(
                f"{kind} {name!r} of the model changes in its forward pass: what the "
                "training rows put there would leave the run without clipping or noise, "
                "outside the (epsilon, delta) it reports; compute it from public data "
                "before training, or (a buffer) make it a parameter, which DP-SGD trains")


def _rng_state(devices: list[torch.device]) -> list[torch.Tensor]:
    """torch's generator states: the CPU's, then each CUDA device's of ``devices``."""
    return [torch.get_rng_state(), *(torch.cuda.get_rng_state(d) for d in devices)]


def _set_rng_state(devices: list[torch.device], state: list[torch.Tensor]) -> None:
    """Set torch's generators to ``state`` (from :func:`_rng_state` on ``devices``)."""
    torch.set_rng_state(state[0])
    for d, s in zip(devices, state[1:]):
        torch.cuda.set_rng_state(s, d)


def _mismatch(a: torch.Tensor, b: torch.Tensor, at_least: float = 0.0,
              computed_in: torch.dtype | None = None) -> tuple[float, float] | None:
    """``(largest difference, tolerance)`` where the logits ``a`` and ``b`` of
    the same rows differ by more than float rounding (``(inf, 0)`` where
    their shapes differ), else None. The tolerance is ``sqrt(eps)`` of ``a``'s
    dtype times the largest finite magnitude of either, or ``at_least`` where
    that is larger (3.5e-4 of it in float32): the same arithmetic rounded in
    another order (a GEMM blocked for another row count) passes, a row that
    another row moves does not. NaN matches NaN, an infinity the same
    infinity. ``computed_in``: the dtype the values were computed in where
    coarser than their own (float64 logits of a float32 model carry float32
    rounding)."""
    if a.shape != b.shape:
        return float("inf"), 0.0
    eps = torch.finfo(a.dtype).eps if a.is_floating_point() else 0.0
    if computed_in is not None and computed_in.is_floating_point:
        eps = max(eps, torch.finfo(computed_in).eps)
    a, b = a.detach().double(), b.detach().double()
    if a.numel() == 0:
        return None
    scale = max([at_least] + [float(torch.nan_to_num(t, 0.0, 0.0, 0.0).abs().max())
                              for t in (a, b)])
    tol = eps ** 0.5 * scale
    apart = torch.where((a == b) | (a.isnan() & b.isnan()), 0.0,
                        torch.nan_to_num((a - b).abs(), nan=float("inf")))
    largest = float(apart.max())
    return None if largest <= tol else (largest, tol)


def _refuse_mixing(model: nn.Module, x: torch.Tensor) -> None:
    """Refuse (ConfigError) a model whose logits for one row depend on the
    other rows of the batch or on its size (``x - x.mean(0)`` in forward, a
    batch statistic in a layer of the user's, a scale by ``len(x)``).

    Per-example clipping bounds each example's gradient only where that
    example's loss depends on that example alone; otherwise one outlying row
    moves every other row's gradient, and the clipped sum by far more than
    the bound C the noise is calibrated to. Tried on the probe rows ``x``
    in the modes the step runs the model in (as given: training, unless the
    whole model is in eval mode) and in eval mode (evaluation):
    the shared rows' logits must match, within float rounding
    (:func:`_mismatch`), when the last row is replaced by another probe row
    and when it is left out. torch's generators are reset to one state
    before each call, so a random layer (Dropout) draws alike for the same
    batch shape; a model that draws differently on two calls of the same
    rows gets the second test (another shape, other draws) in eval mode
    only. Generators are left as they were; ``x`` is not changed.
    """
    n = x.shape[0]
    if n < 2:
        return
    devices = [x.device] if x.device.type == "cuda" else []
    distance = (x - x[-1:]).reshape(n, -1).abs().sum(1)
    changed = x.clone()
    changed[-1] = x[int(distance.argmax())]  # the probe row farthest from the last
    tests = [("another row of the batch changes", changed)] if float(distance.max()) > 0 \
        else []
    modes = {m: m.training for m in model.modules()}  # as the step runs it, restored
    # the rounding of the coarsest precision the model computes in (its inputs'
    # and parameters'), whatever dtype its logits are cast to
    coarsest = max([x.dtype] + [p.dtype for p in model.parameters() if p.is_floating_point()],
                   key=lambda d: torch.finfo(d).eps)
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            state = _rng_state(devices)

            def logits(rows: torch.Tensor, reset: bool = True) -> torch.Tensor:
                if reset:
                    _set_rng_state(devices, state)
                try:
                    out = model(rows.clone())
                except Exception as exc:  # the user's code: any failure is a bad model
                    raise ConfigError(f"the model's forward pass fails on {rows.shape[0]} "
                                      f"rows: {type(exc).__name__}: {exc}") from exc
                if not torch.is_tensor(out) or out.shape[:1] != rows.shape[:1]:
                    got = tuple(out.shape) if torch.is_tensor(out) else type(out).__name__
                    raise ConfigError(f"the model returns {got} for {rows.shape[0]} rows; it "
                                      "must return logits of shape [rows, classes]")
                return out

            for mode in ["training", "eval"] if any(modes.values()) else ["eval"]:
                if mode == "eval":
                    model.eval()
                full = logits(x)
                drawing = _mismatch(full, logits(x, reset=False), computed_in=coarsest) \
                    is not None
                more = [] if drawing else [("the batch has one row fewer", x[:-1])]
                for what, rows in tests + more:
                    found = _mismatch(full[:n - 1], logits(rows)[:n - 1], computed_in=coarsest)
                    if found is not None:
                        raise ConfigError(
                            f"the model mixes the examples of a batch: in {mode} mode one "
                            f"row's logits change when {what} (by {found[0]:.3g}; float "
                            f"rounding stays within {found[1]:.3g}), so per-example gradients "
                            "do not exist and clipping bounds nothing; compute each row's "
                            "output from that row alone (no statistics over the batch, such "
                            "as x.mean(0), in forward; GroupNorm or LayerNorm, not BatchNorm)")
    finally:
        for m, training in modes.items():
            m.training = training


#: Probe rows whose gradients :func:`_missed_use` compares one by one (and
#: their sum over all the probe rows): the run probes 4.
_ROWS_COMPARED = 8


def _first_difference(flat, ours: torch.Tensor, theirs: torch.Tensor,
                      scale: list[float]) -> tuple[str, int, float, float] | None:
    """``(parameter name, row, largest difference, tolerance)`` of the first
    parameter whose slice of a row of the flat ``[m, n]`` gradients ``ours``
    and ``theirs`` (``flat``'s layout) differs beyond :func:`_mismatch`'s
    tolerance with the row's ``scale``, or None."""
    for row, (a, b, at_least) in enumerate(zip(ours, theirs, scale)):
        mine, other = flat.views(a), flat.views(b)
        for name in flat.names:
            found = _mismatch(mine[name], other[name], at_least=at_least)
            if found is not None:
                return (name, row, *found)
    return None


def _missed_use(clipper: LayerClipper, x: torch.Tensor, y: torch.Tensor) -> str | None:
    """Why the per-layer rules cannot serve the model because they miss a
    use of a parameter (None when they agree with autograd): a use that is
    no call of the parameter's own layer (``F.linear(x, self.l.weight)`` in
    forward beside ``self.l(x)``, a layer's parameter read directly, a weight
    used by another module's forward), which the rules' hooks never see, so
    each example's norm and the clipped sum would be wrong with no error.

    Found on the probe rows ``x``, ``y``, unclipped: the rules'
    gradient of each of the first :data:`_ROWS_COMPARED` rows and of the sum
    over all rows against ``torch.autograd.grad`` over the whole model
    (:meth:`~engine.dp.clipping.LayerClipper.rule_sums`,
    :meth:`~engine.dp.clipping.LayerClipper.autograd_sums`), parameter by
    parameter, within float rounding of that row's whole gradient
    (:func:`_mismatch` with the row's largest magnitude; the sum's also
    covers the rows', which may cancel in it).
    torch's generators are set to one state before each pass, so Dropout
    draws alike in both; the first pass of the rules over a model that
    changes a layer's output in place runs the forward again (other draws),
    so a mismatch is tried once more. Generators are left as they were."""
    k = x.shape[0]
    if k == 0:
        return None
    m = min(k, _ROWS_COMPARED)
    weights = torch.cat([torch.eye(m, k), torch.ones(1, k)]).to(x.device)
    devices = [x.device] if x.device.type == "cuda" else []
    flat = clipper.flat
    with torch.random.fork_rng(devices=devices):
        state = _rng_state(devices)
        for _ in range(2):
            _set_rng_state(devices, state)
            rules = clipper.rule_sums(x.clone(), y, weights)
            _set_rng_state(devices, state)
            auto = clipper.autograd_sums(x.clone(), y, weights)
            # each row's scale: its whole gradient's largest magnitude (a parameter
            # whose own gradient vanishes, a bias under a norm layer, has only
            # rounding); the sum's: also its rows', which may cancel in it
            scale = torch.maximum(*(torch.nan_to_num(t, 0.0, 0.0, 0.0).abs().amax(1)
                                    for t in (rules, auto))).tolist()
            scale[m] = max(scale)
            found = _first_difference(flat, rules, auto, scale)
            if found is None:
                return None
    name, row, largest, tol = found
    where = f"on probe row {row}" if row < m else f"summed over the {k} probe rows"
    return (f"the per-layer rules miss a use of parameter {name!r}: its gradient {where} "
            f"differs from autograd's over the whole model by {largest:.3g} (float rounding "
            f"stays within {tol:.3g}); the rules see a parameter only in its own layer's "
            "call, not in a functional call on it (F.linear(x, self.l.weight)), a direct "
            "read in forward or another module's forward")


def _refuse_random_draws(model: nn.Module, clipper: FuncClipper, x: torch.Tensor,
                         y: torch.Tensor, why: str) -> None:
    """Refuse (ConfigError) a model that the whole-model ``torch.func`` path
    cannot clip, found by one clipped sum of the probe rows: a failure of
    ``torch.func`` on it (a GRU has no batching rule), or random draws in
    its forward pass (Dropout in training mode, ...), which ``vmap``
    refuses there. Letting it draw (``randomness="different"``) would take
    each example's draws from the rank's torch generator, which the run
    neither seeds per rank nor checkpoints: exact DP needs draws
    independent between ranks (ranks a user seeded alike would share their
    masks), and a resumed run would draw others. The per-layer path runs
    the model's own batched forward pass instead."""
    try:
        clipper.clipped_sum(x, y.long(), 1.0)
    except Exception as exc:  # the user's model under torch.func: any failure
        if not (isinstance(exc, RuntimeError) and "randomness" in str(exc)):
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            raise ConfigError(
                f"the model cannot be clipped per example: the per-layer rules cannot serve "
                f"it because {why}, and torch.func's per-example gradients fail on it "
                f"({type(exc).__name__}: {first}); change the model so that the per-layer "
                "rules serve it") from exc
        drawing = [layer_label(name, m) for name, m in model.named_modules()
                   if isinstance(m, _RANDOM_LAYERS) and m.training]
        raise ConfigError(
            f"{', '.join(drawing) or 'the model'} draws random numbers in training, which "
            f"the whole-model torch.func path cannot do per example, and that path is taken "
            f"because {why}: change that (the per-layer rules then serve the model, and "
            "Dropout trains) or remove the random layer") from None
    finally:
        clipper.grad.zero_()


#: Layers known to draw random numbers in training mode (named in the refusal).
_RANDOM_LAYERS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                  nn.FeatureAlphaDropout)


class ModuleEngine:
    """Per-example-clipped gradient sums of any ``nn.Module`` (module docstring).

    Args:
        model: the module, on the run's device, float32 (``check_model``).
        grad: flat buffer of the model's parameter count that receives the sums
            (the head of the all-reduce buffer).
        probe: a few rows of ``X`` (with the ones column) and their labels, to
            check the output shape and choose the clipper.
        n_classes: the task's class count; the model must return logits
            ``[k, n_classes]``.
        capacity: rows to preallocate (grown when a batch is larger).

    Raises:
        ConfigError: the model's output is not ``[k, n_classes]`` float32 or
            float64 logits, its forward pass fails on the probe rows (the
            message says which), one row's logits depend on the other rows
            or on the batch's size (:func:`_refuse_mixing`), a probe pass
            (gradients on or off) changes one of its buffers or parameters
            (:func:`_refuse_changed_state`), or it draws random numbers where
            only ``torch.func`` can clip it.
    """

    def __init__(self, model: nn.Module, grad: torch.Tensor, probe: tuple[torch.Tensor,
                 torch.Tensor], n_classes: int, capacity: int = 256) -> None:
        device, dtype = grad.device, grad.dtype
        frozen_to_buffers(model)
        check_model(model, device, dtype)
        n_params = sum(p.numel() for p in model.parameters())
        if grad.shape != (n_params,):
            raise ValueError(f"grad must be a flat vector of the model's {n_params} parameters")
        # each call gets its own copy of the probe rows (a model may change
        # its input in place: seen here, and its steps then get copies too)
        x = probe[0][:, :-1].to(device, copy=True)
        # every probe pass is followed by the state check, with gradients off
        # and on: a model may change its buffers only where they are enabled
        state = _state(model)
        changes_input = self.check_output(model, x.clone(), n_classes)
        _refuse_changed_state(model, state)
        _refuse_mixing(model, x)
        _refuse_changed_state(model, state)
        why = _whole_model_reason(model, x)
        _refuse_changed_state(model, state)
        y = probe[1][:x.shape[0]].to(device)
        warn_unreached(model, x, y)
        _refuse_changed_state(model, state)
        if why is None:
            clipper = LayerClipper(model, grad)
            clipper.copy_inputs = changes_input
            why = _missed_use(clipper, x, y.long())
            _refuse_changed_state(model, state)
        if why is not None:
            warnings.warn(f"clipping the whole model through torch.func (exact, slower) "
                          f"instead of per layer: {why}", SlowPathWarning, stacklevel=2)
            clipper = FuncClipper(model, grad)
            clipper.copy_inputs = changes_input
            _refuse_random_draws(model, clipper, x, y, why)
            _refuse_changed_state(model, state)
        self.model, self.clipper = model, clipper
        self.rule = "per-layer rules" if why is None else "torch.func"
        self.params, self.grad = clipper.params, grad
        self.device, self.dtype = device, dtype
        self._clipped_sum = clipper.clipped_sum
        self.gather = BatchGather(device)  # into the features only
        self.capacity = 0
        self._allocate(max(1, capacity), probe[0].shape[1])

    @staticmethod
    def check_output(model: nn.Module, x: torch.Tensor, n_classes: int) -> bool:
        """Raise ConfigError unless ``model(x)`` runs and returns ``[k, n_classes]``
        float32 or float64 logits (float16 or bfloat16 ones are refused, not
        cast: their rounding would be the model's, and the clippers' kernels
        take neither); whether it changed ``x`` in place."""
        version = x._version
        try:
            with torch.no_grad():
                out = model(x)
        except Exception as exc:  # the user's code: any failure is a bad model
            raise ConfigError(f"the model's forward pass fails on {x.shape[0]} rows of "
                              f"{x.shape[1]} features: {type(exc).__name__}: {exc}") from exc
        want = (x.shape[0], n_classes)
        if not torch.is_tensor(out) or tuple(out.shape) != want:
            got = tuple(out.shape) if torch.is_tensor(out) else type(out).__name__
            raise ConfigError(f"the model returns {got} for {x.shape[0]} rows; it must "
                              f"return logits of shape [rows, {n_classes}] (the task has "
                              f"{n_classes} classes)")
        if out.dtype not in (torch.float32, torch.float64):
            raise ConfigError(f"the model returns logits of dtype {out.dtype}; they must be "
                              "float32 or float64, the precision the loss and its per-example "
                              "gradients are computed in: drop the cast, or return out.float()")
        return x._version != version

    @property
    def backends(self) -> dict[str, str]:
        """Kernels by op, as FastMLP reports them: torch's, whatever the rule."""
        return {"clip_rows": "torch"}

    def _allocate(self, capacity: int, width: int) -> None:
        # the features only, contiguous: the model's input needs no copy
        self.x = torch.empty(capacity, width - 1, dtype=self.dtype, device=self.device)
        self.y = torch.empty(capacity, dtype=torch.int64, device=self.device)
        self.capacity = capacity
        self.gather.forget()

    def load(self, X: torch.Tensor, y: torch.Tensor, rows: torch.Tensor) -> int:
        """Gather ``X[rows]``, ``y[rows]`` (same contract as FastMLP.load)."""
        k = int(rows.shape[0])
        if rows.device != self.device:
            rows = rows.to(self.device, non_blocking=True)
        if k > self.capacity:
            self._allocate(k + k // 4, X.shape[1])
        self.gather(X, y, rows, self._inputs)
        return k

    def _inputs(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's input rows (the features only) and the labels, k rows."""
        return self.x[:k], self.y[:k]

    def clipped_sum(self, k: int, max_norm: float | None,
                    groups: torch.Tensor | None = None) -> tuple[float, int]:
        """Write ``sum_i c_i grad_i`` of the ``k`` loaded rows into ``grad``
        (same contract as FastMLP.clipped_sum, groups included)."""
        x = self.x[:k]
        if max_norm is None:  # non-private: nothing is clipped, groups or not
            return self.clipper.summed(x, self.y[:k])
        if groups is None:
            return self._clipped_sum(x, self.y[:k], max_norm)
        return self._clipped_sum(x, self.y[:k], max_norm, groups)

    def masked_sum(self, X: torch.Tensor, y: torch.Tensor, rows: torch.Tensor,
                   mask: torch.Tensor, max_norm: float | None, loss: torch.Tensor,
                   count: torch.Tensor) -> None:
        """:meth:`load` + :meth:`clipped_sum` on a batch of fixed shape with no
        value read back (same contract as
        :meth:`engine.dp.fast_mlp.FastMLP.masked_sum`; the clipper's
        ``masked_sum`` makes the padding rows contribute nothing)."""
        cap = int(rows.shape[0])
        if cap > self.capacity:
            self._allocate(cap, X.shape[1])
        self.gather(X, y, rows, self._inputs)
        self.clipper.masked_sum(self.x[:cap], self.y[:cap], mask, max_norm, loss, count)

    def logits(self, X: torch.Tensor) -> torch.Tensor:
        """Logits of rows ``X`` (with the ones column), on the CPU; the model in
        eval mode (dropout off) for the call."""
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                # a copy: the model may change its input, and X is the split's data
                return self.model(X[:, :-1].to(self.device, copy=True)).cpu()
        finally:
            self.model.train(was_training)
