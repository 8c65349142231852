"""``auto``: the selector, from a static table or by measurement.

* :mod:`~collectives.auto.table`: the algorithm by message size and
  placement, from measured thresholds; registers the selector ``auto``;
* :mod:`~collectives.auto.tuning`: each call signature tries the candidates
  on its own calls and keeps the fastest, remembered per machine.
"""
