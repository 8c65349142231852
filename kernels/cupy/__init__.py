"""CuPy kernels: CUDA C, the default on GPUs.

``<op>.py`` launches the kernels of ``<op>.cu`` beside it, compiled once per
process by ``cupy.RawModule`` (NVRTC). :mod:`kernels.cupy.sources` names
every entry point of the ``.cu`` files; :mod:`kernels.cupy.launch` passes
torch CUDA tensors as device pointers and launches on torch's current
stream. Preferred over Numba CUDA because its launches cost the least
Python per call.

Importing a kernel module imports CuPy (extra ``mpidp[cuda12]`` or
``[cuda13]``; without it the registry records the ImportError and skips
this back-end). This package and :mod:`kernels.cupy.sources` import nothing
CUDA, so the tests compile the ``.cu`` files with nvcc and check the
launches against a fake CuPy on machines without a GPU.
"""
