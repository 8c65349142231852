"""Philox4x64-10 and Box-Muller on the host: the GPU noise streams' state and reference.

The CUDA noise kernels (``kernels/numba_cuda/gaussian.py``, ``kernels/cupy/gaussian.py``
with ``kernels/cupy/gaussian.cu``) draw from Philox4x64-10, the counter-based
generator of Salmon, Moraes, Dror & Shaw (2011), "Parallel random numbers:
as easy as 1, 2, 3" (SC'11): block ``counter`` under ``key`` is a pure
function, so thousands of threads draw independent blocks without sharing
state, and the numbers do not depend on the launch configuration. It is the
stream of ``numpy.random.Philox`` (the tests check this module against it
bit for bit, and the kernels against this module).

One call ``add_(buf, std)`` on n elements uses blocks ``counter .. counter +
ceil(n/4) - 1``: block b gives four 64-bit words, i.e. four uniforms in (0, 1]
(53 bits each), i.e. two Box-Muller pairs, the normals of ``buf[4b:4b+4]``.
The counter then advances by ``ceil(n/4)``. The state is four integers:
``[key0, key1, counter_lo, counter_hi]``.

Pure numpy; imports nothing CUDA.
"""
from __future__ import annotations

import numpy as np

MASK64 = (1 << 64) - 1
M0, M1 = 0xD2E7470EE14C6C93, 0xCA5A826395121157   # multipliers
W0, W1 = 0x9E3779B97F4A7C15, 0xBB67AE8584CAA73B   # Weyl key increments
ROUNDS = 10
STATE_WORDS = 4

_U64 = np.uint64
_M32 = _U64(0xFFFFFFFF)
_S32 = _U64(32)


def round_keys(key: tuple[int, int]) -> np.ndarray:
    """The key of each of the 10 rounds (uint64, shape (10, 2)): k, k + W, k + 2W, ..."""
    k0, k1 = int(key[0]) & MASK64, int(key[1]) & MASK64
    table = np.empty((ROUNDS, 2), dtype=np.uint64)
    for r in range(ROUNDS):
        table[r] = ((k0 + r * W0) & MASK64, (k1 + r * W1) & MASK64)
    return table


def _mulhilo(a: np.ndarray, b: int) -> tuple[np.ndarray, np.ndarray]:
    """(high, low) 64-bit halves of a * b, element-wise, from 32-bit pieces."""
    a0, a1 = a & _M32, a >> _S32
    b0, b1 = _U64(b & 0xFFFFFFFF), _U64(b >> 32)
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = (p00 >> _S32) + (p01 & _M32) + (p10 & _M32)
    hi = p11 + (p01 >> _S32) + (p10 >> _S32) + (mid >> _S32)
    lo = (mid << _S32) | (p00 & _M32)
    return hi, lo


def philox_blocks(counter: int, blocks: int, key: tuple[int, int]) -> np.ndarray:
    """Blocks ``counter .. counter + blocks - 1`` (uint64, shape (blocks, 4)).

    The counter is 128 bits (the two high words of Philox's 256-bit counter are 0).
    """
    start = int(counter)
    index = np.arange(blocks, dtype=np.uint64)
    lo0 = _U64(start & MASK64)
    with np.errstate(over="ignore"):
        c0 = lo0 + index
    c1 = _U64((start >> 64) & MASK64) + (c0 < lo0).astype(np.uint64)
    c = [c0, c1, np.zeros(blocks, np.uint64), np.zeros(blocks, np.uint64)]
    for k0, k1 in round_keys(key):
        hi0, lo0_ = _mulhilo(c[0], M0)
        hi1, lo1 = _mulhilo(c[2], M1)
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0_]
    return np.stack(c, axis=1)


def uniforms(words: np.ndarray) -> np.ndarray:
    """64-bit words -> float64 uniforms in (0, 1] (the top 53 bits, plus one ulp)."""
    return ((words >> _U64(11)).astype(np.float64) + 1.0) * (1.0 / 9007199254740992.0)


def normals(counter: int, n: int, key: tuple[int, int]) -> np.ndarray:
    """The n standard normals (float64) that ``add_`` draws from ``counter``."""
    blocks = -(-n // 4)
    u = uniforms(philox_blocks(counter, blocks, key))
    r1 = np.sqrt(-2.0 * np.log(u[:, 0]))
    r2 = np.sqrt(-2.0 * np.log(u[:, 2]))
    t1, t2 = 2 * np.pi * u[:, 1], 2 * np.pi * u[:, 3]
    z = np.stack([r1 * np.cos(t1), r1 * np.sin(t1), r2 * np.cos(t2), r2 * np.sin(t2)], 1)
    return z.reshape(-1)[:n]


def add_reference(buf: np.ndarray, std: float, counter: int, key: tuple[int, int]) -> int:
    """What the kernels do, on the host: ``buf += std * normals`` rounded once to
    ``buf``'s dtype. Returns the next counter."""
    n = buf.shape[0]
    buf[:] = (buf.astype(np.float64) + std * normals(counter, n, key)).astype(buf.dtype)
    return counter + -(-n // 4)


class PhiloxState:
    """Key and 128-bit block counter of one stream, seeded from a SeedSequence."""

    def __init__(self, seed_sequence: np.random.SeedSequence):
        words = seed_sequence.generate_state(2, np.uint64)
        self.key = (int(words[0]), int(words[1]))
        self.counter = 0

    def take(self, n: int) -> int:
        """Reserve the blocks for ``n`` elements; returns the first block's counter."""
        first = self.counter
        self.counter = (self.counter + -(-n // 4)) & ((1 << 128) - 1)
        return first

    def get_state(self) -> list[int]:
        return [self.key[0], self.key[1], self.counter & MASK64, self.counter >> 64]

    def set_state(self, state: list[int]) -> None:
        """Restore :meth:`get_state`; ValueError for the state of another kind of stream."""
        if len(state) != STATE_WORDS or not all(
                isinstance(w, (int, np.integer)) and 0 <= int(w) <= MASK64 for w in state):
            raise ValueError(f"a Philox Gaussian stream state is {STATE_WORDS} 64-bit words, "
                             f"not {len(state)} values")
        self.key = (int(state[0]), int(state[1]))
        self.counter = int(state[2]) | (int(state[3]) << 64)
