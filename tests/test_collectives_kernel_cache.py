"""The collectives' Numba loops load from Numba's cache in a second process.

Made inside a factory, a loop closed over dispatchers or intrinsics whose
pickled form changes per process, so each process compiled it again (a
quarter second per op and dtype at every job's first all-reduce) and left
one more file in the cache. This pins that a second process compiles
nothing: the cache directory does not grow.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WARM = """
import numpy as np
from collectives.core import combine
from collectives.channels import streaming
for dtype in (np.float32, np.float64):
    for op in ("sum", "max", "min"):
        a, b, out = (np.ones(3, dtype) for _ in range(3))
        combine.host_combiner(op, np.dtype(dtype))(a, b, out)   # the three-array loop
        combine.host_combiner(op, np.dtype(dtype))(a, b, b)     # the in-place one
    combine.canonicalize(np.ones(3, dtype))
if streaming.available():
    streaming._kernel()
"""


def _files(cache: Path) -> list[str]:
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file())


def test_a_second_process_compiles_no_collectives_kernel(tmp_path):
    cache = tmp_path / "numba"
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    subprocess.run([sys.executable, "-c", WARM], env=env, check=True, timeout=300)
    first = _files(cache)
    assert any(name.endswith(".nbc") for name in first), first
    subprocess.run([sys.executable, "-c", WARM], env=env, check=True, timeout=300)
    assert _files(cache) == first
