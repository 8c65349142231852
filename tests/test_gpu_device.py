"""--device: one GPU per rank by node-local rank, and the engine's device plumbing, on the CPU.

The selection runs through :func:`engine.nn.device.select` with a fake GPU
inventory (what ranks see, what they bind to) at every rank count; the
engine's device path (a tensor all-reduce buffer, transfers to and from the
device) runs on the CPU and must give the same model, bit for bit, as the
CPU path. What remains GPU-only is torch's CUDA ops, the kernel launches and
the CUDA-aware transfer (tests/test_gpu_real.py, ``make test-gpu``).
"""
from __future__ import annotations

import itertools
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from engine.bench import synthetic
from engine.config import TrainConfig
from engine.nn.device import DeviceError, Placement, assign, select
from engine.errors import ConfigError
from engine.trainer import Trainer
from launcher import clean_env, mpidp


class FakeInventory:
    """What one rank sees: GPU identities, or no CUDA at all."""

    def __init__(self, visible: list[str] | None):
        self._visible = visible
        self.bound: list[int] = []

    def visible(self) -> list[str]:
        if self._visible is None:
            raise DeviceError("--device cuda: no CUDA here (fake)")
        return list(self._visible)

    def name(self, index: int) -> str:
        return f"Fake GPU {self._visible[index]}"

    def bind(self, index: int) -> None:
        self.bound.append(index)


# ----------------------------------------------------------- the assignment
def test_every_rank_sees_every_gpu_local_rank_i_gets_gpu_i():
    gpus = ["A", "B", "C", "D"]
    assert assign([gpus] * 4) == [0, 1, 2, 3]
    assert assign([gpus] * 2) == [0, 1]


def test_launcher_binding_one_gpu_per_rank():
    assert assign([["A"], ["B"], ["C"]]) == [0, 0, 0]


def test_constrained_ranks_choose_first():
    assert assign([["A", "B"], ["A"]]) == [1, 0]


def test_more_ranks_than_gpus_is_an_error_naming_the_counts():
    with pytest.raises(DeviceError, match=r"3 ranks on node7 but only 2 GPU\(s\)"):
        assign([["A", "B"]] * 3, host="node7")
    with pytest.raises(DeviceError, match="only 1 GPU"):
        assign([["A"], ["A"]])


def test_a_rank_that_sees_no_gpu_is_an_error():
    with pytest.raises(DeviceError, match="local rank 1 .* sees no GPU"):
        assign([["A"], []])


def test_bound_ranks_sharing_a_gpu_while_another_is_free_is_an_error():
    with pytest.raises(DeviceError, match="all taken"):
        assign([["A"], ["A"], ["B", "C"]])


def test_a_choice_that_would_block_another_rank_is_revised():
    # Rank 0 taking B (its first free GPU) would leave ranks 1 and 2 one GPU for two.
    views = [["B", "C"], ["A", "B"], ["A", "B"]]
    index = assign(views)
    assert sorted(views[r][i] for r, i in enumerate(index)) == ["A", "B", "C"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.sampled_from("ABCDE"), min_size=0, max_size=4, unique=True),
                min_size=1, max_size=6))
@example([["B", "C"], ["A", "B"], ["A", "B"]])
def test_assignment_never_shares_a_gpu(views):
    # Brute force: is there any way to give every rank a GPU of its own?
    possible = any(len(set(pick)) == len(pick) for pick in itertools.product(*views))
    if not possible:
        with pytest.raises(DeviceError):
            assign(views)
        return
    index = assign(views)  # refusing a possible assignment is a bug
    assert all(0 <= i < len(views[r]) for r, i in enumerate(index))
    chosen = [views[r][i] for r, i in enumerate(index)]
    assert len(set(chosen)) == len(views)


# ------------------------------------------------------ select() over MPI
def test_cpu_needs_no_communicator_and_keeps_the_numpy_buffer():
    placement = select("cpu", None)
    assert placement.device == torch.device("cpu") and placement.host_buffer
    with pytest.raises(ConfigError, match="--device 'tpu'"):
        select("tpu", None)


@pytest.mark.mpi(min_size=1)
def test_each_rank_binds_the_gpu_of_its_node_local_rank(comm):
    size = comm.Get_size()
    inventory = FakeInventory([f"GPU-{i}" for i in range(size + 1)])
    placement = select("cuda", comm, inventory)
    # One node here: the node-local rank is the rank.
    assert placement.local_rank == comm.Get_rank() and placement.local_size == size
    assert placement.device == torch.device("cuda", comm.Get_rank())
    assert inventory.bound == [comm.Get_rank()] and not placement.host_buffer
    assert f"local rank {comm.Get_rank()} of {size}" in placement.describe()


@pytest.mark.mpi(min_size=1)
def test_launcher_bound_ranks_each_take_their_only_gpu(comm):
    inventory = FakeInventory([f"GPU-{comm.Get_rank()}"])
    assert select("cuda", comm, inventory).device == torch.device("cuda", 0)


@pytest.mark.mpi(min_size=2)
def test_fewer_gpus_than_ranks_fails_on_every_rank(comm):
    inventory = FakeInventory([f"GPU-{i}" for i in range(comm.Get_size() - 1)])
    with pytest.raises(DeviceError, match=f"{comm.Get_size()} ranks on .* only") as error:
        select("cuda", comm, inventory)
    assert error.value.collective and inventory.bound == []


