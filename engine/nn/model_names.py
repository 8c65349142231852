"""The names ``--model`` takes (or the library's ``model=``): built-ins, and ``MODULE:FACTORY``.

``mlp`` and ``logreg`` are the built-in fused MLPs (:mod:`engine.dp.fast_mlp`;
``logreg`` is the MLP without hidden layers); ``embedding-mlp``
(:mod:`engine.nn.embedding_mlp`) is built in too, for files of integer
category codes, and runs through the per-layer rules. ``MODULE:FACTORY`` names a
user's function ``FACTORY(n_features, n_classes) -> torch.nn.Module`` in an
importable module (the current directory is on the path), called on every
rank after seeding torch with the run's shared seed, so ranks build the same
initial model; the trainer still checks a parameter digest across ranks.
``mnist-small``, ``mnist-large`` and ``resnet20`` are the built-in image
models (:mod:`engine.nn.image_models`), built for the file's image shape.
"""
from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Callable

from engine.errors import ConfigError

if TYPE_CHECKING:  # torch is imported where a model is built: `--help` stays fast
    from torch import nn

#: Built-in model names: the fused MLPs, embedding-mlp, then the image models
#: (:mod:`engine.nn.image_models`, for files of ``mpidp prep --format mnist|cifar10``).
BUILTIN = ("mlp", "logreg", "embedding-mlp", "mnist-small", "mnist-large", "resnet20")


def check_name(name: str) -> None:
    """Raise ConfigError unless ``name`` is a built-in or of the form MODULE:FACTORY."""
    if name in BUILTIN:
        return
    module, sep, attr = name.partition(":")
    if not sep or not module or not attr:
        raise ConfigError(f"--model {name!r}: choose {', '.join(BUILTIN)} or MODULE:FACTORY "
                          "(a function (n_features, n_classes) -> torch.nn.Module)")


def is_user_factory(name) -> bool:
    """Whether ``name`` is a ``MODULE:FACTORY`` of the user's: code that building
    the model imports and calls. Not a built-in, nor the label ``python:...``
    of a model given as a Python object (nothing names how to rebuild it).

    A name read from a file is never imported unless the user names it too
    (``--model``): a checkpoint anyone can write would otherwise choose the
    code mpidp runs (``os:kill``).
    """
    return isinstance(name, str) and name not in BUILTIN and name != "python" \
        and not name.startswith("python:") and ":" in name


def load_factory(name: str) -> Callable[[int, int], "nn.Module"]:
    """Import ``MODULE:FACTORY``: only a name the user gave (``--model``), never
    one read from a file alone (:func:`is_user_factory`).

    Raises:
        ConfigError: the module does not import (its own error is quoted), or
            has no such attribute, or it is not callable.
    """
    check_name(name)
    if not is_user_factory(name):  # a built-in name is no module to import
        raise ConfigError(f"--model {name}: not a MODULE:FACTORY to import")
    module_name, _, attr = name.partition(":")
    if "" not in sys.path:
        sys.path.insert(0, "")  # the current directory, as `python -m` has it
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # the user's module: any failure is a bad --model
        raise ConfigError(f"--model {name}: cannot import {module_name!r}: "
                          f"{type(exc).__name__}: {exc}") from exc
    factory = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise ConfigError(f"--model {name}: {module_name!r} has no {attr!r}")
    if not callable(factory):
        raise ConfigError(f"--model {name}: {attr!r} is not callable")
    return factory


def build(factory: "Callable[[int, int], nn.Module] | nn.Module", n_features: int,
          n_classes: int, label: str) -> "nn.Module":
    """Call ``factory(n_features, n_classes)`` (or take a module as it is).

    Raises:
        ConfigError: ``factory`` is not callable, or the factory raises (its
            error is quoted) or returns something other than an ``nn.Module``.
    """
    from torch import nn

    if isinstance(factory, nn.Module):
        return factory
    if not callable(factory):
        raise ConfigError(f"model {label}: an object of type {type(factory).__name__} is "
                          "neither a torch.nn.Module nor a factory (n_features, n_classes) "
                          "-> nn.Module; pass one of those, or a name as --model takes")
    _check_signature(factory, n_features, n_classes, label)
    try:
        model = factory(n_features, n_classes)
    except Exception as exc:  # the user's code
        raise ConfigError(f"model {label}: the factory raised {type(exc).__name__}: "
                          f"{exc}") from exc
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model {label}: the factory returned {type(model).__name__}, "
                          "not a torch.nn.Module")
    return model


def _check_signature(factory, n_features: int, n_classes: int, label: str) -> None:
    """Refuse (ConfigError) a factory that cannot be called as
    ``factory(n_features, n_classes)``, saying how it is called; nothing where
    its signature cannot be read."""
    import inspect

    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(n_features, n_classes)
    except TypeError:
        name = getattr(factory, "__name__", "the factory")
        raise ConfigError(f"model {label}: a model factory is called as {name}(n_features, "
                          f"n_classes), here {name}({n_features}, {n_classes}), but "
                          f"{name}{signature} does not take them: add those two parameters, "
                          "or pass a model instance instead") from None
