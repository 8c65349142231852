"""The Linear layers a module's forward chains with ReLUs, found by tracing it.

A user's MLP is as often a class of its own (``self.fc1``, ``self.fc2``,
``forward`` calling ``F.relu`` between them) as an ``nn.Sequential``. Both
compute the function the fused MLP kernels compute, but only the
``Sequential`` showed it by its structure. :func:`linear_chain` reads the
structure of any module from ``torch.fx``'s symbolic trace of its forward:
where the trace is exactly ``input -> Linear -> relu -> Linear -> ... ->
Linear -> output``, each node feeding only the next, it returns the Linear
layers in the order the forward calls them; anything else (another
operation or layer, a branch, a reused layer or a parameter two layers
share, a forward fx cannot trace) gives None, and the module trains
through the generic path.

The fused kernels never call ``forward`` again, so a forward must have
nothing in it but the chain: a trace records only the path one call took
and what it did to tensors, not Python's own work (counting calls, a test
on a flag or a rank, printing), which the kernels would silently skip. So
a class's ``forward`` must also be straight-line code (:func:`_straight_line`:
assignments to local names and a return, of calls, nothing else), and every
module inside it a ``Linear``, ``ReLU`` or ``Sequential``; tracing then
calls it once with symbolic values (never with data).
"""
from __future__ import annotations

import ast
import inspect
import textwrap

import torch
from torch import nn
from torch.nn import functional as F

from engine.nn.hooks import own_hooks

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


#: Syntax a straight-line forward may hold: local assignments, a return,
#: calls of functions, methods and attributes, and constant keywords.
_PLAIN_SYNTAX = (ast.FunctionDef, ast.arguments, ast.arg, ast.Assign, ast.Return, ast.Call,
                 ast.Name, ast.Attribute, ast.keyword, ast.Constant, ast.Load, ast.Store)
#: Module types whose forward mpidp knows (no user code in them).
_KNOWN = (nn.Linear, nn.ReLU, nn.Sequential)


def _straight_line(module: nn.Module) -> bool:
    """Whether ``module`` runs no Python of its own beyond the calls a trace
    sees: an ``nn.Sequential``, or a class whose ``forward`` (its source)
    holds only assignments to local names and a return of calls, and whose
    submodules are Linear, ReLU or Sequential. False where the source cannot
    be read."""
    inner = list(module.modules())[1:]
    if any(type(m) not in _KNOWN for m in inner):
        return False
    if type(module) is nn.Sequential:
        return True
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(type(module).forward)))
    except (OSError, TypeError, SyntaxError):
        return False
    function = tree.body[0] if tree.body else None
    if not isinstance(function, ast.FunctionDef) or function.decorator_list \
            or not function.args.args:
        return False
    owner = function.args.args[0].arg  # ``self``, by whatever name the forward gives it
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    for statement in body:
        if isinstance(statement, ast.Assign) and not all(
                isinstance(t, ast.Name) for t in statement.targets):
            return False  # self.x = ...: state kept across calls
        for node in ast.walk(statement):
            if not isinstance(node, _PLAIN_SYNTAX):
                return False
            if isinstance(node, ast.Call) and not _known_call(node, module, owner):
                return False
    return bool(body) and isinstance(body[-1], ast.Return)


def _known_call(call: ast.Call, module: nn.Module, owner: str) -> bool:
    """Whether ``call`` calls a submodule (``self.NAME(...)``, ``owner`` being
    the forward's name for ``self``) or a ReLU (``F.relu``, ``torch.relu``,
    ``x.relu()``, ...), nothing a user wrote: a function of the user's would
    be traced through, and any Python in it skipped by the kernels."""
    func = call.func
    if not isinstance(func, ast.Attribute) or any(k.arg != "inplace" for k in call.keywords):
        return False
    if func.attr in _RELU_METHODS:
        return True
    return (isinstance(func.value, ast.Name) and func.value.id == owner
            and isinstance(getattr(module, func.attr, None), _KNOWN))


def linear_chain(module: nn.Module) -> list[nn.Linear] | None:
    """The ``nn.Linear`` layers (exact type) that ``module``'s forward applies
    in turn with one ReLU between each two, in call order, where its forward
    is straight-line code (:func:`_straight_line`), its trace is exactly that
    chain from its one input to its output, those layers hold every
    parameter of the module and no module in it has a hook; else None.

    Never raises: a module fx cannot trace (data-dependent control flow,
    several inputs, ...) gives None.
    """
    if isinstance(module, torch.jit.ScriptModule) or any(map(own_hooks, module.modules())) \
            or not _straight_line(module):
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
    used = [id(p) for layer in linears for p in layer.parameters()]
    held = set(used)
    if len(held) != len(used):
        return None  # a parameter in two layers (tied weights): the kernels' layout has
        # one slot per layer's parameter, and the per-layer clipping would split its gradient
    if held != {id(p) for p in module.parameters()}:
        return None  # parameters the chain does not use (they would not train)
    return linears

