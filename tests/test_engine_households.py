"""The household as the privacy unit: per-household clipping against a loop over
households, household sampling, shards cut on household boundaries, and
``mpidp train --privacy-unit household`` end to end, with its bad inputs.

The references are independent of the code under test: the per-household
gradient is the sum of the members' gradients from the naive per-example
loop (:func:`engine.dp.naive.naive_clipped_sum` without clipping), its norm
and clip factor computed explicitly, one household at a time.
"""
import io
import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from engine import checkpoint as ckpt
from engine.bench import synthetic
from engine.config import TrainConfig
from engine.dp.naive import naive_clipped_sum
from engine.dp.sampler import HouseholdSampler
from engine.errors import ConfigError, DataError
from engine.dp.fast_mlp import FastMLP
from engine.nn.mlp import MLPSpec, flat_from_module, init_params, to_module
from engine.shard import read_info, read_shard
from engine.trainer import Trainer
from kernel_inputs import random_layers
from kernels import registry
from launcher import mpidp

SETTINGS = settings(max_examples=15, deadline=None)
#: Households of 1-20 persons, and batches of none to several households.
household_sizes = st.lists(st.integers(1, 20), min_size=0, max_size=6)
clip_bounds = st.sampled_from([1e-3, 0.3, 1e9])
#: Hidden widths: 1 to 3 layers. The Numba step is compiled once per layer count
#: and dtype (seconds each, in a fresh clone); it is checked at every depth
#: against the composed ops in tests/test_kernels_mlp_step.py, so here it runs
#: at the depth those tests compile, and the torch back-end draws every depth.
DEPTHS = {"torch": st.sampled_from([(), (5,), (6, 4)]), "numba": st.just((6, 4))}


def _offsets(sizes) -> torch.Tensor:
    return torch.tensor(np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]),
                        dtype=torch.int64)


def _household_loop(spec, params, x, y, sizes, C):
    """sum_h min(1, C/|G_h|) G_h with G_h the household's summed gradient, one
    household at a time (float64), in the flat [W | b] layout; also the norms."""
    total = torch.zeros(spec.n_params, dtype=torch.float64)
    norms, start = [], 0
    for size in sizes:
        model = to_module(spec, params.double())
        g, _, _ = naive_clipped_sum(model, x[start:start + size].double(),
                                    y[start:start + size], None)
        # naive returns [W, b] per layer in parameter order: back to [W | b]
        offset = 0
        for m in (m for m in model if isinstance(m, nn.Linear)):
            w, b = m.weight.numel(), m.bias.numel()
            m.weight.data = g[offset:offset + w].view_as(m.weight)
            m.bias.data = g[offset + w:offset + w + b]
            offset += w + b
        flat = flat_from_module(spec, model)
        norm = float(flat.norm())
        norms.append(norm)
        total += min(1.0, C / norm) * flat if norm > 0 else flat
        start += size
    return total, norms


