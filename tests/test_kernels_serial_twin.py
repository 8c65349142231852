"""kernels.numba_cpu.serial_twin: a parallel kernel's one-thread twin gives the
same numbers and keeps its own entry in Numba's disk cache (in child
processes sharing one cache directory, as successive jobs do)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MODULE = '''
import numba
import numpy as np
from kernels.numba_cpu import serial_twin
from kernels.shared_compiles import cached_njit

@cached_njit(parallel=True)
def scaled(x, out):
    for i in numba.prange(x.shape[0]):
        out[i] = 3.0 * x[i] + 1.0

scaled_serial = serial_twin(scaled)
'''

RUN = '''
import numpy as np
import twin_module as m
x = np.arange(1000, dtype=np.float64)
a, b = np.empty_like(x), np.empty_like(x)
m.scaled(x, a)
m.scaled_serial(x, b)
hits = [sum(k.stats.cache_hits.values()) for k in (m.scaled, m.scaled_serial)]
fresh = [] if hits[0] else [any("parfor" in o.library.get_llvm_str()
                                for o in k.overloads.values())
                            for k in (m.scaled, m.scaled_serial)]
print(bool(np.array_equal(a, b)), hits, fresh)
'''


def _run(tmp_path: Path) -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]),
               NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", textwrap.dedent(RUN)],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_a_serial_twin_has_its_own_cache_entry_and_the_same_numbers(tmp_path):
    (tmp_path / "twin_module.py").write_text(MODULE)
    # first job: both compiled; only the parallel kernel has a parallel region
    assert _run(tmp_path) == "True [0, 0] [True, False]"
    # next job: each loads its own entry (compiled from one function under one
    # name, the second would have loaded the first's code)
    assert _run(tmp_path) == "True [1, 1] []"
    names = sorted(p.name.split("-")[0] for p in (tmp_path / "cache").rglob("*.nbi"))
    assert names == ["twin_module.scaled", "twin_module.scaled_serial"]
