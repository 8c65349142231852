"""Inputs for the per-example kernels, shared by the CPU kernel tests and the
CUDA-simulator and fake-CuPy cases (tests/scripts/gpu_*_cases.py)."""
import torch


def random_layers(k: int, dims: tuple, dtype: torch.dtype, seed: int):
    """Activations (with the trailing ones column) and output gradients of an MLP
    of widths ``dims`` for ``k`` rows: the book-keeping inputs of ``clip_rows``."""
    g = torch.Generator().manual_seed(seed)
    acts = [torch.cat([torch.randn(k, d, generator=g, dtype=dtype),
                       torch.ones(k, 1, dtype=dtype)], 1) for d in dims[:-1]]
    grads = [torch.randn(k, d, generator=g, dtype=dtype) * 0.3 for d in dims[1:]]
    return acts, grads


def cpu_clip_rows():
    """The CPU's ``clip_rows`` the GPU cases compare with: its torch back-end,
    pinned equal to the Numba one by tests/test_kernels_registry.py. The Numba
    one would compile for every layer count and dtype these cases draw (about
    17 s in a fresh clone), shapes no other test uses."""
    from kernels import registry

    return registry.get("clip_rows", "cpu", "torch")
