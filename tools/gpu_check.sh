#!/usr/bin/env bash
# The GPU check, for a GPU machine without network, in under 8 minutes (docs/gpus.md).
#
#   tools/gpu_check.sh [OUT_DIR]      (make gpu-check runs it; default OUT_DIR: gpu-check/)
#
# What the machine's image lacks comes from wheels in .gpu-wheels/ (made on a
# machine with network by tools/gpu_wheels.sh). Steps, each under its own time
# limit (seconds), the limits summing to 545:
#   install  25  unpack the MPICH wheel, install the missing pure wheels
#   tests   150  pytest -m gpu on the files that hold gpu tests (one rank)
#   mpi      45  the gpu and mpi tests on 2 ranks
#   info     15  mpiexec -n 1 mpidp info
#   bench   110  mpidp bench dpsgd --device cuda (4 models, graph/eager, PyTorch, Opacus)
#   train   100  the seed's workload trained on the GPU (graph 3 epochs, eager 2,
#                non-private 3) and on the CPU cores (3)
#   peers   100  whole training runs beside Opacus-DDP on the same GPU (mpidp bench
#                scaling): mnist-small at batch 256, resnet20 at 32 (5,000 images)
# Results (six small files): OUT/bench_dpsgd_cuda.json, OUT/train_seed_workload.json,
# OUT/peers_<model>.json, OUT/summary.txt (printed last) and OUT/logs.txt (the
# tail of every step's output; train's ends with each run's epochs); tools/gpu_tables.py
# renders docs/gpus.md's tables from them. STEPS="tests bench" runs a subset;
# BENCH_MODELS=mlp,resnet20 fewer models; GPU_CHECK_COMMIT names the code
# where the checkout has no .git.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-$ROOT/gpu-check}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export ROOT OUT
export PY=${PYTHON:-python3}
export WHEELS=${GPU_WHEELS:-$ROOT/.gpu-wheels}
STEPS=${STEPS:-install tests mpi info bench train peers}
export SITE=/tmp/mpidp-gpu-site
export MPICH=/tmp/mpidp-gpu-mpich
export NUMBA_CACHE_DIR=/tmp/mpidp-gpu-numba
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export MPIDP_REQUIRE_GPU=1 MPIDP_ALLREDUCE_TUNING_FILE=none
export BIN=/tmp/mpidp-gpu-bin
export PATH="$BIN:$MPICH/mpich.data/data/bin:$PATH"
export LD_LIBRARY_PATH="$MPICH/mpich.data/data/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
cd "$ROOT"

# run NAME LIMIT COMMAND...: the command (or exported function) under its limit,
# its output in OUT/NAME.log
run() {
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    local verdict=ok
    [ $rc -eq 124 ] || [ $rc -eq 137 ] && verdict="TIMED OUT"
    [ $rc -ne 0 ] && [ "$verdict" = ok ] && verdict="FAILED (exit $rc)"
    printf '%-14s %-18s %4ss of %ss\n' "$name" "$verdict" "$((SECONDS - start))" "$limit" \
        >> "$SUMMARY"
    return $rc
}

want() { case " $STEPS " in *" $1 "*) return 0 ;; esac; return 1; }

