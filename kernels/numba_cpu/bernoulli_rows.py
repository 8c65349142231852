"""``bernoulli_rows``: Poisson sampling of many steps at once, by geometric skips.

Poisson sampling keeps each of n rows independently with probability q at
every step. Laid end to end, the steps' rows form one sequence of
``steps * n`` independent coins, and the gap from one kept position to the
next is geometric: ``1 + floor(E / lambda)`` with ``E ~ Exp(1)`` and
``lambda = -ln(1 - q)`` (``P(gap > m) = (1 - q)^m``, exactly). So a block of
steps costs one exponential per kept row, and its rows come out sorted
within each step, distinct, with no binomial draw, no sort and no
duplicate to redraw. The exponentials come from the caller's
``numpy.random.Generator`` (its stream decides everything); this loop only
turns them into positions, which needs one pass and a branch per row.
"""
from __future__ import annotations

import numpy as np

from kernels.shared_compiles import cached_njit

#: Gaps beyond this are "past the block" whatever the block's size (no int64 overflow).
_FAR = 4.0e18


@cached_njit(nogil=True)
def bernoulli_rows(exponentials, scale, n, steps, state, rows, offsets):
    """Advance a block's geometric skips over ``exponentials``.

    Args:
        exponentials: float64 Exp(1) draws, consumed in order.
        scale: ``1 / -ln(1 - q)`` (0.0 for q = 1: every gap is 1).
        n: rows per step (> 0).
        steps: steps in the block.
        state: int64 ``[3]``, in and out: the last kept position within the
            current step (-1 at a step's start), the current step, rows written.
            Start a block with ``[-1, 0, 0]``; it is done when ``state[1] ==
            steps``.
        rows: int64 output, room for ``state[2] + len(exponentials)`` rows.
        offsets: int64 ``[steps + 1]``; ``offsets[j]`` is set to where step j's
            rows start when step j - 1 ends (``offsets[0]`` is the caller's, 0).

    Returns how many exponentials were used (all of them unless the block
    ended first).
    """
    pos, step, count = state[0], state[1], state[2]
    used = 0
    while used < exponentials.shape[0] and step < steps:
        gap = exponentials[used] * scale
        used += 1
        pos += (np.int64(gap) if gap < _FAR else np.int64(_FAR)) + 1
        if pos >= n:  # past this step's rows: into a later step (empty ones between)
            ahead = min(pos // n, steps - step)
            for j in range(step + 1, step + ahead + 1):
                offsets[j] = count
            step += ahead
            pos -= ahead * n
        if step < steps:
            rows[count] = pos
            count += 1
    state[0], state[1], state[2] = pos, step, count
    return used
