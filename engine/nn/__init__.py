"""The models and how they learn, without any privacy logic.

Nothing here imports :mod:`engine.dp`: clipping, noise and accounting sit
above the models (docs/contributing.md, "Inside engine").

* :mod:`~engine.nn.mlp`: the MLP's widths (:class:`~engine.nn.mlp.MLPSpec`), its flat
  parameter layout, initialisation, logits and a torch module view;
* :mod:`~engine.nn.embedding_mlp`: ``--model embedding-mlp``;
* :mod:`~engine.nn.image_models`: ``--model mnist-small|mnist-large|resnet20``;
* :mod:`~engine.nn.model_names`: the names ``--model`` takes, and a user's
  ``MODULE:FACTORY`` imported and called;
* :mod:`~engine.nn.batch_gather`: the step's batch gathered from the shard;
* :mod:`~engine.nn.device`: the CPU, or one GPU per rank;
* :mod:`~engine.nn.optim`: SGD with momentum and Adam on the flat vector;
* :mod:`~engine.nn.schedule`: learning-rate schedules.

The model of a run, bound to its clipping engine, is :mod:`engine.models`.
"""
