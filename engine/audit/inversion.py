"""Model inversion: infer a record's sensitive attribute from the model (Fredrikson et al.).

Fredrikson, Lantz, Jha, Lin, Page & Ristenpart, "Privacy in pharmacogenetics"
(USENIX Security 2014) and Fredrikson, Jha & Ristenpart, "Model inversion
attacks that exploit confidence information and basic countermeasures" (CCS
2015), Sec. 3: the attacker knows a record's other attributes ``x_-s`` and its
label ``y`` and wants the sensitive attribute ``s``. For every candidate value
``v`` it asks the model how likely the known label is with ``s = v``, and
picks the most probable value a posteriori::

    s_hat = argmax_v  pi(v) * p_model(y | x_-s, s = v)

where ``pi`` is the attribute's marginal in the population (known to the
attacker; counted on the population sample of :mod:`engine.audit.inputs`,
with add-one smoothing). The **baseline** is the best guess from the
marginal alone, ``argmax_v pi(v)``: an attack that does not beat it learned
nothing from the model. A model that memorised its training records lets the
attack do better on members than on non-members.

The attribute is one-hot encoded in the prepared file: its columns are the
``feature_names`` ``NAME=value`` (e.g. ``SEX=1``, ``SEX=2``), and each row
has exactly one of them set. Accuracies come with exact Clopper-Pearson
intervals.

Example (a logistic model whose label is the attribute itself)::

    >>> import numpy as np, torch
    >>> from engine.nn.mlp import MLPSpec
    >>> from engine.audit import inversion
    >>> spec = MLPSpec.build(2, (), 2)     # features S=a, S=b; class logits (4 S=a, 4 S=b)
    >>> params = torch.tensor([4., 0., 0., 0., 4., 0.], dtype=torch.float64)
    >>> X = np.array([[1, 0, 1], [0, 1, 1]], dtype=np.float32)
    >>> ll = inversion.candidate_log_likelihoods(spec, params, X, np.array([0, 1]), [0, 1])
    >>> inversion.predict(ll, np.log([0.5, 0.5])).tolist()
    [0, 1]
"""
from __future__ import annotations

import numpy as np

import collectives
from engine.audit import stats
from engine.audit.scoring import CHUNK_ROWS, label_log_probs
from engine.errors import DataError

NAME = "inversion"
TITLE = "attribute inference by model inversion (Fredrikson et al. 2015)"


class AttributeNotFound(DataError):
    """The sensitive attribute is not a one-hot group of the data file."""


def one_hot_groups(feature_names: list[str]) -> dict[str, list[int]]:
    """``NAME -> columns`` of every ``NAME=value`` group with at least 2 columns."""
    groups: dict[str, list[int]] = {}
    for column, name in enumerate(feature_names):
        if "=" in name:
            groups.setdefault(name.split("=", 1)[0], []).append(column)
    return {k: v for k, v in groups.items() if len(v) >= 2}


def attribute_columns(feature_names: list[str], attribute: str,
                      path: str = "the data file") -> tuple[np.ndarray, list[str]]:
    """The columns of ``attribute`` and the value each stands for.

    Raises:
        AttributeNotFound: (collective) no one-hot group of that name; for a
            file with none at all (images, all-numeric features), the message
            says the attack needs a census file's attributes and points to
            ``--attack membership``, which needs none.
    """
    groups = one_hot_groups(feature_names)
    if not groups:
        raise AttributeNotFound(
            f"the inversion attack (--attack inversion, run by default) infers a sensitive "
            f"attribute one-hot encoded in a census file (--attribute {attribute}); {path} "
            "has no such attribute (no NAME=value columns): audit it with --attack "
            "membership", collective=True)
    if attribute not in groups:
        listed = ", ".join(sorted(groups)) or "none"
        raise AttributeNotFound(f"--attribute {attribute}: {path} has no one-hot encoded "
                                f"attribute of that name; it has: {listed}", collective=True)
    cols = np.array(groups[attribute], dtype=np.int64)
    return cols, [feature_names[c].split("=", 1)[1] for c in cols]


