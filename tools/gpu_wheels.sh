#!/usr/bin/env bash
# The wheels tools/gpu_check.sh installs on a GPU machine without network, downloaded
# here (a machine with PyPI) into .gpu-wheels/ for that machine's Python (default 3.12,
# what the GPU images seen so far run: docs/gpus.md). About 15 MB; carry the folder.
#   tools/gpu_wheels.sh [PYTHON_VERSION]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VERSION=${1:-3.12}
DEST=$ROOT/.gpu-wheels
mkdir -p "$DEST"
# The image has torch, numpy, CuPy, Numba (CUDA), h5py, scipy, pytest; mpidp also needs
# an MPI library, the accountant and its dependencies, pytest-mpi, and Opacus for the
# benchmark's peers. polars (prep) is left out: the check writes its data itself.
python3 -m pip download --no-deps --only-binary=:all: --python-version "$VERSION" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$DEST" \
    mpich==5.0.2 dp-accounting==0.6.0 dm-tree absl-py attrs mpmath wrapt pytest-mpi \
    opacus==1.6.0 opt-einsum
ls -l "$DEST"
