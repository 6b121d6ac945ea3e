"""The rank side of ``psring bench``: each launched process runs this module, times its part and
(rank 0) writes the result file the parent reads. Also the gloo stand-in for side-by-side runs.

Run as ``python -m psring.training.bench_ranks SPEC_JSON`` (the parent does this; the package's
``__init__`` does not import this module, so running it with -m is clean).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from typing import Any

import numpy as np

from .. import settings as settings_mod
from ..core.optim import SGD
from ..topology.api import init_group
from ..transport.loop import new_event_loop
from .sgd import SyncSGD


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) so the next peak is this size's alone."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _peak_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ------------------------------------------------------------------ rank side
def _iters_for(spec: dict[str, Any], size: int) -> int:
    """Latency-bound sizes are cheap and noisy: time them more often. So are the sizes of a few
    milliseconds a call on a busy machine, where one call in ten loses its core for a time slice
    (3-6 ms): a mean over 5 such calls swung 0.5-1.6x gloo's from run to run (docs/performance-history.md)."""
    if size <= (64 << 10):
        return int(spec.get("small_iters", spec["iters"]))
    if size <= (4 << 20):
        return int(spec.get("mid_iters", spec["iters"]))
    return int(spec["iters"])


def _warmup_for(spec: dict[str, Any], size: int) -> int:
    return max(int(spec["warmup"]), 20) if size <= (64 << 10) else int(spec["warmup"])


def _resources() -> list[int]:
    """This process's open file descriptors, sockets among them, and threads."""
    fds = os.listdir("/proc/self/fd")
    sockets = 0
    for fd in fds:
        try:
            sockets += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass  # the listing's own descriptor, gone already
    return [len(fds), sockets, len(os.listdir("/proc/self/task"))]


def _scale_record(rows: np.ndarray) -> dict[str, Any]:
    """Per-rank set-up figures (init microseconds, fds, sockets, threads), the worst rank's."""
    return {
        "init_s": float(rows[:, 0].max()) / 1e6,
        "fds": int(rows[:, 1].max()),
        "sockets": int(rows[:, 2].max()),
        "threads": int(rows[:, 3].max()),
    }


async def _psring_rank(spec: dict[str, Any]) -> dict[str, Any] | None:
    t0 = time.perf_counter()
    group = await init_group(timeout=spec.get("timeout"))
    init_us = int((time.perf_counter() - t0) * 1e6)
    try:
        setup = None
        if spec.get("scale"):  # psring bench scale: what joining cost, per rank
            rows = await group.all_gather(np.array([init_us, *_resources()], np.int64))
            setup = _scale_record(np.array([r for r in rows]))
        out = await _time_sizes(group, spec)
        if out is not None and setup is not None:
            out["setup"] = setup
        return out
    finally:
        await group.close()