@pytest.mark.parametrize("backend", ["numba", "torch"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@SETTINGS
@given(sizes=household_sizes, C=clip_bounds, classes=st.sampled_from([2, 3]),
       seed=st.integers(0, 10_000), data=st.data())
def test_household_clipping_matches_a_loop_over_households(backend, dtype, sizes, C, classes,
                                                           seed, data):
    """FastMLP with groups: the clipped sum of households' summed gradients
    equals the loop over households (float64: to 1e-10; float32: to float32
    rounding), and the clipped-row count is the rows of households clipped."""
    spec = MLPSpec.build(4, data.draw(DEPTHS[backend], label="hidden"), classes)
    params = init_params(spec, seed, dtype=dtype)
    grad = torch.full_like(params, float("nan"))  # must be overwritten entirely
    engine = FastMLP(spec, params, grad, capacity=3, backend=backend)
    k = sum(sizes)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(k, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, classes, (k,), generator=g)
    X = torch.cat([x, torch.ones(k, 1, dtype=torch.float64)], 1).to(dtype)
    n = engine.load(X, y, torch.arange(k))
    loss, clipped = engine.clipped_sum(n, C, _offsets(sizes))
    want, norms = _household_loop(spec, params, X[:, :-1], y, sizes, C)
    if dtype == torch.float64:
        assert torch.allclose(grad, want, rtol=1e-10, atol=1e-12)
    else:
        scale = max(1.0, float(want.abs().max()))
        assert torch.allclose(grad.double(), want, rtol=1e-4, atol=1e-5 * scale)
    assert clipped == sum(s for s, norm in zip(sizes, norms) if norm > C * (1 + 1e-6)) or \
        any(abs(norm - C) <= 1e-6 * C for norm in norms)
    assert k > 0 or (loss == 0.0 and torch.count_nonzero(grad) == 0)


def test_the_norm_of_a_sum_is_not_the_sum_of_norms():
    """Two identical persons: the household's gradient is twice one person's, so
    its norm is twice theirs (per-person clipping would bound it by 2C, the
    household clip by C)."""
    spec = MLPSpec.build(3, (4,), 2)
    params = init_params(spec, 1, dtype=torch.float64)
    grad = torch.empty_like(params)
    engine = FastMLP(spec, params, grad, backend="numba")
    X = torch.tensor([[0.5, -1.0, 2.0, 1.0]] * 2, dtype=torch.float64)
    y = torch.tensor([1, 1])
    engine.load(X, y, torch.arange(2))
    engine.clipped_sum(2, None)
    household = float(grad.norm())
    engine.clipped_sum(2, household / 4, torch.tensor([0, 2]))
    assert float(grad.norm()) == pytest.approx(household / 4, rel=1e-12)
    engine.clipped_sum(2, household / 4)  # per person: each clipped to C, summed: 2C
    assert float(grad.norm()) == pytest.approx(household / 2, rel=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("sizes", [[], [1], [3, 1, 20], [1] * 9, [2, 7, 5, 1, 1]])
@pytest.mark.parametrize("C", [1e-3, 1.5, 1e6])
def test_clip_groups_numba_equals_torch_and_clip_rows_for_singletons(dtype, sizes, C):
    k = sum(sizes)
    out = {}
    for backend in ("numba", "torch"):
        acts, grads = random_layers(k, (5, 7, 3), dtype, seed=k)
        factors = torch.full((k + 2,), -1.0, dtype=dtype)
        n = registry.get("clip_groups", "cpu", backend)(acts, grads, _offsets(sizes), C,
                                                        factors)
        out[backend] = (n, factors[:k], grads)
    (n1, f1, g1), (n2, f2, g2) = out["numba"], out["torch"]
    assert n1 == n2
    tol = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-12, atol=0)
    assert torch.allclose(f1, f2, **tol)
    assert all(torch.allclose(a, b, **tol) for a, b in zip(g1, g2))
    starts = _offsets(sizes)
    for h in range(len(sizes)):  # one factor per household
        block = f1[starts[h]:starts[h + 1]]
        assert bool((block == block[0]).all()) and 0 < float(block[0]) <= 1
    if sizes and all(s == 1 for s in sizes):
        acts, grads = random_layers(k, (5, 7, 3), dtype, seed=k)
        factors = torch.empty(k, dtype=dtype)
        assert registry.get("clip_rows", "cpu", "numba")(acts, grads, C, factors) == n1
        assert torch.allclose(factors, f1, **tol)


def test_household_sampler_takes_whole_households_at_rate_q():
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 21, size=300)
    starts = np.concatenate([[0], np.cumsum(sizes)])
    q, steps = 0.05, 3000
    sampler = HouseholdSampler(starts, q, seed=1, rank=0)
    assert sampler.expected_local_batch() == pytest.approx(q * starts[-1])
    picked = np.zeros(len(sizes))
    empty = 0
    for step in range(steps):
        rows = sampler.sample(step)
        groups = sampler.groups
        assert rows.dtype == np.int64 and groups[0] == 0 and groups[-1] == rows.size
        assert np.all(np.diff(rows) > 0)  # sorted, distinct
        empty += rows.size == 0
        for h in range(groups.size - 1):
            members = rows[groups[h]:groups[h + 1]]
            home = np.searchsorted(starts, members[0], side="right") - 1
            assert np.array_equal(members, np.arange(starts[home], starts[home + 1]))
            picked[home] += 1
    # every household with probability q, whatever its size
    assert abs(picked.mean() / steps - q) < 4 * np.sqrt(q * (1 - q) / steps / len(sizes))
    big, small = picked[sizes > 10].mean(), picked[sizes <= 10].mean()
    assert abs(big - small) / steps < 0.01
    state = sampler.get_state()
    first = [sampler.sample(i).copy() for i in range(3)]
    sampler.set_state(state)
    assert all(np.array_equal(f, sampler.sample(i)) for i, f in enumerate(first))
    nothing = HouseholdSampler(np.array([0, 3]), 1e-9, seed=2, rank=0)
    assert nothing.sample(0).size == 0 and nothing.groups.tolist() == [0]


@pytest.mark.mpi(min_size=1)
def test_shards_end_on_household_boundaries(comm, shared_tmp):
    path = str(shared_tmp / "h.h5")
    if comm.Get_rank() == 0:
        synthetic.write(path, rows=997, features=3, test_rows=50, seed=3)
    comm.Barrier()
    info = read_info(path, comm)
    shard = read_shard(info, "train", comm, min_rows_per_rank=1, unit="household")
    import h5py

    with h5py.File(path, "r") as f:
        keys = f["train/household"][:]
    mine = keys[shard.offset:shard.offset + shard.n_local]
    # its households are whole: the row before and after belong to others
    if shard.offset > 0:
        assert keys[shard.offset - 1] != keys[shard.offset]
    end = shard.offset + shard.n_local
    if end < len(keys):
        assert keys[end - 1] != keys[end]
    starts = shard.groups
    assert starts[0] == 0 and starts[-1] == shard.n_local
    for h in range(len(starts) - 1):
        block = mine[starts[h]:starts[h + 1]]
        assert (block == block[0]).all()
        if h:
            assert mine[starts[h] - 1] != block[0]
    # the ranks' ranges partition the split; households counted once
    ranges = comm.allgather((shard.offset, end))
    assert ranges[0][0] == 0 and ranges[-1][1] == len(keys)
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert shard.units_total == len(np.unique(keys)) == json.loads(
        h5py.File(path, "r").attrs["households"])["train"]
    person = read_shard(info, "train", comm, unit="person")
    assert person.groups is None and person.units_total == len(keys)


def _persons_shuffled(path: str, seed: int = 0) -> None:
    """Permute the /train rows of ``path`` person by person (X, y and household
    keys alike, keys kept): a layout `mpidp prep` never writes, with a
    household's rows scattered over the split."""
    import h5py

    with h5py.File(path, "r+") as f:
        perm = np.random.default_rng(seed).permutation(f["train/y"].shape[0])
        for name in ("train/X", "train/y", "train/household"):
            f[name][...] = f[name][:][perm]


def _households_by_first_row(keys: np.ndarray) -> list[list[int]]:
    """The reference: each key's rows in file order, keys in the order of their
    first row (a loop over the rows, no numpy grouping)."""
    rows: dict = {}
    for i, key in enumerate(keys.tolist()):
        rows.setdefault(key, []).append(i)
    return list(rows.values())


@pytest.mark.parametrize("seed", range(4))
def test_group_by_key_keeps_each_household_whole_whatever_the_row_order(seed):
    """Consecutive households are the file's runs (no reordering); shuffled ones
    are grouped by key, households in the order of their first row, each
    one's rows in file order; a key that comes back later is the same household."""
    from engine.shard import group_by_key

    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 9, size=rng.integers(1, 60))
    keys = np.repeat(rng.choice(2 ** 62, size=sizes.size, replace=False).astype(np.uint64),
                     sizes)
    grouped = group_by_key(keys)
    assert grouped.order is None
    assert grouped.starts.tolist() == [0, *np.cumsum(sizes).tolist()]
    shuffled = keys[rng.permutation(keys.size)]
    layout = group_by_key(shuffled)
    want = _households_by_first_row(shuffled)
    assert layout.households == len(want) == sizes.size
    got = [layout.order[a:b].tolist() if layout.order is not None else list(range(a, b))
           for a, b in zip(layout.starts[:-1], layout.starts[1:])]
    assert got == want
    back = group_by_key(np.array([5, 5, 7, 5, 9], dtype=np.uint64))
    assert back.order.tolist() == [0, 1, 3, 2, 4] and back.starts.tolist() == [0, 3, 4, 5]
    assert group_by_key(np.zeros(0, dtype=np.uint64)).starts.tolist() == [0]


