"""The model of a run: the fused MLP or any torch module, behind one interface.

The trainer asks a model for its parameter count, a one-line description,
what the checkpoint records about it, and an *engine*
(:class:`~engine.dp.fast_mlp.FastMLP` or
:class:`~engine.dp.module_engine.ModuleEngine`) over the run's gradient
buffer; the engine holds the flat parameter vector the optimizer updates.
:func:`resolve` turns ``--model`` (or the library's ``model=``) into one.

It binds a model (:mod:`engine.nn`) to its clipping engine
(:mod:`engine.dp`), so it sits above both, beside the step that drives it.
"""
from __future__ import annotations

import hashlib
import warnings
from typing import Any, Callable

import torch
from torch import nn

from engine.dp.fast_mlp import FastMLP
from engine.dp.module_engine import (ModuleEngine, buffer_digests, check_model,
                                     frozen_to_buffers)
from engine.errors import CheckpointError, ConfigError
from engine.nn import image_models, model_names
from engine.nn.embedding_mlp import EmbeddingMLP
from engine.nn.linear_chain import linear_chain
from engine.nn.mlp import MLPSpec, flat_from_module, init_params, layer_views, to_module
from engine.nn.mlp import logits as mlp_logits


class MLPModel:
    """The built-in MLP (``--model mlp`` with ``--hidden``, or ``logreg``): fused kernels."""

    fused = True

    def __init__(self, spec: MLPSpec, name: str = "mlp") -> None:
        self.spec, self.name = spec, name
        self.n_params = spec.n_params

    def describe(self) -> str:
        return self.spec.describe()

    def to_dict(self) -> dict:
        """The checkpoint's ``model`` entry (an MLP's widths, as always)."""
        return self.spec.to_dict()

    def build_engine(self, grad: torch.Tensor, seed: int, probe, n_classes: int,
                     capacity: int, backend: str | None) -> FastMLP:
        params = init_params(self.spec, seed).to(grad.device)
        return FastMLP(self.spec, params, grad, capacity=capacity, backend=backend)

    def module(self, params: torch.Tensor) -> nn.Module:
        """A ``torch.nn.Sequential`` with a copy of ``params`` (for users)."""
        return to_module(self.spec, params.detach().cpu())


def mlp_linears_of(module: nn.Module) -> list[nn.Linear] | None:
    """The Linear layers, in call order, of a module that *is* the fused MLP,
    else None.

    That is a module whose forward applies ``nn.Linear`` layers with biases
    and a ReLU between each two, widths chained, float32, without hooks: an
    ``nn.Sequential`` of them, or any module whose forward fx traces to
    exactly that chain (:func:`engine.nn.linear_chain.linear_chain`: a
    user's class calling ``F.relu`` between its layers). The fused kernels
    compute it exactly, so such a module trains at their speed instead of
    the generic path's.
    """
    linears = linear_chain(module)
    if not linears:
        return None
    for before, layer in zip([None, *linears], linears):
        if layer.bias is None or layer.weight.dtype != torch.float32:
            return None
        if before is not None and before.out_features != layer.in_features:
            return None
    return linears


def mlp_spec_of(module: nn.Module) -> MLPSpec | None:
    """The :class:`MLPSpec` of a module that *is* the fused MLP
    (:func:`mlp_linears_of`), else None."""
    return _spec(mlp_linears_of(module))


def _spec(linears: list[nn.Linear] | None) -> MLPSpec | None:
    if linears is None:
        return None
    return MLPSpec((linears[0].in_features, *(layer.out_features for layer in linears)))


