"""The prepared HDF5 file: the one owner of its contract (docs/preprocessing.md).

``mpidp prep`` writes the file (:mod:`preprocessing.pipeline` through
:mod:`preprocessing.h5write`), the synthetic files of tests and benchmarks
are written in the same layout (:mod:`engine.bench.synthetic`), and the
engine reads it (:mod:`engine.shard`). All of them take the names, types
and attribute encoding from here, and readers check a file with
:func:`read_info`, so the layout is defined once.

Datasets, per split ``s`` in :data:`SPLITS` (``train`` and ``test`` always;
``val`` when the file has a validation split, see below):

* ``/s/X``: float32 ``[N, F]`` (any float type is read), encoded features,
  rows in a global random order; F is the same in every split;
* ``/s/y``: int8 ``[N]`` (any integer type is read), labels ``0 .. n_classes-1``;
* ``/s/household`` (format version 2): uint64 ``[N]``, the row's household
  key, a keyed hash of its SERIALNO (never the serial itself: see
  :data:`HOUSEHOLD_KEY`), the same for every person of a household. The
  persons of a household are consecutive rows, households in a random order,
  so a reader can cut a split into shards on household boundaries
  (``mpidp train --privacy-unit household``).

* ``/s/groups/NAME``: int16 ``[N]`` (any integer type is read), the code of
  group attribute NAME of each row (:mod:`preprocessing.groups`: ``SEX``,
  ``RAC1P``, ``AGEP`` in bands, ``ST`` and the task's folktables ``group``),
  for ``mpidp eval --by``; never part of ``X``. The ``groups`` attribute
  describes them (labels of the codes, from the data dictionary); a file
  without it (older files, images, synthetic files written without groups)
  has none, and is still read and scored overall. Like ``/val``, the group
  columns need no new ``format_version``: an older reader ignores them.

The ``val`` split (``/val/X``, ``/val/y``, ``/val/household``) is optional
(:data:`OPTIONAL_SPLITS`): ``mpidp prep --val-fraction F`` moves a share F
of the *training* households there (``mpidp train`` scores it every epoch
and reads ``test`` once, at the end). It is checked like the others when
present; a file without it (older files, ``--val-fraction 0``) is read as
before. It needs no new ``format_version``: a reader that does not know
``/val`` ignores it and trains on ``/train`` and scores ``/test`` as it
always did, which is harmless (the val rows are simply unused), so a file
with a validation split is still version 2 (3 for codes).

Version 1 files (no household keys, rows in a random order) stay readable;
only the household privacy unit refuses them (re-run ``mpidp prep``).

Version 3 is version 2 with categorical features stored as integer codes
(``mpidp prep --encoding codes``: one column per categorical feature holding
its category's index, described by the ``encoding`` attribute, which such a
file must have). One-hot files are still written as version 2, and a
version-3 file is refused by older readers instead of being trained on as
if its codes were numbers.

Version 4 holds images (``mpidp prep --format mnist|cifar10``): ``/s/X`` is
uint8 ``[N, C*H*W]``, each row an image's pixels in ``C, H, W`` order, and
the ``image_shape`` (``[C, H, W]``), ``channel_mean`` and ``channel_std``
attributes (of the training pixels scaled to ``[0, 1]``) say how a reader
unflattens and normalises them; an image has no household, so there is no
``/s/household``. Older readers refuse the file instead of training on raw
bytes.

Root attributes are :data:`ATTRIBUTES`; dicts and lists are stored as JSON
strings (:func:`attribute_value`). Only :data:`REQUIRED` ones are needed to
train on a file.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field

import numpy as np

from preprocessing.errors import PrepError

#: The first bytes of every HDF5 file.
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def is_hdf5(path: str | os.PathLike) -> bool:
    """Whether the file ``path`` starts with :data:`HDF5_SIGNATURE` (False when
    it cannot be read)."""
    try:
        with open(path, "rb") as handle:
            return handle.read(len(HDF5_SIGNATURE)) == HDF5_SIGNATURE
    except OSError:
        return False


#: The ``format`` attribute of every prepared file.
FORMAT = "mpidp"


def is_prepared(path: str | os.PathLike) -> bool:
    """Whether ``path`` is an HDF5 file whose ``format`` attribute is
    :data:`FORMAT` (a file ``mpidp prep`` wrote); False when it cannot be read."""
    if not is_hdf5(path):
        return False
    import h5py  # deferred: callers that only look at the signature skip it

    try:
        with h5py.File(path, "r") as f:
            return _attr(f.attrs, "format") == FORMAT
    except (OSError, ValueError):
        return False
#: The ``format_version`` writers write, and the versions readers accept.
FORMAT_VERSION = 2
FORMAT_VERSIONS = (1, 2, 3, 4)
#: The first version with household keys.
HOUSEHOLD_VERSION = 2
#: The version of files whose categorical features are integer codes.
CODES_VERSION = 3
#: The version of image files (uint8 pixels, no household keys).
IMAGE_VERSION = 4
#: Element type of an image file's ``X``.
IMAGE_DTYPE = "uint8"
#: The splits a file may have, in the order they are written.
SPLITS = ("train", "val", "test")
#: The splits every file has.
REQUIRED_SPLITS = ("train", "test")
#: The splits a file may lack (a file without ``val`` is read as before it existed).
OPTIONAL_SPLITS = ("val",)
#: Element types writers use for ``X`` and ``y``.
X_DTYPE = "float32"
Y_DTYPE = "int8"
HOUSEHOLD_DTYPE = "uint64"
GROUP_DTYPE = "int16"
#: How ``/s/household`` is made (the ``household_key`` attribute).
HOUSEHOLD_KEY = ("AES-256 of the household's SERIALNO id and 'mpidp-hh' (one block), keyed "
                 "with SHA-256 of 'mpidp-household' and a secret that is not stored, first "
                 "8 bytes (little-endian); the secret is random per run of mpidp prep "
                 "unless --household-secret FILE gives one")

#: Root attributes: name -> what it holds (docs/preprocessing.md, "The prepared HDF5 file").
ATTRIBUTES: dict[str, str] = {
    "format": f"{FORMAT!r}: identifies the layout",
    "format_version": f"{FORMAT_VERSION}",
    "task": "task name, e.g. 'employment'",
    "n_classes": "number of classes (an integer >= 2)",
    "feature_names": "JSON list of the F column names",
    "encoding": "JSON: per source variable its kind, categories or mean/std, in column "
                "order, and the layout of categorical features (onehot unless 'codes')",
    "encoding_fingerprint": "sha256 hex digest of the encoding attribute",
    "drop_counts": "JSON: records dropped, per reason",
    "sources": "JSON list: file name, sha256, rows read",
    "seed": "seed of the split and the shuffle",
    "test_fraction": "share of households in the test split",
    "val_fraction": "share of the training households moved to the val split (0: no val "
                    "split; absent in older files)",
    "created_by": "'mpidp <version>' or the writer's name",
    "label": "prep only: the label's definition",
    "universe": "prep only: the records kept",
    "like": "prep only: the file whose encoding was reused (--like), or ''",
    "households": "JSON: households per split (version 2; val included when present)",
    "household_key": "how /s/household was made (version 2): " + HOUSEHOLD_KEY,
    "groups": "JSON: per group attribute kept in /s/groups/NAME, its description, column, "
              "labels (code as a string -> label, from the data dictionary), bands (AGEP) "
              "and feature (whether the model reads it); absent: no group columns",
    "group": "the task's group column in folktables' sense (RAC1P for the ACS tasks)",
    "image_shape": "images only (version 4): JSON [C, H, W] of each row's pixels",
    "channel_mean": "images only: JSON list of C means of the training pixels / 255",
    "channel_std": "images only: JSON list of C standard deviations of the training "
                   "pixels / 255 (a reader feeds (pixel / 255 - mean) / std)",
}
#: Attributes a reader needs (the others describe how the file was made).
REQUIRED = ("format", "format_version", "n_classes")


class FormatError(PrepError):
    """A file that is not a readable prepared file (missing, not HDF5, wrong layout)."""


def x_name(split: str) -> str:
    """Path of the features of ``split`` (``"train/X"``)."""
    return f"{split}/X"


def y_name(split: str) -> str:
    """Path of the labels of ``split`` (``"train/y"``)."""
    return f"{split}/y"


def household_name(split: str) -> str:
    """Path of the household keys of ``split`` (``"train/household"``, version 2)."""
    return f"{split}/household"


def group_name(split: str, attribute: str) -> str:
    """Path of the codes of group attribute ``attribute`` in ``split``
    (``"train/groups/SEX"``)."""
    return f"{split}/groups/{attribute}"


@dataclass(frozen=True)
class GroupColumn:
    """A group attribute a file keeps (the ``groups`` attribute's entry).

    Attributes:
        name: the attribute (``"SEX"``), its dataset ``/s/groups/NAME``.
        description: the data dictionary's words (``"Sex"``; ``", in bands"`` for AGEP).
        labels: code -> label (``{1: "Male", 2: "Female"}``; for AGEP the
            band's first age -> ``"25-34"``); every code in the file has one.
        feature: whether the model reads the column as a feature.
    """

    name: str
    description: str
    labels: dict[int, str]
    feature: bool = False


def splits_in(handle) -> tuple[str, ...]:
    """The splits an open file (an h5py File or group) has, in :data:`SPLITS` order:
    the required ones, whether present or not (the reader checks them), and each
    optional one of which anything is stored."""
    return tuple(s for s in SPLITS if s in REQUIRED_SPLITS or s in handle)


def version_for(layout: str) -> int:
    """The ``format_version`` a writer gives a file of this categorical layout."""
    return CODES_VERSION if layout == "codes" else FORMAT_VERSION


def fingerprint(encoding_text: str) -> str:
    """The ``encoding_fingerprint`` of an ``encoding`` attribute (sha256 hex)."""
    return hashlib.sha256(encoding_text.encode()).hexdigest()


def identity(version: int = FORMAT_VERSION) -> dict:
    """The attributes that make a file a prepared file of ``version`` (default:
    the one writers write; tests write version 1 files to check old ones)."""
    return {"format": FORMAT, "format_version": version}


def attribute_value(value):
    """How ``value`` is stored: dicts and lists as compact JSON, anything else as is."""
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"))
    return value


def write_attributes(attrs, values: dict) -> None:
    """Store ``values`` in an h5py attribute manager (None values are left out)."""
    for key, value in values.items():
        if value is not None:
            attrs[key] = attribute_value(value)


@dataclass(frozen=True)
class DataInfo:
    """What a prepared file says about itself (read from its attributes and shapes)."""

    path: str
    n_features: int
    n_classes: int
    #: rows per split the file has: ``train`` and ``test``, and ``val`` when present
    rows: dict[str, int]
    feature_names: list[str] = field(default_factory=list)
    task: str = ""
    fingerprint: str = ""
    #: Whether the file has household keys (format version 2).
    households: bool = False
    #: ``(column, number of categories, name)`` of each integer-code column
    #: (format version 3, ``--encoding codes``); empty for one-hot files.
    code_columns: tuple[tuple[int, int, str], ...] = ()
    #: ``(C, H, W)`` of an image file (format version 4); empty for tabular files.
    image_shape: tuple[int, ...] = ()
    #: Per channel: mean and standard deviation of the training pixels / 255.
    channel_mean: tuple[float, ...] = ()
    channel_std: tuple[float, ...] = ()
    #: The group attributes kept in ``/s/groups/NAME``, by name (empty: none).
    groups: dict[str, GroupColumn] = field(default_factory=dict)
    #: The task's group column in folktables' sense (``"RAC1P"``), or ``""``.
    group: str = ""
    #: The label's definition (``"ESR == 1"``; prep's ``label`` attribute), or ``""``.
    label: str = ""

    @property
    def is_image(self) -> bool:
        """Whether the file holds images (uint8 pixels to normalise on load)."""
        return bool(self.image_shape)

    @property
    def splits(self) -> tuple[str, ...]:
        """The splits of the file, in :data:`SPLITS` order."""
        return tuple(s for s in SPLITS if s in self.rows)

    @property
    def has_val(self) -> bool:
        """Whether the file has a validation split (it may still have 0 rows)."""
        return "val" in self.rows

    @property
    def layout_fingerprint(self) -> str:
        """A sha256 of the file's public layout only: task, feature names and
        counts, class count, code columns, image shape. Unlike
        :attr:`fingerprint` it holds no statistic of the training rows (the
        numeric means and deviations, the images' channel means), so a
        published model can carry it (``engine.checkpoint.published``)."""
        layout = {"task": self.task, "n_features": self.n_features,
                  "n_classes": self.n_classes, "feature_names": list(self.feature_names),
                  "code_columns": [list(c) for c in self.code_columns],
                  "image_shape": list(self.image_shape)}
        return "layout:" + hashlib.sha256(json.dumps(layout, sort_keys=True).encode()).hexdigest()

    def encoded_unlike(self, trained: dict) -> str:
        """Why this file is not encoded like the one a model was trained on,
        from the model's record of it (a checkpoint's ``data``): its encoding
        ``fingerprint`` where recorded (``checkpoint.pt``), else its
        ``layout_fingerprint`` (``best.pt``, which cannot hold the
        statistics), after the label definition where both record one. ``""``:
        alike, or nothing recorded to compare."""
        if trained.get("label") and self.label and trained["label"] != self.label:
            return f"its rows are labelled {self.label}, the model's {trained['label']}"
        if trained.get("fingerprint") and self.fingerprint:
            return "" if trained["fingerprint"] == self.fingerprint else \
                "encoding fingerprints differ"
        if trained.get("layout_fingerprint"):
            return "" if trained["layout_fingerprint"] == self.layout_fingerprint else \
                "their feature layouts differ"
        return ""

    def summary(self) -> dict:
        return {"path": self.path, "n_features": self.n_features,
                "n_classes": self.n_classes, "rows": dict(self.rows), "task": self.task,
                "fingerprint": self.fingerprint, "layout_fingerprint": self.layout_fingerprint,
                "label": self.label}


def _attr(attrs, name, default=None):
    value = attrs.get(name, default)
    if isinstance(value, bytes):
        value = value.decode()
    if isinstance(value, np.generic):
        value = value.item()
    return value


def read_info(path: str) -> DataInfo:
    """Open ``path`` and check its layout and attributes; reads no rows.

    Raises:
        FormatError: the file is missing, not HDF5, not of format ``"mpidp"``
            with a supported version, misses a split or has datasets of the
            wrong shape or type (the optional ``val`` split included, when
            present), or bad ``n_classes`` / ``feature_names``.
    """
    import h5py  # deferred: keeps `mpidp --help` fast (command modules import this one)

    if not os.path.exists(path):
        raise FormatError(f"data file {path} does not exist (make one with `mpidp prep`)")
    if os.path.isdir(path):
        raise FormatError(f"data file {path} is a directory; give the HDF5 file `mpidp prep` "
                          "wrote (its --out)")
    try:
        handle = h5py.File(path, "r")
    except OSError as exc:
        # HDF5's own text may run over several lines (a time, a buffer address):
        # one line, cut short
        reason = " ".join(str(exc).split())
        reason = reason if len(reason) <= 120 else reason[:117] + "..."
        raise FormatError(f"{path} is not a readable HDF5 file ({reason}); make it with "
                          "`mpidp prep`") from None
    with handle as f:
        fmt = _attr(f.attrs, "format")
        if fmt != FORMAT:
            raise FormatError(f"{path}: attribute format={fmt!r}, expected {FORMAT!r}; "
                              "this is not a file written by `mpidp prep`")
        version = _attr(f.attrs, "format_version")
        if version not in FORMAT_VERSIONS:
            raise FormatError(f"{path}: format_version={version!r} is not supported "
                              f"(supported: {FORMAT_VERSIONS}); re-run `mpidp prep`")
        rows: dict[str, int] = {}
        n_features = None
        for split in splits_in(f):
            X, y = _dataset(f, x_name(split)), _dataset(f, y_name(split))
            if X is None or y is None:
                raise FormatError(f"{path}: missing /{split}/X or /{split}/y (datasets, "
                                  "not groups)")
            if X.ndim != 2 or y.ndim != 1 or X.shape[0] != y.shape[0]:
                raise FormatError(f"{path}: /{split}/X must be [N, F] and /{split}/y [N]; "
                                  f"found {X.shape} and {y.shape}")
            if X.shape[1] == 0:
                raise FormatError(f"{path}: /{split}/X has no feature columns (shape "
                                  f"{X.shape}); a model needs at least one")
            x_kind = "u" if version == IMAGE_VERSION else "f"
            if X.dtype.kind != x_kind or y.dtype.kind not in "iu":
                raise FormatError(f"{path}: /{split}/X must be "
                                  f"{'uint8' if x_kind == 'u' else 'float'} and /{split}/y "
                                  f"integer; found {X.dtype} and {y.dtype}")
            if has_households(version):
                name = household_name(split)
                if name not in f:
                    raise FormatError(f"{path}: format_version={version} but /{name} is "
                                      "missing; re-run `mpidp prep`")
                keys = _dataset(f, name)
                if keys is None or keys.shape != y.shape or keys.dtype.kind not in "iu":
                    found = "a group" if keys is None else f"{keys.dtype} {keys.shape}"
                    raise FormatError(f"{path}: /{name} must be integer [N] like /{split}/y; "
                                      f"found {found}")
            if n_features is not None and X.shape[1] != n_features:
                raise FormatError(f"{path}: /{SPLITS[0]}/X has {n_features} features but "
                                  f"/{split}/X has {X.shape[1]}")
            n_features = int(X.shape[1])
            rows[split] = int(X.shape[0])
        n_classes = _attr(f.attrs, "n_classes")
        if not isinstance(n_classes, int) or n_classes < 2:
            raise FormatError(f"{path}: attribute n_classes={n_classes!r} must be an "
                              "integer >= 2")
        names_text = _attr(f.attrs, "feature_names", "[]")
        try:
            names = json.loads(names_text) if isinstance(names_text, str) else list(names_text)
        except ValueError:
            raise FormatError(f"{path}: attribute feature_names is not a JSON list") from None
        if names and len(names) != n_features:
            raise FormatError(f"{path}: {len(names)} feature_names for {n_features} "
                              "feature columns")
        code_columns = _code_columns(path, f.attrs, version, n_features)
        image = _image_layout(path, f.attrs, version, n_features)
        groups = _group_columns(path, f, rows)
        encoding_fingerprint = _attr(f.attrs, "encoding_fingerprint", "") or ""
        if not encoding_fingerprint and names:
            encoding_fingerprint = "names:" + hashlib.sha256(
                json.dumps(names).encode()).hexdigest()
        return DataInfo(path=path, n_features=n_features, n_classes=n_classes, rows=rows,
                        feature_names=names, task=str(_attr(f.attrs, "task", "") or ""),
                        fingerprint=encoding_fingerprint,
                        households=has_households(version),
                        code_columns=code_columns, groups=groups,
                        group=str(_attr(f.attrs, "group", "") or ""),
                        label=str(_attr(f.attrs, "label", "") or ""), **image)


def _dataset(f, name: str):
    """The dataset at ``name`` in an open file; None when there is none (absent, or
    a group of that name: a file written by hand may have either)."""
    import h5py  # deferred: as in read_info

    item = f.get(name)
    return item if isinstance(item, h5py.Dataset) else None


def _group_columns(path: str, f, rows: dict[str, int]) -> dict[str, GroupColumn]:
    """The group columns the ``groups`` attribute describes, checked in every split."""
    text = _attr(f.attrs, "groups", "")
    if not text:
        return {}
    try:
        described = json.loads(text)
        columns = {name: GroupColumn(name, str(entry["description"]),
                                     {int(code): str(label)
                                      for code, label in entry["labels"].items()},
                                     bool(entry.get("feature", False)))
                   for name, entry in described.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise FormatError(f"{path}: attribute groups is not a JSON table of group columns "
                          f"({exc}); re-run `mpidp prep`") from None
    for name in columns:
        for split, n in rows.items():
            dataset = _dataset(f, group_name(split, name))
            if dataset is None or dataset.shape != (n,) or dataset.dtype.kind not in "iu":
                found = "missing" if dataset is None else f"{dataset.dtype} {dataset.shape}"
                raise FormatError(f"{path}: attribute groups lists {name}, but "
                                  f"/{group_name(split, name)} is {found}, not integer "
                                  f"[{n}]; re-run `mpidp prep`")
    return columns


def has_households(version: int) -> bool:
    """Whether files of ``version`` have household keys (2 and 3: not images)."""
    return HOUSEHOLD_VERSION <= version < IMAGE_VERSION


def _image_layout(path: str, attrs, version: int, n_features: int) -> dict:
    """The image attributes of a version-4 file, checked (``{}`` for other versions)."""
    if version != IMAGE_VERSION:
        return {}
    try:
        shape = tuple(int(v) for v in json.loads(_attr(attrs, "image_shape", "")))
        mean = tuple(float(v) for v in json.loads(_attr(attrs, "channel_mean", "")))
        std = tuple(float(v) for v in json.loads(_attr(attrs, "channel_std", "")))
    except (ValueError, TypeError):
        raise FormatError(f"{path}: format_version={version} needs the attributes "
                          "image_shape, channel_mean and channel_std as JSON lists; "
                          "re-run `mpidp prep --format mnist|cifar10`") from None
    if (len(shape) != 3 or min(shape) < 1 or shape[0] * shape[1] * shape[2] != n_features
            or len(mean) != shape[0] or len(std) != shape[0]
            or not all(s > 0 and math.isfinite(s) for s in std)
            or not all(math.isfinite(m) for m in mean)):
        raise FormatError(f"{path}: image_shape {list(shape)}, channel_mean {list(mean)} "
                          f"and channel_std {list(std)} do not describe its rows of "
                          f"{n_features} pixels; re-run `mpidp prep --format mnist|cifar10`")
    return {"image_shape": shape, "channel_mean": mean, "channel_std": std}


def _code_columns(path: str, attrs, version: int,
                  n_features: int) -> tuple[tuple[int, int, str], ...]:
    """The code columns a version-3 file's ``encoding`` attribute describes."""
    if version != CODES_VERSION:
        return ()
    from preprocessing.encoding import Encoding  # deferred: only version 3 needs it

    try:
        encoding = Encoding.from_json(_attr(attrs, "encoding", "") or "")
        columns = tuple(encoding.code_columns)
        width = encoding.n_features
    except (ValueError, KeyError, TypeError) as exc:
        raise FormatError(f"{path}: format_version={version} needs an encoding attribute "
                          f"that describes its code columns ({exc}); re-run `mpidp prep "
                          "--encoding codes`") from None
    if encoding.layout != "codes" or width != n_features:
        raise FormatError(f"{path}: format_version={version} but its encoding attribute "
                          f"describes a {encoding.layout} layout of {width} columns for "
                          f"{n_features}; re-run `mpidp prep --encoding codes`")
    return columns