@pytest.mark.mpi(min_size=1)
def test_a_file_whose_households_are_not_consecutive_is_grouped_by_key(comm, shared_tmp):
    """Rows shuffled person by person: each rank still holds whole households
    (no key on two ranks), every row once, the file's rows and labels at their
    places, N counted as the distinct keys, and a training run's N and first
    line say the households (before: one household per row)."""
    import h5py

    path = str(shared_tmp / "scattered.h5")
    if comm.Get_rank() == 0:
        synthetic.write(path, rows=900, features=4, test_rows=60, seed=8)
        _persons_shuffled(path)
    comm.Barrier()
    info = read_info(path, comm)
    shard = read_shard(info, "train", comm, min_rows_per_rank=1, unit="household")
    with h5py.File(path, "r") as f:
        keys, X, y = f["train/household"][:], f["train/X"][:], f["train/y"][:]
    distinct = len(np.unique(keys))
    assert distinct < len(keys) // 2  # the file's households have several rows
    assert shard.units_total == distinct and shard.rows is not None
    assert np.array_equal(shard.X[:, :-1], X[shard.rows]) and np.array_equal(shard.y,
                                                                              y[shard.rows])
    assert [shard.file_row(i) for i in (0, shard.n_local - 1)] == [shard.rows[0],
                                                                   shard.rows[-1]]
    mine = keys[shard.rows]
    blocks = [mine[a:b] for a, b in zip(shard.groups[:-1], shard.groups[1:])]
    assert all(b.size and (b == b[0]).all() for b in blocks)
    assert len({int(b[0]) for b in blocks}) == len(blocks)  # one block per key
    everything = comm.allgather((shard.rows, sorted({int(b[0]) for b in blocks})))
    rows = np.concatenate([r for r, _ in everything])
    assert np.array_equal(np.sort(rows), np.arange(len(keys)))
    assert sum(len(k) for _, k in everything) == distinct  # no key on two ranks
    cfg = TrainConfig(data=path, epochs=1, batch_size=20, hidden=(4,), noise_multiplier=1.0,
                      seed=3, progress=False, privacy_unit="household")
    cfg.validate()
    out = io.StringIO()
    trainer = Trainer(cfg, comm, out=out)
    assert trainer.run() == 0
    assert trainer.n_train == distinct and trainer.q == 20 / distinct
    if comm.Get_rank() == 0:
        assert f"({len(keys):,} training rows in {distinct:,} households" in \
            out.getvalue().splitlines()[0]