class TorchModel:
    """Any ``nn.Module``, trained in place through :class:`ModuleEngine` (or
    the fused kernels, when the module is an MLP they compute: :func:`mlp_spec_of`)."""

    fused = False

    def __init__(self, module: nn.Module, name: str) -> None:
        self.module_obj, self.name = module, name
        #: frozen parameters, now buffers (engine.dp.module_engine.frozen_to_buffers)
        self.frozen = frozen_to_buffers(module)
        self.frozen_sha256 = frozen_digest(module, self.frozen)
        #: every buffer's digest as built (frozen ones included): the run must
        #: publish them unchanged (:meth:`check_buffers_unchanged`)
        self.buffers_at_start = buffer_digests(module)
        self.n_params = sum(p.numel() for p in module.parameters())
        self.rule = "?"
        # the fused kernels train every layer of the chain: none of it frozen
        self.mlp_linears = None if self.frozen else mlp_linears_of(module)
        self.mlp_spec = _spec(self.mlp_linears)

    def unfuse(self) -> None:
        """Train through the generic path even where the module is the fused
        MLP: a checkpoint written by that path (mpidp before a class's
        forward was traced) holds its parameters in the module's own order."""
        self.mlp_linears = self.mlp_spec = None

    def describe(self) -> str:
        clipping = "" if self.rule == "?" else f", clipping by {self.rule}"  # not yet built
        return f"{type(self.module_obj).__name__} ({self.name}, {self.n_params:,} parameters" \
            f"{clipping})"

    def to_dict(self) -> dict:
        """The checkpoint's ``model`` entry: enough to refuse another model on resume
        (and, for a module run by the fused kernels, the widths that say how its
        flat parameters are laid out: ``fused``). ``buffers``: each buffer's
        digest but the frozen parameters' (:func:`buffer_digests`; ``{}`` for
        none), which ``mpidp eval`` compares with the rebuilt model's; an
        entry without it was written before mpidp recorded buffers.

        Raises:
            ConfigError: a buffer changed since the model was built
                (:meth:`check_buffers_unchanged`): nothing is written.
        """
        now = self.check_buffers_unchanged()
        entry = {"kind": "module", "name": self.name,
                 "class": type(self.module_obj).__qualname__, "n_params": self.n_params,
                 "shapes": [[n, list(p.shape)] for n, p in self.module_obj.named_parameters()]}
        if self.mlp_spec is not None:
            entry["fused"] = self.mlp_spec.to_dict()
        if self.frozen:  # a resume, or mpidp eval, must rebuild the same constants
            entry["frozen"] = {"names": self.frozen, "sha256": self.frozen_sha256}
        entry["buffers"] = {n: d for n, d in now.items() if n not in self.frozen}
        return entry

    def check_buffers_unchanged(self) -> dict[str, str]:
        """The buffers' digests now (:func:`buffer_digests`), after checking
        that they are those the model was built with.

        The engine refuses a model whose probe passes change its state
        (:class:`~engine.dp.module_engine.ModuleEngine`), but a change made
        only by later calls (after some steps, on some rows) is seen here,
        before the model is published: in a checkpoint (:meth:`to_dict`)
        and in what ``engine.train`` returns (:meth:`module`).

        Raises:
            ConfigError: (this rank's) the first buffer that differs.
        """
        now = buffer_digests(self.module_obj)
        changed = next((n for n in {**self.buffers_at_start, **now}
                        if self.buffers_at_start.get(n) != now.get(n)), None)
        if changed is not None:
            raise ConfigError(
                f"buffer {changed!r} of the model changed during training: what the "
                "training rows put there would leave the run without clipping or noise, "
                "outside the (epsilon, delta) it reports, so the model is not published; "
                "compute it from public data before training, or make it a parameter, "
                "which DP-SGD trains")
        return now

    def build_engine(self, grad: torch.Tensor, seed: int, probe, n_classes: int,
                     capacity: int, backend: str | None) -> ModuleEngine | FastMLP:
        if self.mlp_spec is None:
            engine = ModuleEngine(self.module_obj, grad, probe, n_classes, capacity=capacity)
            self.rule = engine.rule
            return engine
        check_model(self.module_obj, grad.device, grad.dtype)
        ModuleEngine.check_output(self.module_obj, probe[0][:, :-1].to(grad.device, copy=True),
                                  n_classes)
        flat = flat_from_module(self.mlp_spec, self.mlp_linears).to(grad.device)
        engine = FastMLP(self.mlp_spec, flat, grad, capacity=capacity, backend=backend)
        # the module trains in place: its parameters become views of the engine's
        for view, linear in zip(layer_views(self.mlp_spec, engine.params), self.mlp_linears):
            linear.weight.data = view[:, :-1]
            linear.bias.data = view[:, -1]
        self.rule = "the fused MLP kernels"
        return engine

    def module(self, params: torch.Tensor) -> nn.Module:
        """The user's module itself (its parameters are views of ``params``).

        Raises:
            ConfigError: one of its buffers changed since it was built
                (:meth:`check_buffers_unchanged`).
        """
        self.check_buffers_unchanged()
        return self.module_obj


