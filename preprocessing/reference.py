"""A single-process polars pipeline doing prep's job: the benchmark's reference.

The straightforward way to do what ``mpidp prep`` does with a good library
on one machine, written carefully (it is the bar to beat, not a straw man):
polars reads only the needed columns with all its threads while a thread
computes the input's sha256 (also part of the job: it goes into the
output), the universe is filtered, and the rows are split by household,
shuffled, one-hot encoded straight into one preallocated float32 array per
split and written with h5py. It skips what the real command adds
(dictionary checks and drop counts, atomic write, identical output for any
number of ranks), so it is, if anything, favoured.

    python -m preprocessing.reference FILE.csv --out ref.h5
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import threading
import time

import numpy as np

from preprocessing import dictionary
from preprocessing.cleaning import category_codes, category_names
from preprocessing.tasks import EMPLOYMENT as task


def prepare(path: str, out: str, seed: int = 0, test_fraction: float = 0.2,
            steps: dict | None = None) -> int:
    """Run the reference pipeline; returns the number of rows written. ``steps``,
    if given, receives the seconds of each step (``read`` the columns and
    filter, ``split`` and the encoding's statistics, ``sha256`` waited for,
    ``encode+write``)."""
    import h5py  # deferred: as the real pipeline's
    import polars as pl

    digest = {}

    def sha256() -> None:
        state = hashlib.sha256()
        with open(path, "rb", buffering=0) as handle:
            for block in iter(lambda: handle.read(8 << 20), b""):
                state.update(block)
        digest["sha256"] = state.hexdigest()

    clock = [time.perf_counter()]
    steps = {} if steps is None else steps

    def mark(name: str) -> None:
        now = time.perf_counter()
        steps[name] = now - clock[0]
        clock[0] = now

    hashing = threading.Thread(target=sha256)
    hashing.start()
    codebook = dictionary.load()
    features = [f.name for f in task.features]
    columns = ["SERIALNO", *features, "ESR"]
    frame = (pl.scan_csv(path, schema_overrides={c: pl.Int32 for c in columns[1:]})
             .select(columns).filter(pl.col("AGEP") >= 16).collect())
    mark("read")
    household = frame.get_column("SERIALNO").hash(seed).to_numpy()
    in_test = (household % 1_000_000) < int(test_fraction * 1_000_000)
    rng = np.random.default_rng(seed)
    layout, width = [], 0
    for name in features:
        if name == "AGEP":
            layout.append((name, width, None))
            width += 1
        else:
            variable = codebook[name]
            codes = category_codes(variable)
            table = np.full(max(codes) + 2, len(codes), dtype=np.int64)  # blank -> last
            table[codes] = np.arange(len(codes))
            layout.append((name, width, table))
            width += len(category_names(variable))
    arrays = {name: frame.get_column(name).fill_null(-1).to_numpy() for name in columns[1:]}
    train_age = arrays["AGEP"][~in_test].astype(np.float64)
    mean, std = train_age.mean(), train_age.std()
    mark("split")
    hashing.join()
    mark("sha256")
    with h5py.File(out, "w") as handle:
        handle.attrs["sources"] = json.dumps([{"file": path, "sha256": digest["sha256"]}])
        for split, mask in (("train", ~in_test), ("test", in_test)):
            rows = rng.permutation(np.flatnonzero(mask))
            X = np.zeros((len(rows), width), dtype=np.float32)
            base = np.arange(len(rows), dtype=np.int64) * width
            flat = X.reshape(-1)
            for name, column, table in layout:
                values = arrays[name][rows]
                if table is None:
                    X[:, column] = (values - mean) / std
                else:
                    flat[base + column + table[values]] = 1.0
            y = (arrays["ESR"][rows] == 1).astype(np.int8)
            # An empty split cannot be chunked (h5py refuses chunks larger than the data).
            chunks = (min(len(X), 2647), width) if len(X) else None
            handle.create_dataset(f"{split}/X", data=X, chunks=chunks)
            handle.create_dataset(f"{split}/y", data=y)
    mark("encode+write")
    return frame.height


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("input")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timings", action="store_true",
                        help="also print the seconds of each step")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    steps: dict[str, float] = {}
    rows = prepare(args.input, args.out, args.seed, steps=steps)
    print(f"reference: {rows:,} rows in {time.perf_counter() - started:.2f} s", file=sys.stderr)
    if args.timings:
        print("  steps   " + ", ".join(f"{k} {v:.2f}" for k, v in steps.items()),
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
