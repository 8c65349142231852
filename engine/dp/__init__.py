"""The differential-privacy components of DP-SGD, one concern per module.

* :mod:`~engine.dp.sampler`: which rows a step uses (Poisson sampling, or shuffling);
* :mod:`~engine.dp.clipping` and :mod:`~engine.dp.rules`: per-example
  clipped gradient sums for any torch model (the MLP's own is
  :mod:`engine.nn.fast_mlp`);
* :mod:`~engine.dp.naive`: the per-example loop every clipping engine is tested against;
* :mod:`~engine.dp.noise`: Gaussian noise added exactly once over the ranks;
* :mod:`~engine.dp.streams`: the per-rank random streams the sampler and the noise draw from;
* :mod:`~engine.dp.accountant`: epsilon spent, sigma for a target, the budget's arithmetic;
* :mod:`~engine.dp.privacy`: the ``mpidp privacy`` command (accounting offline).

They sit apart from the training loop so that a reviewer can audit each
privacy-relevant piece on its own; :mod:`engine.step` puts them together.
"""
