"""Hand-written forward and backward of an MLP, for DP-SGD at the cost of SGD.

No autograd: the forward keeps every layer's input activations ``a_l`` (with
a trailing column of ones, so the bias is one more weight column) and the
backward computes every layer's output gradient ``g_l``; both are exactly
what per-example clipping needs (:mod:`engine.dp.rules.linear` explains the
book-keeping rule). Per step, for L layers:

* forward: L GEMMs ``z_l = a_l [W_l | b_l]^T`` and L-1 ReLUs written straight
  into the next activation buffer;
* loss: one fused softmax-cross-entropy kernel, ``g_L = softmax(z_L) - onehot(y)``;
* backward: L-1 GEMMs ``g_{l-1} = g_l W_l`` and ReLU masks;
* clipping: one fused kernel for all layers: squared norms
  ``sum_l |a_l,i|^2 |g_l,i|^2``, factors ``min(1, C/norm_i)``, rows of every
  ``g_l`` scaled in place; for the household unit, one norm per household
  from the Gram products of its rows, ``sum_l sum_{i,j} (a_l,i . a_l,j)
  (g_l,i . g_l,j)``, and its factor on all its rows (``clip_groups``: the
  households are small, so the Gram blocks cost about what the per-row
  norms do);
* clipped sums: L GEMMs ``(c g_l)^T a_l`` written straight into the flat
  gradient buffer (the one the all-reduce sends).

Every buffer is allocated once (and grown if a Poisson batch is larger than
any before), so a step allocates nothing but a few tensor views. Kernels
come from :mod:`kernels.registry` for the parameters' device; on a GPU every
buffer lives there too (``--device cuda``), and only the sampled row indices
go in and the loss and clipped count come back.

:meth:`FastMLP.masked_sum` is the same step on a batch of fixed shape: the
rows of a fixed-capacity batch and a 0/1 mask, results left on the device
(:mod:`engine.fixed_step`, the CUDA graph's step).

Where the device's back-end offers the fused ``mlp_step`` (Numba on the CPU,
with the BLAS routine torch calls: :mod:`kernels.numba_cpu.mlp_step`), all of
the above is one call from Python instead of about fifteen, with the same
results; elsewhere, or with ``MPIDP_NO_FUSED_STEP=1``, the ops are composed
here.
"""
from __future__ import annotations

import torch

from engine.nn.batch_gather import BatchGather
from engine.nn.mlp import MLPSpec, layer_views, logits as mlp_logits
from kernels import registry


