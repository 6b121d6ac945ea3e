"""``psring train``: synchronous data-parallel SGD on real data (scikit-learn's digits).

Starts everything locally (a store, for ps the server shards, N worker processes).
Each worker trains a numpy (or cupy) MLP with a hand-written backward pass on its
shard of the data, and steps with :class:`psring.SyncSGD`: over the ring, gradients
are averaged with all_reduce and the optimizer runs on every rank; over ps, the
shards average and apply the same optimizer. Ranks -- and both topologies -- end with
bit-identical parameters, which the job checks rather than assumes.
"""

from __future__ import annotations

import json
import math
import sys
import time
from typing import Any

import numpy as np

from ..core.arrays import cupy_module
from ..core.optim import SGD, Adam
from ..topology.api import init_group
from ..transport.loop import new_event_loop
from .data import load_digits_split, shard_indices
from .model import accuracy, forward_backward, init_params
from .sgd import SyncSGD


def make_optimizer(spec: dict[str, Any]) -> Any:

    if spec["optimizer"] == "adam":
        return Adam(lr=spec["lr"])
    return SGD(lr=spec["lr"], momentum=spec["momentum"])


PROGRESS = "PSRING-PROGRESS "


# ------------------------------------------------------------------ worker
async def worker(spec: dict[str, Any], progress: Any = None) -> dict[str, Any] | None:
    """One rank of the main job; rank 0 returns (and writes to spec["out"], if set) the summary.

    ``progress`` receives rank 0's progress records (default: printed as PSRING-PROGRESS lines).
    """

    def emit(record: dict[str, Any]) -> None:
        if progress is not None:
            progress(record)
        else:
            print(PROGRESS + json.dumps(record), flush=True)

    group = await init_group(timeout=spec["timeout"])
    try:
        xtr, ytr, xte, yte = load_digits_split(spec["seed"])
        xp: Any = np
        if spec["device"] == "cuda":
            xp = cupy_module()
            xtr, ytr, xte, yte = (xp.asarray(v) for v in (xtr, ytr, xte, yte))
        # ranks start from different seeds and agree on rank 0's parameters in start()
        params = {k: xp.asarray(v) for k, v in init_params(spec["seed"] + group.rank).items()}
        opt = SyncSGD(
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


if __name__ == "__main__":
    _loop = new_event_loop()
    try:
        _loop.run_until_complete(worker(json.loads(sys.argv[1])))
    finally:
        _loop.close()
