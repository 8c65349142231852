"""Per-example clipping for any torch model: clipped gradient sums, no per-example loop.

Two engines share one contract, ``clipped_sum(x, y, max_norm, groups=None) ->
(loss_sum, n_clipped)``: they write ``sum_i c_i * grad_i`` (cross-entropy loss
of example i, clip factor ``c_i = min(1, max_norm / |grad_i|)``, or ``c_i = 1``
when ``max_norm`` is None) into the flat buffer ``grad`` that matches
``params``. With ``groups`` (int64 ``[H+1]`` row offsets: the households of
``--privacy-unit household``), each group's summed gradient is clipped as
one: ``c_i = min(1, max_norm / |sum_{j in h(i)} grad_j|)``.

* :class:`LayerClipper` — per layer: one forward with hooks that keep each
  parameterised layer's input (a plain ``nn.Sequential`` of leaf layers is
  called layer by layer instead, no hook), one ``torch.autograd.grad`` to the layer
  outputs only (so autograd never computes weight gradients that would be
  thrown away; a layer output changed in place later, as by
  ``nn.ReLU(inplace=True)``, is copied first), then each layer's rule (:mod:`engine.dp.rules`: Linear,
  Embedding, the norm layers, Conv1d/2d), ``torch.func`` for a layer without
  one (announced by a ``SlowPathWarning``). Every layer's inputs must be
  batch first. The loss gradient at the logits comes from the
  ``softmax_xent`` kernel, and the book-keeping Linear layers are clipped
  together by the ``clip_linear_rows`` kernel (norms, factors and row
  scaling in one pass, the other layers' norms added in): at a batch of a
  few hundred rows the torch ops they replace cost more in dispatch than
  in arithmetic.
  A plain ``nn.Sequential`` of ``nn.Linear`` and ``nn.ReLU`` layers only (an
  MLP) with no hooks skips autograd altogether: the forward under
  ``no_grad`` and the output gradients by hand (``g W`` per Linear, the
  ``relu_backward`` kernel per ReLU), because torch's ReLU backward and the
  graph cost more than the GEMMs at that batch size.
* :class:`FuncClipper` — the whole model through ``torch.func`` (vmap over
  grad): for models whose parameters are not all in leaf layers used once,
  or held by two layers (tied weights, which ``LayerClipper`` refuses), or
  used outside their own layer's call, which ``LayerClipper``'s hooks never
  see: its :meth:`~LayerClipper.rule_sums` then differ from
  :meth:`~LayerClipper.autograd_sums` (what
  :class:`engine.dp.module_engine.ModuleEngine` checks on its probe rows).

Layers that break per-example privacy (:func:`engine.dp.rules.refusal`) are
refused by both.

Both also have ``masked_sum(x, y, mask, max_norm, loss, count)``: the same
sum over a batch of fixed shape whose padding rows (``mask`` 0) contribute
nothing, with the loss and the clipped count written into device tensors
instead of returned, so no value is read back and a CUDA graph can hold the
call (:mod:`engine.fixed_step`).

MLPs built by ``mpidp train`` use the hand-written :mod:`engine.dp.fast_mlp`
instead; all three are tested against the naive loop (:mod:`engine.dp.naive`).
An empty batch is valid: the sum is zero.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.nn import functional as F

from engine.dp.flat_model import (FlatGradient, by_hand, hooks_anywhere, layer_hooks,
                                  layer_label, leaf_layers, plain_chain)
from engine.dp.rules import (FuncRule, LayerTerm, SlowPathWarning, group_sq_norms_of,
                             has_fast_rule, rule_for)
from kernels import registry


def clip_factors(sq_norms: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(1, max_norm / norm)`` per example, written as ``C / max(norm, C)``
    (exact, and 1 for a zero gradient)."""
    norms = sq_norms.sqrt()
    return max_norm / torch.clamp_min(norms, max_norm)


