"""Benchmarks of the engine and the synthetic data they run on.

* :mod:`~engine.bench.dpsgd`: ``mpidp bench dpsgd``, one DP-SGD step (:mod:`engine.step`)
  against non-DP, the naive per-example loop and Opacus, side by side;
* :mod:`~engine.bench.scaling`: ``mpidp bench scaling``, ``mpidp train`` at several
  rank counts (presets: the seed's workload, mlbench 2a and 1a, the data-parallel
  image sweep); :mod:`~engine.bench.scaling_plan` resolves its presets and plans
  the launches, :mod:`~engine.bench.scaling_runs` runs them,
  :mod:`~engine.bench.scaling_report` turns their metrics into tables and
  :mod:`~engine.bench.scaling_plot` into a PNG;
* :mod:`~engine.bench.ddp_baseline`: the same run in PyTorch DDP or Opacus'
  distributed DP-SGD, the peers ``bench scaling --baseline ddp`` sets beside mpidp
  (its options, process group and model: :mod:`~engine.bench.ddp_setup`);
* :mod:`~engine.bench.synthetic`: files in the prepared-HDF5 contract (tabular rows;
  images in :mod:`~engine.bench.synthetic_images`), for tests and benchmarks.
"""