class EmbeddingModel(TorchModel):
    """``--model embedding-mlp``: :class:`EmbeddingMLP`, recorded by its widths and
    code columns so that ``mpidp eval`` can rebuild it."""

    def __init__(self, n_features: int, n_classes: int, code_columns, hidden) -> None:
        self.spec = {"n_features": n_features, "n_classes": n_classes,
                     "code_columns": [list(c) for c in code_columns],
                     "hidden": [int(h) for h in hidden]}
        super().__init__(build_embedding_mlp(self.spec), "embedding-mlp")

    def to_dict(self) -> dict:
        return {**super().to_dict(), "spec": self.spec}


class ImageModel(TorchModel):
    """``--model mnist-small|mnist-large|resnet20`` (:mod:`engine.nn.image_models`),
    recorded by its name, image shape and classes so that ``mpidp eval`` can
    rebuild it."""

    def __init__(self, name: str, image_shape, n_classes: int) -> None:
        self.spec = {"image_shape": [int(s) for s in image_shape], "n_classes": n_classes}
        super().__init__(image_models.build(name, image_shape, n_classes), name)

    def to_dict(self) -> dict:
        return {**super().to_dict(), "spec": self.spec}


def build_embedding_mlp(spec: dict) -> EmbeddingMLP:
    """The :class:`EmbeddingMLP` an :class:`EmbeddingModel` spec describes."""
    return EmbeddingMLP(spec["n_features"], spec["n_classes"],
                        [tuple(c) for c in spec["code_columns"]], spec["hidden"])


def check_layout(name: str, code_columns, path: str) -> None:
    """Refuse a built-in model that would misread the file's categorical layout.

    Raises:
        ConfigError: (collective) ``mlp``/``logreg`` on a file of integer codes
            (they would read codes as numbers), or ``embedding-mlp`` on a
            one-hot file (it has nothing to embed).
    """
    if name in ("mlp", "logreg") and code_columns:
        raise ConfigError(f"{path} stores its categorical features as integer codes "
                          f"(`mpidp prep --encoding codes`); --model {name} would read them "
                          "as numbers: train it with --model embedding-mlp (or a model of "
                          "yours that embeds them), or prepare the file with --encoding "
                          "onehot", collective=True)
    if name == "embedding-mlp" and not code_columns:
        raise ConfigError(f"{path} is one-hot encoded; --model embedding-mlp needs the "
                          "categorical features as integer codes: prepare the file with "
                          "`mpidp prep --encoding codes`", collective=True)


def resolve(name: str, hidden: tuple[int, ...], n_features: int, n_classes: int, seed: int,
            device: torch.device, given: nn.Module | Callable[[int, int], nn.Module] | None = None,
            code_columns: tuple = (), path: str = "the data file",
            image_shape: tuple = ()) -> MLPModel | TorchModel:
    """The model a run trains.

    Args:
        name: ``mlp``, ``logreg``, ``embedding-mlp`` or ``MODULE:FACTORY``
            (``--model``); ignored when ``given`` is set.
        hidden: the MLP's hidden widths (``--hidden``; ``logreg`` has none).
        seed: the run's shared seed; torch is seeded with it before a factory
            is called, so every rank builds the same initial model.
        device: where a factory's module is moved; a given module must
            already be there.
        given: the library's ``model=``: a module, or a factory
            ``(n_features, n_classes) -> nn.Module``.
        code_columns, path: the data file's integer-code columns
            (:attr:`~preprocessing.h5format.DataInfo.code_columns`) and its
            name, for embedding-mlp and :func:`check_layout`.
        image_shape: the file's ``(C, H, W)`` (empty for tabular files), for
            the image models.

    Raises:
        ConfigError: a bad name, a factory that fails, a module of the wrong
            kind (see :func:`engine.nn.model_names.build`), a built-in model
            that does not fit the file's layout.
    """
    if given is None and name == "python":
        raise ConfigError("this run's model was given as a Python object (engine.train's "
                          "model=): pass the same model= to resume it", collective=True)
    if given is None and name in image_models.IMAGE_MODELS:
        image_models.check_fits(name, image_shape, n_features, path)
        model = seeded(seed, lambda: ImageModel(name, image_shape, n_classes))
        model.module_obj.to(device)
        return model
    if given is None and name == "embedding-mlp" and image_shape:
        shape = "x".join(map(str, image_shape))
        raise ConfigError(f"{path} holds images ({shape}); --model embedding-mlp embeds the "
                          "category codes of a tabular file: train an image model "
                          f"({', '.join(image_models.IMAGE_MODELS)}) or mlp on it",
                          collective=True)
    if given is None and name in model_names.BUILTIN:
        check_layout(name, code_columns, path)
        widths = () if name == "logreg" else tuple(hidden)
        if name == "embedding-mlp":
            model = seeded(seed, lambda: EmbeddingModel(n_features, n_classes,
                                                         code_columns, widths))
            model.module_obj.to(device)
            return model
        return MLPModel(MLPSpec.build(n_features, widths, n_classes), name)
    if given is None:
        factory, label = model_names.load_factory(name), name
    else:
        factory, label = given, label_of(given)
    module = seeded(seed, lambda: model_names.build(factory, n_features, n_classes, label))
    if given is None or not isinstance(given, nn.Module):
        module = module.to(device)
    return TorchModel(module, label)


