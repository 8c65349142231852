"""Synthetic files in the prepared-HDF5 contract, for tests and benchmarks.

Not census data: rows with a few standardised numeric columns and one-hot
categorical groups (the shape of what ``mpidp prep`` writes), and a binary
label from a fixed nonlinear rule plus noise, so a model has something to
learn. Rows are grouped into synthetic households of 1-8 consecutive rows
(sizes drawn like PUMS households'), whose random keys fill ``/s/household``
(format version 2); ``households=False`` writes a version-1 file without
them, as an older mpidp did. Written in chunks, so benchmark-size files
(e.g. 790,000 x 100, what prep makes of the 1.2-million-row synthetic PUMS
file) need little memory::

    python -m engine.bench.synthetic --rows 790000 --features 100 --out bench.h5

:func:`write_dense` writes the other shape benchmarks need: dense rows like
the PASCAL 2008 "epsilon" set of mlbench's task 2a (400,000 + 100,000 rows,
2,000 features, every row of unit length, two classes; epsilon itself cannot
be downloaded here), labels from a logistic model whose best possible test
accuracy is about 0.91::

    python -m engine.bench.synthetic --dense --rows 400000 --test-rows 100000 \
        --features 2000 --out epsilon-like.h5

:func:`engine.bench.synthetic_images.write_images` writes image files
(format version 4, what ``mpidp prep --format mnist|cifar10`` writes) for the
image benchmarks when the real MNIST / CIFAR-10 files are not at hand::

    python -m engine.bench.synthetic --images 3x32x32 --rows 50000 --test-rows 10000 \
        --out cifar-like.h5
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

import kernels.files
from engine.choices import seed_value
from engine.bench.synthetic_images import check_classes, parse_image_shape, write_images
from preprocessing import h5format

#: Rows generated and written at a time.
CHUNK = 65536
#: Household sizes 1..8 and their shares (about those of PUMS person files).
HOUSEHOLD_SIZES = np.arange(1, 9)
HOUSEHOLD_SHARES = np.array([0.28, 0.34, 0.15, 0.13, 0.06, 0.025, 0.01, 0.005])


def household_keys(rng: np.random.Generator, n: int) -> np.ndarray:
    """uint64 keys of ``n`` rows in consecutive synthetic households."""
    sizes = rng.choice(HOUSEHOLD_SIZES, size=n // 2 + 1,
                       p=HOUSEHOLD_SHARES / HOUSEHOLD_SHARES.sum())
    keys = rng.integers(0, np.iinfo(np.int64).max, size=sizes.shape[0], dtype=np.int64)
    return np.repeat(keys.astype(np.uint64), sizes)[:n]


def _groups(features: int, numeric: int) -> list[int]:
    sizes, left, pattern, i = [], features - numeric, (9, 24, 5, 18, 4, 2, 8, 3, 2, 6), 0
    while left > 0:
        size = min(pattern[i % len(pattern)], left)
        sizes.append(size)
        left -= size
        i += 1
    return sizes


def _rows(rng: np.random.Generator, n: int, numeric: int, groups: list[int],
          weights: np.ndarray, n_classes: int) -> tuple[np.ndarray, np.ndarray]:
    X = np.zeros((n, numeric + sum(groups)), dtype=np.float32)
    X[:, :numeric] = rng.standard_normal((n, numeric), dtype=np.float32)
    col = numeric
    for size in groups:
        pick = rng.integers(0, size, n)
        X[np.arange(n), col + pick] = 1.0
        col += size
    score = X @ weights[0] + 0.8 * np.tanh(X @ weights[1]) * (X[:, 0] if numeric else 1.0)
    score += rng.logistic(size=n).astype(np.float32) * 0.6
    if n_classes == 2:
        y = (score > np.median(score) if n else score > 0).astype(np.int8)
    else:
        edges = np.quantile(score, np.linspace(0, 1, n_classes + 1)[1:-1]) if n else []
        y = np.searchsorted(edges, score).astype(np.int8)
    return X, y


def feature_names(features: int, numeric: int = 2) -> list[str]:
    """Column names of :func:`write`'s and :func:`rows_in_memory`'s rows:
    ``NUM0``.., then ``CAT<g>=<v>`` per one-hot group."""
    numeric = min(numeric, features)
    names = [f"NUM{i}" for i in range(numeric)]
    for g, size in enumerate(_groups(features, numeric)):
        names += [f"CAT{g}={v}" for v in range(size)]
    return names


def rows_in_memory(rows: int, features: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``rows`` two-class rows of the kind :func:`write` makes (2 numeric columns,
    the rest one-hot groups), in memory and in a shard's layout (:mod:`engine.shard`):
    X float32 ``[rows, features + 1]`` whose last column is 1, y int64 ``[rows]``."""
    rng = np.random.default_rng(seed)
    numeric = 2
    weights = rng.standard_normal((2, features)).astype(np.float32)
    X = np.empty((rows, features + 1), dtype=np.float32)
    y = np.empty(rows, dtype=np.int64)
    X[:, -1] = 1.0
    for start in range(0, rows, CHUNK):
        xb, yb = _rows(rng, min(CHUNK, rows - start), numeric, _groups(features, numeric),
                       weights, 2)
        X[start:start + len(yb), :-1] = xb
        y[start:start + len(yb)] = yb
    return X, y


