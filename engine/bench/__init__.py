"""Benchmarks of the engine and the synthetic data they run on.

* :mod:`~engine.bench.dpsgd`: ``mpidp bench dpsgd``, one DP-SGD step (:mod:`engine.step`)
  against non-DP, the naive per-example loop and Opacus, side by side;
* :mod:`~engine.bench.scaling`: ``mpidp bench scaling``, ``mpidp train`` at several
  rank counts; :mod:`~engine.bench.scaling_report` turns its metrics into tables
  and :mod:`~engine.bench.scaling_plot` into a PNG;
* :mod:`~engine.bench.synthetic`: files in the prepared-HDF5 contract, for tests and
  benchmarks.
"""
