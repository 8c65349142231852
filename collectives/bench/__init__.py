"""``mpidp bench allreduce``: the all-reduce micro-benchmark.

* :mod:`~collectives.bench.allreduce`: the command (options, the run, its
  outputs);
* :mod:`~collectives.bench.measure`: the timed rounds, with the correctness
  check and what the machine did meanwhile;
* :mod:`~collectives.bench.report`: the table, the plot, and the summary
  over several runs;
* :mod:`~collectives.bench.core_probe`: copy bandwidth between two cores;
* :mod:`~collectives.bench.errors`: the one-line errors of the command.
"""