install() {
    set -e
    rm -rf "$MPICH" && mkdir -p "$MPICH" "$SITE" "$BIN"
    "$PY" -m zipfile -e "$WHEELS"/mpich-*.whl "$MPICH"
    mv "$MPICH"/mpich-*.data "$MPICH/mpich.data"
    chmod +x "$MPICH"/mpich.data/data/bin/*
    # only what the image lacks: its own packages stay first-class
    local missing=""
    for pair in dp_accounting:dp_accounting tree:dm_tree absl:absl_py attr:attrs \
            mpmath:mpmath pytest_mpi:pytest_mpi opacus:opacus wrapt:wrapt \
            opt_einsum:opt_einsum; do
        "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('${pair%%:*}') is None)" \
            || missing="$missing $(ls "$WHEELS"/"${pair#*:}"-*.whl)"
    done
    [ -z "$missing" ] || "$PY" -m pip install -q --no-index --no-deps --target "$SITE" $missing
    cat > "$BIN/mpidp" <<EOF
#!/bin/sh
exec "$PY" -c 'import sys; from engine.cli import console; sys.argv[0] = "mpidp"; sys.exit(console())' "\$@"
EOF
    chmod +x "$BIN/mpidp"
    "$PY" -c "import torch, numpy; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'numpy', numpy.__version__, torch.cuda.get_device_name(0))"
    mpiexec --version | head -2
    echo "installed:$missing"
}

GPU_TEST_FILES=$(grep -l "pytest.mark.gpu\|mark.gpu" tests/test_*.py | tr '\n' ' ')

export -f install
want install && run install 25 bash -c install
want tests && run tests 150 "$PY" -m pytest $GPU_TEST_FILES -m gpu --with-mpi -q -ra \
    -p no:cacheprovider --timeout=140
want mpi && run mpi 45 mpiexec -n 2 "$PY" -m pytest $GPU_TEST_FILES -m "gpu and mpi" \
    --with-mpi -q -ra -p no:cacheprovider --timeout=40
# after the tests: a fresh machine's first Numba compiles are theirs, not info's
want info && run info 15 mpiexec -n 1 mpidp info
want bench && run bench 110 mpidp bench dpsgd --device cuda --steps 60 --repeats 3 \
    --models "${BENCH_MODELS:-mlp,embedding-mlp,mnist-small,resnet20}" \
    --json "$OUT/bench_dpsgd_cuda.json"

train() {
    set -e
    local data=/tmp/mpidp-gpu-seed.h5 common="--epochs 3 --target-epsilon 1 --delta 1e-6 --seed 0 --no-progress"
    [ -f "$data" ] || "$PY" -m engine.bench.synthetic --rows 790000 --test-rows 10000 \
        --features 100 --seed 0 --out "$data"
    for run in "cuda_graph --device cuda" "cuda_eager --device cuda --cuda-graph off" \
            "cuda_nodp --device cuda" "cpu --device cpu"; do
        set -- $run
        local name=$1
        shift
        local extra=$common
        [ "$name" = cuda_nodp ] && extra="--epochs 3 --no-dp --seed 0 --no-progress"
        [ "$name" = cuda_eager ] && extra="${extra/--epochs 3/--epochs 2}"
        echo "== $name: mpidp train $* $extra"
        mpiexec -n 1 mpidp train --data "$data" "$@" $extra --metrics "/tmp/mpidp-gpu-$name.jsonl"
    done
    # each run's epochs (the first pays compiles and captures): seconds and phases,
    # printed and kept as OUT/train_seed_workload.json
    "$PY" "$ROOT/tools/gpu_train_record.py"
}
export -f train
want train && run train 100 bash -c train

peers() {
    set -e
    local cache=/tmp/mpidp-gpu-cache
    mpidp bench scaling --device cuda --ranks 1 --preset dp-sweep --models mnist-small \
        --batch-sizes 256 --data-repeats 1 --privacy dp --cache "$cache" \
        --json "$OUT/peers_mnist-small.json"
    mpidp bench scaling --device cuda --ranks 1 --preset mlbench-1a --privacy dp --epochs 2 \
        --rows 5000 --test-rows 1000 --cache "$cache" --json "$OUT/peers_resnet20.json"
}
export -f peers
want peers && run peers 100 bash -c peers

echo "== gpu check, $(date -u +%FT%TZ), ${GPU_CHECK_COMMIT:-$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null)}"
[ -f "$OUT/tests.log" ] && tail -n 3 "$OUT/tests.log"
[ -f "$OUT/bench.log" ] && grep -E "^[a-z0-9-]+:|DP / non-DP|eager / graph|Opacus ghost|step" "$OUT/bench.log" | head -40
[ -f "$OUT/train.log" ] && grep -E "^== |^epoch |CUDA graph|eager step" "$OUT/train.log"
[ -f "$OUT/peers.log" ] && grep -iE "opacus|examples/s" "$OUT/peers.log" | head -20
cat "$SUMMARY"
# the steps' logs as one file (the tail of each): what comes back from a lent
# machine is limited in number of files, not only in size
: > "$OUT/logs.txt"
for name in install info tests mpi bench train peers; do
    [ -f "$OUT/$name.log" ] || continue
    { echo "==== $name"; tail -c 6000 "$OUT/$name.log"; echo; } >> "$OUT/logs.txt"
    rm -f "$OUT/$name.log"
done