def write(path: str | os.PathLike, rows: int = 1000, features: int = 16,
          test_rows: int | None = None, n_classes: int = 2, seed: int = 0,
          numeric: int = 2, attrs: dict | None = None, households: bool = True,
          codes: bool = False, val_rows: int | None = None,
          group_columns: dict[str, dict[int, float]] | None = None) -> str:
    """Write a contract-format file; returns its path.

    Args:
        rows: training rows; test_rows: test rows (default rows // 4).
        val_rows: rows of a validation split ``/val`` (0: an empty one), or
            None (the default) for a file without one, as older files.
        features: F; ``numeric`` of them are N(0,1), the rest one-hot groups.
        attrs: root attributes overriding the defaults (to make bad files).
        households: household keys (version 2), or none (version 1).
        codes: store each one-hot group as one column of its integer code
            (format version 3, as ``mpidp prep --encoding codes``): the same
            rows and labels, ``numeric + groups`` columns.
        group_columns: group columns ``/s/groups/NAME`` (as ``mpidp prep`` keeps SEX,
            RAC1P, ...): name -> {code: share}, each row's code drawn with
            those shares, independently of its features and label (labels
            ``"NAME code"``); the rows do not depend on them.
    """
    test_rows = rows // 4 if test_rows is None else test_rows
    numeric = min(numeric, features)
    groups = _groups(features, numeric)
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((2, features)).astype(np.float32)
    names = feature_names(features, numeric)
    encoding = {"numeric": names[:numeric], "groups": groups, "synthetic": True}

    def make_rows(n):
        return _rows(rng, n, numeric, groups, weights, n_classes)

    if codes:
        names, encoding, make_rows = _as_codes(numeric, groups, make_rows)
    return _write(path, rows, test_rows, names, encoding, n_classes, seed, "synthetic",
                  make_rows, attrs, households, val_rows, group_columns)


def onehot_to_codes(X: np.ndarray, names: list[str]) -> tuple[np.ndarray,
                                                           list[tuple[int, int, str]]]:
    """Rows of one-hot features ``X`` (``[n, F]``, no ones column) in the
    ``codes`` layout of :class:`preprocessing.encoding.Encoding`.

    Columns named ``NAME=VALUE`` that share a ``NAME`` and hold exactly one 1
    per row become one column of the index of that 1 (in place of the first of
    them); other columns (numbers, a numeric feature's ``=blank`` flag) are kept.

    Returns:
        (float32 rows, ``(column, categories, name)`` per code column).
    """
    blocks: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        prefix, sep, _ = name.partition("=")
        if sep:
            blocks.setdefault(prefix, []).append(i)
    coded = {prefix: cols for prefix, cols in blocks.items()
             if np.array_equal(X[:, cols].sum(1), np.ones(len(X)))}
    in_block = {i: prefix for prefix, cols in coded.items() for i in cols}
    columns: list[np.ndarray] = []
    code_columns: list[tuple[int, int, str]] = []
    for i in range(X.shape[1]):
        prefix = in_block.get(i)
        if prefix is None:
            columns.append(X[:, i])
        elif i == coded[prefix][0]:
            code_columns.append((len(columns), len(coded[prefix]), prefix))
            columns.append(X[:, coded[prefix]].argmax(1))
    out = np.stack(columns, 1) if columns else np.empty((len(X), 0))
    return out.astype(np.float32), code_columns


def _as_codes(numeric: int, groups: list[int], make_rows):
    """Column names, the ``encoding`` attribute (the ``codes`` layout) and a row
    maker that turns each one-hot group of ``make_rows``' rows into its code."""
    features = [{"name": f"NUM{i}", "kind": "numeric", "mean": 0.0, "std": 1.0,
                 "blank": False} for i in range(numeric)]
    features += [{"name": f"CAT{g}", "kind": "categorical",
                  "categories": [str(v) for v in range(size)]}
                 for g, size in enumerate(groups)]
    encoding = {"version": 1, "features": features, "layout": "codes"}
    onehot_names = feature_names(numeric + sum(groups), numeric)

    def coded(n):
        X, y = make_rows(n)
        return onehot_to_codes(X, onehot_names)[0], y

    return [f["name"] for f in features], encoding, coded


