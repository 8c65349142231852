"""``mpidp tune``: hyperparameter search with the engine, selected on the val split.

:mod:`engine.tune.space` parses and checks the space, :mod:`engine.tune.search`
runs the trials side by side on sub-communicators and scores them,
:mod:`engine.tune.privacy` bounds what choosing among them costs in privacy
(Papernot & Steinke's private random search, or the composition of the
trials), :mod:`engine.tune.report` writes the table, the JSON, the
``mpidp train`` command and the chosen model to publish,
:mod:`engine.tune.options` checks the command line against the space and the
file, :mod:`engine.tune.state` keeps the search's state in ``--out``, and
:mod:`engine.tune.command` is the command.
"""
