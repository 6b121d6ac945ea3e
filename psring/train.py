"""``psring train``: synchronous data-parallel SGD on real data (scikit-learn's digits).

Starts everything locally (embedded store, N worker processes). Each worker trains a
numpy MLP with a hand-written backward pass on its shard of the data; gradients are
bucketed into one flat buffer and averaged with ``all_reduce(op="avg")`` every step;
SGD with momentum (torch.optim.SGD's formula) runs identically on every rank, so all
ranks hold bit-identical parameters. Rank 0 reports per-epoch loss and test accuracy.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from typing import Any

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


# ------------------------------------------------------------------ model
def init_params(seed: int, sizes: tuple[int, ...] = (64, 128, 10)) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    params = {}
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(sizes)):
        bound = 1 / np.sqrt(fan_in)
        params[f"w{i}"] = rng.uniform(-bound, bound, (fan_in, fan_out)).astype(np.float32)
        params[f"b{i}"] = rng.uniform(-bound, bound, fan_out).astype(np.float32)
    return params


def forward_backward(
    params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray
) -> tuple[float, dict[str, np.ndarray]]:
    h = x @ params["w0"] + params["b0"]
    a = np.maximum(h, 0)
    logits = a @ params["w1"] + params["b1"]
    logits = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(logits)
    p /= p.sum(axis=1, keepdims=True)
    n = len(x)
    loss = float(-np.log(p[np.arange(n), y] + 1e-12).mean())
    d = p
    d[np.arange(n), y] -= 1
    d /= n
    grads = {"w1": a.T @ d, "b1": d.sum(axis=0)}
    da = d @ params["w1"].T
    da[h <= 0] = 0
    grads["w0"] = x.T @ da
    grads["b0"] = da.sum(axis=0)
    return loss, {k: v.astype(np.float32) for k, v in grads.items()}


def accuracy(params: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    a = np.maximum(x @ params["w0"] + params["b0"], 0)
    return float(((a @ params["w1"] + params["b1"]).argmax(axis=1) == y).mean())


def sgd_momentum(
    params: dict[str, np.ndarray], grads: dict[str, np.ndarray], bufs: dict[str, np.ndarray], lr: float, momentum: float
) -> None:
    """torch.optim.SGD: buf = g at the first step, then momentum*buf + g; p -= lr*buf."""
    for name, g in grads.items():
        if name not in bufs:
            bufs[name] = g.copy()
        else:
            bufs[name] *= momentum
            bufs[name] += g
        params[name] -= lr * bufs[name]


# ------------------------------------------------------------------ worker
async def worker(spec: dict[str, Any]) -> None:
    import psring

    group = await psring.init_group(timeout=spec["timeout"])
    try:
        xtr, ytr, xte, yte = load_digits_split(spec["seed"])
        params = init_params(spec["seed"] + group.rank)  # ranks start different...
        names = sorted(params)
        for name in names:  # ...and agree after rank 0's broadcast
            params[name] = await group.broadcast(params[name], src=0)
        bufs: dict[str, np.ndarray] = {}
        shapes = {k: params[k].shape for k in names}
        sizes = [params[k].size for k in names]
        comm = compute = 0.0
        steps = 0
        history = []
        t_start = time.perf_counter()
        for epoch in range(spec["epochs"]):
            idx = shard_indices(len(xtr), epoch, spec["seed"], group.rank, group.world_size)
            losses = []
            for start in range(0, len(idx), spec["batch_size"]):
                batch = idx[start : start + spec["batch_size"]]
                t0 = time.perf_counter()
                loss, grads = forward_backward(params, xtr[batch], ytr[batch])
                flat = np.concatenate([grads[k].reshape(-1) for k in names])  # one bucket, one frame per hop
                t1 = time.perf_counter()
                avg = await group.all_reduce(flat, op="avg")
                t2 = time.perf_counter()
                parts = np.split(avg, np.cumsum(sizes)[:-1])
                sgd_momentum(
                    params,
                    {k: p.reshape(shapes[k]) for k, p in zip(names, parts, strict=True)},
                    bufs,
                    spec["lr"],
                    spec["momentum"],
                )
                compute += (t1 - t0) + (time.perf_counter() - t2)
                comm += t2 - t1
                losses.append(loss)
                steps += 1
            mean_loss = float((await group.all_reduce(np.array([np.mean(losses)]), op="avg"))[0])
            acc = accuracy(params, xte, yte)
            history.append({"epoch": epoch + 1, "loss": mean_loss, "test_accuracy": acc})
            if group.rank == 0:
                stats = group.stats()
                print(
                    f"epoch {epoch + 1:3d}/{spec['epochs']}  loss {mean_loss:.4f}  test acc {acc:.4f}  "
                    f"{steps / (time.perf_counter() - t_start):.0f} steps/s  "
                    f"{stats['bytes_sent'] / 1e6:.1f} MB sent",
                    flush=True,
                )
        # every rank must hold identical parameters: check it, do not assume it
        digest = np.frombuffer(b"".join(params[k].tobytes() for k in names), np.uint8).astype(np.int64).sum()
        digests = await group.all_gather(np.array([digest]))
        agree = len({int(d[0]) for d in digests}) == 1
        wall = time.perf_counter() - t_start
        stats = group.stats()
        all_stats = await group.all_gather(np.array([stats["bytes_sent"], stats["bytes_received"]], np.int64))
        if group.rank == 0:
            summary = {
                "topology": group.topology,
                "workers": group.world_size,
                "test_accuracy": history[-1]["test_accuracy"],
                "final_loss": history[-1]["loss"],
                "wall_s": wall,
                "steps": steps,
                "ms_per_step_compute": 1e3 * compute / max(steps, 1),
                "ms_per_step_comm": 1e3 * comm / max(steps, 1),
                "bytes_per_worker": [[int(s[0]), int(s[1])] for s in all_stats],
                "ranks_agree": agree,
                "history": history,
            }
            with open(spec["out"], "w") as fh:
                json.dump(summary, fh)
    finally:
        await group.close()


def run(args: argparse.Namespace) -> int:
    from .facade import new_event_loop
    from .launch import launch

    if args.topology not in ("ring", "ps"):
        print(f"psring train: unknown topology {args.topology!r} (ring or ps)", file=sys.stderr)
        return 2
    if args.workers < 1:
        print(f"psring train: --workers must be at least 1, got {args.workers}", file=sys.stderr)
        return 2
    if args.topology == "ring" and args.servers is not None:
        print("psring train: --servers applies to --topology ps only", file=sys.stderr)
        return 2
    if args.topology == "ps":
        print("psring train: the ps topology is not built yet; use --topology ring", file=sys.stderr)
        return 2
    if args.device == "cuda":
        from . import gpu

        if not gpu.available():
            print("psring train: --device cuda needs cupy and a CUDA GPU, and none was found", file=sys.stderr)
            return 2
        print("psring train: --device cuda is not wired into the training loop yet", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="psring-train-") as tmp:
        spec = {
            "epochs": args.epochs,
            "batch_size": args.batch_size,
            "lr": args.lr,
            "momentum": args.momentum,
            "seed": args.seed,
            "timeout": args.timeout,
            "out": os.path.join(tmp, "summary.json"),
        }
        print(
            f"psring train: topology={args.topology} workers={args.workers} epochs={args.epochs} "
            f"batch={args.batch_size}/worker lr={args.lr}",
            flush=True,
        )
        cmd = [sys.executable, "-m", "psring.train", json.dumps(spec)]
        loop = new_event_loop()
        try:
            code = loop.run_until_complete(launch(args.workers, cmd, topology=args.topology, prefix_output=False))
        finally:
            loop.close()
        if code != 0:
            print(f"psring train: a worker failed (exit code {code})", file=sys.stderr)
            return code
        with open(spec["out"]) as fh:
            summary = json.load(fh)
    print("\nsummary")
    print(f"  test accuracy      {summary['test_accuracy']:.4f}")
    print(f"  final loss         {summary['final_loss']:.4f}")
    print(f"  wall time          {summary['wall_s']:.2f} s ({summary['steps']} steps)")
    print(
        f"  time per step      {summary['ms_per_step_compute']:.2f} ms compute + "
        f"{summary['ms_per_step_comm']:.2f} ms communication"
    )
    for r, (sent, received) in enumerate(summary["bytes_per_worker"]):
        print(f"  worker {r}           sent {sent / 1e6:.2f} MB, received {received / 1e6:.2f} MB")
    print(f"  ranks bit-identical {summary['ranks_agree']}")
    if args.json:
        print(json.dumps(summary))
    return 0 if summary["ranks_agree"] else 1


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "train",
        help="the main job: synchronous SGD on the digits data set",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--topology", default=os.environ.get("PSRING_TOPOLOGY", "ring"), help="ring or ps (PSRING_TOPOLOGY)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--servers", type=int, default=None, help="parameter-server shards (ps only)")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32, help="samples per worker per step")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--optimizer", choices=("sgd",), default="sgd")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--json", action="store_true", help="also print the summary as JSON")
    p.set_defaults(func=run)


if __name__ == "__main__":
    from .facade import new_event_loop

    _loop = new_event_loop()
    try:
        _loop.run_until_complete(worker(json.loads(sys.argv[1])))
    finally:
        _loop.close()