class FastMLP:
    """Per-example-clipped gradient sums of an MLP (see module docstring).

    Args:
        spec: the widths.
        params: flat parameter vector (float32 or float64), updated in place by
            the optimizer between steps.
        grad: flat buffer of the same size and dtype that receives the sums.
        capacity: rows to preallocate (the expected local batch, plus slack).
        backend: force a kernel back-end (``"torch"``); None picks the best
            registered one for the device.
    """

    def __init__(self, spec: MLPSpec, params: torch.Tensor, grad: torch.Tensor,
                 capacity: int = 256, backend: str | None = None):
        if params.shape != (spec.n_params,) or grad.shape != params.shape:
            raise ValueError("params and grad must be flat vectors of spec.n_params")
        self.spec, self.params, self.grad = spec, params, grad
        self.dtype, self.device = params.dtype, params.device
        self.W = layer_views(spec, params)
        self.W_in = [w[:, :-1] for w in self.W]
        self.G_out = layer_views(spec, grad)
        device = params.device
        self.clip_rows = registry.get("clip_rows", device, backend)
        self.relu_backward = registry.get("relu_backward", device, backend)
        self.softmax_xent = registry.get("softmax_xent", device, backend)
        self.gather = BatchGather(device, backend)
        self.fused = registry.fused("mlp_step", device, backend)
        self._backend = backend
        self.clip_groups = None  # looked up on the first grouped call
        self.capacity = 0
        self._allocate(max(1, capacity))
        if self.fused is not None and self._slices(1)[5][4] is None:
            self.fused = None  # it cannot serve these buffers (dtype, no BLAS): compose
            self._views = {}

    @property
    def backends(self) -> dict[str, str]:
        """Op -> back-end family; ``mlp_step`` is ``"composed"`` where the ops are
        composed here."""
        fused = "composed" if self.fused is None else self.fused.backend
        return {"clip_rows": self.clip_rows.backend,
                "relu_backward": self.relu_backward.backend,
                "softmax_xent": self.softmax_xent.backend,
                "gather_rows": self.gather.backend,
                "mlp_step": fused}

    @property
    def parts(self) -> int:
        """Into how many parts (threads) the fused step cuts a batch's rows; 1
        where it does not, or where the ops are composed."""
        return 1 if self.fused is None else self._slices(1)[5][4].parts

    def _allocate(self, capacity: int) -> None:
        dims, kw = self.spec.dims, {"dtype": self.dtype, "device": self.device}
        self.A = []
        for d in dims[:-1]:
            a = torch.empty(capacity, d + 1, **kw)
            a[:, d] = 1.0
            self.A.append(a)
        self.Z = [torch.empty(capacity, d, **kw) for d in dims[1:]]
        self.G = [torch.empty(capacity, d, **kw) for d in dims[1:]]
        self.y = torch.empty(capacity, dtype=torch.int64, device=self.device)
        self.factors = torch.empty(capacity, **kw)
        self.losses = torch.empty(capacity, **kw)
        self.capacity = capacity
        self._views: dict[int, tuple] = {}
        self.gather.forget()

    def _slices(self, k: int) -> tuple:
        """Views of every buffer's first k rows, and the kernels bound to them
        (cached per k: a step reuses them)."""
        views = self._views.get(k)
        if views is None:
            A = tuple(a[:k] for a in self.A)
            H = tuple(a[:k, :-1] for a in self.A)
            Z = tuple(z[:k] for z in self.Z)
            G = tuple(g[:k] for g in self.G)
            last = self.spec.n_layers - 1
            kernels = (
                registry.bind(self.softmax_xent, logits=Z[last], labels=self.y[:k],
                              grad=G[last]),
                tuple(registry.bind(self.relu_backward, grad=G[i - 1], out=H[i])
                      for i in range(last, 0, -1)),
                registry.bind(self.clip_rows, acts=A, grads=G, factors=self.factors),
                None if self.clip_groups is None else
                registry.bind(self.clip_groups, acts=A, grads=G, factors=self.factors),
                None if self.fused is None else
                registry.bind(self.fused, acts=A, grads=G, weights=self.W,
                              grad_out=self.G_out, logits=Z[last], labels=self.y[:k],
                              factors=self.factors))
            views = (A, H, Z, G, self.y[:k], kernels)
            self._views[k] = views
        return views

    def load(self, X: torch.Tensor, y: torch.Tensor, rows: torch.Tensor) -> int:
        """Gather the batch ``X[rows]``, ``y[rows]`` into the input buffers.

        ``X`` carries the trailing ones column (:mod:`engine.shard`); ``rows``
        is an int64 tensor of local row indices (copied to the device if it is
        elsewhere). Returns the batch size k.
        """
        k = int(rows.shape[0])
        if rows.device != self.device:
            rows = rows.to(self.device, non_blocking=True)
        if k > self.capacity:
            self._allocate(k + k // 4)
        self.gather(X, y, rows, self._inputs)
        return k

    def _inputs(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first layer's input rows (ones column included) and the labels, k rows."""
        A, _, _, _, yk, _ = self._slices(k)
        return A[0], yk

    def _use_groups(self) -> None:
        """Look up ``clip_groups`` (the back-end asked for, else the generic one:
        no CUDA kernel of its own) and forget the bound kernels."""
        self.clip_groups = registry.get_or_best("clip_groups", self.device, self._backend)
        self._views = {}

    def clipped_sum(self, k: int, max_norm: float | None,
                    groups: torch.Tensor | None = None) -> tuple[float, int]:
        """Write ``sum_i c_i grad_i`` of the loaded batch of ``k`` rows into ``grad``.

        ``max_norm=None`` gives the plain sum (non-private baseline). With
        ``groups`` (int64 ``[H+1]`` row offsets, ``groups[-1] = k``: the
        batch's households), each group's summed gradient is clipped to
        ``max_norm`` as a whole. Returns (summed cross-entropy loss, number of
        rows whose gradient was scaled down).
        """
        if k == 0:
            self.grad.zero_()
            return 0.0, 0
        fused = self._slices(k)[5][4]  # the bound mlp_step, or None
        if fused is not None:
            return fused(max_norm, groups)
        if groups is not None and self.clip_groups is None:
            self._use_groups()
        A, H, Z, G, _, (softmax_xent, relu_backward, clip_rows, clip_groups, _) = \
            self._slices(k)
        W = self.W
        last = self.spec.n_layers - 1
        for i in range(last + 1):
            torch.mm(A[i], W[i].t(), out=Z[i])
            if i < last:
                torch.clamp_min(Z[i], 0.0, out=H[i + 1])
        loss = softmax_xent()
        for i, relu_back in zip(range(last, 0, -1), relu_backward):
            torch.mm(G[i], self.W_in[i], out=G[i - 1])
            relu_back()
        clipped = 0
        if max_norm is not None and groups is not None:
            clipped = clip_groups(groups=groups, max_norm=float(max_norm))
        elif max_norm is not None:
            clipped = clip_rows(max_norm=float(max_norm))
        for i in range(last + 1):
            torch.mm(G[i].t(), A[i], out=self.G_out[i])
        return loss, clipped

    def masked_sum(self, X: torch.Tensor, y: torch.Tensor, rows: torch.Tensor,
                   mask: torch.Tensor, max_norm: float | None, loss: torch.Tensor,
                   count: torch.Tensor) -> None:
        """:meth:`load` + :meth:`clipped_sum` on a batch of fixed shape, with no
        value read back from the device (a CUDA graph can capture the call).

        Args:
            X, y: as for :meth:`load`.
            rows: int64 ``[cap]`` row indices on the engine's device, every one
                valid; the rows where ``mask`` is 0 are padding.
            mask: ``[cap]`` of the parameters' dtype, 1 for a sampled row and 0
                for padding. Padding rows contribute exactly nothing: their
                loss gradient is zeroed at the logits, so their gradient, norm
                and clip factor (1) add nothing to the sum or the count.
            max_norm: as for :meth:`clipped_sum` (per row; no groups).
            loss: float64 0-d tensor, set to the sampled rows' summed loss.
            count: int32 ``[1]``, set to the number of rows clipped.

        The sums equal :meth:`clipped_sum`'s on the sampled rows up to float
        rounding (the products' sums over rows run over the padding's exact
        zeros too, in the BLAS's own order).
        """
        cap = int(rows.shape[0])
        if cap > self.capacity:
            self._allocate(cap)
        self.gather(X, y, rows, self._inputs)
        A, H, Z, G, yk, _ = self._slices(cap)
        W, last = self.W, self.spec.n_layers - 1
        for i in range(last + 1):
            torch.mm(A[i], W[i].t(), out=Z[i])
            if i < last:
                torch.clamp_min(Z[i], 0.0, out=H[i + 1])
        losses = self.losses[:cap]
        self.softmax_xent(Z[last], yk, G[last], losses=losses)
        G[last].mul_(mask[:, None])
        loss.copy_(torch.sum(losses * mask, dtype=torch.float64))
        for i in range(last, 0, -1):
            torch.mm(G[i], self.W_in[i], out=G[i - 1])
            self.relu_backward(G[i - 1], H[i])
        if max_norm is None:
            count.zero_()
        else:
            self.clip_rows(A, G, float(max_norm), self.factors[:cap], count=count)
        for i in range(last + 1):
            torch.mm(G[i].t(), A[i], out=self.G_out[i])

    def logits(self, X: torch.Tensor) -> torch.Tensor:
        """Logits of rows ``X`` (with the ones column) on the CPU, computed on the
        parameters' device; allocates (evaluation)."""
        return mlp_logits(self.spec, self.params, X.to(self.device)).cpu()