@pytest.mark.mpi(min_size=1)
def test_one_rank_without_cuda_fails_every_rank(comm):
    last = comm.Get_size() - 1
    inventory = FakeInventory(None if comm.Get_rank() == last else ["GPU-0", "GPU-1"] * 4)
    with pytest.raises(DeviceError, match="no CUDA here") as error:
        select("cuda", comm, inventory)
    assert error.value.collective and inventory.bound == []


@pytest.mark.mpi(min_size=1)
def test_this_machine_has_no_gpu_and_says_so(comm):
    """The real inventory: a CPU build of torch (or no GPU) is a clear, collective error."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(DeviceError, match="--device cuda: .*(without CUDA|no CUDA GPU)"):
        select("cuda", comm)


def test_mpidp_train_device_cuda_without_a_gpu_is_a_one_line_error(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    data = synthetic.write(tmp_path / "d.h5", rows=80, features=3, test_rows=10, seed=1)
    done = mpidp(2, "train", "--data", str(data), "--device", "cuda", "--epochs", "1",
                 "--noise-multiplier", "1", "--no-progress")
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("mpidp: error: --device cuda:"), done.stderr
    assert "Traceback" not in done.stderr


# ------------------------------------------------------------------ config
def test_device_option_defaults_to_cpu_and_checks_kernels():
    import argparse

    from engine.config import add_arguments, from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--data", "x.h5", "--noise-multiplier", "1"])
    assert from_args(args).device == "cpu"
    args = parser.parse_args(["--data", "x.h5", "--noise-multiplier", "1", "--device", "cuda",
                              "--kernels", "cupy"])
    assert from_args(args).device == "cuda"
    args = parser.parse_args(["--data", "x.h5", "--noise-multiplier", "1", "--kernels", "cupy"])
    with pytest.raises(ConfigError, match="--kernels cupy runs on GPUs only"):
        from_args(args)


# --------------------------------------------------- the engine's device path
class _Null:
    def write(self, text):
        pass

    def flush(self):
        pass


def _device_path_on_the_cpu(monkeypatch):
    """Make the trainer take its GPU code path (tensor buffer, transfers) on the CPU."""
    monkeypatch.setattr("engine.trainer.select_device",
                        lambda kind, comm: Placement(torch.device("cpu"), host_buffer=False))


@pytest.mark.mpi(min_size=1)
def test_the_device_path_trains_the_same_model_as_the_cpu_path(comm, shared_tmp, monkeypatch):
    path = str(shared_tmp / "d.h5")
    if comm.Get_rank() == 0:
        synthetic.write(path, rows=300, features=5, test_rows=40, seed=3)
    comm.Barrier()
    runs = {}
    for name in ("cpu", "device"):
        if name == "device":
            _device_path_on_the_cpu(monkeypatch)
        cfg = TrainConfig(data=path, epochs=2, batch_size=32, hidden=(6,), noise_multiplier=0.8,
                          seed=7, progress=False, allreduce="ring",  # auto times: not bitwise
                          checkpoint_dir=str(shared_tmp / name))
        cfg.validate()
        trainer = Trainer(cfg, comm, out=_Null())
        assert trainer.run() == 0
        runs[name] = trainer
    cpu, dev = runs["cpu"], runs["device"]
    assert isinstance(cpu.buffer, np.ndarray)
    assert torch.is_tensor(dev.buffer) and dev.grad.data_ptr() == dev.buffer.data_ptr()
    assert torch.equal(cpu.params, dev.params)
    assert torch.equal(cpu.optimizer.velocity, dev.optimizer.velocity)
    keys = ("train_loss", "test_accuracy", "clipped_fraction", "epsilon")
    assert [[r[k] for k in keys] for r in cpu.history] == [[r[k] for k in keys] for r in dev.history]


@pytest.mark.mpi(min_size=1)
def test_a_checkpoint_cannot_change_device(comm, shared_tmp, monkeypatch):
    path = str(shared_tmp / "d.h5")
    if comm.Get_rank() == 0:
        synthetic.write(path, rows=120, features=3, test_rows=20, seed=4)
    comm.Barrier()
    common = dict(data=path, epochs=2, batch_size=16, hidden=(4,), noise_multiplier=1.0, seed=1,
                  progress=False, checkpoint_dir=str(shared_tmp / "run"))
    first = Trainer(TrainConfig(**common, stop_after=2), comm, out=_Null())
    assert first.run() == 75
    monkeypatch.setattr("engine.trainer.select_device",
                        lambda kind, comm: Placement(torch.device("cuda", 0), host_buffer=False))
    second = Trainer(TrainConfig(**common, resume=True, device="cuda"), comm, out=_Null())
    with pytest.raises(ConfigError, match=r"--device cuda \(the run has --device cpu\)"):
        second.run()


def test_the_cpu_path_imports_nothing_cuda(tmp_path):
    """A whole CPU training run, then: no CuPy, no Numba CUDA target, no CUDA kernel module."""
    data = synthetic.write(tmp_path / "d.h5", rows=100, features=3, test_rows=10, seed=2)
    script = f"""
import sys, json
from collectives.runtime import MPI
from engine.config import TrainConfig
from engine.trainer import Trainer
cfg = TrainConfig(data={str(data)!r}, epochs=1, batch_size=16, hidden=(4,),
                  noise_multiplier=1.0, seed=1, progress=False)
assert Trainer(cfg, MPI.COMM_SELF, out=open('/dev/null', 'w')).run() == 0
print(json.dumps(sorted(m for m in sys.modules if m.startswith(
    ('cupy', 'numba.cuda', 'kernels.cupy', 'kernels.numba_cuda')))))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env=clean_env())
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
