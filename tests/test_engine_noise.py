"""Noise is added exactly once: the reduced buffer carries N(0, (sigma C)^2) at any rank count."""
import numpy as np
import pytest
import torch
from scipy import stats

import collectives
from engine.dp.noise import GaussianNoise

D = 200_000


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("scheme,secure", [("partition", False), ("split", False),
                                           ("partition", True)])
def test_reduced_noise_has_the_target_variance(comm, scheme, secure):
    std = 2.5
    noise = GaussianNoise(D, std, comm.Get_size(), comm.Get_rank(), seed=11, scheme=scheme,
                          secure=secure)
    buf = np.zeros(D, dtype=np.float32)
    noise.add_(torch.from_numpy(buf))
    collectives.allreduce(buf, comm)
    x = buf.astype(np.float64)
    # sd of the sample variance is sqrt(2/D) sigma^2 ~ 0.32%; margin 2% is > 6 sd,
    # while noise added on every rank in full would be off by (p - 1) * 100%.
    assert x.var() / std**2 == pytest.approx(1.0, abs=0.02)
    assert abs(x.mean()) < 6 * std / np.sqrt(D)


@pytest.mark.mpi(min_size=2)
def test_rank_streams_are_independent(comm):
    """Each rank's own draws are uncorrelated with rank 0's."""
    noise = GaussianNoise(D, 1.0, comm.Get_size(), comm.Get_rank(), seed=5, scheme="split")
    buf = torch.zeros(D)
    noise.add_(buf)
    zero = comm.bcast(buf.numpy().copy() if comm.Get_rank() == 0 else None, root=0)
    if comm.Get_rank() != 0:
        r = np.corrcoef(zero, buf.numpy())[0, 1]
        assert abs(r) < 6 / np.sqrt(D)


def test_partition_covers_every_coordinate_once():
    for size in (1, 2, 3, 4, 7):
        covered = np.zeros(1001, dtype=int)
        for rank in range(size):
            n = GaussianNoise(1001, 1.0, size, rank, seed=0)
            covered[n.lo:n.hi] += 1
        assert (covered == 1).all()


def test_noise_is_reproducible_from_the_seed():
    a, b = (torch.zeros(1000) for _ in range(2))
    GaussianNoise(1000, 1.0, 2, 1, seed=9).add_(a)
    GaussianNoise(1000, 1.0, 2, 1, seed=9).add_(b)
    assert torch.equal(a, b) and torch.count_nonzero(a[:500]) == 0


def test_secure_noise_is_keyed_by_the_os_not_the_seed_and_is_gaussian():
    """--secure-noise: two runs with one seed draw different noise (a known
    --seed reveals nothing), and the sum of four half-deviation draws is
    N(0, std^2) (unseeded, so the bounds are 6-7 standard errors: no flakes)."""
    std, n = 0.7, 400_000
    a, b = torch.zeros(n), torch.zeros(n)
    GaussianNoise(n, std, 1, 0, seed=9, secure=True).add_(a)
    GaussianNoise(n, std, 1, 0, seed=9, secure=True).add_(b)
    assert not torch.equal(a, b)
    x = a.double().numpy() / std
    assert abs(x.mean()) < 6 / np.sqrt(n) and abs(x.var() - 1) < 6 * np.sqrt(2 / n)
    assert abs(stats.kurtosis(x)) < 7 * np.sqrt(24 / n)
    assert stats.kstest(x, "norm").pvalue > 1e-7
    assert abs(np.corrcoef(x, b.double().numpy())[0, 1]) < 6 / np.sqrt(n)


@pytest.mark.mpi(min_size=1)
def test_secure_noise_runs_end_to_end_and_is_not_reproducible(comm, shared_tmp):
    import engine
    from engine.bench import synthetic

    path = shared_tmp / "noise.h5"
    if comm.Get_rank() == 0:
        synthetic.write(path, rows=800, features=12, seed=2)
    comm.Barrier()
    common = dict(comm=comm, epochs=1, batch_size=80, noise_multiplier=1.0, seed=3,
                  quiet=True, allreduce="ring")
    runs = [engine.train(str(path), secure_noise=secure, **common)
            for secure in (False, False, True, True)]
    flat = [torch.cat([p.detach().reshape(-1) for p in r.model.parameters()]) for r in runs]
    assert torch.equal(flat[0], flat[1])  # seeded noise: reproducible
    assert not torch.equal(flat[2], flat[3]) and not torch.equal(flat[0], flat[2])
    assert runs[2].epsilon == runs[0].epsilon  # the same sigma, the same accounting


@pytest.mark.parametrize("secure", [False, True])
def test_a_bound_noise_adds_what_add_adds_and_nothing_outside_its_part(secure):
    """``bind(buf)()`` adds this rank's part's draws, as many per coordinate as
    the mode takes (secure: four of half the deviation), to that part only;
    checked against the stream's own ``add_`` from the same state. A rank
    without coordinates adds nothing."""
    noise = GaussianNoise(1000, 1.5, 2, 1, seed=4, secure=secure)
    start = noise.get_state()
    x = torch.zeros(1000)
    bound = noise.bind(x)
    bound()
    bound()
    stream = GaussianNoise(1000, 1.5, 2, 1, seed=4).stream
    stream.set_state(start)
    want = torch.zeros(500)
    for _ in range(2 * (4 if secure else 1)):
        stream.add_(want, 0.75 if secure else 1.5)
    assert torch.equal(x[500:], want) and torch.count_nonzero(want) == 500
    assert torch.count_nonzero(x[:500]) == 0
    empty = torch.zeros(3)
    GaussianNoise(3, 1.0, 8, 0, seed=1).bind(empty)()  # rank 0 of 8 owns no coordinate
    assert torch.count_nonzero(empty) == 0
