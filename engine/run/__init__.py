"""A training run, cut along its seams; :class:`engine.trainer.Trainer` wires them.

* :mod:`engine.run.threads`: threads per rank (``configure_threads``);
* :mod:`engine.run.collective`: the run's collective helpers (rank 0 checks
  and values, the shared seed);
* :mod:`engine.run.resume`: a resumed run's settings and checkpoint;
* :mod:`engine.run.plan`: the privacy plan and the kernels, settled first;
* :mod:`engine.run.state`: the sampler, the model's engine and the step,
  built (or restored) before the first step;
* :mod:`engine.run.selection`: which epoch's parameters are the run's model,
  and the test split scored once with them;
* :mod:`engine.run.report`: what the run prints (first lines, summary);
* :mod:`engine.run.hooks`: where a program composes its own parts into a run
  (the canary audit adds its rows and wraps the step there).

The loop itself, the epoch's records and checkpoints stay in
:mod:`engine.trainer`.
"""