def frozen_digest(module: nn.Module, names: list[str]) -> str:
    """SHA-256 of the frozen tensors' bytes, by name ("" when none)."""
    if not names:
        return ""
    buffers = dict(module.named_buffers())
    digest = hashlib.sha256()
    for name in names:
        digest.update(name.encode())
        digest.update(buffers[name].detach().cpu().contiguous().view(torch.uint8)
                      .numpy().tobytes())
    return digest.hexdigest()


def seeded(seed: int, build: Callable[[], Any]) -> Any:
    """``build()`` with torch's global generator seeded by the run's seed (and
    restored after), so every rank draws the same initial parameters."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed % 2 ** 63)
        return build()


def label_of(given: Any) -> str:
    """How a model given as a Python object is named (``python:CLASS`` for a
    module, ``python:FACTORY`` for a factory, by qualified name): its
    ``model`` entry's name, and what the ranks of one run compare."""
    if isinstance(given, nn.Module):
        return f"python:{type(given).__qualname__}"
    return f"python:{getattr(given, '__qualname__', type(given).__name__)}"


def check_resume(recorded: dict, model: MLPModel | TorchModel, where: str) -> None:
    """Refuse to resume a checkpoint of another model (one line, by what differs).

    Raises:
        CheckpointError: (collective) the checkpoint's model differs.
    """
    current = model.to_dict()
    if "buffers" not in recorded:  # written before mpidp recorded buffers
        current.pop("buffers", None)
    if recorded == current:
        return
    if isinstance(model, TorchModel) and model.mlp_spec is not None and "fused" not in recorded \
            and recorded == {k: v for k, v in current.items() if k != "fused"}:
        model.unfuse()  # the same model, trained by the generic path: resumed on it
        return
    was = recorded.get("name", "mlp") if recorded.get("kind") == "module" else \
        MLPSpec.from_dict(recorded).describe()
    raise CheckpointError(f"{where} holds a checkpoint of another model ({was}); this run "
                          f"builds {model.describe()}: resume with the same model, or use "
                          "another --checkpoint-dir", collective=True)


def _rebuilt(name: str, n_features: int, n_classes: int, where: str) -> nn.Module:
    """The run's ``MODULE:FACTORY`` model built again (every rank: the same
    verdict everywhere, so a failure is one line, not one per rank)."""
    try:
        return model_names.build(model_names.load_factory(name), n_features, n_classes, name)
    except ConfigError as exc:
        why = str(exc).removeprefix(f"--model {name}: ")
        hint = (": run it where the module imports (its directory, or PYTHONPATH)"
                if "cannot import" in why else "")
        raise ConfigError(f"{where}: the run's model {name} cannot be built again: {why}{hint}",
                          collective=True) from None


def factory_to_import(recorded: dict) -> str | None:
    """The ``MODULE:FACTORY`` that :func:`checkpoint_logits` would import to
    rebuild a checkpoint's ``model`` entry, else None (an MLP, a module the
    fused kernels ran, rebuilt from its widths; embedding-mlp and the image
    models, built in)."""
    name = recorded.get("name")
    if recorded.get("kind") != "module" or "fused" in recorded:
        return None
    return name if model_names.is_user_factory(name) else None