async def _time_sizes(group: Any, spec: dict[str, Any]) -> dict[str, Any] | None:
    dtype = np.dtype(spec["dtype"])
    compression = spec.get("compression")  # a codec (float32, op sum)
    results = []
    for size in spec["sizes"]:
        count = max(1, size // dtype.itemsize)
        rng = np.random.default_rng(group.rank)
        x = (rng.standard_normal(count) * 10).astype(dtype)
        await group.barrier()
        idle = _rss_bytes()
        _reset_peak_rss()
        for _ in range(_warmup_for(spec, size)):
            await group.all_reduce(x, compression=compression)
        times = []
        sent = 0
        for _ in range(_iters_for(spec, size)):
            await group.barrier()
            before = group.stats()["bytes_sent"]
            t0 = time.perf_counter()
            await group.all_reduce(x, compression=compression)
            times.append(time.perf_counter() - t0)
            sent += group.stats()["bytes_sent"] - before
        peak = _peak_rss_bytes()
        sent_per_call = await group.all_reduce(np.array([sent / max(len(times), 1)]), op="max")
        slowest = await group.all_reduce(np.array(times), op="max")
        peaks = await group.all_gather(np.array([peak - idle], dtype=np.int64))
        shards = group.per_shard()  # the parameter server's shards ([] on the ring)
        results.append(
            {
                "size": count * dtype.itemsize,
                "count": count,
                "time_s": float(np.median(slowest)),
                "peak_rss_over_idle": int(max(int(p[0]) for p in peaks)),
                "compression": compression,
                # the most bytes a rank sent per call (its barriers' few bytes included)
                "bytes_sent_per_call": int(sent_per_call[0]),
                "topology": group.topology,
                "ps_piece": group.piece_for(count * dtype.itemsize) if hasattr(group, "piece_for") else None,
                "ps_shards": len(shards) if shards else None,
                "ps_weights": list(group.shard_weights or ()) if shards else None,
                # ps: all_reduce blocks this rank reduced within its host before pushing them (0: none)
                "ps_host_blocks": group.stats().get("host_reduce_blocks", 0) if shards else None,
            }
        )
    return {"results": results} if group.rank == 0 else None


def _gloo_rank(spec: dict[str, Any]) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist

    # under psring launch MASTER_PORT is psring's store: gloo meets through a file there; elsewhere
    # (one rank per container, say) through MASTER_ADDR/MASTER_PORT
    launcher = settings_mod.scheduler_env()
    t0 = time.perf_counter()
    dist.init_process_group(
        "gloo",
        init_method=spec.get("gloo_init") or "env://",
        rank=int(launcher["RANK"]),
        world_size=int(launcher["WORLD_SIZE"]),
    )
    init_us = int((time.perf_counter() - t0) * 1e6)
    rank = dist.get_rank()
    dtype = np.dtype(spec["dtype"])
    results = []
    setup = None
    try:
        if spec.get("scale"):
            mine = torch.tensor([init_us, *_resources()], dtype=torch.int64)
            rows = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(rows, mine)
            setup = _scale_record(torch.stack(rows).numpy())
        for size in spec["sizes"]:
            count = max(1, size // dtype.itemsize)
            rng = np.random.default_rng(rank)
            x = torch.from_numpy((rng.standard_normal(count) * 10).astype(dtype))
            dist.barrier()
            for _ in range(_warmup_for(spec, size)):
                y = x.clone()
                dist.all_reduce(y)
            times = []
            for _ in range(_iters_for(spec, size)):
                y = x.clone()  # psring returns a new array; give gloo the same allocation
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(y)
                times.append(time.perf_counter() - t0)
            t = torch.tensor(times, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            results.append({"size": count * dtype.itemsize, "count": count, "time_s": float(np.median(t.numpy()))})
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return None
    return {"results": results, "setup": setup} if setup is not None else {"results": results}


def _mpich_rank(spec: dict[str, Any]) -> dict[str, Any] | None:
    """The same timing through MPICH (mpi4py, started by its own mpiexec): Allreduce in place."""
    t0 = time.perf_counter()
    from mpi4py import MPI  # MPI_Init runs here

    comm = MPI.COMM_WORLD
    init_us = int((time.perf_counter() - t0) * 1e6)
    rank, n = comm.Get_rank(), comm.Get_size()
    dtype = np.dtype(spec["dtype"])
    setup = None
    if spec.get("scale"):
        rows = comm.allgather([init_us, *_resources()])
        setup = _scale_record(np.array(rows, np.int64))
    results = []
    for size in spec["sizes"]:
        count = max(1, size // dtype.itemsize)
        x = (np.random.default_rng(rank).standard_normal(count) * 10).astype(dtype)
        y = np.empty_like(x)
        comm.Barrier()
        for _ in range(_warmup_for(spec, size)):
            y[...] = x
            comm.Allreduce(MPI.IN_PLACE, y)
        times = []
        for _ in range(_iters_for(spec, size)):
            y[...] = x  # psring returns a new array; give MPICH the same copy
            comm.Barrier()
            t1 = time.perf_counter()
            comm.Allreduce(MPI.IN_PLACE, y)
            times.append(time.perf_counter() - t1)
        worst = np.array(times)
        comm.Allreduce(MPI.IN_PLACE, worst, op=MPI.MAX)
        results.append({"size": count * dtype.itemsize, "count": count, "time_s": float(np.median(worst))})
    del n
    if rank != 0:
        return None
    return {"results": results, "setup": setup} if setup is not None else {"results": results}


def synthetic_model(total: int, tensors: int, seed: int = 0) -> dict[str, np.ndarray]:
    """``tensors`` float32 tensors of ``total`` elements in all, sized like a conv net's.

    A few large weight matrices hold most elements; many small ones (biases, norms)
    make up the count -- the shape of the problem bucketing is for.
    """
    rng = np.random.default_rng(seed)
    small = max(tensors // 2, 1)
    big = max(tensors - small, 1)
    small_sizes = rng.integers(64, 2048, small)
    rest = max(total - int(small_sizes.sum()), big)
    weights = rng.uniform(0.2, 1.0, big)
    big_sizes = np.maximum((weights / weights.sum() * rest).astype(np.int64), 1)
    big_sizes[0] += rest - int(big_sizes.sum())
    sizes = [int(s) for s in np.concatenate([big_sizes, small_sizes])]
    return {f"t{i:04d}": np.full(n, 0.01, np.float32) for i, n in enumerate(sizes)}


async def _sgd_rank(spec: dict[str, Any]) -> dict[str, Any] | None:
    group = await init_group(timeout=spec.get("timeout"))
    try:
        params = synthetic_model(spec["params"], spec["tensors"])
        opt = SyncSGD(group, params, SGD(lr=0.01, momentum=0.9), compression=spec.get("compression"))
        await opt.start()
        rng = np.random.default_rng(group.rank)
        grads = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in params.items()}
        rows = []
        for i in range(spec["warmup"] + spec["steps"]):
            await group.barrier()
            t0 = time.perf_counter()
            await opt.step(grads)
            total = time.perf_counter() - t0
            if i >= spec["warmup"]:
                rows.append([total, opt.last_timing["exchange_s"], opt.last_timing["update_s"]])
        worst = await group.all_reduce(np.array(rows), op="max")
        return (
            {"step_s": worst.tolist(), "buckets": len(opt.buckets), "tensors": len(params)} if group.rank == 0 else None
        )
    finally:
        await group.close()


def rank_main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    if spec.get("mode") == "sgd":
        loop = new_event_loop()
        try:
            out = loop.run_until_complete(_sgd_rank(spec))
        finally:
            loop.close()
        if out is not None:
            with open(spec["out"], "w") as fh:
                json.dump(out, fh)
        return 0
    if spec.get("backend", "psring") == "gloo":
        out = _gloo_rank(spec)
    elif spec.get("backend") == "mpich":
        out = _mpich_rank(spec)
    else:
        loop = new_event_loop()
        try:
            out = loop.run_until_complete(_psring_rank(spec))
        finally:
            loop.close()
    if out is not None:
        with open(spec["out"], "w") as fh:
            json.dump(out, fh)
    return 0


if __name__ == "__main__":
    sys.exit(rank_main(sys.argv[1:]))
