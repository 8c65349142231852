"""A torch model as the clippers see it (:mod:`engine.dp.clipping`).

:class:`FlatParameters` moves every parameter into one flat buffer (views
into it), which the optimizer, the checkpoint and the all-reduce see;
:class:`FlatGradient` adds the flat buffer the clipped gradient sum is
written into, and refuses a layer that breaks per-example privacy;
:func:`leaf_layers` lists the layers that hold parameters (a module with
parameters of its own and in its children is :func:`mixed_module`, one
parameter held by two layers :func:`shared_parameter`);
:func:`plain_chain` recognises an ``nn.Sequential`` whose layers can be
called one by one, :func:`by_hand` one of Linear and ReLU layers only, whose
backward needs no autograd, and :func:`layer_hooks` / :func:`hooks_anywhere`
the hooks that forbid both shortcuts.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from engine.dp.rules import refusal
from engine.nn.hooks import own_hooks


class FlatParameters:
    """Moves every parameter of ``model`` into one flat buffer (views into it)."""

    def __init__(self, model: nn.Module):
        named = list(model.named_parameters())
        if not named:
            raise ValueError("the model has no parameters")
        self.names = [name for name, _ in named]
        self.shapes = [tuple(p.shape) for _, p in named]
        self.params = torch.cat([p.detach().reshape(-1) for _, p in named]).contiguous()
        for (_, p), view in zip(named, self._split(self.params)):
            p.data = view

    def _split(self, buf: torch.Tensor) -> list[torch.Tensor]:
        views, offset = [], 0
        for shape in self.shapes:
            n = 1
            for s in shape:
                n *= s
            views.append(buf[offset:offset + n].view(shape))
            offset += n
        return views

    def views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{parameter name: view of buf}`` in the parameters' layout."""
        return dict(zip(self.names, self._split(buf)))


def layer_label(name: str, module: nn.Module) -> str:
    """How messages name a module: ``layer 'body.0' (Linear)``."""
    return f"layer {name!r} ({type(module).__name__})" if name else \
        f"the model itself ({type(module).__name__})"


def mixed_module(model: nn.Module) -> str | None:
    """Why the per-layer rules cannot split ``model`` (a module that holds
    parameters of its own and in its children), or None."""
    for name, module in model.named_modules():
        if any(True for _ in module.parameters(recurse=False)) and \
                any(True for child in module.children() for _ in child.parameters()):
            return (f"{layer_label(name, module)} has parameters of its own and in its "
                    "children, which the per-layer rules cannot split")
    return None


def shared_parameter(model: nn.Module) -> str | None:
    """Why the per-layer rules cannot split ``model``'s parameters among its
    layers when two distinct modules hold the same ``nn.Parameter`` (tied
    weights: ``b.weight = a.weight``), or None. The rules write each layer's
    gradient into its own parameters' slots; a tied parameter's gradient is
    the sum over every layer using it, so each example's norm needs the
    whole model (``torch.func``). A module reused whole (``self.b2 =
    self.b``) is one module here: it runs twice, which the probe finds."""
    holder: dict[int, str] = {}
    for prefix, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            name = f"{prefix}.{pname}" if prefix else pname
            first = holder.setdefault(id(p), name)
            if first != name:
                return (f"parameter {name!r} is parameter {first!r} (one parameter in two "
                        "layers: tied weights), which the per-layer rules cannot split")
    return None


def plain_chain(model: nn.Module) -> tuple[nn.Module, ...] | None:
    """The children of ``model`` when it is an ``nn.Sequential`` itself (not a
    subclass, whose forward may differ) whose children have no children of
    their own, so that calling them in turn *is* its forward; else None.

    A global forward hook turns every module call into torch's slow path;
    calling such a chain's layers one by one records their inputs without one.
    """
    if type(model) is not nn.Sequential:
        return None
    children = tuple(model)  # as its forward runs them: children() skips a repeated one
    if not children or any(True for c in children for _ in c.children()):
        return None
    return children


#: Layers whose backward to their input :meth:`engine.dp.clipping.LayerClipper._chain_pass` writes
#: itself: an MLP's. torch's ReLU backward (``threshold_backward``) and the
#: autograd graph cost more than the GEMMs at a batch of a few hundred rows.
_BY_HAND = (nn.Linear, nn.ReLU)


