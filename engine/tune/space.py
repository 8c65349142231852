"""The search space of ``mpidp tune``: parsed, checked value by value, enumerated.

A space names settings of ``mpidp train`` (the fields of
:class:`engine.config.TrainConfig` listed in :data:`TUNABLE`) and the values
to try for each, on the command line::

    --space 'lr=0.01,0.05;batch_size=256,1024;max_grad_norm=0.5,1;optimizer=sgd,adam;\
             hidden=128,128|64'

(``;`` between settings, ``,`` between values, except for ``hidden``, whose
values are layer-width lists separated by ``|``; ``none`` or an empty value
is no hidden layer) or in a TOML file (``--space-file``), as keys of the
top level or of a ``[space]`` table::

    lr = [0.01, 0.05]
    batch_size = [256, 1024]
    hidden = [[128, 128], [64]]      # or ["128,128", "64"]
    optimizer = "adam"               # one value: fixed for every trial

Keys may be written with ``-`` or ``_`` (``batch-size``). Both sources may
be given; a key in both is an error. A key with one value is fixed: every
trial uses it.

Each value is checked on its own against :meth:`TrainConfig.validate` (a
config that differs from a valid one in that value only), so a bad value is
one line naming the key and the value (exit 2); points that are invalid
only in combination are dropped by :func:`valid_points` and counted, and a
space with no valid point is an error.
"""
from __future__ import annotations

import dataclasses
import difflib
import hashlib
import itertools
import json
from dataclasses import dataclass
from typing import Any

from engine.config import TrainConfig
from engine.errors import ConfigError
from engine.choices import OPTIMIZERS as NAMES, parse_hidden
from engine.nn.schedule import SCHEDULES

#: The settings a space may vary, with the type of their values.
TUNABLE: dict[str, str] = {
    "lr": "float", "batch_size": "int", "max_grad_norm": "float", "epochs": "int",
    "optimizer": "choice", "momentum": "float", "weight_decay": "float",
    "lr_schedule": "choice", "model": "str", "hidden": "hidden",
    "noise_multiplier": "float",
}
#: Settings that change a trial's privacy accounting (the rest change only what it learns).
PRIVACY_KEYS = ("batch_size", "epochs", "noise_multiplier")
_CHOICES = {"optimizer": NAMES, "lr_schedule": SCHEDULES}
#: Other names of tunable settings, suggested (never accepted) for an unknown key.
_ALIASES = {"learning_rate": "lr", "batch": "batch_size", "clip": "max_grad_norm",
            "clipping_norm": "max_grad_norm", "clip_norm": "max_grad_norm",
            "max_norm": "max_grad_norm", "sigma": "noise_multiplier",
            "noise": "noise_multiplier", "widths": "hidden", "layers": "hidden",
            "optim": "optimizer", "schedule": "lr_schedule", "wd": "weight_decay"}


def _fail(message: str):
    raise ConfigError(message, collective=True)


