"""``mpidp tune``: hyperparameter search with the engine, selected on the val split.

:mod:`engine.tune.space` parses and checks the space, :mod:`engine.tune.search`
runs the trials side by side on sub-communicators and scores them,
:mod:`engine.tune.privacy` bounds what choosing among them costs in privacy
(Papernot & Steinke's private random search, or the composition of the
trials), :mod:`engine.tune.report` writes the table, the JSON and the
``mpidp train`` command, and :mod:`engine.tune.command` is the command.
"""
