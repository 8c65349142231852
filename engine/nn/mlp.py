"""The model: a multi-layer perceptron described by its widths, in a flat buffer.

``--hidden 128,128`` on a file with F features and C classes gives the widths
``(F, 128, 128, C)``: Linear layers with ReLU between them; ``--hidden ""``
gives ``(F, C)``, multinomial logistic regression.

All parameters live in one flat float32 vector, layer after layer, each layer
as a ``d_out x (d_in + 1)`` row-major block ``[W | b]`` (weights with the bias
as an extra last column). That is the book-keeping layout: with activations
carrying a trailing column of ones, a layer is one GEMM forward and its
clipped gradient sum one GEMM backward (:mod:`engine.dp.fast_mlp`), the
optimizer updates one vector, and the all-reduce sends one buffer.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

ACTIVATIONS = ("relu",)


@dataclass(frozen=True)
class MLPSpec:
    """Widths ``(d_0, ..., d_L)`` of an MLP with ``L`` Linear layers."""

    dims: tuple[int, ...]
    activation: str = "relu"

    def __post_init__(self):
        if len(self.dims) < 2:
            raise ValueError("an MLP needs at least an input and an output width")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} not in {ACTIVATIONS}")

    @classmethod
    def build(cls, n_features: int, hidden: tuple[int, ...], n_classes: int) -> "MLPSpec":
        return cls(dims=(n_features, *hidden, n_classes))

    @property
    def n_layers(self) -> int:
        return len(self.dims) - 1

    def layer_shapes(self) -> list[tuple[int, int]]:
        """``(d_out, d_in + 1)`` of each layer's ``[W | b]`` block."""
        return [(self.dims[i + 1], self.dims[i] + 1) for i in range(self.n_layers)]

    @property
    def n_params(self) -> int:
        return sum(r * c for r, c in self.layer_shapes())

    def to_dict(self) -> dict:
        return {"kind": "mlp", "dims": list(self.dims), "activation": self.activation}

    @classmethod
    def from_dict(cls, data: dict) -> "MLPSpec":
        return cls(dims=tuple(int(d) for d in data["dims"]),
                   activation=str(data.get("activation", "relu")))

    def describe(self) -> str:
        kind = "logistic regression" if self.n_layers == 1 else "MLP"
        return f"{kind} {'-'.join(map(str, self.dims))} ({self.n_params:,} parameters)"


def layer_views(spec: MLPSpec, flat: torch.Tensor) -> list[torch.Tensor]:
    """Views ``[W | b]`` (d_out x (d_in+1)) of each layer inside ``flat``."""
    views, offset = [], 0
    for rows, cols in spec.layer_shapes():
        views.append(flat[offset:offset + rows * cols].view(rows, cols))
        offset += rows * cols
    return views


def init_params(spec: MLPSpec, seed: int, dtype=torch.float32) -> torch.Tensor:
    """A flat parameter vector initialised like ``torch.nn.Linear`` does.

    Weights and biases ~ U(-1/sqrt(d_in), 1/sqrt(d_in)), from a generator
    seeded with ``seed`` alone, so every rank builds the same model.
    """
    generator = torch.Generator().manual_seed(int(seed) & ((1 << 63) - 1))
    flat = torch.empty(spec.n_params, dtype=dtype)
    for view, d_in in zip(layer_views(spec, flat), spec.dims[:-1]):
        bound = 1.0 / d_in ** 0.5
        view.uniform_(-bound, bound, generator=generator)
    return flat


def to_module(spec: MLPSpec, flat: torch.Tensor) -> nn.Sequential:
    """A ``torch.nn.Sequential`` with a copy of the parameters (for reference
    implementations, Opacus and users); float dtype of ``flat``."""
    layers: list[nn.Module] = []
    for i, view in enumerate(layer_views(spec, flat)):
        d_out, d_in = spec.dims[i + 1], spec.dims[i]
        linear = nn.Linear(d_in, d_out, dtype=flat.dtype)
        with torch.no_grad():
            linear.weight.copy_(view[:, :d_in])
            linear.bias.copy_(view[:, d_in])
        layers.append(linear)
        if i < spec.n_layers - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def flat_from_module(spec: MLPSpec, module: nn.Sequential | Sequence[nn.Linear]) -> torch.Tensor:
    """Inverse of :func:`to_module`: the flat ``[W | b]`` vector of ``module``
    (a Sequential, or its Linear layers in call order)."""
    linears = [m for m in module if isinstance(m, nn.Linear)]
    flat = torch.empty(spec.n_params, dtype=linears[0].weight.dtype)
    for view, linear in zip(layer_views(spec, flat), linears):
        view[:, :-1] = linear.weight.detach()
        view[:, -1] = linear.bias.detach()
    return flat


def logits(spec: MLPSpec, flat: torch.Tensor, X_aug: torch.Tensor) -> torch.Tensor:
    """Forward pass on rows with the trailing ones column (allocating; for eval)."""
    h = X_aug
    views = layer_views(spec, flat)
    for i, view in enumerate(views):
        z = h @ view.t()
        if i == len(views) - 1:
            return z
        h = torch.nn.functional.pad(torch.relu_(z), (0, 1), value=1.0)
    return h
