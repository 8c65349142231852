"""Train your own torch model with mpidp's DP-SGD from Python: every rank runs this script.

    mpiexec -n 2 python examples/train_api.py demo/pums.h5

(``make demo`` writes demo/pums.h5; any file from ``mpidp prep`` works.)

1. The built-in MLP (fused kernels), the default model.
2. A model of your own, given as a factory ``(n_features, n_classes) ->
   nn.Module``: mpidp seeds torch with the run's seed before calling it on
   every rank, clips each example's gradient per layer (Linear and LayerNorm
   each have their rule: no per-example gradient of the whole model is
   formed), and trains it in place.
   The same factory runs from the command line as
   ``mpidp train --model examples.train_api:ResidualNet``.

If one rank's run fails (its model raises, a bug), that rank prints the error
and ends the whole job (``MPI_Abort``), as ``mpidp train`` does: no rank is
left waiting. ``collectives.abort_on_error(False)`` before the call raises
the error on that rank instead.
"""
import sys

import torch
from torch import nn

import engine
from collectives import MPI


class ResidualNet(nn.Module):
    """A small residual MLP with LayerNorm (BatchNorm mixes examples: not DP)."""

    def __init__(self, n_features: int, n_classes: int, width: int = 64):
        super().__init__()
        self.inp = nn.Linear(n_features, width)
        self.block = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
        self.out = nn.Linear(width, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        return self.out(h + self.block(h))


def main(data: str) -> None:
    settings = dict(epochs=2, target_epsilon=1.0, delta=1e-5, seed=0, batch_size=256,
                    quiet=True)
    mlp = engine.train(data, **settings)
    mine = engine.train(data, model=ResidualNet, **settings)
    if MPI.COMM_WORLD.Get_rank() == 0:
        for name, run in (("MLP", mlp), ("ResidualNet", mine)):
            print(f"{name}: epsilon {run.epsilon:.3f} (delta {run.delta:g}), test accuracy "
                  f"{run.history[-1]['test_accuracy']:.4f} after {len(run.history)} epochs")
        print(mine.model)


if __name__ == "__main__":
    main(sys.argv[1])