def check_named(recorded: dict, model: str | None, where: str) -> None:
    """Refuse to rebuild a user's model the user did not name.

    Raises:
        CheckpointError: (collective: a function of the file and the command
            line) the entry's model is a ``MODULE:FACTORY`` and ``model``
            (``--model``) is not that name.
    """
    name = factory_to_import(recorded)
    if name is None or model == name:
        return
    given = f" (--model {model} is another)" if model else ""
    raise CheckpointError(f"{where} holds a model built by {name}, code that mpidp imports "
                          f"and runs only when you name it{given}: if you trust that file, "
                          f"pass --model {name}", collective=True)


def checkpoint_logits(recorded: dict, params: torch.Tensor, n_features: int, n_classes: int,
                      where: str, model: str | None = None
                      ) -> Callable[[torch.Tensor], torch.Tensor]:
    """Rebuild a checkpoint's model for ``mpidp eval``: a function from rows with
    the ones column to logits.

    The MLP comes from its widths; a ``MODULE:FACTORY`` model from calling the
    factory again (with ``n_features``, ``n_classes`` of the file evaluated),
    only when ``model`` (the user's ``--model``) names that factory: a name
    read from the file alone is never imported (:func:`check_named`). The
    built-in modules are built on torch's meta device first, so a forged
    description costs nothing before its parameter count is compared.

    Raises:
        CheckpointError: a ``MODULE:FACTORY`` that ``model`` does not name.
        ConfigError: a model given as a Python object (nothing names how to
            rebuild it), or a factory that fails.
        ConfigError: the rebuilt model's parameter count differs
            from the checkpoint's (another feature count or class count), or
            its frozen parameters or buffers differ from those the
            checkpoint records (:func:`check_rebuilt_buffers`; a checkpoint
            that predates the buffers' record: an
            :class:`UncheckedBuffersWarning`).
    """
    check_named(recorded, model, where)
    if recorded.get("kind") != "module":
        spec = MLPSpec.from_dict(recorded)
        return lambda xb: mlp_logits(spec, params, xb)
    name = recorded.get("name", "")
    if name.startswith("python:"):
        checkpoint_spec(recorded, where)  # raises: nothing names how to rebuild it
    if "fused" in recorded:  # a module the fused kernels ran: their layout
        spec = MLPSpec.from_dict(recorded["fused"])
        if spec.dims[0] != n_features or spec.dims[-1] != n_classes:
            raise ConfigError(f"{where}: {name} was trained on {spec.dims[0]} features and "
                              f"{spec.dims[-1]} classes, this file has {n_features} and "
                              f"{n_classes}: evaluate on a file prepared like the training "
                              "file (`mpidp prep --like`)", collective=True)
        return lambda xb: mlp_logits(spec, params, xb)
    if name == "embedding-mlp" or name in image_models.IMAGE_MODELS:
        module = _built_in(name, recorded["spec"], params.numel(), where)
    elif model_names.is_user_factory(name):  # named by --model (check_named, above)
        module = _rebuilt(name, n_features, n_classes, where)
    else:  # "mlp" or "logreg" as a module: no run writes that, and it would import them
        raise CheckpointError(f"{where} is not an mpidp model file: its model entry names "
                              f"{name!r} as a module", collective=True)
    frozen = frozen_to_buffers(module)
    if recorded.get("frozen", {"names": [], "sha256": ""}) != \
            {"names": frozen, "sha256": frozen_digest(module, frozen)}:
        raise ConfigError(f"{where}: {name} builds other frozen parameters than the run "
                          "trained with: build them the same way on every call (load them "
                          "from a file, or seed torch in the factory)", collective=True)
    # the count before the buffers: a factory that builds another model is told so
    count = sum(p.numel() for p in module.parameters())
    if count != params.numel():
        now = [[n, list(p.shape)] for n, p in module.named_parameters()]
        differs = next((f" (first difference: {a[0]} {a[1]} in the checkpoint, {b[0]} {b[1]} "
                        "now)" for a, b in zip(recorded.get("shapes", []), now) if a != b), "")
        raise ConfigError(f"{where}: {name} builds {count:,} parameters for {n_features} "
                          f"features and {n_classes} classes, the checkpoint holds "
                          f"{params.numel():,}{differs}: either {name} builds another model "
                          "than the run trained (changed since?), or this file is prepared "
                          "unlike the training file (`mpidp prep --like`)", collective=True)
    check_rebuilt_buffers(recorded, module, frozen, where)
    torch.nn.utils.vector_to_parameters(params.to(torch.float32), module.parameters())
    module.eval()

    def logits(xb: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():  # a copy: the model may change its input in place
            return module(xb[:, :-1].clone())
    return logits


class UncheckedBuffersWarning(UserWarning):
    """A checkpoint written before mpidp recorded a model's buffers: the
    rebuilt model's are used as built, unchecked."""


def check_rebuilt_buffers(recorded: dict, module: nn.Module, frozen: list[str],
                          where: str) -> None:
    """Refuse a rebuilt model whose buffers (but the ``frozen`` parameters,
    checked by their own record) differ from those the checkpoint's
    ``model`` entry records (:meth:`TorchModel.to_dict`); warn
    (:class:`UncheckedBuffersWarning`) where the entry predates that record
    and the module has buffers.

    Refused rather than replaced: the checkpoint holds the parameters, not
    the buffers, and a factory that builds other constants (a random
    projection drawn without a seed: ``mpidp eval`` calls it without the
    run's) would be scored as another model than the run trained.

    Raises:
        ConfigError: (collective) naming the first buffer that differs.
    """
    now = buffer_digests(module, skip=tuple(frozen))
    name = recorded.get("name")
    if "buffers" not in recorded:
        if now:
            shown = ", ".join(repr(n) for n in list(now)[:3]) + (", ..." if len(now) > 3
                                                                 else "")
            warnings.warn(f"{where} was written before mpidp recorded a model's buffers: "
                          f"{name}'s buffers ({shown}) are used as it builds them now, "
                          "unchecked; a run trained by this mpidp records them",
                          UncheckedBuffersWarning, stacklevel=3)
        return
    was = recorded["buffers"] if isinstance(recorded["buffers"], dict) else {}
    if was == now and isinstance(recorded["buffers"], dict):
        return
    differs = next((n for n in {**was, **now} if was.get(n) != now.get(n)), None)
    first = f" (first: {differs!r})" if differs is not None else ""
    raise ConfigError(f"{where}: {name} builds other buffers than the run trained with{first}: "
                      "build them the same way on every call (seed torch in the factory, or "
                      "load them from a file)", collective=True)


def _built_in(name: str, spec: dict, n_params: int, where: str) -> nn.Module:
    """embedding-mlp or an image model from its recorded spec, counted on the
    meta device (no memory) before it is built.

    Raises:
        CheckpointError: (collective) the spec builds another parameter count
            than the file holds, or cannot be built at all.
    """
    def build() -> nn.Module:
        if name == "embedding-mlp":
            return build_embedding_mlp(spec)
        return image_models.build(name, spec["image_shape"], spec["n_classes"])

    try:
        with torch.device("meta"):
            count = sum(p.numel() for p in build().parameters())
    except Exception as exc:  # noqa: BLE001 - a forged spec: any failure is the file's
        raise CheckpointError(f"{where} is not an mpidp model file: its {name} spec cannot "
                              f"be built ({type(exc).__name__})", collective=True) from None
    if count != n_params:
        raise CheckpointError(f"{where} is not an mpidp model file: its {name} spec builds "
                              f"{count:,} parameters, params holds {n_params:,}",
                              collective=True)
    return build()


def checkpoint_spec(recorded: dict, where: str, command: str = "mpidp eval") -> MLPSpec:
    """The MLP of a checkpoint's ``model`` entry, for the commands that rebuild it
    (eval, audit).

    Raises:
        ConfigError: the checkpoint holds a model of the user's (those commands
            rebuild only the built-in MLP).
    """
    if recorded.get("kind") == "module":
        how = ("rebuilds a model of yours only from --model MODULE:FACTORY"
               if command == "mpidp eval" else "attacks mpidp's MLPs only")
        raise ConfigError(f"{where} holds a {recorded.get('class') or 'torch'} model "
                          f"({recorded.get('name')}); `{command}` {how}: evaluate it from "
                          "Python (engine.train returns the model)", collective=True)
    return MLPSpec.from_dict(recorded)