def test_a_file_without_household_keys_is_refused_for_the_household_unit(tmp_path):
    from collectives.runtime import MPI

    old = synthetic.write(tmp_path / "v1.h5", rows=50, features=3, households=False)
    info = read_info(old)
    assert not info.households
    read_shard(info, "train", MPI.COMM_SELF, unit="person")  # still readable
    with pytest.raises(DataError, match=r"has no household keys .* re-run `mpidp prep`"):
        read_shard(info, "train", MPI.COMM_SELF, unit="household")


@pytest.mark.mpi(min_size=1)
def test_household_training_runs_on_every_rank_count(comm, shared_tmp):
    """Same steps and model on every rank, N counted as households in the
    accountant, the first line saying whom epsilon protects."""
    path = str(shared_tmp / "t.h5")
    if comm.Get_rank() == 0:
        synthetic.write(path, rows=1200, features=5, test_rows=100, seed=6)
    comm.Barrier()
    cfg = TrainConfig(data=path, epochs=2, batch_size=20, hidden=(8,), target_epsilon=2.0,
                      seed=3, progress=False, privacy_unit="household")
    cfg.validate()
    out = io.StringIO()
    trainer = Trainer(cfg, comm, out=out)
    assert trainer.run() == 0
    import h5py

    households = json.loads(h5py.File(path, "r").attrs["households"])["train"]
    assert trainer.n_train == households and trainer.q == 20 / households
    assert trainer.steps_per_epoch == round(households / 20)
    assert trainer.accountant.epsilon() <= 2.0
    if comm.Get_rank() == 0:
        first = out.getvalue().splitlines()[0]
        assert first.startswith("mpidp train: epsilon protects each household (all its "
                                "rows at once);") and f"in {households:,} households" in first
        done = [x for x in out.getvalue().splitlines() if x.startswith("done:")]
        assert "per household" in done[0]
    params = comm.allgather(trainer.params.numpy().tobytes())
    assert len(set(params)) == 1
    # more rows per step than households: whole households are sampled
    assert trainer.history[-1]["train_examples"] > 20 * trainer.steps_per_epoch


