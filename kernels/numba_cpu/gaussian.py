"""``gaussian_stream`` on the CPU: SFC64 lanes and Box-Muller, vectorised by LLVM.

Noise is a measurable cost of every DP-SGD step (one Gaussian per model
parameter per step), and a scalar sampler (numpy's and torch's, or a
ziggurat with its table lookups and branches) draws one sample at a time
(figures: docs/design/noise-generator.md). This kernel is written so
that LLVM vectorises it for the CPU it runs on: Numba compiles
for the host, so the same source runs 16 float32 lanes on an AVX-512 CPU
and 8 on an AVX2 one, chosen when it is compiled there (Numba's cache is
kept per CPU). The loop has no branch and no table lookup:

* **Bits.** :data:`LANES` independent SFC64 generators (Chris
  Doty-Humphrey's Small Fast Chaotic generator, the step of
  ``numpy.random.SFC64``: the tests check each lane bit for bit) step side by
  side, one per vector slot.
* **Transform.** Box-Muller: each lane makes two normal pairs from three
  64-bit draws. The top 52 bits of each of the first two give
  u = (k + 1/2) 2^-52 in (0, 1) and a pair's radius sqrt(-2 ln u), so the
  tail reaches 8.57 standard deviations (P(|Z| > 8.57) = 1e-17); the third
  draw's halves are the two pairs' angles, 32 bits each (2 bits the
  quadrant, 30 the position within it). Three draws instead of four: the
  bits were a third of the kernel's time. ln u is split exactly into
  exponent and mantissa in float64 (bit casts,
  :mod:`kernels.numba_cpu.bitcast`), then ln of the mantissa and sin/cos of
  the angle are short polynomials in float32 (series of atanh and of
  sin/cos on a quarter turn), each within a few float32 ulps; the tests
  compare every step with numpy in float64.

The result is added, scaled, to a float32 or float64 buffer in place: no
temporary the size of the buffer. The buffer is cut into :data:`CHUNKS`
slices, each with its own lanes seeded from a child of the stream's seed
sequence, so threads share the work and the numbers do not depend on the
thread count. Within a slice, block j of :data:`BLOCK` values holds, lane
by lane, the first pairs' cosines, their sines, then the second pairs'
cosines and sines (a test rebuilds whole buffers in that layout); a
slice's last partial block is drawn whole and cut, so a buffer of a given
length always takes the same draws.
"""
from __future__ import annotations

import math
from typing import Callable

import numba
import numpy as np

from kernels.numba_cpu import serial_twin
from kernels.numba_cpu.bitcast import bits_f64, f64_bits
from kernels.registry import register
from kernels.shared_compiles import cached_njit

#: SFC64 generators stepped side by side in each slice (a multiple of 16, the
#: widest float32 vector), each filling one slot of every block.
LANES = 64
#: The stream is cut into this many slices, each with its own LANES
#: generators, so threads can share the work and the result does not depend
#: on how many threads there are.
CHUNKS = 8
#: Values per block: two normal pairs per lane, from three draws per lane.
BLOCK = 4 * LANES
#: Raw draws per lane per block.
DRAWS = 3

_U64, _U32, _F32 = np.uint64, np.uint32, np.float32
_TWO52 = 4503599627370496.0
_MAGIC = _U64(0x4330000000000000)   # the bits of 2^52: OR-ing in k < 2^52 gives 2^52 + k
_MANTISSA = _U64(0x000FFFFFFFFFFFFF)
_ONE = _U64(0x3FF0000000000000)
_SQRT2 = math.sqrt(2.0)
_LN2 = _F32(math.log(2.0))
_HALF_PI = _F32(math.pi / 2)
# ln m = 2 atanh(s) = 2 s (1 + s^2/3 + s^4/5 + ...), s = (m - 1) / (m + 1), |s| < 0.172
_ATANH = tuple(_F32(1.0 / (2 * i + 1)) for i in range(6))
# sin and cos on |phi| <= pi/4: Taylor series to phi^9 and phi^10
_SIN = tuple(_F32((-1) ** i / math.factorial(2 * i + 1)) for i in range(5))
_COS = tuple(_F32((-1) ** i / math.factorial(2 * i)) for i in range(6))


@numba.njit(inline="always")
def _sfc64(a, b, c, w):
    r = a + b + w
    w += _U64(1)
    a = b ^ (b >> _U64(11))
    b = c + (c << _U64(3))
    c = ((c << _U64(24)) | (c >> _U64(40))) + r
    return r, a, b, c, w


