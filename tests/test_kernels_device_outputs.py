"""The kernels' device outputs (``losses=``, ``count=``) on the CPU back-ends.

A CUDA graph cannot read a number back in the middle of a step, so the
fixed-shape step asks ``softmax_xent`` for its rows' losses and the clipping
kernels for their count as tensors (contract in :mod:`kernels`). Here: they
equal what the same kernels return, for every CPU back-end, also for an
empty batch. The CUDA back-ends' twins are checked in
tests/scripts/gpu_simulator_cases.py and gpu_fake_cupy_cases.py.
"""
import pytest
import torch

from kernel_inputs import random_layers
from kernels import registry

BACKENDS = ["numba", "torch"]
DTYPES = [torch.float32, torch.float64]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [0, 1, 9])
def test_clip_rows_count(backend, dtype, k):
    kernel = registry.get("clip_rows", "cpu", backend)
    acts, grads = random_layers(k, (4, 6, 2), dtype, seed=k)
    other = [g.clone() for g in grads]
    f1, f2 = torch.empty(k, dtype=dtype), torch.empty(k, dtype=dtype)
    count = torch.full((1,), -1, dtype=torch.int32)
    n = kernel(acts, grads, 0.2, f1)
    assert kernel(acts, other, 0.2, f2, count=count) is None
    assert int(count) == n and (k < 9 or n > 0)
    assert torch.equal(f1, f2) and all(torch.equal(a, b) for a, b in zip(grads, other))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("k", [0, 7])
def test_clip_linear_rows_count(backend, k):
    kernel = registry.get("clip_linear_rows", "cpu", backend)
    g = torch.Generator().manual_seed(k)
    acts = [torch.randn(k, d, generator=g) for d in (3, 5)]
    grads = [torch.randn(k, d, generator=g) for d in (5, 2)]
    other = [x.clone() for x in grads]
    extra = torch.rand(k, generator=g)
    f1, f2 = torch.empty(k), torch.empty(k)
    count = torch.full((1,), -1, dtype=torch.int32)
    n = kernel(acts, grads, [True, False], extra, 0.5, f1)
    assert kernel(acts, other, [True, False], extra, 0.5, f2, count=count) is None
    assert int(count) == n and torch.equal(f1, f2)
    assert all(torch.equal(a, b) for a, b in zip(grads, other))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [0, 1, 11])
def test_softmax_xent_losses(backend, dtype, k):
    kernel = registry.get("softmax_xent", "cpu", backend)
    g = torch.Generator().manual_seed(k)
    logits = torch.randn(k, 3, generator=g, dtype=dtype) * 2
    labels = torch.randint(0, 3, (k,), generator=g)
    g1, g2 = torch.empty(k, 3, dtype=dtype), torch.empty(k, 3, dtype=dtype)
    losses = torch.full((k + 2,), -1.0, dtype=dtype)
    total = kernel(logits, labels, g1)
    assert kernel(logits, labels, g2, losses=losses) is None
    assert torch.equal(g1, g2)
    assert torch.equal(losses[k:], torch.full((2,), -1.0, dtype=dtype))  # untouched
    want = torch.nn.functional.cross_entropy(logits.double(), labels, reduction="none")
    assert torch.allclose(losses[:k].double(), want, rtol=1e-6 if dtype == torch.float32
                          else 1e-12)
    assert float(losses[:k].double().sum()) == pytest.approx(total, rel=1e-6, abs=1e-9)