def _train_cli(n, tmp_path, *extra):
    return mpidp(n, "train", "--hidden", "4", "--epochs", "1", "--batch-size", "8",
                 "--seed", "1", "--no-progress", *extra, timeout=180)


def test_bad_input_is_one_line_on_every_rank_and_writes_nothing(tmp_path, capsys):
    """Each bad input: exit 2 from the job, one line from rank 0, no traceback,
    no metrics file, no checkpoint directory. The first at 2 ranks; the others,
    refused the same way before any rank trains, through the same entry point
    in this process."""
    from engine.cli import main

    old = synthetic.write(tmp_path / "v1.h5", rows=200, features=3, households=False)
    new = synthetic.write(tmp_path / "v2.h5", rows=200, features=3)
    metrics, run = tmp_path / "m.jsonl", tmp_path / "run"
    outputs = ["--metrics", str(metrics), "--checkpoint-dir", str(run)]
    cases = [
        (["--data", old, "--target-epsilon", "1", "--privacy-unit", "household"],
         "has no household keys (prepared by an older mpidp, format_version 1); re-run "
         "`mpidp prep`"),
        (["--data", new, "--target-epsilon", "1e-9", "--epochs", "1"],
         "is out of reach"),
        (["--data", new, "--noise-multiplier", "0.001", "--epochs", "2"],
         "use --accountant rdp"),  # dp-accounting's PLD overflows: one line, not its traceback
    ]
    for number, (argv, message) in enumerate(cases):
        if number == 0:
            result = _train_cli(2, tmp_path, *argv, *outputs)
            code, stderr = result.returncode, result.stderr
        else:
            capsys.readouterr()
            with pytest.raises(SystemExit) as stopped:
                main(["train", "--hidden", "4", "--epochs", "1", "--batch-size", "8", "--seed",
                      "1", "--no-progress", *map(str, argv), *outputs])
            code, stderr = stopped.value.code, capsys.readouterr().err
        assert code == 2, (argv, stderr)
        assert stderr.count(message) == 1, (argv, stderr)
        assert len(stderr.strip().splitlines()) == 1, stderr
        assert "Traceback" not in stderr
        assert not metrics.exists() and not run.exists()


def test_a_delta_above_one_over_n_names_households_for_the_household_unit(tmp_path):
    """N is households with the household unit: the refusal (and the warning
    --allow-large-delta lets through) counts households and says a random
    household would be released, not a row; the person unit says rows."""
    import h5py
    from collectives.runtime import MPI
    from engine.errors import PrivacyError

    path = synthetic.write(tmp_path / "d.h5", rows=600, features=4, test_rows=40)
    households = json.loads(h5py.File(path, "r").attrs["households"])["train"]
    rows = read_info(path).rows["train"]
    assert households < rows
    delta = 1.5 / households  # above 1/N for either unit

    def trainer(unit: str, allow: bool = False) -> Trainer:
        cfg = TrainConfig(data=path, epochs=1, batch_size=8, hidden=(4,), seed=1,
                          noise_multiplier=1.0, delta=delta, progress=False,
                          privacy_unit=unit, allow_large_delta=allow)
        cfg.validate()
        run = Trainer(cfg, MPI.COMM_SELF, out=io.StringIO())
        run.setup()
        return run

    for unit, n, one in (("household", households, "household"), ("person", rows, "row")):
        with pytest.raises(PrivacyError) as refused:
            trainer(unit)
        message = str(refused.value)
        assert message.startswith(f"--delta {delta:g} is above 1/N = {1 / n:.3g} for the "
                                  f"{n:,} training {one}s of {path}: a guarantee with "
                                  f"delta > 1/N is met by releasing a random {one} in the "
                                  "clear"), message
        assert refused.value.collective
        warning = trainer(unit, allow=True).large_delta
        assert warning.endswith(f"training {one}s of {path}: the guarantee permits releasing "
                                f"a {one} in the clear"), warning


