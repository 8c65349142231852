"""A user's program around engine.train, launched as the README says
(``mpiexec -n N python train_api_failure.py SCENARIO DATA``, no ``-m mpi4py``);
tests/test_engine_api.py runs it with a timeout (a hang is a failure).

* ``model-raises``: the model raises a ValueError on rank 1 at its sixth
  forward pass, in the middle of training: the job must end (exit 1) with
  rank 1's traceback, not leave rank 0 waiting in the all-reduce.
* ``opt-out``: the same after ``collectives.abort_on_error(False)``: rank 1
  gets its ValueError, and rank 0, which waited for it in the all-reduce,
  gets an error too once rank 1's program ends. Each prints ``CAUGHT``.
  A third argument names the all-reduce algorithm (default ``auto``).
* ``collective``: an unknown option, raised on every rank alike: raised
  everywhere (``CAUGHT`` on each rank), the job not ended.
* ``rank-0-only``: ``engine.train`` under ``if rank == 0:``; the other ranks'
  programs end. ``once-more``: every rank calls it, rank 0 a second time.
  ``fails-first``: rank 1's program raises before its call. Each must end
  the job (exit 2) with rank 0's (rank 1's) one line, not wait for ever.
"""
from __future__ import annotations

import sys

import torch
from torch import nn

import collectives
import engine
from collectives import MPI

rank = MPI.COMM_WORLD.Get_rank()
scenario, data = sys.argv[1], sys.argv[2]


class FailsOnRank1(nn.Module):
    def __init__(self, n_features: int, n_classes: int):
        super().__init__()
        self.linear = nn.Linear(n_features, n_classes)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a few steps into training (the probes before it run 4 rows a dozen
        # times): rank 0 is then inside the step's all-reduce
        self.calls += x.shape[0] > 8
        if rank == 1 and self.calls > 5:
            raise ValueError("the user's model fails on rank 1")
        return self.linear(x)


settings = dict(epochs=2, batch_size=100, noise_multiplier=1.0, seed=0, quiet=True)
if scenario == "opt-out":
    collectives.abort_on_error(False)
    settings["allreduce"] = sys.argv[3] if len(sys.argv) > 3 else "auto"
if scenario == "rank-0-only":
    if rank == 0:
        engine.train(data, **settings)
    sys.exit(0)
if scenario == "once-more":
    engine.train(data, **settings)
    if rank == 0:
        engine.train(data, **settings)
    sys.exit(0)
if scenario == "fails-first" and rank == 1:
    raise RuntimeError("the user's program fails before its call")
try:
    if scenario == "collective":
        engine.train(data, model=FailsOnRank1, epochs=1, learning_rate=0.1, quiet=True)
    else:
        engine.train(data, model=FailsOnRank1, **settings)
    print(f"DONE rank {rank}", flush=True)
except Exception as error:  # noqa: BLE001 - what each rank gets is the test's subject
    if scenario == "model-raises":
        raise
    print(f"CAUGHT rank {rank} {type(error).__name__}: {error}", flush=True)
