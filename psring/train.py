"""``psring train``: synchronous data-parallel SGD on real data (scikit-learn's digits).

Starts everything locally (a store, for ps the server shards, N worker processes).
Each worker trains a numpy (or cupy) MLP with a hand-written backward pass on its
shard of the data, and steps with :class:`psring.SyncSGD`: over the ring, gradients
are averaged with all_reduce and the optimizer runs on every rank; over ps, the
shards average and apply the same optimizer. Ranks -- and both topologies -- end with
bit-identical parameters, which the job checks rather than assumes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
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


def forward_backward(params: dict[str, Any], x: Any, y: Any) -> tuple[float, dict[str, Any]]:
    """Loss and gradients of the 2-layer ReLU MLP with softmax cross-entropy (numpy or cupy)."""
    from .arrays import array_module

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
    from .arrays import array_module

    xp = array_module(params["w0"])
    a = xp.maximum(x @ params["w0"] + params["b0"], 0)
    return float(((a @ params["w1"] + params["b1"]).argmax(axis=1) == y).mean())


def make_optimizer(spec: dict[str, Any]) -> Any:
    from .optim import SGD, Adam

    if spec["optimizer"] == "adam":
        return Adam(lr=spec["lr"])
    return SGD(lr=spec["lr"], momentum=spec["momentum"])


PROGRESS = "PSRING-PROGRESS "


# ------------------------------------------------------------------ worker
async def worker(spec: dict[str, Any], progress: Any = None) -> dict[str, Any] | None:
    """One rank of the main job; rank 0 returns (and writes to spec["out"], if set) the summary.

    ``progress`` receives rank 0's progress records (default: printed as PSRING-PROGRESS lines).
    """
    import psring

    def emit(record: dict[str, Any]) -> None:
        if progress is not None:
            progress(record)
        else:
            print(PROGRESS + json.dumps(record), flush=True)

    group = await psring.init_group(timeout=spec["timeout"])
    try:
        xtr, ytr, xte, yte = load_digits_split(spec["seed"])
        xp: Any = np
        if spec["device"] == "cuda":
            from .arrays import cupy_module

            xp = cupy_module()
            xtr, ytr, xte, yte = (xp.asarray(v) for v in (xtr, ytr, xte, yte))
        # ranks start from different seeds and agree on rank 0's parameters in start()
        params = {k: xp.asarray(v) for k, v in init_params(spec["seed"] + group.rank).items()}
        opt = psring.SyncSGD(
            group,
            params,
            make_optimizer(spec),
            accumulate=spec.get("accumulate", 1),
            compression=spec.get("compression"),
        )
        params = await opt.start()
        comm = compute = 0.0
        steps = 0
        history = []
        per_rank = math.ceil(len(xtr) / group.world_size)
        per_epoch = math.ceil(per_rank / spec["batch_size"])
        t_start = time.perf_counter()
        for epoch in range(spec["epochs"]):
            idx = shard_indices(len(xtr), epoch, spec["seed"], group.rank, group.world_size)
            losses = []
            for start in range(0, len(idx), spec["batch_size"]):
                batch = xp.asarray(idx[start : start + spec["batch_size"]])
                t0 = time.perf_counter()
                loss, grads = forward_backward(params, xtr[batch], ytr[batch])
                t1 = time.perf_counter()
                params = await opt.step(grads)
                t2 = time.perf_counter()
                compute += t1 - t0
                comm += t2 - t1
                losses.append(loss)
                steps += 1
                if group.rank == 0 and (steps % 10 == 0 or start + spec["batch_size"] >= len(idx)):
                    moved = sum(group.stats().values())
                    emit(
                        {
                            "step": steps,
                            "total": per_epoch * spec["epochs"],
                            "epoch": epoch + 1,
                            "loss": float(np.mean(losses[-10:])),
                            "elapsed": time.perf_counter() - t_start,
                            "mb": moved / 1e6,
                        }
                    )
            mean_loss = float((await group.all_reduce(np.array([np.mean(losses)]), op="avg"))[0])
            acc = accuracy(params, xte, yte)
            history.append({"epoch": epoch + 1, "loss": mean_loss, "test_accuracy": acc, "step": steps})
            if group.rank == 0:
                emit(
                    {
                        "step": steps,
                        "total": per_epoch * spec["epochs"],
                        "epoch": epoch + 1,
                        "loss": mean_loss,
                        "acc": acc,
                        "elapsed": time.perf_counter() - t_start,
                        "mb": sum(group.stats().values()) / 1e6,
                    }
                )
        # every rank must hold identical parameters: check it, do not assume it
        host = {k: (v if isinstance(v, np.ndarray) else v.get()) for k, v in params.items()}
        digest = np.frombuffer(b"".join(host[k].tobytes() for k in sorted(host)), np.uint8).astype(np.int64)
        digest = int((digest * (np.arange(digest.size) % 251 + 1)).sum())
        digests = await group.all_gather(np.array([digest], np.int64))
        agree = len({int(d[0]) for d in digests}) == 1
        wall = time.perf_counter() - t_start
        stats = group.stats()
        all_stats = await group.all_gather(np.array([stats["bytes_sent"], stats["bytes_received"]], np.int64))
        servers: list[list[int]] = []
        if group.topology == "ps":  # what the shards received and sent = the sum over workers of the reverse
            mine = np.array(group.links.per_shard(), np.int64).reshape(-1, 2)
            total = await group.all_reduce(mine, op="sum")
            servers = [[int(r), int(s)] for s, r in total]
        if group.rank == 0:
            summary = {
                "topology": group.topology,
                "workers": group.world_size,
                "servers": getattr(group, "num_servers", 0),
                "optimizer": spec["optimizer"],
                "compression": spec.get("compression"),
                "accumulate": spec.get("accumulate", 1),
                "test_accuracy": history[-1]["test_accuracy"],
                "final_loss": history[-1]["loss"],
                "wall_s": wall,
                "steps": steps,
                "ms_per_step_compute": 1e3 * compute / max(steps, 1),
                "ms_per_step_comm": 1e3 * comm / max(steps, 1),
                "bytes_per_worker": [[int(s[0]), int(s[1])] for s in all_stats],
                "bytes_per_server": servers,
                "ranks_agree": agree,
                "param_digest": digest,
                "history": history,
            }
            if spec.get("out"):
                with open(spec["out"], "w") as fh:
                    json.dump(summary, fh)
            return summary
        return None
    finally:
        await group.close()


class _Progress:
    """A live bar in the parent, fed by rank 0's progress lines (tqdm if installed, else plain lines)."""

    def __init__(self, label: str, quiet: bool) -> None:
        self.label = label
        self.quiet = quiet
        self.bar: Any = None
        self.last_epoch = 0

    def __call__(self, line: str) -> bool:
        if not line.startswith(PROGRESS):
            return False
        if self.quiet:
            return True
        info = json.loads(line[len(PROGRESS) :])
        rate = info["step"] / max(info["elapsed"], 1e-9)
        text = f"epoch {info['epoch']} loss {info['loss']:.4f}" + (f" acc {info['acc']:.4f}" if "acc" in info else "")
        text += f" {rate:.0f} steps/s {info['mb']:.1f} MB"
        try:
            from tqdm import tqdm
        except ImportError:
            if "acc" in info:
                print(f"[{self.label}] {text}", flush=True)
            return True
        if self.bar is None:
            self.bar = tqdm(total=info["total"], desc=self.label, unit="step", dynamic_ncols=True)
        self.bar.n = info["step"]
        self.bar.set_postfix_str(text, refresh=True)
        if "acc" in info:
            self.bar.write(f"[{self.label}] {text}")
        return True

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def train_once(args: argparse.Namespace, topology: str, quiet: bool = False) -> dict[str, Any] | None:
    from .facade import new_event_loop
    from .launch import launch

    with tempfile.TemporaryDirectory(prefix="psring-train-") as tmp:
        spec = {
            "epochs": args.epochs,
            "batch_size": args.batch_size,
            "lr": args.lr,
            "momentum": args.momentum,
            "optimizer": args.optimizer,
            "compression": None if args.compression == "none" else args.compression,
            "accumulate": args.accumulate,
            "device": args.device,
            "seed": args.seed,
            "timeout": args.timeout,
            "out": os.path.join(tmp, "summary.json"),
        }
        env = dict(os.environ)
        if topology == "ps":
            env["PSRING_SERVERS"] = str(args.servers or args.workers)
        cmd = [sys.executable, "-m", "psring.train", json.dumps(spec)]
        progress = _Progress(topology, quiet)
        loop = new_event_loop()
        try:
            code = loop.run_until_complete(
                launch(args.workers, cmd, topology=topology, env=env, prefix_output=False, on_line=progress)
            )
        finally:
            loop.close()
            progress.close()
        if code != 0:
            print(f"psring train: a worker failed (exit code {code})", file=sys.stderr)
            return None
        with open(spec["out"]) as fh:
            return json.load(fh)  # type: ignore[no-any-return]


