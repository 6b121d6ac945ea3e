"""The second main job (``psring train --model embed``): a recommendation model with two embedding
tables, on data it generates with a known structure.

Users and items have hidden factor vectors; a user clicks an item when their dot product is
positive (a few labels flipped as noise). The model learns a user table and an item table (sparse
tables: a batch touches a few rows of each) and a bias, with a logistic loss on the dot product of
the rows: a two-tower model at its smallest. Test accuracy says how much of the hidden structure it
found (the noise bounds it).

Knows arrays, not groups: the loop (``job``) pulls the rows a batch needs and pushes SparseRows.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..core.sparse import SparseRows

USERS, ITEMS, DIM, TRUE_DIM = 600, 400, 16, 6
TRAIN, TEST, NOISE = 60_000, 6_000, 0.02


def make_data(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train pairs (n, 2) of user, item ids; their labels; test pairs; test labels)."""
    rng = np.random.default_rng(10_000 + seed)
    u_true = rng.standard_normal((USERS, TRUE_DIM))
    v_true = rng.standard_normal((ITEMS, TRUE_DIM))
    pairs = np.stack([rng.integers(0, USERS, TRAIN + TEST), rng.integers(0, ITEMS, TRAIN + TEST)], axis=1)
    labels = (np.einsum("nd,nd->n", u_true[pairs[:, 0]], v_true[pairs[:, 1]]) > 0).astype(np.float32)
    flip = rng.random(labels.size) < NOISE
    labels[flip] = 1 - labels[flip]
    return pairs[:TRAIN].astype(np.int64), labels[:TRAIN], pairs[TRAIN:].astype(np.int64), labels[TRAIN:]


def init_params(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "users": (rng.standard_normal((USERS, DIM)) * 0.1).astype(np.float32),
        "items": (rng.standard_normal((ITEMS, DIM)) * 0.1).astype(np.float32),
        "bias": np.zeros(1, np.float32),
    }


SPARSE = ["users", "items"]


def forward_backward(
    u_rows: np.ndarray, v_rows: np.ndarray, bias: np.ndarray, pairs: np.ndarray, y: np.ndarray
) -> tuple[float, dict[str, Any]]:
    """Logistic loss of sigmoid(u . v + b) against y, and the gradients: SparseRows for the tables
    (one row per example; a user or item met twice in the batch gets two, summed later)."""
    logit = np.einsum("nd,nd->n", u_rows, v_rows) + bias[0]
    p = 1.0 / (1.0 + np.exp(-logit))
    eps = np.float32(1e-7)
    loss = float(-np.mean(y * np.log(p + eps) + (1 - y) * np.log(1 - p + eps)))
    # the rows take the gradient of the batch's summed loss (each example moves its own rows as much
    # whatever the batch size, as embedding models are usually trained); the bias the mean's
    d = (p - y).astype(np.float32)
    grads = {
        "users": SparseRows(pairs[:, 0], (d[:, None] * v_rows).astype(np.float32), USERS),
        "items": SparseRows(pairs[:, 1], (d[:, None] * u_rows).astype(np.float32), ITEMS),
        "bias": np.array([d.mean()], np.float32),
    }
    return loss, grads


def accuracy(u_rows: np.ndarray, v_rows: np.ndarray, bias: np.ndarray, y: np.ndarray) -> float:
    logit = np.einsum("nd,nd->n", u_rows, v_rows) + bias[0]
    return float(((logit > 0).astype(np.float32) == y).mean())
