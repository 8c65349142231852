"""The differential-privacy components of DP-SGD, one concern per module.

* :mod:`~engine.dp.sampler`: which rows a step uses (Poisson sampling, or shuffling);
* the clipping engines, per-example clipped gradient sums behind one
  interface: :mod:`~engine.dp.fast_mlp` (the MLP's hand-written forward and
  backward, at the cost of plain SGD) and :mod:`~engine.dp.module_engine`
  (any torch model, through :mod:`~engine.dp.clipping` and the per-layer
  rules of :mod:`~engine.dp.rules`; :mod:`~engine.dp.flat_model` is the
  model as they see it: flat parameters, leaf layers, plain chains);
* :mod:`~engine.dp.naive`: the per-example loop every clipping engine is tested against;
* :mod:`~engine.dp.noise`: Gaussian noise added exactly once over the ranks;
* :mod:`~engine.dp.streams`: the per-rank random streams the sampler and the noise draw from;
* :mod:`~engine.dp.accountant`: epsilon spent, sigma for a target, the budget's arithmetic;
  :mod:`~engine.dp.pld` computes the epsilon (dp-accounting's PLD on a bounded grid);
* :mod:`~engine.dp.privacy`: the ``mpidp privacy`` command (accounting offline).

They sit apart from the training loop so that a reviewer can audit each
privacy-relevant piece on its own; :mod:`engine.step` puts them together.
They use the models of :mod:`engine.nn` (the MLP's layout, the batch
gather), never the step, the trainer or :mod:`engine.models`.
"""