def print_summary(summary: dict[str, Any]) -> None:
    print(
        f"\nsummary ({summary['topology']}, {summary['workers']} workers"
        + (f", {summary['servers']} server shards" if summary["topology"] == "ps" else "")
        + ")"
    )
    print(f"  test accuracy      {summary['test_accuracy']:.4f}")
    print(f"  final loss         {summary['final_loss']:.4f}")
    print(f"  wall time          {summary['wall_s']:.2f} s ({summary['steps']} steps)")
    print(
        f"  time per step      {summary['ms_per_step_compute']:.2f} ms compute + "
        f"{summary['ms_per_step_comm']:.2f} ms communication (incl. the update)"
    )
    for r, (sent, received) in enumerate(summary["bytes_per_worker"]):
        print(f"  worker {r}           sent {sent / 1e6:.2f} MB, received {received / 1e6:.2f} MB")
    for i, (sent, received) in enumerate(summary.get("bytes_per_server", [])):
        print(f"  server shard {i}     sent {sent / 1e6:.2f} MB, received {received / 1e6:.2f} MB")
    print(f"  ranks bit-identical {summary['ranks_agree']}")


def print_compare(results: dict[str, dict[str, Any]]) -> None:
    ring, ps = results["ring"], results["ps"]
    rows = [
        ("test accuracy", f"{ring['test_accuracy']:.4f}", f"{ps['test_accuracy']:.4f}"),
        ("final loss", f"{ring['final_loss']:.6f}", f"{ps['final_loss']:.6f}"),
        ("wall time (s)", f"{ring['wall_s']:.2f}", f"{ps['wall_s']:.2f}"),
        ("compute ms/step", f"{ring['ms_per_step_compute']:.2f}", f"{ps['ms_per_step_compute']:.2f}"),
        ("comm ms/step", f"{ring['ms_per_step_comm']:.2f}", f"{ps['ms_per_step_comm']:.2f}"),
        (
            "MB sent / worker",
            f"{ring['bytes_per_worker'][0][0] / 1e6:.2f}",
            f"{ps['bytes_per_worker'][0][0] / 1e6:.2f}",
        ),
        ("ranks bit-identical", str(ring["ranks_agree"]), str(ps["ranks_agree"])),
    ]
    same = ring["param_digest"] == ps["param_digest"]
    print("\ncomparison (same seed)")
    print(f"  {'':22}{'ring':>12}{'ps':>12}")
    for name, a, b in rows:
        print(f"  {name:22}{a:>12}{b:>12}")
    print(f"  ring and ps final parameters bit-identical: {same}")


