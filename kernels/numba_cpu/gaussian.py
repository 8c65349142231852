"""``gaussian_stream`` on the CPU: SFC64 bits and the ziggurat, in one Numba loop.

Noise is a measurable cost of every DP-SGD step (one Gaussian per model
parameter per step). ``torch.randn`` spends most of its time in its Mersenne
Twister; this kernel draws the bits from SFC64 (Chris Doty-Humphrey's Small
Fast Chaotic generator, the same stream as ``numpy.random.SFC64``: the tests
check that bit for bit) and turns them into normals with the ziggurat method
of Marsaglia & Tsang (2000), "The Ziggurat Method for Generating Random
Variables", J. Stat. Softw. 5(8), with 256 layers: 8 bits pick a layer, 1 bit
the sign, 23 bits the position; about 99% of samples are accepted on the
first comparison, the rest go through the exact wedge and tail tests. The
result is added, scaled, to a float32 or float64 buffer in place, so no
temporary is allocated.

Seeding follows numpy: each of :data:`CHUNKS` sub-streams starts from the state
of ``numpy.random.SFC64(child)`` for the children spawned from the stream's
seed sequence; sub-stream t fills slice t of the buffer, so the threads can
share the work and the numbers do not depend on the thread count.
"""
from __future__ import annotations

import math

import numba
import numpy as np

from kernels.registry import register

_LAYERS = 256
_R = 3.6541528853610088      # start of the tail for 256 layers
_V = 0.00492867323399        # area of every layer


def ziggurat_tables(layers: int = _LAYERS, r: float = _R, v: float = _V):
    """The ziggurat's tables (float64): ``K`` (accept thresholds on the 23-bit
    integer), ``W`` (layer widths / 2**23) and ``F`` (density at the edges).

    Layer 0 is the base strip plus the tail (pseudo-width v / f(r)); layer i
    is the rectangle [0, x_i] x [f(x_i), f(x_{i+1})] with x_1 = r and x_256 = 0.
    """
    def f(x):
        return math.exp(-0.5 * x * x)

    x = np.zeros(layers + 1)
    x[0] = v / f(r)
    x[1] = r
    for i in range(1, layers - 1):
        x[i + 1] = math.sqrt(-2.0 * math.log(v / x[i] + f(x[i])))
    x[layers] = 0.0
    scale = float(1 << 23)
    k = np.floor(scale * x[1:] / x[:-1]).astype(np.uint32)
    w = x[:-1] / scale
    fx = np.exp(-0.5 * x * x)
    return k, w, fx


_K, _W, _F = ziggurat_tables()
_M32 = np.uint64(0xFFFFFFFF)


@numba.njit(inline="always")
def _sfc64(a, b, c, w):
    r = a + b + w
    w += np.uint64(1)
    a = b ^ (b >> np.uint64(11))
    b = c + (c << np.uint64(3))
    c = ((c << np.uint64(24)) | (c >> np.uint64(40))) + r
    return r, a, b, c, w


@numba.njit(cache=True)
def sfc64_raw(state, out):
    """Fill ``out`` (uint64) with the next raw outputs; advances ``state``."""
    a, b, c, w = state[0], state[1], state[2], state[3]
    for i in range(out.shape[0]):
        r, a, b, c, w = _sfc64(a, b, c, w)
        out[i] = r
    state[0], state[1], state[2], state[3] = a, b, c, w


@numba.njit(inline="always")
def _uniform(r):
    # (0, 1], never 0, so log() is finite: 53 random bits.
    return (np.float64(r >> np.uint64(11)) + 1.0) * (1.0 / 9007199254740992.0)


@numba.njit(cache=True)
def _slow(u, a, b, c, w, K, W, F):
    """Finish one sample whose first candidate ``u`` failed the fast test."""
    while True:
        idx = u & np.uint32(0xFF)
        j = u >> np.uint32(9)
        x = np.float64(j) * W[idx]
        if j < K[idx]:
            pass  # accepted (only reachable after a re-draw)
        elif idx == 0:  # the tail beyond r (Marsaglia 1964)
            while True:
                r1, a, b, c, w = _sfc64(a, b, c, w)
                r2, a, b, c, w = _sfc64(a, b, c, w)
                e1 = -math.log(_uniform(r1)) / _R
                e2 = -math.log(_uniform(r2))
                if e2 + e2 > e1 * e1:
                    break
            x = _R + e1
        else:  # the wedge between the rectangle and the curve
            r1, a, b, c, w = _sfc64(a, b, c, w)
            y = F[idx] + _uniform(r1) * (F[idx + 1] - F[idx])
            if y >= math.exp(-0.5 * x * x):
                r1, a, b, c, w = _sfc64(a, b, c, w)
                u = np.uint32(r1 & _M32)
                continue
        if (u >> np.uint32(8)) & np.uint32(1):
            x = -x
        return x, a, b, c, w


