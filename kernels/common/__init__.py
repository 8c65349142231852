"""What the two CUDA back-ends share; not a back-end (it registers no kernel).

* :mod:`kernels.common.philox`: Philox4x64-10 and Box-Muller on the host,
  the GPU noise streams' state and the reference their kernels are tested
  against (pure numpy);
* :mod:`kernels.common.philox_stream`: the ``gaussian_stream`` object both
  CUDA back-ends return (a subclass only launches its kernel);
* :mod:`kernels.common.cuda_shapes`: launch shapes, argument checks and
  scratch buffers, so both back-ends launch the same grids.

Imports nothing CUDA, so the tests use it without a GPU.
"""
