"""Per-example gradient kernels and the SGD update (Numba CPU, Numba CUDA, CuPy), and back-end probes."""
