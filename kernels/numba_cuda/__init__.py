"""Numba CUDA kernels (``@numba.cuda.jit``): on GPUs, the choice after CuPy.

Each ``<op>.py`` is the twin of ``kernels/cupy/<op>.cu`` (same algorithm,
same launch shapes from :mod:`kernels.common.cuda_shapes`). Kernels take
torch CUDA tensors through zero-copy views and launch on torch's current
stream (:mod:`kernels.numba_cuda.launch`). The same code runs under Numba's
CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, CPU tensors standing in for
device memory): that is how the tests run it without a GPU, so it uses no
warp intrinsics, which the simulator lacks.

Importing a kernel module imports Numba's CUDA target (``numba-cuda``, extra
``mpidp[cuda12]`` or ``[cuda13]``); the registry does so only when a CUDA
device is asked for.
"""
