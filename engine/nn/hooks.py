"""Whether a module has hooks of its own: what decides if mpidp may run a
model's layers without calling the model (``engine.dp.flat_model``) or
replace its forward by the fused kernels (``engine.nn.linear_chain``)."""
from __future__ import annotations

from torch import nn


def own_hooks(module: nn.Module) -> bool:
    """Whether ``module`` has a forward, pre-forward, backward or pre-backward hook."""
    return bool(module._forward_hooks or module._forward_pre_hooks
                or module._backward_hooks or module._backward_pre_hooks)
