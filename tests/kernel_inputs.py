"""Inputs for the per-example kernels, shared by the CPU kernel tests and the
CUDA-simulator cases (tests/scripts/gpu_simulator_cases.py)."""
import torch


def random_layers(k: int, dims: tuple, dtype: torch.dtype, seed: int):
    """Activations (with the trailing ones column) and output gradients of an MLP
    of widths ``dims`` for ``k`` rows: the book-keeping inputs of ``clip_rows``."""
    g = torch.Generator().manual_seed(seed)
    acts = [torch.cat([torch.randn(k, d, generator=g, dtype=dtype),
                       torch.ones(k, 1, dtype=dtype)], 1) for d in dims[:-1]]
    grads = [torch.randn(k, d, generator=g, dtype=dtype) * 0.3 for d in dims[1:]]
    return acts, grads
