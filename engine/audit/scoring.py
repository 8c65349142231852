"""What the attacks observe: the model's log-probability of each record's label.

Every rank scores the rows of its own shard (:mod:`engine.shard`) with the
model of the checkpoint (:func:`engine.nn.mlp.logits`), in float64 so that a
row's score does not depend on how the rows are cut between ranks or
chunks. Scores that a statistic needs all at once are gathered in rank
order, i.e. in global row order (:func:`allgather_rows`).

Example::

    >>> import torch, numpy as np
    >>> from engine.nn.mlp import MLPSpec
    >>> from engine.audit.scoring import label_log_probs
    >>> spec = MLPSpec.build(1, (), 2)              # logistic regression, 1 feature
    >>> params = torch.tensor([0., 0., 1., 0.], dtype=torch.float64)  # logits (0, x)
    >>> X = np.array([[0., 1.], [2., 1.]], dtype=np.float32)   # features + ones column
    >>> np.round(np.exp(label_log_probs(spec, params, X, np.array([1, 1]))), 4)
    array([0.5   , 0.8808])
"""
from __future__ import annotations

import numpy as np
import torch

from engine.nn.mlp import logits

#: Rows per forward pass.
CHUNK_ROWS = 16384


def _loss(z, y):
    """Cross-entropy ``-log softmax(z)_y``, accurate also when it is tiny.

    ``log_softmax`` rounds the loss of a confident, correct prediction to
    exactly 0 (it subtracts two nearly equal numbers), which would tie the
    members of an overfit model with each other and with easy non-members.
    Written as ``softplus(logsumexp_{j != y} z_j - z_y)`` it keeps its
    relative precision down to about 1e-300.
    """
    z_y = z.gather(1, y[:, None])[:, 0]
    others = z.scatter(1, y[:, None], float("-inf"))
    return torch.nn.functional.softplus(torch.logsumexp(others, dim=1) - z_y)


def score_rows(spec, params, X: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(``log p(y_i | x_i)`` float64 ``[n]``, whether the model's top class is
    ``y_i``: bool ``[n]``); arguments as :func:`label_log_probs`."""
    logp = np.empty(y.shape[0], dtype=np.float64)
    correct = np.empty(y.shape[0], dtype=bool)
    with torch.no_grad():
        for start in range(0, y.shape[0], CHUNK_ROWS):
            xb = torch.from_numpy(np.ascontiguousarray(X[start:start + CHUNK_ROWS],
                                                       dtype=np.float64))
            yb = torch.from_numpy(np.asarray(y[start:start + CHUNK_ROWS], dtype=np.int64))
            z = logits(spec, params, xb)
            stop = start + yb.shape[0]
            logp[start:stop] = (-_loss(z, yb)).numpy()
            correct[start:stop] = (z.argmax(1) == yb).numpy()
    return logp, correct


def label_log_probs(spec, params, X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``log p(y_i | x_i)`` under the model: float64 ``[n]`` (the loss is its negative).

    Args:
        spec: :class:`engine.nn.mlp.MLPSpec`; params: its flat float64 vector.
        X: rows ``[n, F+1]`` with the trailing ones column (as :mod:`engine.shard`
            reads them); y: int labels ``[n]``.
    """
    return score_rows(spec, params, X, y)[0]


def allgather_rows(comm, local: np.ndarray) -> np.ndarray:
    """Collective: every rank's ``local`` rows concatenated in rank order
    (global row order when each rank holds a contiguous block)."""
    parts = comm.allgather(np.ascontiguousarray(local))
    return np.concatenate(parts) if parts else local
