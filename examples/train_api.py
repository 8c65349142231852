"""Train with mpidp from Python: every rank of the job runs this script.

    mpiexec -n 2 python examples/train_api.py demo/pums.h5

(``make demo`` writes demo/pums.h5; any file from ``mpidp prep`` works.)
"""
import sys

import engine
from collectives import MPI

run = engine.train(sys.argv[1], epochs=2, target_epsilon=1.0, delta=1e-5, seed=0,
                   batch_size=256, quiet=True)
if MPI.COMM_WORLD.Get_rank() == 0:
    last = run.history[-1]
    print(f"epsilon {run.epsilon:.3f} (delta {run.delta:g}), test accuracy "
          f"{last['test_accuracy']:.4f} after {len(run.history)} epochs")
    print(run.model)
