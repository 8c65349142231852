"""The model and how it learns, without any privacy logic.

* :mod:`~engine.nn.model`: the MLP's widths (:class:`~engine.nn.model.MLPSpec`), its flat
  parameter layout, initialisation and a torch module view;
* :mod:`~engine.nn.fast_mlp`: hand-written forward/backward that yields per-example
  clipped gradient sums at the cost of plain SGD;
* :mod:`~engine.nn.optim`: SGD with momentum and Adam on the flat vector;
* :mod:`~engine.nn.schedule`: learning-rate schedules.
"""