@numba.njit(inline="always")
def _draw_block(state, bits):
    """Three draws per lane: ``bits[d * LANES + l]`` is lane l's draw d
    (``state``: uint64[4, LANES], rows a, b, c, counter)."""
    a, b, c, w = state[0], state[1], state[2], state[3]
    for lane in range(LANES):
        r1, a1, b1, c1, w1 = _sfc64(a[lane], b[lane], c[lane], w[lane])
        r2, a1, b1, c1, w1 = _sfc64(a1, b1, c1, w1)
        r3, a1, b1, c1, w1 = _sfc64(a1, b1, c1, w1)
        bits[lane], bits[LANES + lane], bits[2 * LANES + lane] = r1, r2, r3
        a[lane], b[lane], c[lane], w[lane] = a1, b1, c1, w1


@numba.njit(inline="always", error_model="numpy")
def _radius(r1):
    """sqrt(-2 ln u), u = (k + 1/2) 2^-52, k the top 52 bits of ``r1`` (float32)."""
    x = bits_f64(_MAGIC | (r1 >> _U64(12))) - (_TWO52 - 0.5)  # k + 1/2, exact
    bits = f64_bits(x)
    e = np.int32(bits >> _U64(52)) - np.int32(1023 + 52)
    m = bits_f64((bits & _MANTISSA) | _ONE)                    # x = m 2^(e + 52)
    big = m > _SQRT2
    m = m * 0.5 if big else m                                   # m in [1/sqrt2, sqrt2)
    e = e + np.int32(1) if big else e
    s = _F32(m - 1.0) / _F32(m + 1.0)
    z = s * s
    p = _ATANH[0] + z * (_ATANH[1] + z * (_ATANH[2] + z * (_ATANH[3] + z * (
        _ATANH[4] + z * _ATANH[5]))))
    ln_u = _F32(e) * _LN2 + _F32(2.0) * s * p
    return math.sqrt(max(_F32(-2.0) * ln_u, _F32(0.0)))


@numba.njit(inline="always", error_model="numpy")
def _direction(u):
    """(cos theta, sin theta), theta uniform on the circle from the 32 bits
    ``u`` (uint32): 2 bits the quadrant q, 30 bits phi in [-pi/4, pi/4),
    theta = q pi/2 + phi."""
    q = u >> _U32(30)
    phi = (_F32(np.int32(u & _U32(0x3FFFFFFF))) * _F32(1.0 / 1073741824.0)
           - _F32(0.5)) * _HALF_PI
    p2 = phi * phi
    sn = phi * (_SIN[0] + p2 * (_SIN[1] + p2 * (_SIN[2] + p2 * (_SIN[3] + p2 * _SIN[4]))))
    cs = _COS[0] + p2 * (_COS[1] + p2 * (_COS[2] + p2 * (_COS[3] + p2 * (
        _COS[4] + p2 * _COS[5]))))
    odd = (q & _U32(1)) != _U32(0)
    x = -sn if odd else cs
    y = cs if odd else sn
    if (q & _U32(2)) != _U32(0):
        x, y = -x, -y
    return x, y


@numba.njit(inline="always", error_model="numpy")
def _add_block(out, base, std, bits):
    """``out[base:base + BLOCK] += std * (the block's normals)``, in the layout
    of the module docstring."""
    for lane in range(LANES):
        ra = std * _radius(bits[lane])
        rb = std * _radius(bits[LANES + lane])
        angles = bits[2 * LANES + lane]
        xa, ya = _direction(_U32(angles >> _U64(32)))
        xb, yb = _direction(_U32(angles & _U64(0xFFFFFFFF)))
        out[base + lane] += ra * xa
        out[base + LANES + lane] += ra * ya
        out[base + 2 * LANES + lane] += rb * xb
        out[base + 3 * LANES + lane] += rb * yb


@cached_njit(error_model="numpy", fastmath={"contract"})
def add_normal(out, std, state, bits, tail):
    """``out += std * N(0, 1)`` element-wise (1-D, float32/64); advances ``state``
    (uint64[4, LANES]) by ``ceil(len(out) / BLOCK)`` blocks. ``bits``
    (uint64[DRAWS * LANES]) and ``tail`` (float32[BLOCK]) are scratch."""
    n = out.shape[0]
    sd = _F32(std)
    whole = n // BLOCK
    for block in range(whole):
        _draw_block(state, bits)
        _add_block(out, block * BLOCK, sd, bits)
    rest = n - whole * BLOCK
    if rest:
        _draw_block(state, bits)
        tail[:] = 0
        _add_block(tail, 0, sd, bits)
        for i in range(rest):
            out[whole * BLOCK + i] += tail[i]