def by_hand(chain: tuple[nn.Module, ...] | None) -> bool:
    """Whether a plain chain is Linear and ReLU layers only (those exact types,
    each used once, one Linear at least): then no autograd is needed."""
    return (chain is not None and all(type(m) in _BY_HAND for m in chain)
            and any(type(m) is nn.Linear for m in chain)
            and len({id(m) for m in chain}) == len(chain))


def layer_hooks(chain: tuple[nn.Module, ...]) -> bool:
    """Whether any layer of the chain has a hook of its own (a forward hook may
    change an output, a backward hook must see autograd)."""
    return any(own_hooks(m) for m in chain)


def hooks_anywhere(model: nn.Module) -> bool:
    """Whether calling ``model`` would run hooks that calling its children would
    not (its own, or global ones): then the chain is not called layer by layer."""
    module_mod = nn.modules.module
    return bool(own_hooks(model) or module_mod._global_forward_hooks
                or module_mod._global_forward_pre_hooks or module_mod._global_backward_hooks
                or module_mod._global_backward_pre_hooks)


def leaf_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every module that holds parameters, in order.

    Raises:
        ValueError: a module holds parameters of its own and in its children
            (:func:`mixed_module`), or two modules hold one parameter
            (:func:`shared_parameter`): use :class:`engine.dp.clipping.FuncClipper`.
    """
    reason = mixed_module(model) or shared_parameter(model)
    if reason is not None:
        raise ValueError(f"{reason}; use FuncClipper")
    return [(name, module) for name, module in model.named_modules()
            if any(True for _ in module.parameters(recurse=False))]


class FlatGradient:
    """A model's parameters as one flat vector, and the flat buffer its clipped
    gradient sum is written into (``grad``, allocated unless given).

    Raises:
        ValueError: a layer breaks per-example privacy (:func:`engine.dp.rules.refusal`).
    """

    def __init__(self, model: nn.Module, grad: torch.Tensor | None = None):
        for name, module in model.named_modules():
            reason = refusal(module)
            if reason is not None:  # ModuleEngine says so earlier, as a ConfigError
                raise ValueError(f"{layer_label(name, module)} {reason}")
        self.model = model
        self.flat = FlatParameters(model)
        self.params = self.flat.params
        self.grad = torch.zeros_like(self.params) if grad is None else grad
        self._grad_views = self.flat.views(self.grad)
        #: the model changes its input in place (``x /= 255`` in forward): each
        #: forward pass gets a copy, so a pass run again sees the rows as loaded
        self.copy_inputs = False

    def _input(self, x: torch.Tensor) -> torch.Tensor:
        """The rows to call the model on: ``x``, or a copy (:attr:`copy_inputs`)."""
        return x.clone() if self.copy_inputs else x

    def summed(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, int]:
        """The plain gradient sum (no clipping: a non-private step) into ``grad``,
        by one backward pass: a per-example rule has nothing to add here.

        Returns:
            (summed loss, 0).
        """
        if x.shape[0] == 0:
            self.grad.zero_()
            return 0.0, 0
        total = F.cross_entropy(self.model(self._input(x)), y, reduction="sum")
        grads = torch.autograd.grad(total, list(self.model.parameters()), allow_unused=True)
        for name, g in zip(self.flat.names, grads):
            view = self._grad_views[name]
            view.zero_() if g is None else view.copy_(g)
        return float(total.detach()), 0

    def _masked_summed(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor,
                       loss: torch.Tensor, count: torch.Tensor) -> None:
        """:meth:`summed` over the rows where ``mask`` is 1, on the device."""
        per_row = F.cross_entropy(self.model(self._input(x)), y, reduction="none")
        total = (per_row * mask).sum()
        grads = torch.autograd.grad(total, list(self.model.parameters()), allow_unused=True)
        for name, g in zip(self.flat.names, grads):
            view = self._grad_views[name]
            view.zero_() if g is None else view.copy_(g)
        loss.copy_(total.detach())
        count.zero_()