def _row_factors(per_group: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Each row's factor: its group's."""
    starts = groups.to(torch.int64)
    return torch.repeat_interleave(per_group, starts[1:] - starts[:-1])


class LayerClipper(FlatGradient):
    """Per-layer clipped gradient sums (see module docstring).

    A layer that takes the ``torch.func`` fallback (no rule for its type, a
    rule that declines its input, more than one input) is announced once
    with a :class:`~engine.dp.rules.SlowPathWarning` naming it.
    """

    def __init__(self, model: nn.Module, grad: torch.Tensor | None = None):
        super().__init__(model, grad)
        self.layers = leaf_layers(model)
        # each layer's own parameters, as views of grad: {layer name: {param: view}}
        self._layer_views = {name: {pname: self._grad_views[f"{name}.{pname}" if name else pname]
                                    for pname, _ in m.named_parameters(recurse=False)}
                             for name, m in self.layers}
        self._announced: set[str] = set()
        self._clip_linear = registry.get("clip_linear_rows", self.grad.device)
        # the CPU's kernels save torch's dispatches; elsewhere torch's ops,
        # which take any dtype and layout a user's model may return
        small_ops = None if self.grad.device.type == "cpu" else "torch"
        self._softmax_xent = registry.get("softmax_xent", self.grad.device, small_ops)
        self._factors = self.grad.new_empty(256)
        self._chain = plain_chain(model)
        self._by_hand = by_hand(self._chain)
        self._copy_outputs = False  # set once a layer's output is seen changed in place
        if self._by_hand:
            self._relu_backward = registry.get("relu_backward", self.grad.device, small_ops)
            #: where the chain's trainable Linear layers are (self.layers, in order): a
            #: frozen one (its parameters made buffers) only passes the gradient down
            trained = {id(m) for _, m in self.layers}
            self._linear_at = [i for i, m in enumerate(self._chain)
                               if type(m) is nn.Linear and id(m) in trained]
            self._by_hand = bool(self._linear_at)
        for name, m in self.layers:
            if not has_fast_rule(m):
                self._announce(name, m, "has no per-layer rule")

    def _announce(self, name: str, layer: nn.Module, why: str) -> None:
        self._announced.add(name)
        warnings.warn(f"{layer_label(name, layer)} {why}: its per-example gradients go "
                      "through torch.func (exact, slower); a rule goes in engine.dp.rules "
                      "(register_rule)", SlowPathWarning, stacklevel=3)

    def _term(self, name: str, layer: nn.Module, inputs: tuple, b: torch.Tensor,
              k: int) -> LayerTerm:
        """The layer's term, by its rule or the fallback (announced)."""
        for x in inputs:
            if torch.is_tensor(x) and (x.dim() == 0 or x.shape[0] != k):
                raise ValueError(f"{layer_label(name, layer)} takes an input of shape "
                                 f"{list(x.shape)} for a batch of {k} rows: the per-layer "
                                 "rules need every layer's inputs batch first; use "
                                 "FuncClipper")
        a = inputs[0].detach()
        if len(inputs) > 1:
            if name not in self._announced:
                self._announce(name, layer, f"takes {len(inputs)} inputs")
            return FuncRule(layer, a, b, inputs[1:])
        term = rule_for(layer)(layer, a, b)
        if isinstance(term, FuncRule) and name not in self._announced:
            self._announce(name, layer, f"has a rule, but not for inputs of shape "
                                        f"{list(a.shape)}")
        return term

    def clipped_sum(self, x: torch.Tensor, y: torch.Tensor, max_norm: float | None,
                    groups: torch.Tensor | None = None) -> tuple[float, int]:
        """Write the (clipped) gradient sum of the batch into ``grad``.

        Args:
            x: ``[k, ...]`` model inputs; y: ``[k]`` int64 labels; k may be 0.
            max_norm: the clipping bound C, or None for plain summed gradients.
            groups: int64 ``[H+1]`` row offsets of groups clipped as one
                (households), or None (each example alone).

        Returns:
            (summed loss, number of examples whose gradient was scaled down).
        """
        if x.shape[0] == 0:
            self.grad.zero_()
            return 0.0, 0
        # every layer's parameters are written below: grad needs no zeroing
        total, terms = self._terms(x, y)
        keeping = [getattr(t, "book_keeping", False) for t in terms]
        if groups is None and max_norm is not None and any(keeping):
            return total, self._clip_book_keeping(terms, keeping, max_norm)
        if groups is not None and max_norm is not None:
            factors = _row_factors(clip_factors(
                sum(t.group_sq_norms(groups) for t in terms), max_norm), groups)
        else:
            sq = sum(t.sq_norms for t in terms)
            factors = (torch.ones_like(sq) if max_norm is None
                       else clip_factors(sq, max_norm))
        self._write_sums(terms, factors)
        clipped = 0 if max_norm is None else int((factors < 1).sum())
        return total, clipped

    def _terms(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, list]:
        """(summed loss, each layer's term) of the batch ``x``, ``y`` (k > 0)."""
        if self._by_hand and not hooks_anywhere(self.model) \
                and not layer_hooks(self._chain):
            total, inputs, out_grads = self._chain_pass(x, y)
        else:
            total, inputs, out_grads = self._autograd_pass(x, y)
        return total, [self._term(name, m, layer_inputs, b, x.shape[0])
                       for (name, m), layer_inputs, b in zip(self.layers, inputs, out_grads)]

    def rule_sums(self, x: torch.Tensor, y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``[m, n]``: row j is ``sum_i weights[j, i] grad_i`` by the per-layer
        rules (``weights`` ``[m, k]``; an identity row is one example's gradient),
        flat in the layout of ``grad`` (``grad`` itself untouched). For checks
        (:meth:`autograd_sums` must give the same): one pass and m sums."""
        out = self.grad.new_zeros(weights.shape[0], self.grad.numel())
        _, terms = self._terms(x, y)
        for row, w in zip(out, weights.to(self.grad.dtype)):
            views = self.flat.views(row)
            for (name, _), term in zip(self.layers, terms):
                # clipped_sum, not clipped_sum_into, which spends the term
                for pname, value in term.clipped_sum(w).items():
                    views[f"{name}.{pname}" if name else pname].copy_(value)
        return out

    def autograd_sums(self, x: torch.Tensor, y: torch.Tensor,
                      weights: torch.Tensor) -> torch.Tensor:
        """:meth:`rule_sums` by autograd over the whole model instead of the
        rules: one forward pass of the model itself (no hook), the loss
        gradient at the logits by the same kernel, and one
        ``torch.autograd.grad`` to every parameter per row of ``weights``, so
        every use of a parameter counts (a functional call on a layer's
        weight, a parameter read in ``forward``), whichever layer's call
        makes it. A parameter the loss does not reach gets zeros."""
        params = list(self.model.parameters())  # named_parameters' order: flat.names
        out = self.grad.new_zeros(weights.shape[0], self.grad.numel())
        with torch.enable_grad():
            logits = self.model(self._input(x))
            dlogits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
            self._loss_gradient(logits.detach(), y, dlogits, None, None)
            if not logits.requires_grad:
                return out
            ones = (1,) * (dlogits.dim() - 1)  # each row's weight over its logits
            for j, w in enumerate(weights.to(dlogits.dtype)):
                grads = torch.autograd.grad(logits, params,
                                            grad_outputs=dlogits * w.reshape(-1, *ones),
                                            retain_graph=j + 1 < weights.shape[0],
                                            allow_unused=True)
                for view, g in zip(self.flat.views(out[j]).values(), grads):
                    if g is not None:
                        view.copy_(g)
        return out

    def masked_sum(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor,
                   max_norm: float | None, loss: torch.Tensor, count: torch.Tensor) -> None:
        """:meth:`clipped_sum` of the rows where ``mask`` is 1 (``[k]``, the
        parameters' dtype; 0 marks padding), per example (no groups), with no
        value read back: the summed loss goes into ``loss`` (float64 0-d), the
        clipped count into ``count`` (int32 ``[1]``). The loss gradient at the
        logits is zeroed on the padding rows, so every layer's per-example
        gradient, norm and clip factor (1) there adds nothing."""
        if max_norm is None:
            return self._masked_summed(x, y, mask, loss, count)
        losses = self._losses(x.shape[0])
        if self._by_hand and not hooks_anywhere(self.model) \
                and not layer_hooks(self._chain):
            _, inputs, out_grads = self._chain_pass(x, y, mask, losses)
        else:
            _, inputs, out_grads = self._autograd_pass(x, y, mask, losses)
        loss.copy_(torch.sum(losses * mask, dtype=torch.float64))
        terms = [self._term(name, m, layer_inputs, b, x.shape[0])
                 for (name, m), layer_inputs, b in zip(self.layers, inputs, out_grads)]
        keeping = [getattr(t, "book_keeping", False) for t in terms]
        if any(keeping):
            self._clip_book_keeping(terms, keeping, max_norm, count)
            return
        factors = clip_factors(sum(t.sq_norms for t in terms), max_norm)
        self._write_sums(terms, factors)
        count.copy_((factors < 1).sum(dtype=count.dtype))

    def _losses(self, k: int) -> torch.Tensor:
        """A reused ``[k]`` buffer for the rows' losses (grown, never shrunk)."""
        buf = getattr(self, "_loss_rows", None)
        if buf is None or buf.shape[0] < k:
            buf = self._loss_rows = self.grad.new_empty(max(k, 256))
        return buf[:k]

    def _write_sums(self, terms: list, factors: torch.Tensor) -> None:
        """Every layer's clip-weighted sum into its views of ``grad``."""
        for (name, _), term in zip(self.layers, terms):
            into = getattr(term, "clipped_sum_into", None)
            if into is not None:  # writes its views itself (no temporary, no copy)
                into(factors, self._layer_views[name])
                continue
            for pname, value in term.clipped_sum(factors).items():
                self._layer_views[name][pname].copy_(value)

    def _autograd_pass(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None = None,
                       losses: torch.Tensor | None = None) -> tuple[float | None, list, list]:
        """(summed loss, each layer's inputs, each layer's output gradient) by a
        recorded forward and one ``torch.autograd.grad`` to the layer outputs.

        A layer's output changed in place afterwards (``nn.ReLU(inplace=True)``
        after a Linear) would give the gradient at the changed tensor, not at
        the layer's output; once such a change is seen, the forward runs
        again, and every later one, with the layers' outputs copied (the copy
        is what the rest of the model gets and changes).

        With ``mask`` and ``losses`` (:meth:`masked_sum`) the rows' losses go
        into ``losses``, the loss gradient is zeroed where ``mask`` is 0, and
        the summed loss returned is None."""
        records: dict[nn.Module, list] = {m: [] for _, m in self.layers}
        copy = self._copy_outputs

        def record(module: nn.Module, inputs: tuple, output):
            seen = records.get(module)
            if seen is None:
                return None
            seen.append((inputs, output, output._version))
            return output.clone() if copy else None  # a hook's value replaces the output

        if self._chain is not None and not hooks_anywhere(self.model):
            logits = self._input(x)  # a plain Sequential of leaves: its forward, recorded here
            for m in self._chain:
                out = m(logits)
                replaced = record(m, (logits,), out)
                logits = out if replaced is None else replaced
        else:
            # one global hook for the forward pass: a fraction of the cost of
            # registering and removing one per layer at every step
            hook = nn.modules.module.register_module_forward_hook(record)
            try:
                logits = self.model(self._input(x))
            finally:
                hook.remove()
        for name, m in self.layers:
            if len(records[m]) != 1:
                raise ValueError(f"layer {name!r} ran {len(records[m])} times in one "
                                 "forward pass; use FuncClipper")
        if not copy and any(records[m][0][1]._version != records[m][0][2]
                            for _, m in self.layers):
            self._copy_outputs = True  # changed in place: see the docstring
            return self._autograd_pass(x, y, mask, losses)
        outs = [records[m][0][1] for _, m in self.layers]
        # the loss's gradient at the logits by one kernel (softmax - onehot),
        # autograd only from there to the layer outputs
        dlogits = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        total = self._loss_gradient(logits.detach(), y, dlogits, mask, losses)
        # a layer run under torch.no_grad (or cut off by detach) gets no
        # gradient: zero, as autograd would leave its parameters' .grad
        reached = [i for i, out in enumerate(outs) if out.requires_grad]
        got = torch.autograd.grad(logits, [outs[i] for i in reached], grad_outputs=dlogits,
                                  allow_unused=True) if reached and logits.requires_grad else []
        out_grads: list = [None] * len(outs)
        for i, b in zip(reached, got):
            out_grads[i] = b
        out_grads = [torch.zeros_like(out) if b is None else b for out, b in zip(outs, out_grads)]
        return total, [records[m][0][0] for _, m in self.layers], out_grads

    def _loss_gradient(self, logits: torch.Tensor, y: torch.Tensor, dlogits: torch.Tensor,
                       mask: torch.Tensor | None, losses: torch.Tensor | None) -> float | None:
        """``softmax - onehot`` into ``dlogits``; the summed loss, or with ``mask``
        the rows' losses into ``losses``, the padding rows' gradient zeroed, None."""
        if mask is None:
            return self._softmax_xent(logits, y, dlogits)
        self._softmax_xent(logits, y, dlogits, losses=losses)
        dlogits.mul_(mask.to(dlogits.dtype)[:, None])
        return None

    def _chain_pass(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None = None,
                    losses: torch.Tensor | None = None) -> tuple[float | None, list, list]:
        """:meth:`_autograd_pass` for a chain of Linear and ReLU layers, without
        autograd: the forward under ``no_grad``, and backward from the logits
        ``g <- g W`` through each Linear and the ``relu_backward`` kernel (in
        place) through each ReLU, down to the first Linear. The same numbers
        (up to the sign of zeros: the kernel multiplies by the mask)."""
        chain = self._chain
        with torch.no_grad():
            acts = [x]  # acts[i]: chain[i]'s input; acts[i + 1] its output
            for i, m in enumerate(chain):
                # the layers' own forwards without Module.__call__ (exact types,
                # no hooks: by_hand, layer_hooks); a ReLU after a Linear in place,
                # on the output that Linear just made and nothing else reads
                if type(m) is nn.Linear:
                    acts.append(F.linear(acts[-1], m.weight, m.bias))
                else:
                    acts.append(F.relu(acts[-1], inplace=m.inplace or (
                        i > 0 and type(chain[i - 1]) is nn.Linear)))
            logits = acts[-1]
            g = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
            total = self._loss_gradient(logits, y, g, mask, losses)
            linear = self._linear_at
            grads: dict[int, torch.Tensor] = {}
            for i in range(len(chain) - 1, linear[0] - 1, -1):
                m = chain[i]
                if type(m) is nn.Linear:
                    grads[i] = g
                    if i > linear[0]:
                        g = g.mm(m.weight)
                else:  # g is not a Linear's kept gradient: g W made it anew
                    self._relu_backward(g, acts[i + 1])
        return total, [(acts[i],) for i in linear], [grads[i] for i in linear]

    def _clip_book_keeping(self, terms: list, keeping: list[bool], max_norm: float,
                           count: torch.Tensor | None = None) -> int | None:
        """Clip with one ``clip_linear_rows`` kernel for the book-keeping
        (Linear) terms (``keeping``), the others' squared norms added in;
        write every layer's sum. Returns the rows clipped (or writes them into
        ``count`` and returns None)."""
        linear = [t for t, keep in zip(terms, keeping) if keep]
        others = [t for t, keep in zip(terms, keeping) if not keep]
        k = linear[0].b.shape[0]
        if self._factors.shape[0] < k:
            self._factors = self.grad.new_empty(k + k // 4)
        factors = self._factors[:k]
        extra = sum(t.sq_norms for t in others) if others else None
        clipped = self._clip_linear([t.a for t in linear], [t.b for t in linear],
                                    [t.has_bias for t in linear], extra, max_norm, factors,
                                    count=count)
        for (name, _), term, keep in zip(self.layers, terms, keeping):
            if keep:
                term.scaled_sum_into(self._layer_views[name])
                continue
            for pname, value in term.clipped_sum(factors).items():
                self._layer_views[name][pname].copy_(value)
        return clipped


class FuncClipper(FlatGradient):
    """Whole-model per-example gradients with ``torch.func`` (the general fallback).

    The parameters are bound to the model by one name per (module, attribute)
    that holds one (``_bindings``), each given the value of its parameter:
    a parameter held by two modules (tied weights) gets both names, a module
    reached by two paths (a layer that another module holds to use its
    weight) one. ``functional_call`` sets and restores each name in turn;
    its own tying (``tie_weights=True``) binds every path, and so restores a
    module reached by two paths to the value bound in its place, leaving a
    plain tensor in the model instead of its parameter."""

    def __init__(self, model: nn.Module, grad: torch.Tensor | None = None):
        super().__init__(model, grad)
        name_of = {id(p): name for name, p in model.named_parameters()}
        #: {path through the modules: the name of the parameter it holds}
        self._bindings = {f"{prefix}.{pname}" if prefix else pname: name_of[id(p)]
                          for prefix, module in model.named_modules()
                          for pname, p in module.named_parameters(recurse=False)}

    def _per_example(self, x: torch.Tensor, y: torch.Tensor) -> tuple[dict, torch.Tensor]:
        """``({parameter name: [k, ...] per-example gradients}, [k] losses)``."""
        # deferred: only FuncClipper needs torch.func
        from torch.func import functional_call, grad_and_value, vmap

        params = {name: p.detach() for name, p in self.model.named_parameters()}
        bindings = self._bindings

        def loss_one(theta, x_i, y_i):
            bound = {path: theta[name] for path, name in bindings.items()}
            out = functional_call(self.model, bound, (x_i.unsqueeze(0),), tie_weights=False)
            return F.cross_entropy(out, y_i.unsqueeze(0), reduction="sum")

        return vmap(grad_and_value(loss_one), in_dims=(None, 0, 0))(params, self._input(x), y)

    def clipped_sum(self, x: torch.Tensor, y: torch.Tensor, max_norm: float | None,
                    groups: torch.Tensor | None = None) -> tuple[float, int]:
        """Same contract as :meth:`LayerClipper.clipped_sum`."""
        self.grad.zero_()
        k = x.shape[0]
        if k == 0:
            return 0.0, 0
        grads, losses = self._per_example(x, y)
        if groups is not None and max_norm is not None:
            factors = _row_factors(clip_factors(group_sq_norms_of(grads.values(), groups),
                                                max_norm), groups)
        else:
            sq = sum(g.reshape(k, -1).square().sum(1) for g in grads.values())
            factors = torch.ones_like(sq) if max_norm is None else clip_factors(sq, max_norm)
        for name, g in grads.items():
            self._grad_views[name].copy_(torch.tensordot(factors, g, dims=([0], [0])))
        clipped = 0 if max_norm is None else int((factors < 1).sum())
        return float(losses.sum()), clipped

    def masked_sum(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor,
                   max_norm: float | None, loss: torch.Tensor, count: torch.Tensor) -> None:
        """Same contract as :meth:`LayerClipper.masked_sum`: the padding rows'
        per-example gradients are computed and weighted by 0."""
        if max_norm is None:
            return self._masked_summed(x, y, mask, loss, count)
        k = x.shape[0]
        grads, losses = self._per_example(x, y)
        weight = mask.to(self.grad.dtype)
        factors = clip_factors(sum(g.reshape(k, -1).square().sum(1) for g in grads.values()),
                               max_norm)
        count.copy_(((factors < 1) & (weight > 0)).sum(dtype=count.dtype))
        factors = factors * weight
        for name, g in grads.items():
            self._grad_views[name].copy_(torch.tensordot(factors, g, dims=([0], [0])))
        loss.copy_(torch.sum(losses * weight, dtype=torch.float64))
