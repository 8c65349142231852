"""The built-in image models: ``--model mnist-small``, ``mnist-large`` and ``resnet20``.

Every model takes the engine's rows, the flat ``[k, C*H*W]`` float32 pixels
of an image file (normalised per channel on load, :mod:`engine.shard`), and
unflattens them to ``[k, C, H, W]`` itself, so an image model is an
ordinary ``nn.Module`` of the per-layer rules (Conv2d, Linear, GroupNorm;
:mod:`engine.dp.rules`) and of every other part of the engine.

* ``mnist-small``: conv 3x3 32, ReLU, max-pool 2, conv 3x3 64, ReLU,
  max-pool 2, linear 120, ReLU, linear to the classes: 396,466 parameters
  on 1x28x28 images with 10 classes (the sweep's ~0.40 M model).
* ``mnist-large``: conv 3x3 32, ReLU, conv 3x3 64, ReLU, max-pool 2, linear
  206, ReLU, linear to the classes: 2,605,156 parameters on 1x28x28 with 10
  classes (the sweep's ~2.6 M model).
* ``resnet20``: the CIFAR ResNet-20 of He et al. (2016) that mlbench task 1a
  trains (3 stages of 3 basic blocks, 16/32/64 channels, 1x1 convolution
  shortcuts where the shape changes, global average pooling), with
  GroupNorm (:data:`GROUPS` groups) in place of BatchNorm: BatchNorm
  normalises each example with statistics of the whole batch, so one
  example's gradient depends on the others and per-example clipping no
  longer bounds its influence; GroupNorm normalises each example alone.
  272,474 parameters on 3x32x32 with 10 classes.

The convolutions pad by one, so the shapes above follow from the image
shape; an image too small for a model's poolings is refused
(:func:`check_fits`).
"""
from __future__ import annotations

from typing import Sequence

from torch import nn

from engine.errors import ConfigError

#: The built-in image models, by ``--model`` name.
IMAGE_MODELS = ("mnist-small", "mnist-large", "resnet20")
#: GroupNorm groups of resnet20 (every width, 16/32/64, is a multiple).
GROUPS = 8
#: The smallest side each model accepts (its poolings halve the side).
MIN_SIDE = {"mnist-small": 4, "mnist-large": 2, "resnet20": 4}


def _conv(c_in: int, c_out: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1)


def mnist_small(shape: Sequence[int], n_classes: int) -> nn.Sequential:
    """The sweep's small model (module docstring) for ``shape = (C, H, W)``."""
    c, h, w = shape
    return nn.Sequential(
        nn.Unflatten(1, (c, h, w)),
        _conv(c, 32), nn.ReLU(), nn.MaxPool2d(2),
        _conv(32, 64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * (h // 4) * (w // 4), 120), nn.ReLU(),
        nn.Linear(120, n_classes))


def mnist_large(shape: Sequence[int], n_classes: int) -> nn.Sequential:
    """The sweep's large model (module docstring) for ``shape = (C, H, W)``."""
    c, h, w = shape
    return nn.Sequential(
        nn.Unflatten(1, (c, h, w)),
        _conv(c, 32), nn.ReLU(),
        _conv(32, 64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * (h // 2) * (w // 2), 206), nn.ReLU(),
        nn.Linear(206, n_classes))


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with GroupNorm, and the shortcut added before the last ReLU."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(GROUPS, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(GROUPS, c_out)
        self.relu = nn.ReLU()
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False),
                nn.GroupNorm(GROUPS, c_out))

    def forward(self, x):
        out = self.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet20(nn.Module):
    """ResNet-20 for CIFAR-shaped images with GroupNorm (module docstring)."""

    def __init__(self, shape: Sequence[int], n_classes: int) -> None:
        super().__init__()
        c = shape[0]
        self.unflatten = nn.Unflatten(1, tuple(shape))
        self.stem = nn.Sequential(nn.Conv2d(c, 16, 3, padding=1, bias=False),
                                  nn.GroupNorm(GROUPS, 16), nn.ReLU())
        blocks, width = [], 16
        for stage, out in enumerate((16, 32, 64)):
            for i in range(3):
                blocks.append(BasicBlock(width, out, 2 if (stage and not i) else 1))
                width = out
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(64, n_classes)

    def forward(self, x):
        x = self.blocks(self.stem(self.unflatten(x)))
        return self.head(self.pool(x).flatten(1))


def check_fits(name: str, shape: Sequence[int], n_features: int, path: str) -> None:
    """Raise ConfigError (collective) unless ``name`` can take the file's images.

    Args:
        shape: the file's image shape ``(C, H, W)``; empty for a tabular file.
        n_features: the file's feature count (``C*H*W`` for an image file).
    """
    if not shape:
        raise ConfigError(f"--model {name} is an image model and {path} holds tabular "
                          "rows: prepare images with `mpidp prep --format mnist|cifar10`, "
                          "or pick a tabular model (mlp, logreg, embedding-mlp)",
                          collective=True)
    c, h, w = (int(s) for s in shape)
    if c * h * w != n_features:
        raise ConfigError(f"{path}: image shape {c}x{h}x{w} does not match its "
                          f"{n_features} feature columns; re-run `mpidp prep`",
                          collective=True)
    side = MIN_SIDE[name]
    if h < side or w < side:
        raise ConfigError(f"--model {name} needs images of at least {side}x{side} pixels; "
                          f"{path} holds {c}x{h}x{w}", collective=True)


def build(name: str, shape: Sequence[int], n_classes: int) -> nn.Module:
    """The image model ``name`` for images of ``shape = (C, H, W)`` and ``n_classes``."""
    shape = tuple(int(s) for s in shape)
    if name == "mnist-small":
        return mnist_small(shape, n_classes)
    if name == "mnist-large":
        return mnist_large(shape, n_classes)
    if name == "resnet20":
        return ResNet20(shape, n_classes)
    raise ValueError(f"no image model {name!r} (choose {', '.join(IMAGE_MODELS)})")