def test_a_resumed_run_keeps_its_unit_and_accountant(tmp_path):
    from collectives.runtime import MPI

    path = synthetic.write(tmp_path / "d.h5", rows=300, features=4, test_rows=40)
    d = str(tmp_path / "ck")
    base = dict(data=path, epochs=2, batch_size=16, hidden=(4,), noise_multiplier=1.0,
                seed=2, progress=False, checkpoint_dir=d)
    cfg = TrainConfig(**base, privacy_unit="household", stop_after=3)
    cfg.validate()
    assert Trainer(cfg, MPI.COMM_SELF, out=io.StringIO()).run() == 75
    saved = ckpt.load(d)
    assert saved["config"]["privacy_unit"] == "household"
    assert saved["accountant"]["kind"] == "pld" and saved["accountant"]["interval"] > 0
    for change, name in ((dict(privacy_unit="person"), "--privacy-unit person "
                          "(the run has --privacy-unit household)"),
                         (dict(privacy_unit="household", accountant="rdp"),
                          "--accountant rdp (the run has --accountant pld)")):
        cfg = TrainConfig(**base, resume=True, **change)
        cfg.validate()
        with pytest.raises(ConfigError, match=r"a resumed run keeps the settings .*"
                           + name.replace("(", r"\(").replace(")", r"\)")):
            # given: the options named now (a default value named is still a choice)
            Trainer(cfg, MPI.COMM_SELF, out=io.StringIO(), given=set(base) | set(change)).run()
    cfg = TrainConfig(**base, resume=True, privacy_unit="household")
    cfg.validate()
    trainer = Trainer(cfg, MPI.COMM_SELF, out=io.StringIO())
    assert trainer.run() == 0 and trainer.step == 2 * trainer.steps_per_epoch


@pytest.mark.long  # the same refusal as test_a_resumed_run_keeps_its_unit_and_accountant
def test_a_resume_with_another_unit_or_accountant_is_one_line_and_writes_nothing(tmp_path):
    """The command under mpiexec: exit 2, one line naming the setting and the
    checkpoint's value, no traceback, checkpoint and metrics untouched."""
    path = synthetic.write(tmp_path / "d.h5", rows=300, features=4, test_rows=40)
    run, metrics = tmp_path / "run", tmp_path / "m.jsonl"
    common = ["--data", path, "--noise-multiplier", "1", "--epochs", "3",
              "--checkpoint-dir", str(run), "--metrics", str(metrics)]
    # 300 rows in about 160 households, 8 per step: 20 steps an epoch; stop in epoch 2
    first = _train_cli(2, tmp_path, *common, "--privacy-unit", "household",
                       "--stop-after", "25")
    assert first.returncode == 75, first.stderr
    before = {p.name: p.read_bytes() for p in (run / "checkpoint.pt", metrics)}
    assert before["m.jsonl"]  # an epoch's record is there to be kept
    for extra, named in ((["--privacy-unit", "person"],
                          "--privacy-unit person (the run has --privacy-unit household)"),
                         (["--privacy-unit", "household", "--accountant", "rdp"],
                          "--accountant rdp (the run has --accountant pld)")):
        result = _train_cli(2, tmp_path, *common, *extra, "--resume")
        assert result.returncode == 2, result.stderr
        assert result.stderr == ("mpidp: error: a resumed run keeps the settings it started "
                                 "with, and --resume needs none of them; leave out what "
                                 f"differs: {named}\n")
        assert {p.name: p.read_bytes() for p in (run / "checkpoint.pt", metrics)} == before
        assert sorted(p.name for p in run.iterdir()) == ["checkpoint.pt"]


def test_household_unit_needs_poisson_sampling():
    with pytest.raises(ConfigError, match="drop --sampling shuffle"):
        TrainConfig(data="x", noise_multiplier=1.0, privacy_unit="household",
                    sampling="shuffle").validate()