#: Logistic slope (in units of the margin's standard deviation) of write_dense:
#: the Bayes-optimal test accuracy is E[sigmoid(6|g|)], g ~ N(0, 1): about 0.911.
DENSE_SLOPE = 6.0
#: Feature-scale decay of write_dense: an ill-conditioned problem, so SGD needs
#: several epochs to come near the best accuracy (as on the real epsilon set).
DENSE_DECAY = 0.5


def dense_rows(rng: np.random.Generator, n: int, weights: np.ndarray,
               slope: float = DENSE_SLOPE, scales: np.ndarray | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
    """``n`` rows of unit length and labels drawn from ``P(y = 1 | x) =
    sigmoid(slope * w.x / sd(w.x))``: Gaussian rows with per-feature
    ``scales`` (default all 1), then normalised to unit length."""
    features = weights.shape[0]
    scales = np.ones(features, dtype=np.float32) if scales is None else scales
    X = rng.standard_normal((n, features), dtype=np.float32)
    X *= scales
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    sd = np.sqrt(np.sum((weights * scales) ** 2) / np.sum(scales ** 2))
    p = 1.0 / (1.0 + np.exp(-slope / sd * (X @ weights)))
    y = (rng.random(n) < p).astype(np.int8)
    return X, y


def write_dense(path: str | os.PathLike, rows: int = 400_000, features: int = 2000,
                test_rows: int | None = None, seed: int = 0,
                slope: float = DENSE_SLOPE, decay: float = DENSE_DECAY) -> str:
    """Write a dense epsilon-like two-class file in the contract format; returns its path.

    Args:
        rows, test_rows: training and test rows (test default rows // 4, as epsilon).
        features: F, all numeric; every row has unit L2 norm (as epsilon's rows).
        slope: label noise (see :data:`DENSE_SLOPE`).
        decay: feature j has scale (1 + j)^-decay before the rows are normalised
            (0: isotropic, which plain SGD fits within one epoch; see
            :data:`DENSE_DECAY`).
    """
    test_rows = rows // 4 if test_rows is None else test_rows
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal(features)
    weights /= np.linalg.norm(weights)
    weights = weights.astype(np.float32)
    scales = (1.0 + np.arange(features, dtype=np.float32)) ** -np.float32(decay)
    names = [f"X{i}" for i in range(features)]
    encoding = {"numeric": names, "groups": [], "synthetic": True, "dense": True,
                "slope": slope, "decay": decay}
    return _write(path, rows, test_rows, names, encoding, 2, seed, "synthetic-dense",
                  lambda n: dense_rows(rng, n, weights, slope, scales), None, True)


def _write(path, rows: int, test_rows: int, names: list[str], encoding: dict,
           n_classes: int, seed: int, task: str, make_rows, attrs: dict | None,
           households: bool, val_rows: int | None = None,
           groups: dict[str, dict[int, float]] | None = None) -> str:
    """The splits (``val`` only when ``val_rows`` is not None), chunk by chunk
    from ``make_rows(n) -> (X, y)``, the household keys, then the attributes
    (layout: :mod:`preprocessing.h5format`); written under a temporary name
    and renamed. The train and test rows do not depend on ``val_rows``."""
    import h5py  # deferred: keeps `mpidp bench --help` fast (bench scaling imports this module)

    features = len(names)
    encoding_text = json.dumps(encoding)
    counts: dict[str, int] = {}
    sizes = {"train": rows, "test": test_rows}
    if val_rows is not None:
        sizes["val"] = val_rows
    with kernels.files.replacing(path) as tmp, h5py.File(tmp, "w") as f:
        # train, test, then val: the rows drawn for train and test stay those of a
        # file without val
        for split, n in sizes.items():
            chunk_rows = max(1, min(n, 4096, (1 << 22) // max(1, features)))
            X = f.create_dataset(h5format.x_name(split), (n, features),
                                 dtype=h5format.X_DTYPE,
                                 chunks=(chunk_rows, features) if n else None)
            y = f.create_dataset(h5format.y_name(split), (n,), dtype=h5format.Y_DTYPE)
            for start in range(0, n, CHUNK):
                xb, yb = make_rows(min(CHUNK, n - start))
                X[start:start + len(yb)] = xb
                y[start:start + len(yb)] = yb
            if households:
                keys = household_keys(np.random.default_rng([seed, len(split)]), n)
                f.create_dataset(h5format.household_name(split), data=keys,
                                 dtype=h5format.HOUSEHOLD_DTYPE)
                counts[split] = int(n > 0) + int(np.count_nonzero(keys[1:] != keys[:-1]))
            for i, (name, shares) in enumerate((groups or {}).items()):
                draw = np.random.default_rng([seed, 7, len(split), i])
                codes = np.fromiter(shares, dtype=np.int64)
                p = np.array(list(shares.values()), dtype=np.float64)
                f.create_dataset(h5format.group_name(split, name),
                                 data=draw.choice(codes, size=n, p=p / p.sum()),
                                 dtype=h5format.GROUP_DTYPE)
        described = {name: {"description": f"synthetic group {name}", "column": name,
                            "labels": {str(c): f"{name} {c}" for c in shares},
                            "feature": False} for name, shares in (groups or {}).items()}
        version = h5format.FORMAT_VERSION if households else 1
        if encoding.get("layout") == "codes":
            version = h5format.CODES_VERSION
        base = {**h5format.identity(version), "task": task,
                "n_classes": n_classes, "feature_names": json.dumps(names),
                "encoding": encoding_text,
                "encoding_fingerprint": h5format.fingerprint(encoding_text),
                "drop_counts": json.dumps({}), "sources": json.dumps([]), "seed": seed,
                "test_fraction": test_rows / max(1, rows + test_rows + (val_rows or 0)),
                "val_fraction": (None if val_rows is None
                                 else val_rows / max(1, rows + val_rows)),
                "created_by": "mpidp engine.bench.synthetic",
                "households": json.dumps(counts) if households else None,
                "household_key": "random synthetic keys" if households else None,
                "groups": json.dumps(described) if groups else None}
        base.update(attrs or {})
        h5format.write_attributes(f.attrs, base)  # None values: left out (bad files)
    return str(path)


def tile_rows(source: str | os.PathLike, path: str | os.PathLike, repeat: int) -> str:
    """Copy a prepared file with its training rows repeated ``repeat`` times
    (one after the other; the other splits and every attribute as they are);
    returns ``path``. A benchmark's bigger epoch from a real file: the same
    rows, the same normalisation (the mean and std of the training pixels do
    not change when every row appears ``repeat`` times)."""
    import h5py  # deferred: as in _write

    with (kernels.files.replacing(path) as tmp, h5py.File(source, "r") as src,
          h5py.File(tmp, "w") as dst):
        for split in h5format.splits_in(src):
            times = repeat if split == "train" else 1
            for name in (h5format.x_name(split), h5format.y_name(split),
                         h5format.household_name(split)):
                if name not in src:
                    continue
                data = src[name]
                n = data.shape[0]
                shape = (n * times, *data.shape[1:])
                row_bytes = max(1, int(np.prod(data.shape[1:], dtype=np.int64))
                                * data.dtype.itemsize)
                chunk = ((max(1, min(n, (1 << 20) // row_bytes)), *data.shape[1:])
                         if n else None)
                out = dst.create_dataset(name, shape, dtype=data.dtype, chunks=chunk)
                step = max(1, (64 << 20) // row_bytes)
                for start in range(0, n, step):
                    block = data[start:min(n, start + step)]
                    for t in range(times):
                        out[t * n + start:t * n + start + len(block)] = block
        for key, value in src.attrs.items():
            dst.attrs[key] = value
        dst.attrs["created_by"] = (f"mpidp engine.bench.synthetic: {os.path.basename(source)}"
                                   f" with its training rows x{repeat}")
    return str(path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=790_000)
    parser.add_argument("--test-rows", type=int, default=None)
    parser.add_argument("--val-rows", type=int, default=None,
                        help="rows of a validation split (default: none)")
    parser.add_argument("--features", type=int, default=100)
    parser.add_argument("--classes", type=int, default=2)
    parser.add_argument("--seed", type=seed_value, default=0)
    parser.add_argument("--codes", action="store_true",
                        help="categorical groups as integer-code columns (format version 3, "
                        "for --model embedding-mlp)")
    parser.add_argument("--dense", action="store_true",
                        help="dense unit-length rows, two classes (epsilon-like, mlbench 2a)")
    parser.add_argument("--images", metavar="CxHxW", default=None,
                        help="uint8 images of this shape (format version 4, as `mpidp prep "
                        "--format mnist|cifar10`), 10 classes unless --classes")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    classes = 10 if args.images and args.classes == 2 else args.classes
    try:
        check_classes(classes)  # labels are int8: refused before anything is written
    except ValueError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    if args.images:
        try:
            shape = parse_image_shape(args.images)
        except ValueError as exc:
            parser.error(str(exc))
        write_images(args.out, shape, rows=args.rows,
                     test_rows=args.rows // 6 if args.test_rows is None else args.test_rows,
                     n_classes=classes, seed=args.seed)
    elif args.dense:
        write_dense(args.out, rows=args.rows, features=args.features,
                    test_rows=args.test_rows, seed=args.seed)
    else:
        write(args.out, rows=args.rows, features=args.features, test_rows=args.test_rows,
              n_classes=args.classes, seed=args.seed, codes=args.codes,
              val_rows=args.val_rows)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
