"""The main job's data: scikit-learn's bundled digits, split, and shared out like torch's DistributedSampler."""

from __future__ import annotations

import numpy as np


# ------------------------------------------------------------------ data
def load_digits_split(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise SystemExit(
            "psring train needs scikit-learn for its digits data set: pip install 'psring[examples]'"
        ) from None
    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(x))
    cut = int(len(x) * 0.8)
    tr, te = order[:cut], order[cut:]
    return x[tr], y[tr], x[te], y[te]


def shard_indices(n: int, epoch: int, seed: int, rank: int, world: int) -> np.ndarray:
    """DistributedSampler-like: one shared shuffle per epoch; rank r takes every world-th index.

    The shuffled list is padded by wrapping around so every rank gets ceil(n/world) samples.
    """
    order = np.random.default_rng(seed + 1000 + epoch).permutation(n)
    per_rank = -(-n // world)
    padded = np.concatenate([order, order[: per_rank * world - n]])
    return padded[rank::world]
