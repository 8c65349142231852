"""The Linear layers a module's forward chains with ReLUs, found by tracing it.

A user's MLP is as often a class of its own (``self.fc1``, ``self.fc2``,
``forward`` calling ``F.relu`` between them) as an ``nn.Sequential``. Both
compute the function the fused MLP kernels compute, but only the
``Sequential`` showed it by its structure. :func:`linear_chain` reads the
structure of any module from ``torch.fx``'s symbolic trace of its forward:
where the trace is exactly ``input -> Linear -> relu -> Linear -> ... ->
Linear -> output``, each node feeding only the next, it returns the Linear
layers in the order the forward calls them; anything else (another
operation or layer, a branch, a reused layer, a forward fx cannot trace)
gives None, and the module trains through the per-layer rules as before.

The trace calls the module's ``forward`` once with symbolic values in place
of tensors (never with data), so a forward with side effects of its own
(counting its calls, printing) sees one extra call.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

#: The call_function targets that are a ReLU of their one tensor argument.
_RELU_FUNCTIONS = (F.relu, torch.relu, torch.relu_)
#: The call_method names that are.
_RELU_METHODS = ("relu", "relu_")


def _relu_node(node, modules: dict) -> bool:
    """Whether ``node`` applies a ReLU to its first argument and nothing else."""
    if node.op == "call_module":
        layer = modules.get(node.target)
        return type(layer) is nn.ReLU and not node.kwargs and len(node.args) == 1
    extra = {k: v for k, v in node.kwargs.items() if k != "inplace"}
    if node.op == "call_function":
        return node.target in _RELU_FUNCTIONS and len(node.args) == 1 and not extra
    if node.op == "call_method":
        return node.target in _RELU_METHODS and len(node.args) == 1 and not extra
    return False


def _hooked(module: nn.Module) -> bool:
    """Whether ``module`` or a module inside it has a hook of its own."""
    return any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
               or m._backward_pre_hooks for m in module.modules())


def linear_chain(module: nn.Module) -> list[nn.Linear] | None:
    """The ``nn.Linear`` layers (exact type) that ``module``'s forward applies
    in turn with one ReLU between each two, in call order, where its traced
    forward is exactly that chain from its one input to its output, those
    layers hold every parameter of the module and no module in it has a hook;
    else None.

    Never raises: a module fx cannot trace (data-dependent control flow,
    several inputs, ...) gives None.
    """
    if isinstance(module, torch.jit.ScriptModule) or _hooked(module):
        return None
    try:
        from torch import fx  # deferred: fx is only needed here

        graph = fx.symbolic_trace(module).graph
    except Exception:  # noqa: BLE001 - any failure to trace: not provably a chain
        return None
    modules = dict(module.named_modules())
    nodes = list(graph.nodes)
    if len(nodes) < 3 or nodes[0].op != "placeholder" or nodes[-1].op != "output":
        return None
    if any(n.op == "placeholder" for n in nodes[1:]):
        return None
    linears: list[nn.Linear] = []
    previous = nodes[0]
    for i, node in enumerate(nodes[1:-1], start=1):
        if node.args[:1] != (previous,) or len(node.users) != 1:
            return None
        want_linear = i % 2 == 1  # Linear, ReLU, Linear, ...
        if want_linear:
            layer = modules.get(node.target) if node.op == "call_module" else None
            if type(layer) is not nn.Linear or len(node.args) != 1 or node.kwargs:
                return None
            linears.append(layer)
        elif not _relu_node(node, modules):
            return None
        previous = node
    out = nodes[-1].args[0]
    if out is not previous or len(nodes) % 2 == 0:  # must end on a Linear
        return None
    if len({id(layer) for layer in linears}) != len(linears):
        return None  # a layer applied twice
    held = {id(p) for layer in linears for p in layer.parameters()}
    if held != {id(p) for p in module.parameters()}:
        return None  # parameters the chain does not use (they would not train)
    return linears

