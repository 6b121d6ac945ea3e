"""One rank of the local SGD / DiLoCo benchmark (benchmarks/slowlink_diloco.py starts four on the slow-link
bed; ``psring launch -n 4 -- python benchmarks/diloco_rank.py SPEC`` runs it on loopback).

The model is a wide ReLU MLP (``--widths``, 10.5 MB of float32 parameters at the default) learning a
fixed random teacher network's outputs (mean squared error): each rank draws its own batches from its
own seed, a held-out set is the same on every rank. The loop is an ordinary blocking one
(``psring.init()``, ``psring.SyncSGD``): the gradients are computed in this thread while a streaming
exchange runs on in the event loop's. Rank 0 writes (``spec["out"]``): samples/s, compute use (the
share of the loop's wall time not spent waiting on an exchange: SyncSGD's ``waited_s``), bytes each
rank sent, the held-out loss of the global parameters at the end, and the loss curve.

SPEC is JSON: steps, local_steps (1: synchronous SGD every step), fragments, compression, lr (AdamW
inner), outer_lr, outer_momentum, batch, widths, seed, out.
"""

from __future__ import annotations

import itertools
import json
import os
import resource
import sys
import time
from typing import Any

import numpy as np

import psring


def init_params(widths: list[int], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        out[f"w{i}"] = (rng.standard_normal((a, b)) * np.sqrt(2.0 / a)).astype(np.float32)
        out[f"b{i}"] = np.zeros(b, np.float32)
    return out


def forward(params: dict[str, np.ndarray], x: np.ndarray, layers: int) -> tuple[np.ndarray, list[np.ndarray]]:
    acts = [x]
    h = x
    for i in range(layers):
        h = h @ params[f"w{i}"] + params[f"b{i}"]
        if i < layers - 1:
            h = np.maximum(h, 0)
        acts.append(h)
    return h, acts


def loss_and_grads(params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray, layers: int) -> tuple[float, dict]:
    out, acts = forward(params, x, layers)
    diff = out - y
    loss = float(np.mean(diff * diff))
    d = (2.0 / diff.size) * diff
    grads = {}
    for i in reversed(range(layers)):
        grads[f"w{i}"] = (acts[i].T @ d).astype(np.float32)
        grads[f"b{i}"] = d.sum(axis=0).astype(np.float32)
        if i:
            d = (d @ params[f"w{i}"].T) * (acts[i] > 0)
    return loss, grads


def _watch(loop: Any) -> None:
    """Debugging: print (with every thread's stack) when the event loop answers a callback late."""
    import faulthandler
    import threading

    def run() -> None:
        while True:
            done = threading.Event()
            t = time.monotonic()
            loop.call_soon_threadsafe(done.set)
            if not done.wait(2.0):
                print(f"WATCH: loop silent for 2 s at {time.time():.1f}", file=sys.stderr, flush=True)
                faulthandler.dump_traceback(sys.stderr)
                done.wait()
                print(f"WATCH: loop back after {time.monotonic() - t:.1f} s", file=sys.stderr, flush=True)
            time.sleep(0.5)

    threading.Thread(target=run, daemon=True).start()


def _peak_rss() -> int:
    """This process's peak resident memory so far, bytes (Linux: ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Task:
    """The teacher and the data: batch(rank, t) and a held-out set, the same on every rank."""

    def __init__(self, widths: list[int], seed: int) -> None:
        self.widths, self.layers = widths, len(widths) - 1
        self.teacher = init_params([widths[0], 64, widths[-1]], seed + 10_000)
        rng = np.random.default_rng(seed + 20_000)
        self.x_test = rng.standard_normal((512, widths[0])).astype(np.float32)
        self.y_test = self.target(self.x_test)

    def target(self, x: np.ndarray) -> np.ndarray:
        return forward(self.teacher, x, 2)[0]

    def batch(self, rank: int, t: int, size: int) -> tuple[np.ndarray, np.ndarray]:
        x = np.random.default_rng([rank, t, 7]).standard_normal((size, self.widths[0])).astype(np.float32)
        return x, self.target(x)

    def test_loss(self, params: dict[str, np.ndarray]) -> float:
        out, _ = forward(params, self.x_test, self.layers)
        return float(np.mean((out - self.y_test) ** 2))


def main(spec: dict[str, Any]) -> None:
    widths = [int(w) for w in spec.get("widths", [256, 1024, 1024, 1024, 256])]
    task = Task(widths, int(spec.get("seed", 0)))
    h = int(spec.get("local_steps", 1))
    kw: dict[str, Any] = {"compression": spec.get("compression")}
    if h > 1:
        kw.update(local_steps=h, fragments=int(spec.get("fragments", 1)),
                  outer=psring.optim.SGD(lr=float(spec.get("outer_lr", 0.7)),
                                         momentum=float(spec.get("outer_momentum", 0.9)), nesterov=True))  # fmt: skip
    start = init_params(widths, 0)
    loss_and_grads(start, *task.batch(0, 10**9, int(spec.get("batch", 32))), task.layers)  # (its buffers, once)
    idle = _peak_rss()  # the training process with its model and a step's gradients, before psring
    g = psring.init()
    if os.environ.get("DILOCO_WATCH"):
        _watch(g.portal.loop)
    try:
        opt = psring.SyncSGD(g, start, psring.optim.AdamW(lr=float(spec.get("lr", 1e-3))), **kw)
        params = opt.start()
        g.barrier()
        steps, batch = int(spec["steps"]), int(spec.get("batch", 32))
        compute, curve = 0.0, []
        sent0 = g.stats()["bytes_sent"]
        t0 = time.perf_counter()
        for t in range(steps):
            x, y = task.batch(g.rank, t, batch)
            c0 = time.perf_counter()
            loss, grads = loss_and_grads(params, x, y, task.layers)
            compute += time.perf_counter() - c0
            params = opt.step(grads)
            del grads  # (not held while the next step's are made: the loop's own copy, not psring's)
            if (t + 1) % max(1, steps // 20) == 0:
                curve.append([t + 1, loss])
        final = opt.global_params() if h > 1 else params
        g.barrier()
        wall = time.perf_counter() - t0
        waited = int(opt.waited_s * 1e6)
        grown = _peak_rss() - idle
        sent = np.array([g.stats()["bytes_sent"] - sent0, int(compute * 1e6), int(wall * 1e6), waited, grown], np.int64)
        every = g.all_gather(sent)
        if g.rank == 0 and spec.get("out"):
            nbytes = sum(v.nbytes for v in final.values())
            with open(spec["out"], "w") as fh:
                json.dump({
                    "spec": spec, "world": g.world_size, "model_bytes": nbytes, "steps": steps,
                    "samples_per_s": g.world_size * batch * steps / wall, "wall_s": wall,
                    # the share of the loop's time not spent waiting on an exchange (the slowest rank's);
                    # and the share spent computing gradients (the inner optimizer's update is the rest)
                    "compute_use": min(1 - int(e[3]) / int(e[2]) for e in every),
                    "grad_share": min(int(e[1]) / int(e[2]) for e in every),
                    "bytes_sent": [int(e[0]) for e in every],
                    # peak RSS beyond the process before init (its data and the model's first copy), by rank
                    "rss_grown": [int(e[4]) for e in every], "test_loss": task.test_loss(final), "curve": curve,
                }, fh)  # fmt: skip
    finally:
        g.close()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]) if len(sys.argv) > 1 else json.loads(os.environ["DILOCO_SPEC"]))
