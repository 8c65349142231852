"""Per-example gradient kernels and the SGD update, one package per back-end.

A DP-SGD step of the engine's MLP calls six of these ops (``clip_groups``
instead of ``clip_rows`` for the household unit). Each has one contract,
below, and one kernel in every back-end that implements it:

``clip_rows(acts, grads, max_norm, factors, count=None) -> int | None``
    Per-example clipping for a stack of Linear layers in book-keeping form.
    ``acts[l]`` is layer l's input with a trailing column of ones (k x
    (d_in+1)), ``grads[l]`` the loss gradient at its output (k x d_out);
    example i's gradient for layer l is ``grads[l][i]^T acts[l][i]``, so its
    squared norm is ``sum_l |acts[l][i]|^2 |grads[l][i]|^2``. Writes the clip
    factors ``min(1, max_norm / norm_i)`` into ``factors[:k]``, scales every
    ``grads[l][i]`` by its factor in place and returns how many rows were
    clipped (factor < 1). k = 0 is valid. With ``count`` (a one-element
    int32 tensor on the grads' device) the number is written there instead
    and None returned: nothing is read back from the device, so a CUDA
    graph can hold the call.
``clip_groups(acts, grads, groups, max_norm, factors) -> int``
    Per-group clipping (a group is a household: ``mpidp train --privacy-unit
    household``). ``groups`` is int64 ``[H+1]``, ``groups[0] = 0`` and
    ``groups[H] = k``: group h is rows ``groups[h] .. groups[h+1]-1``. Its
    gradient for layer l is ``sum_i grads[l][i]^T acts[l][i]`` over its rows,
    whose squared norm is ``sum_{i,j} (acts[l][i] . acts[l][j])
    (grads[l][i] . grads[l][j])`` (the norm of a sum is not the sum of the
    norms); summed over layers it gives factor ``min(1, max_norm / norm_h)``,
    written into ``factors[i]`` of each of the group's rows, which are scaled
    by it in place. Returns how many rows were scaled down (the rows of the
    groups with factor < 1). H = 0 (k = 0) is valid; with groups of one row
    it is ``clip_rows``.
``clip_linear_rows(acts, grads, bias, extra, max_norm, factors, count=None) -> int | None``
    ``clip_rows`` for the generic path's Linear layers (:mod:`engine.dp.rules`),
    as autograd hands them over: ``acts[l]`` is layer l's input (k x d_in,
    any strides, no column of ones), ``grads[l]`` the loss gradient at its
    output (k x d_out), ``bias[l]`` whether the layer has a bias (then the
    squared norm gains ``|grads[l][i]|^2``), ``extra`` None or ``[k]`` squared
    norms of the model's other layers, added to each row's. Writes the
    factors into ``factors`` (``[k]``, float32 or float64), scales the
    ``grads`` rows in place and returns how many rows were clipped (or
    writes it into ``count``, as ``clip_rows`` does).
``relu_backward(grad, out) -> None``
    ``grad[i, j] = 0`` where ``out[i, j] <= 0`` (``out`` is the ReLU output,
    possibly a strided view).
``softmax_xent(logits, labels, grad, losses=None) -> float | None``
    Cross-entropy of every row: writes ``softmax(logits) - onehot(labels)``
    into ``grad`` and returns the summed loss (a Python float). With
    ``losses`` (1-D, the logits' dtype and device, at least k elements) each
    row's loss is written into ``losses[:k]`` instead and None returned
    (nothing read back from the device).
``sgd_update(params, velocity, grad, scale, lr, momentum) -> None``
    SGD with momentum on flat buffers of one dtype, in place:
    ``velocity = momentum * velocity + scale * grad``, then
    ``params -= lr * velocity`` (PyTorch's convention; ``grad`` unchanged).
``gather_rows(X, y, rows, out, out_labels) -> None``
    The step's batch: ``out[i] = X[rows[i], :w]`` and ``out_labels[i] =
    y[rows[i]]`` for every i (``X`` and ``out`` C-contiguous 2-D of one
    dtype, ``out`` of width ``w`` at most ``X``'s: the generic engine's
    models take the features without the trailing ones column; ``y`` and
    ``out_labels`` int64, ``rows`` int64 on the same device, ``len(out) ==
    len(rows)``). IndexError for a row out of range (the Numba kernel;
    torch's raises its own).
``gaussian_stream(seed_sequence[, device]) -> stream``
    A reproducible stream of N(0, 1) samples with ``stream.add_(buf, std)``
    (adds ``std * N(0, 1)`` to every element of a 1-D buffer in place),
    ``stream.get_state() -> list[int]`` and ``stream.set_state(list)``
    (ValueError for the state of another kind of stream). Kernels for a
    device other than the CPU take the ``torch.device`` as second argument.
    A stream may also have ``stream.bind(buf, std) -> call``, ``add_`` on
    that buffer as a call without arguments whose conversions are made once
    (the Numba CPU stream has it; :meth:`engine.dp.noise.GaussianNoise.bind`
    falls back to ``add_`` where there is none).

A back-end may also offer a **fused op**: one call doing what the engine
would otherwise compose from the ops above, with the same results. There is
one, ``mlp_step`` (the MLP's whole clipped gradient sum: its GEMMs,
``softmax_xent``, ``relu_backward`` and the clipping; contract in
:mod:`kernels.numba_cpu.mlp_step`), in the Numba CPU back-end only, which
calls torch's own BLAS ``gemm`` from compiled code
(:mod:`kernels.numba_cpu.blas`). A fused op has no generic kernel: where no
back-end offers it, or its ``bind`` declines the buffers, the engine
composes the ops (:func:`kernels.registry.fused`).

Tensors are float32 or float64 (``labels`` int64), all on the device the
kernel is for; CUDA tensors are passed as torch tensors and the CUDA
kernels run on torch's current stream of their device, so they are ordered
with the torch ops around them. The CUDA kernels raise TypeError for
another dtype or a tensor off the GPU, ValueError for 2-D tensors whose
rows are not contiguous or 1-D buffers that are not.

The back-ends, one package each (a package holds its back-end's code only):

``numba_cpu/``
    Numba ``@njit`` on CPU tensors: the default on CPUs.
``numba_cuda/``
    Numba ``@cuda.jit`` on CUDA tensors; also runs under Numba's CUDA
    simulator, which is how the tests check it without a GPU.
``cupy/``
    CUDA C (``<op>.cu`` beside each ``<op>.py``) compiled by CuPy: the
    default on GPUs.
``torch/``
    torch ops, for any device: the fallback where a device has no kernel of
    its own, and the reference the others are tested against.

``common/`` is not a back-end: it holds what the two CUDA back-ends share
(the Philox generator's host side, the noise stream's state, launch shapes).

How a kernel is chosen: :mod:`kernels.registry` maps (op, back-end) to a
kernel; the engine asks for an op on the device of its tensors and gets
that device's preferred back-end (CuPy, then Numba CUDA on GPUs; Numba on
CPUs), else the torch kernel. ``mpidp train --kernels numba|cupy|torch``
forces one. :mod:`kernels.probe` reports which back-ends this process can
use (``mpidp info``). :mod:`kernels.numba_target` sets the vector width
Numba compiles for, measured once per CPU; every module that decorates an
``@njit`` function imports it first (``collectives``' too). Numba kernels are
decorated by :func:`kernels.shared_compiles.cached_njit`: cached on disk,
each signature compiled by one of the processes that need it at once. This
package imports nothing else of mpidp.
"""
