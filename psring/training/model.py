"""The main job's model: a two-layer ReLU MLP with a hand-written backward pass (numpy or cupy)."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from ..core.arrays import array_module


# ------------------------------------------------------------------ model
def init_params(seed: int, sizes: tuple[int, ...] = (64, 128, 10)) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    params = {}
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
        bound = 1 / np.sqrt(fan_in)
        params[f"w{i}"] = rng.uniform(-bound, bound, (fan_in, fan_out)).astype(np.float32)
        params[f"b{i}"] = rng.uniform(-bound, bound, fan_out).astype(np.float32)
    return params


def forward_backward(params: dict[str, Any], x: Any, y: Any) -> tuple[float, dict[str, Any]]:
    """Loss and gradients of the 2-layer ReLU MLP with softmax cross-entropy (numpy or cupy)."""

    xp = array_module(params["w0"])
    h = x @ params["w0"] + params["b0"]
    a = xp.maximum(h, 0)
    logits = a @ params["w1"] + params["b1"]
    logits = logits - logits.max(axis=1, keepdims=True)
    p = xp.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    n = len(x)
    rows = xp.arange(n)
    loss = float(-xp.log(p[rows, y] + 1e-12).mean())
    d = p
    d[rows, y] -= 1
    d /= n
    grads = {"w1": a.T @ d, "b1": d.sum(axis=0)}
    da = d @ params["w1"].T
    da[h <= 0] = 0
    grads["w0"] = x.T @ da
    grads["b0"] = da.sum(axis=0)
    return loss, {k: v.astype(xp.float32) for k, v in grads.items()}


def accuracy(params: dict[str, Any], x: Any, y: Any) -> float:

    xp = array_module(params["w0"])
    a = xp.maximum(x @ params["w0"] + params["b0"], 0)
    return float(((a @ params["w1"] + params["b1"]).argmax(axis=1) == y).mean())
