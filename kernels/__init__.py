"""Per-example gradient kernels (Numba CPU, Numba CUDA, CuPy) and back-end probes."""
