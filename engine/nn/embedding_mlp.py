"""``--model embedding-mlp``: an MLP over embedded categories and numeric columns.

For files prepared with ``mpidp prep --encoding codes``, where each
categorical feature is one column of integer category codes (format version
3, :attr:`preprocessing.h5format.DataInfo.code_columns`). Every categorical
feature gets ``dim`` learned numbers per category, looked up in one shared
``nn.Embedding`` table (feature j's codes are offset by the category counts of
features 0..j-1, so the table holds every feature's categories once); the
looked-up vectors and the numeric columns, concatenated, feed a ReLU MLP of
the ``--hidden`` widths. On the income task the first layer sees 3 numeric
columns and 8 x 8 embedded numbers instead of 827 one-hot columns, and one
table keeps the per-example clipping to one Embedding rule (the rows each
example touches, :mod:`engine.dp.rules`) and the Linear rules.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

#: Learned numbers per category (the same for every categorical feature).
EMBEDDING_DIM = 8
#: Standard deviation of the initial embeddings. Small, so that the first
#: layer starts from the numeric columns and categories move apart only as
#: the data pushes them; torch's N(0, 1) tested a point worse on income.
EMBEDDING_INIT_STD = 0.1


class EmbeddingMLP(nn.Module):
    """Embeds the code columns of ``x`` and runs an MLP over them and the rest.

    Args:
        n_features: columns of ``x`` (code and numeric columns).
        n_classes: logits returned per row.
        code_columns: ``(column, number of categories, name)`` per categorical
            feature, as :class:`~preprocessing.h5format.DataInfo` gives them;
            at least one.
        hidden: widths of the hidden layers (may be empty).
        dim: learned numbers per category.

    ``forward(x)`` takes float ``[k, n_features]`` rows whose code columns hold
    exact integers ``0 .. categories-1`` (checked when a shard is read) and
    returns logits ``[k, n_classes]``.
    """

    def __init__(self, n_features: int, n_classes: int,
                 code_columns: Sequence[tuple[int, int, str]],
                 hidden: Sequence[int] = (128, 128), dim: int = EMBEDDING_DIM) -> None:
        super().__init__()
        if not code_columns:
            raise ValueError("embedding-mlp needs at least one categorical code column")
        codes = [int(c[0]) for c in code_columns]
        counts = [int(c[1]) for c in code_columns]
        if len(set(codes)) != len(codes) or min(codes) < 0 or max(codes) >= n_features:
            raise ValueError(f"code columns {codes} must be distinct columns of "
                             f"0..{n_features - 1}")
        numeric = [c for c in range(n_features) if c not in set(codes)]
        offsets = [sum(counts[:j]) for j in range(len(counts))]
        self.register_buffer("code_index", torch.tensor(codes, dtype=torch.int64))
        self.register_buffer("numeric_index", torch.tensor(numeric, dtype=torch.int64))
        self.register_buffer("offsets", torch.tensor(offsets, dtype=torch.int64))
        self.embedding = nn.Embedding(sum(counts), dim)
        nn.init.normal_(self.embedding.weight, 0.0, EMBEDDING_INIT_STD)
        widths = [len(numeric) + dim * len(codes), *hidden, n_classes]
        layers: list[nn.Module] = []
        for i, (w_in, w_out) in enumerate(zip(widths[:-1], widths[1:])):
            layers.append(nn.Linear(w_in, w_out))
            if i < len(widths) - 2:
                layers.append(nn.ReLU())
        self.mlp = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index = x.index_select(1, self.code_index).long() + self.offsets
        embedded = self.embedding(index).flatten(1)
        return self.mlp(torch.cat([x.index_select(1, self.numeric_index), embedded], 1))