def plot(results: dict[str, dict[str, Any]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from None
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for topo, summary in results.items():
        steps = [h["step"] for h in summary["history"]]
        ax1.plot(steps, [h["loss"] for h in summary["history"]], marker="o", label=topo)
        ax2.plot(steps, [h["test_accuracy"] for h in summary["history"]], marker="o", label=topo)
    ax1.set_xlabel("step")
    ax1.set_ylabel("training loss")
    ax2.set_xlabel("step")
    ax2.set_ylabel("test accuracy")
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def run(args: argparse.Namespace) -> int:
    def bad(reason: str) -> int:
        print(f"psring train: {reason}", file=sys.stderr)
        return 2

    if args.topology not in ("ring", "ps"):
        return bad(f"unknown topology {args.topology!r} (ring or ps)")
    if args.workers < 1:
        return bad(f"--workers must be at least 1, got {args.workers}")
    if args.topology == "ring" and args.servers is not None and not args.compare:
        return bad("--servers applies to --topology ps only")
    if args.servers is not None and args.servers < 1:
        return bad(f"--servers must be at least 1, got {args.servers}")
    if args.epochs < 1 or args.batch_size < 1 or not args.lr > 0:
        return bad("--epochs, --batch-size and --lr must be positive")
    if args.accumulate < 1:
        return bad(f"--accumulate must be at least 1, got {args.accumulate}")
    if args.device == "cuda":
        from . import gpu

        if not gpu.available():
            return bad("--device cuda needs cupy and a CUDA GPU, and none was found")
    topologies = ["ring", "ps"] if args.compare else [args.topology]
    results: dict[str, dict[str, Any]] = {}
    for topology in topologies:
        print(
            f"psring train: topology={topology} workers={args.workers}"
            + (f" servers={args.servers or args.workers}" if topology == "ps" else "")
            + f" epochs={args.epochs} batch={args.batch_size}/worker optimizer={args.optimizer} lr={args.lr}"
            + f" device={args.device}"
            + (f" compression={args.compression}" if args.compression != "none" else "")
            + (f" accumulate={args.accumulate}" if args.accumulate > 1 else ""),
            flush=True,
        )
        summary = train_once(args, topology)
        if summary is None:
            return 1
        print_summary(summary)
        results[topology] = summary
    if args.compare:
        print_compare(results)
    if args.plot:
        plot(results, args.plot)
        print(f"wrote {args.plot}")
    if args.json:
        print(json.dumps(results if args.compare else results[topologies[0]]))
    return 0 if all(r["ranks_agree"] for r in results.values()) else 1


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
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd", help="sgd (with --momentum) or adam")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--compression", choices=("none", "fp16"), default="none", help="fp16: gradients travel as float16")
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--compare", action="store_true", help="train over ring and ps with the same seed, side by side")
    p.add_argument("--plot", default=None, help="write a PNG of loss and accuracy against step")
    p.add_argument("--json", action="store_true", help="also print the summary as JSON")
    p.set_defaults(func=run)


if __name__ == "__main__":
    from .facade import new_event_loop

    _loop = new_event_loop()
    try:
        _loop.run_until_complete(worker(json.loads(sys.argv[1])))
    finally:
        _loop.close()