def test_bench_dpsgd_times_the_household_step_beside_the_person_step(monkeypatch, tmp_path):
    """mpidp bench dpsgd --methods mpidp-dp,mpidp-household: the household method
    runs the trainer's step with groups of whole households at the same expected
    rows per step, and its ratio is the median of the per-round ratios."""
    import statistics
    import types

    import engine.step
    from engine.bench import dpsgd
    from engine.cli import build_parser

    calls = []
    original = engine.step.DPStep.__call__

    def counted(self, rows, times=None, started=None, groups=None):
        result = original(self, rows, times, started, groups)
        calls.append((int(rows.shape[0]), None if groups is None else groups.numpy().copy()))
        return result

    monkeypatch.setattr(engine.step.DPStep, "__call__", counted)
    ticks = iter(range(10 ** 6))
    monkeypatch.setattr(dpsgd, "time", types.SimpleNamespace(perf_counter=lambda: next(ticks)))
    out = tmp_path / "b.json"
    args = build_parser().parse_args([
        "bench", "dpsgd", "--rows", "4000", "--features", "6", "--hidden", "8",
        "--batch-size", "64", "--steps", "4", "--repeats", "3", "--threads", "1",
        "--methods", "mpidp-dp,mpidp-household", "--json", str(out)])
    assert args._run(args) == 0
    data = json.loads(out.read_text())
    grouped = [(k, g) for k, g in calls if g is not None]
    # one untimed warm-up round of 4 steps, then 3 rounds of one block: the
    # block's untimed settling steps and its 4 timed ones
    assert len(grouped) == 4 + (dpsgd.SETTLE_STEPS + 4) * 3
    assert len(calls) == 2 * len(grouped)
    for k, g in grouped:
        assert g[0] == 0 and g[-1] == k and np.all(np.diff(g) >= 1)
    rounds = data["all_rounds"]
    assert data["household_over_person"] == pytest.approx(statistics.median(
        dp / hh for hh, dp in zip(rounds["mpidp-household"], rounds["mpidp-dp"])))


def _module_cases(d, classes):
    """(name, factory, clipper class): the book-keeping Linear rule, the LayerNorm
    rule with a layer on the torch.func fallback (PReLU), and the whole-model
    torch.func clipper."""
    from engine.dp.clipping import FuncClipper, LayerClipper

    return [
        ("linear-mlp", lambda: nn.Sequential(nn.Linear(d, 6), nn.ReLU(), nn.Linear(6, classes)),
         LayerClipper),
        ("layernorm-rule-prelu-fallback", lambda: nn.Sequential(
            nn.Linear(d, 5), nn.LayerNorm(5), nn.PReLU(), nn.Linear(5, classes, bias=False)),
         LayerClipper),
        ("whole-model-func", lambda: nn.Sequential(
            nn.Linear(d, 5), nn.GELU(), nn.Linear(5, classes)), FuncClipper),
    ]


@pytest.mark.filterwarnings("ignore::engine.dp.rules.SlowPathWarning")  # the PReLU, by design
@pytest.mark.parametrize("case", range(3), ids=[c[0] for c in _module_cases(4, 2)])
@SETTINGS
@given(sizes=household_sizes, C=clip_bounds, classes=st.sampled_from([2, 3]),
       seed=st.integers(0, 10_000))
def test_module_clippers_clip_households_like_the_loop(case, sizes, C, classes, seed):
    """LayerClipper / FuncClipper with groups (the library path for any torch
    model) against the loop over households of naive per-example gradients."""
    name, factory, clipper_cls = _module_cases(4, classes)[case]
    torch.manual_seed(seed)
    model = factory().double()
    reference = factory().double()
    reference.load_state_dict(model.state_dict())
    k = sum(sizes)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(k, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, classes, (k,), generator=g)
    clipper = clipper_cls(model)
    loss, clipped = clipper.clipped_sum(x, y, C, _offsets(sizes))
    want = torch.zeros_like(clipper.grad)
    start, want_clipped = 0, 0
    for size in sizes:
        total, _, _ = naive_clipped_sum(reference, x[start:start + size], y[start:start + size],
                                        None)
        norm = float(total.norm())
        if norm > C:
            want_clipped += size
        want += min(1.0, C / norm) * total if norm > 0 else total
        start += size
    assert torch.allclose(clipper.grad, want, rtol=1e-10, atol=1e-12)
    assert clipped == want_clipped
