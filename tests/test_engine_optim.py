"""The flat-buffer optimizers match torch.optim on the same gradients."""
import pytest
import torch

from engine.nn.optim import SGD, Adam


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_matches_torch(momentum, backend):
    g = torch.Generator().manual_seed(0)
    p0 = torch.randn(50, generator=g, dtype=torch.float64)
    grads = [torch.randn(50, generator=g, dtype=torch.float64) for _ in range(6)]
    mine = SGD(p0.clone(), lr=0.1, momentum=momentum, backend=backend)
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.SGD([ref], lr=0.1, momentum=momentum)
    buffer = torch.empty(50, dtype=torch.float64)  # one buffer, as the trainer passes
    for i, grad in enumerate(grads):
        if i % 2:
            mine.step(torch.mul(grad, 4, out=buffer), scale=0.25)
        else:
            mine.step(grad * 4, scale=0.25)  # another buffer: the kernel re-binds
        ref.grad = grad.clone()
        opt.step()
    assert torch.allclose(mine.params, ref.detach(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("weight_decay", [0.0, 1e-2])
def test_nesterov_sgd_matches_torch(weight_decay):
    g = torch.Generator().manual_seed(1)
    p0 = torch.randn(30, generator=g, dtype=torch.float64)
    mine = SGD(p0.clone(), lr=0.05, momentum=0.9, weight_decay=weight_decay, nesterov=True)
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.SGD([ref], lr=0.05, momentum=0.9, weight_decay=weight_decay,
                          nesterov=True)
    for _ in range(5):
        grad = torch.randn(30, generator=g, dtype=torch.float64)
        mine.step(grad * 2, scale=0.5)
        ref.grad = grad.clone()
        opt.step()
    assert torch.allclose(mine.params, ref.detach(), rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="momentum"):
        SGD(p0.clone(), lr=0.1, momentum=0.0, nesterov=True)


def test_sgd_kernel_backend_falls_back_when_forced_one_has_none():
    p = torch.zeros(4)
    assert SGD(p, lr=0.1, momentum=0.9)._kernel.backend == "numba"
    assert SGD(p, lr=0.1, momentum=0.9, backend="torch")._kernel.backend == "torch"
    # --kernels cupy on the CPU names a back-end without a kernel there: the best one is used
    assert SGD(p, lr=0.1, momentum=0.9, backend="cupy")._kernel.backend == "numba"


def test_adam_matches_torch_and_restores():
    g = torch.Generator().manual_seed(1)
    p0 = torch.randn(40, generator=g, dtype=torch.float64)
    grads = [torch.randn(40, generator=g, dtype=torch.float64) for _ in range(6)]
    mine = Adam(p0.clone(), lr=0.01)
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.Adam([ref], lr=0.01)
    for i, grad in enumerate(grads):
        mine.step(grad, scale=1.0)
        ref.grad = grad.clone()
        opt.step()
        if i == 2:
            copy = Adam(mine.params.clone(), lr=0.01)
            copy.load_state_dict(mine.state_dict())
    assert torch.allclose(mine.params, ref.detach(), rtol=1e-10, atol=1e-12)
    for grad in grads[3:]:
        copy.step(grad)
    assert torch.allclose(copy.params, mine.params, rtol=0, atol=0)
