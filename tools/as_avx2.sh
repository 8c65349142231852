#!/usr/bin/env bash
# Run a command as if this AVX-512 CPU had AVX2 only: every library mpidp's
# speed rests on is told to leave AVX-512 alone, so a benchmark measures the
# AVX2 code an AVX2 machine (AMD Zen 3, older Xeons) would run -- on this
# machine's cores, caches and clock, which is why the results say "limited",
# never "an AVX2 machine".
#
#   tools/as_avx2.sh mpidp bench dpsgd --threads 1 --json run.json
#
# Numba: NUMBA_CPU_FEATURES = this CPU's features with every AVX-512 one off
# (mpidp's vector-width choice then stands aside: kernels/numba_target.py);
# torch's kernels: ATEN_CPU_CAPABILITY; MKL's GEMMs (torch's and the fused
# step's): MKL_ENABLE_INSTRUCTIONS; oneDNN: ONEDNN_MAX_CPU_ISA; numpy's
# dispatch: NPY_DISABLE_CPU_FEATURES. MPIDP_ISA_LIMIT=avx2 makes the
# benchmarks' machine facts drop the AVX-512 flags and say so
# (collectives/machine.py), so the speed guard keeps these runs apart.
set -euo pipefail
if [ $# -eq 0 ]; then
    sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
fi
python=${PYTHON:-python}
features=$("$python" -c '
import llvmlite.binding as llvm
llvm.initialize_native_target()
flags = llvm.get_host_cpu_features().flatten().split(",")
if "+avx512f" not in flags:
    raise SystemExit(0)  # nothing to leave unused: empty output
print(",".join("-" + f[1:] if f[1:].startswith("avx512") else f for f in flags if f))' \
    2>/dev/null) || { echo "tools/as_avx2.sh: needs mpidp's Python (with llvmlite) as" \
                           "'python' on PATH, or PYTHON=..." >&2; exit 2; }
if [ -z "$features" ]; then
    echo "tools/as_avx2.sh: this CPU has no AVX-512 to leave unused:" \
         "running the command as it is" >&2
    exec "$@"
fi
numpy_off=$("$python" -c '
import numpy as np
from numpy._core._multiarray_umath import __cpu_dispatch__ as dispatch
print(" ".join(f for f in dispatch if f.startswith("AVX512")))' 2>/dev/null || true)
export NUMBA_CPU_FEATURES="$features"
export ATEN_CPU_CAPABILITY=avx2
export MKL_ENABLE_INSTRUCTIONS=AVX2
export ONEDNN_MAX_CPU_ISA=AVX2
export NPY_DISABLE_CPU_FEATURES="$numpy_off"
export MPIDP_ISA_LIMIT=avx2
exec "$@"