@numba.njit(cache=True)
def add_normal(out, std, state, K, W, F):
    """``out += std * N(0, 1)`` element-wise (1-D, float32/64); advances ``state``.

    Each 64-bit draw gives two candidates (low and high 32 bits); a rejected
    candidate continues with fresh draws from the same stream. The fast test
    is written out twice on purpose: in a helper function, the generator state
    went through memory instead of registers, which made the loop much slower.
    """
    a, b, c, w = state[0], state[1], state[2], state[3]
    n = out.shape[0]
    i = 0
    while i < n:
        r, a, b, c, w = _sfc64(a, b, c, w)
        u = np.uint32(r & _M32)
        idx = u & np.uint32(0xFF)
        j = u >> np.uint32(9)
        if j < K[idx]:
            x = np.float64(j) * W[idx]
            if (u >> np.uint32(8)) & np.uint32(1):
                x = -x
        else:
            x, a, b, c, w = _slow(u, a, b, c, w, K, W, F)
        out[i] += std * x
        i += 1
        if i == n:
            break
        u = np.uint32(r >> np.uint64(32))
        idx = u & np.uint32(0xFF)
        j = u >> np.uint32(9)
        if j < K[idx]:
            x = np.float64(j) * W[idx]
            if (u >> np.uint32(8)) & np.uint32(1):
                x = -x
        else:
            x, a, b, c, w = _slow(u, a, b, c, w, K, W, F)
        out[i] += std * x
        i += 1
    state[0], state[1], state[2], state[3] = a, b, c, w


#: The stream is cut into this many independent SFC64 sub-streams, each filling
#: a fixed slice of the buffer, so threads can share the work and the result
#: does not depend on how many threads there are.
CHUNKS = 8


@numba.njit(parallel=True, cache=True)
def add_normal_chunks(out, std, states, K, W, F):
    """``out += std * N(0, 1)``: slice t of ``states.shape[0]`` equal slices drawn
    from sub-stream ``states[t]``, slices in parallel."""
    n = out.shape[0]
    chunks = states.shape[0]
    for t in numba.prange(chunks):
        add_normal(out[t * n // chunks:(t + 1) * n // chunks], std, states[t], K, W, F)


def seed_state(seed_sequence: np.random.SeedSequence) -> np.ndarray:
    """SFC64 state (uint64[4]: a, b, c, counter) seeded exactly as numpy seeds it."""
    words = np.random.SFC64(seed_sequence).state["state"]["state"]
    return np.array(words, dtype=np.uint64)


class NumbaGaussianStream:
    """A reproducible N(0, 1) stream added into CPU tensors or arrays in place.

    :data:`CHUNKS` SFC64 sub-streams (spawned from the seed sequence) fill
    fixed slices of each buffer, in parallel when Numba has threads.
    """

    backend = "numba"

    def __init__(self, seed_sequence: np.random.SeedSequence):
        self._state = np.stack([seed_state(child) for child in seed_sequence.spawn(CHUNKS)])

    def add_(self, buf, std: float) -> None:
        """``buf += std * N(0, 1)`` (1-D contiguous float32/float64, tensor or array)."""
        array = buf.numpy() if hasattr(buf, "numpy") and not isinstance(buf, np.ndarray) else buf
        if array.shape[0]:
            add_normal_chunks(array, float(std), self._state, _K, _W, _F)

    def get_state(self) -> list[int]:
        return [int(x) for x in self._state.reshape(-1)]

    def set_state(self, state: list[int]) -> None:
        """Restore :meth:`get_state`; raises ValueError for a state of another layout."""
        if len(state) != self._state.size:
            raise ValueError(f"a numba Gaussian stream state has {self._state.size} words, "
                             f"not {len(state)}")
        self._state[:] = np.array(state, dtype=np.uint64).reshape(self._state.shape)


@register("gaussian_stream", backend="numba_cpu")
def gaussian_stream(seed_sequence: np.random.SeedSequence) -> NumbaGaussianStream:
    """A CPU Gaussian stream (see module docstring)."""
    return NumbaGaussianStream(seed_sequence)