def attribute_values(X: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """Index (into the group's values) of each row's attribute, int64 ``[n]``.

    Raises:
        ValueError: a row does not have exactly one 1 (and 0s) in the group.
    """
    block = X[:, cols]
    ok = np.all((block == 0) | (block == 1), axis=1) & (block.sum(axis=1) == 1)
    if not ok.all():
        raise ValueError(f"row {int(np.flatnonzero(~ok)[0])} is not one-hot in the "
                         "attribute's columns")
    return np.argmax(block, axis=1).astype(np.int64)


def candidate_log_likelihoods(spec, params, X: np.ndarray, y: np.ndarray,
                              cols) -> np.ndarray:
    """``log p_model(y_i | x_i with the attribute set to value v)``: float64 ``[n, k]``.

    X has the trailing ones column; ``cols`` are the attribute's k columns.
    """
    cols = np.asarray(cols, dtype=np.int64)
    out = np.empty((y.shape[0], cols.size), dtype=np.float64)
    for start in range(0, y.shape[0], CHUNK_ROWS):
        stop = min(start + CHUNK_ROWS, y.shape[0])
        Xv = np.array(X[start:stop], dtype=np.float64, copy=True)
        for v, column in enumerate(cols):
            Xv[:, cols] = 0.0
            Xv[:, column] = 1.0
            out[start:stop, v] = label_log_probs(spec, params, Xv, y[start:stop])
    return out


def log_prior(counts: np.ndarray) -> np.ndarray:
    """log of the marginal with add-one smoothing: ``(c_v + 1) / (sum c + k)``."""
    counts = np.asarray(counts, dtype=np.float64)
    return np.log((counts + 1.0) / (counts.sum() + counts.size))


def predict(log_likelihoods: np.ndarray, prior: np.ndarray) -> np.ndarray:
    """Fredrikson's MAP guess ``argmax_v log pi(v) + log p(y | x, v)`` per row
    (ties go to the first value)."""
    return np.argmax(log_likelihoods + prior[None, :], axis=1)


def _group_result(correct: float, baseline: float, rows: float, confidence: float) -> dict:
    n, k, b = int(rows), int(correct), int(baseline)
    nan = float("nan")
    return {"rows": n, "correct": k,
            "accuracy": k / n if n else nan,
            "accuracy_ci": list(stats.clopper_pearson(k, n, confidence)),
            "baseline_correct": b,
            "baseline_accuracy": b / n if n else nan,
            "baseline_ci": list(stats.clopper_pearson(b, n, confidence)),
            "advantage": (k - b) / n if n else nan}


def attack(spec, params, cols: np.ndarray, values: list[str], groups: dict[str, tuple],
           population_values: np.ndarray, comm, confidence: float = 0.95) -> dict:
    """Collective: the attack on each group of records, counts reduced over ranks.

    Args:
        spec, params: the target model (float64 parameters).
        cols, values: from :func:`attribute_columns`.
        groups: ``name -> (X, y, true value indices)`` of this rank's rows, e.g.
            ``{"members": ..., "nonmembers": ...}`` (same names on every rank).
        population_values: this rank's population rows' value indices (the prior).
        comm: every rank must call this.

    Returns:
        ``{"attribute values", "prior", "prior_rows", "baseline_guess",
        name: {"rows", "accuracy", "accuracy_ci", "baseline_accuracy",
        "baseline_ci", "advantage", ...}}``, the same on every rank.
    """
    k = len(values)
    counts = np.bincount(population_values, minlength=k).astype(np.float64)
    collectives.allreduce(counts, comm)
    prior = log_prior(counts)
    mode = int(np.argmax(counts))
    local = []
    for name in groups:
        X, y, truth = groups[name]
        guess = predict(candidate_log_likelihoods(spec, params, X, y, cols), prior)
        local += [float(np.sum(guess == truth)), float(np.sum(truth == mode)), float(y.size)]
    sums = np.array(local, dtype=np.float64)
    collectives.allreduce(sums, comm)
    result = {"values": list(values), "prior": (np.exp(prior)).tolist(),
              "prior_rows": int(counts.sum()), "baseline_guess": values[mode]}
    for i, name in enumerate(groups):
        result[name] = _group_result(*sums[3 * i:3 * i + 3], confidence)
    return result