def normal_key(key: str, where: str) -> str:
    """``batch-size`` -> ``batch_size``; an unknown key is an error naming the
    closest tunable one."""
    name = key.strip().lower().replace("-", "_")
    if name in TUNABLE:
        return name
    if not name:
        _fail(f"{where}: a setting without a name (expected KEY=VALUES)")
    close = [_ALIASES[name]] if name in _ALIASES else \
        difflib.get_close_matches(name, list(TUNABLE), n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    if name in {f.name for f in dataclasses.fields(TrainConfig)}:
        _fail(f"{where}: {name} is not tuned by a search (privacy, seed and system settings are "
              f"options of mpidp tune itself); {hint}tunable: {', '.join(TUNABLE)}")
    _fail(f"{where}: unknown setting {key.strip()!r}; {hint}tunable: {', '.join(TUNABLE)}")


def convert(key: str, text: Any, where: str) -> Any:
    """One value of ``key`` from its text (or a TOML value), in TrainConfig's type."""
    kind = TUNABLE[key]
    if isinstance(text, bool):
        _fail(f"{where}: {key}={text}: a {kind} is expected, not true/false")
    if kind == "hidden":
        if isinstance(text, (list, tuple)):
            if not all(isinstance(w, int) and not isinstance(w, bool) for w in text):
                _fail(f"{where}: hidden={list(text)}: widths must be integers")
            text = ",".join(str(w) for w in text)
        text = str(text).strip()
        if text.lower() == "none":
            text = ""
        try:
            return parse_hidden(text)
        except ConfigError as exc:
            _fail(f"{where}: hidden={text}: {str(exc).replace('--hidden ', '', 1)}")
    text_value = str(text).strip()
    if kind == "float":
        try:
            return float(text_value)
        except ValueError:
            _fail(f"{where}: {key}={text_value}: {text_value!r} is not a number")
    if kind == "int":
        try:
            if isinstance(text, float) and text.is_integer():
                return int(text)
            return int(text_value)
        except ValueError:
            _fail(f"{where}: {key}={text_value}: {text_value!r} is not a whole number")
    if kind == "choice" and text_value not in _CHOICES[key]:
        _fail(f"{where}: {key}={text_value}: choose from {', '.join(_CHOICES[key])}")
    if not text_value:
        _fail(f"{where}: {key}: an empty value")
    return text_value


def check_value(key: str, value: Any, where: str) -> None:
    """Raise ConfigError (one line, naming ``key``) when TrainConfig refuses
    ``value`` in a config that is otherwise valid."""
    cfg = TrainConfig(data="-", dp=True, noise_multiplier=1.0)
    cfg = dataclasses.replace(cfg, **{key: value})
    try:
        cfg.validate()
    except ConfigError as exc:
        _fail(f"{where}: {key}={format_value(value)}: {exc}")


def format_value(value: Any) -> str:
    """How a value is written in a space (``128,128`` for a hidden tuple, ``none``
    for no hidden layer, a tuple or, as JSON records hold it, a list; ``0.05``
    for floats)."""
    if isinstance(value, (tuple, list)):
        return ",".join(str(v) for v in value) if value else "none"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


@dataclass(frozen=True)
class Space:
    """Settings and their values, in the order given."""

    values: dict[str, tuple]

    @property
    def keys(self) -> list[str]:
        return list(self.values)

    @property
    def varied(self) -> list[str]:
        """The keys with more than one value (what tells trials apart)."""
        return [k for k, v in self.values.items() if len(v) > 1]

    @property
    def size(self) -> int:
        n = 1
        for v in self.values.values():
            n *= len(v)
        return n

    def points(self) -> list[dict]:
        """Every combination, the last key varying fastest."""
        keys = self.keys
        return [dict(zip(keys, combo)) for combo in itertools.product(*self.values.values())]

    def to_json(self) -> dict:
        return {k: [list(v) if isinstance(v, tuple) else v for v in vals]
                for k, vals in self.values.items()}

    def describe(self) -> str:
        sep = {"hidden": "|"}
        return ";".join(f"{k}={sep.get(k, ',').join(format_value(v) for v in vals)}"
                        for k, vals in self.values.items())


def _add(values: dict, key: str, items: list, where: str) -> None:
    if key in values:
        _fail(f"{where}: {key} is given twice")
    if not items:
        _fail(f"{where}: {key}: no values")
    out = []
    for item in items:
        value = convert(key, item, where)
        check_value(key, value, where)
        if value not in out:
            out.append(value)
    values[key] = tuple(out)


def parse_text(text: str, where: str = "--space") -> dict[str, tuple]:
    """``'lr=0.01,0.05;hidden=128,128|64'`` ->
    ``{"lr": (0.01, 0.05), "hidden": ((128, 128), (64,))}``."""
    values: dict[str, tuple] = {}
    for item in text.split(";"):
        if not item.strip():
            continue
        name, sep, rest = item.partition("=")
        if not sep:
            _fail(f"{where}: {item.strip()!r} is not KEY=VALUES (e.g. lr=0.01,0.05)")
        key = normal_key(name, where)
        parts = rest.split("|") if key == "hidden" else rest.split(",")
        if not rest.strip():
            _fail(f"{where}: {key}: no values")
        _add(values, key, [p.strip() for p in parts], where)
    return values


def parse_file(path: str) -> dict[str, tuple]:
    """The space of a TOML file (module docstring)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    where = f"--space-file {path}"
    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except FileNotFoundError:
        _fail(f"{where}: no such file")
    except OSError as exc:
        _fail(f"{where}: cannot read it: {exc.strerror}")
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        _fail(f"{where}: not valid TOML: {exc}")
    if "space" in data:
        extra = sorted(set(data) - {"space"})
        if extra:
            _fail(f"{where}: {extra[0]} outside the [space] table")
        data = data["space"]
        if not isinstance(data, dict):
            _fail(f"{where}: space must be a table")
    values: dict[str, tuple] = {}
    for name, raw in data.items():
        key = normal_key(name, where)
        if isinstance(raw, dict):
            _fail(f"{where}: {key}: a value or a list of values is expected, not a table")
        if key == "hidden":
            if isinstance(raw, list) and raw and all(isinstance(w, int) for w in raw):
                _fail(f"{where}: hidden = {raw}: give a list of layer-width lists, e.g. "
                      "[[128, 128], [64]] (or strings: [\"128,128\", \"64\"])")
            items = raw if isinstance(raw, list) else [raw]
        else:
            items = raw if isinstance(raw, list) else [raw]
        _add(values, key, items, where)
    return values


def parse(text: str | None, path: str | None) -> Space:
    """The space of ``--space`` and/or ``--space-file``.

    Raises:
        ConfigError: (collective) neither given, a malformed or unknown key, a
            value TrainConfig refuses, a key given in both.
    """
    if not text and not path:
        _fail("give the search space: --space 'lr=0.01,0.05;batch_size=256,1024' and/or "
              "--space-file space.toml")
    values = parse_text(text) if text else {}
    if path:
        for key, vals in parse_file(path).items():
            if key in values:
                _fail(f"{key} is in both --space and --space-file {path}; give it once")
            values[key] = vals
    if not values:
        _fail("--space: no settings given (expected KEY=VALUES;KEY=VALUES)")
    return Space(values)


def settings_key(index: int, settings: dict) -> str:
    """The key of trial ``index`` with ``settings``: a hash of both (what
    ``trials.jsonl`` records, and what a re-run skips)."""
    text = json.dumps({"trial": index, "settings": plain(settings)}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def plain(settings: dict) -> dict:
    """Settings as JSON values (hidden as a list)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in settings.items()}


def from_plain(settings: dict) -> dict:
    """The inverse of :func:`plain`."""
    return {k: tuple(v) if k == "hidden" else v for k, v in settings.items()}


def describe_point(settings: dict, keys: list[str] | None = None) -> str:
    """``lr=0.05 batch_size=256`` (the ``keys`` only, when given)."""
    keys = list(settings) if keys is None else keys
    return " ".join(f"{k}={format_value(settings[k])}" for k in keys if k in settings)