@cached_njit(parallel=True)
def add_normal_chunks(out, std, states, bits, tail):
    """``out += std * N(0, 1)``: slice t of ``states.shape[0]`` equal slices drawn
    from ``states[t]``, slices in parallel."""
    n = out.shape[0]
    chunks = states.shape[0]
    for t in numba.prange(chunks):
        add_normal(out[t * n // chunks:(t + 1) * n // chunks], std, states[t], bits[t], tail[t])


#: :func:`add_normal_chunks` on one thread, without the cost of starting a
#: parallel region (same numbers).
add_normal_chunks_serial = serial_twin(add_normal_chunks)


@cached_njit
def sfc64_raw(state, out):
    """``out`` (uint64[K, LANES]) = each lane's next K raw outputs (tests:
    against numpy's SFC64); advances ``state``."""
    a, b, c, w = state[0], state[1], state[2], state[3]
    for k in range(out.shape[0]):
        for lane in range(LANES):
            out[k, lane], a[lane], b[lane], c[lane], w[lane] = _sfc64(a[lane], b[lane],
                                                                      c[lane], w[lane])


@cached_njit(error_model="numpy", fastmath={"contract"})
def transform(first, angles):
    """The normal pairs the kernel makes from raw draws (tests: against numpy
    in float64): float32 arrays ``(z0, z1)`` for a uint64 array ``first``
    (the radius's draw) and a uint32 array ``angles`` of equal length."""
    z0 = np.empty(first.shape[0], np.float32)
    z1 = np.empty(first.shape[0], np.float32)
    for i in range(first.shape[0]):
        rad = _radius(first[i])
        x, y = _direction(angles[i])
        z0[i], z1[i] = rad * x, rad * y
    return z0, z1


@cached_njit
def _warm_up(state, rounds):
    a, b, c, w = state[0], state[1], state[2], state[3]
    for lane in range(a.shape[0]):
        for _ in range(rounds):
            _, a[lane], b[lane], c[lane], w[lane] = _sfc64(a[lane], b[lane], c[lane], w[lane])


def seed_lanes(seed_sequence: np.random.SeedSequence) -> np.ndarray:
    """uint64[4, LANES]: LANES SFC64 states seeded as numpy seeds one SFC64
    (three words from the seed sequence, counter 1, 12 rounds discarded)."""
    words = seed_sequence.generate_state(3 * LANES, np.uint64).reshape(LANES, 3).T
    state = np.empty((4, LANES), dtype=np.uint64)
    state[:3] = words
    state[3] = 1
    _warm_up(state, 12)
    return state


class NumbaGaussianStream:
    """A reproducible N(0, 1) stream added into CPU tensors or arrays in place.

    :data:`CHUNKS` slices, each with :data:`LANES` SFC64 lanes (spawned from
    the seed sequence), fill fixed slices of each buffer, in parallel when
    Numba has threads.
    """

    backend = "numba"

    def __init__(self, seed_sequence: np.random.SeedSequence):
        self._state = np.stack([seed_lanes(child) for child in seed_sequence.spawn(CHUNKS)])
        self._bits = np.empty((CHUNKS, DRAWS * LANES), dtype=np.uint64)
        self._tail = np.empty((CHUNKS, BLOCK), dtype=np.float32)

    def add_(self, buf, std: float) -> None:
        """``buf += std * N(0, 1)`` (1-D contiguous float32/float64, tensor or array)."""
        self.bind(buf, std)()

    def bind(self, buf, std: float) -> Callable[[], None]:
        """:meth:`add_` on this buffer and deviation, with the numpy view made and
        the serial or parallel kernel chosen (by Numba's thread count now) once:
        for the training step, which adds to the same buffer every step and
        where converting the tensor per call cost a sizeable part of the
        kernel's own time."""
        array = buf.numpy() if hasattr(buf, "numpy") and not isinstance(buf, np.ndarray) else buf
        fill = add_normal_chunks if numba.get_num_threads() > 1 else add_normal_chunks_serial
        state, bits, tail, std = self._state, self._bits, self._tail, float(std)
        return lambda: fill(array, std, state, bits, tail)

    def get_state(self) -> list[int]:
        return [int(x) for x in self._state.reshape(-1)]

    def set_state(self, state: list[int]) -> None:
        """Restore :meth:`get_state`; raises ValueError for a state of another layout
        (e.g. a checkpoint of a version with another generator)."""
        if len(state) != self._state.size:
            raise ValueError(f"a numba Gaussian stream state has {self._state.size} words, "
                             f"not {len(state)}")
        self._state[:] = np.array(state, dtype=np.uint64).reshape(self._state.shape)


@register("gaussian_stream", backend="numba_cpu")
def gaussian_stream(seed_sequence: np.random.SeedSequence) -> NumbaGaussianStream:
    """A CPU Gaussian stream (see module docstring)."""
    return NumbaGaussianStream(seed_sequence)
