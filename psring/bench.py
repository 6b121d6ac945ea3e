"""``psring bench allreduce``: nccl-tests-style timing of all_reduce over real processes.

The parent starts a store and N ranks (``psring launch`` machinery); each rank times
every size (warm-up, then ``iters`` timed calls, each after a barrier); the figure
per size is the median over iterations of the slowest rank. busbw = algbw * 2(N-1)/N.
The same rank worker can run torch.distributed's gloo backend (``--backend gloo``)
so benchmarks/compare_gloo.py measures both side by side in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from typing import Any

import numpy as np

_SUFFIX = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("IB")
    num = text.rstrip("KMGB")
    unit = text[len(num) :]
    if unit not in _SUFFIX or not num:
        raise ValueError(f"size {text!r} is not a byte count like 4, 64K, 1M or 1G")
    value = float(num) * _SUFFIX[unit]
    if value < 0:
        raise ValueError(f"size {text!r} is negative")
    return int(value)


def human(nbytes: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return str(nbytes)


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
    """Latency-bound sizes are cheap and noisy: time them more often."""
    return int(spec.get("small_iters", spec["iters"])) if size <= (64 << 10) else int(spec["iters"])


def _warmup_for(spec: dict[str, Any], size: int) -> int:
    return max(int(spec["warmup"]), 20) if size <= (64 << 10) else int(spec["warmup"])


async def _psring_rank(spec: dict[str, Any]) -> dict[str, Any] | None:
    import psring

    group = await psring.init_group(timeout=spec.get("timeout", 300.0))
    try:
        return await _time_sizes(group, spec)
    finally:
        await group.close()


async def _time_sizes(group: Any, spec: dict[str, Any]) -> dict[str, Any] | None:
    dtype = np.dtype(spec["dtype"])
    results = []
    for size in spec["sizes"]:
        count = max(1, size // dtype.itemsize)
        rng = np.random.default_rng(group.rank)
        x = (rng.standard_normal(count) * 10).astype(dtype)
        await group.barrier()
        idle = _rss_bytes()
        _reset_peak_rss()
        for _ in range(_warmup_for(spec, size)):
            await group.all_reduce(x)
        times = []
        for _ in range(_iters_for(spec, size)):
            await group.barrier()
            t0 = time.perf_counter()
            await group.all_reduce(x)
            times.append(time.perf_counter() - t0)
        peak = _peak_rss_bytes()
        slowest = await group.all_reduce(np.array(times), op="max")
        peaks = await group.all_gather(np.array([peak - idle], dtype=np.int64))
        results.append(
            {
                "size": count * dtype.itemsize,
                "count": count,
                "time_s": float(np.median(slowest)),
                "peak_rss_over_idle": int(max(int(p[0]) for p in peaks)),
            }
        )
    return {"results": results} if group.rank == 0 else None


def _gloo_rank(spec: dict[str, Any]) -> dict[str, Any] | None:
    import torch
    import torch.distributed as dist

    # psring's launcher owns MASTER_PORT (its store): gloo meets through a file instead
    dist.init_process_group(
        "gloo", init_method=spec["gloo_init"], rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"])
    )
    rank = dist.get_rank()
    dtype = np.dtype(spec["dtype"])
    results = []
    try:
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
    return {"results": results} if rank == 0 else None


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
    import psring

    group = await psring.init_group(timeout=spec.get("timeout", 300.0))
    try:
        params = synthetic_model(spec["params"], spec["tensors"])
        opt = psring.SyncSGD(
            group, params, psring.optim.SGD(lr=0.01, momentum=0.9), compression=spec.get("compression")
        )
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
        from .facade import new_event_loop

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
    else:
        from .facade import new_event_loop

        loop = new_event_loop()
        try:
            out = loop.run_until_complete(_psring_rank(spec))
        finally:
            loop.close()
    if out is not None:
        with open(spec["out"], "w") as fh:
            json.dump(out, fh)
    return 0


# ---------------------------------------------------------------- parent side
def run_allreduce(
    *,
    topology: str,
    workers: int,
    sizes: list[int],
    dtype: str = "float32",
    iters: int = 10,
    warmup: int = 2,
    backend: str = "psring",
    servers: int | None = None,
    quiet: bool = True,
    colocate: bool = False,
) -> list[dict[str, Any]]:
    """Spawn the ranks, time every size, return one row per size."""
    from .facade import new_event_loop
    from .launch import launch

    with tempfile.TemporaryDirectory(prefix="psring-bench-") as tmp:
        out = os.path.join(tmp, "result.json")
        spec = {
            "sizes": sizes,
            "dtype": dtype,
            "iters": iters,
            "warmup": warmup,
            "out": out,
            "backend": backend,
            "gloo_init": "file://" + os.path.join(tmp, "gloo-rendezvous"),
            "small_iters": max(iters, 200),
        }
        env = dict(os.environ)
        if servers is not None:
            env["PSRING_SERVERS"] = str(servers)
        if colocate:
            env["PSRING_PS_COLOCATE"] = "1"
        cmd = [sys.executable, "-m", "psring.bench", json.dumps(spec)]
        loop = new_event_loop()
        try:
            code = loop.run_until_complete(launch(workers, cmd, topology=topology, env=env, prefix_output=not quiet))
        finally:
            loop.close()
        if code != 0:
            raise RuntimeError(f"benchmark ranks failed (exit code {code})")
        with open(out) as fh:
            rows = json.load(fh)["results"]
    for row in rows:
        t = row["time_s"]
        row["algbw_GBps"] = row["size"] / t / 1e9 if t > 0 else 0.0
        row["busbw_GBps"] = row["algbw_GBps"] * 2 * (workers - 1) / workers
        row["dtype"] = dtype
    return rows


def run_sgd(
    *,
    topology: str,
    workers: int,
    params: int,
    tensors: int,
    steps: int,
    warmup: int,
    servers: int | None,
    compression: str | None = None,
) -> dict[str, Any]:
    from .facade import new_event_loop
    from .launch import launch

    with tempfile.TemporaryDirectory(prefix="psring-bench-") as tmp:
        out = os.path.join(tmp, "result.json")
        spec = {
            "mode": "sgd",
            "params": params,
            "tensors": tensors,
            "steps": steps,
            "warmup": warmup,
            "out": out,
            "compression": compression,
        }
        env = dict(os.environ)
        if servers is not None:
            env["PSRING_SERVERS"] = str(servers)
        cmd = [sys.executable, "-m", "psring.bench", json.dumps(spec)]
        loop = new_event_loop()
        try:
            code = loop.run_until_complete(launch(workers, cmd, topology=topology, env=env, prefix_output=False))
        finally:
            loop.close()
        if code != 0:
            raise RuntimeError(f"benchmark ranks failed (exit code {code})")
        with open(out) as fh:
            result: dict[str, Any] = json.load(fh)
    steps_s = np.array(result["step_s"])
    med = np.median(steps_s, axis=0)
    result.update(step_ms=1e3 * med[0], exchange_ms=1e3 * med[1], update_ms=1e3 * med[2])
    return result


def cli_sgd(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise SystemExit(f"psring bench: --workers must be at least 1, got {args.workers}")
    if args.topology == "ring" and args.servers is not None:
        raise SystemExit("psring bench: --servers applies to --topology ps only")
    n = parse_size(args.params.upper().replace("M", "000000").replace("K", "000")) if args.params else 0
    r = run_sgd(
        topology=args.topology,
        workers=args.workers,
        params=n,
        tensors=args.tensors,
        steps=args.steps,
        warmup=args.warmup,
        servers=args.servers,
        compression=None if args.compression == "none" else args.compression,
    )
    title = (
        f"psring SyncSGD step, topology={args.topology}, workers={args.workers}, {n / 1e6:g}M float32 params "
        f"in {r['tensors']} tensors ({r['buckets']} buckets), compression={args.compression}"
    )
    if args.json:
        print(json.dumps({"title": title, **r}))
        return 0
    print(f"# {title}")
    print(f"{'step (ms)':>12} {'exchange (ms)':>14} {'update (ms)':>12}")
    print(f"{r['step_ms']:>12.1f} {r['exchange_ms']:>14.1f} {r['update_ms']:>12.1f}")
    if args.topology == "ps":
        print("# over ps the optimizer runs on the servers: its time is inside the exchange")
    return 0


def format_table(rows: list[dict[str, Any]], title: str) -> str:
    lines = [
        f"# {title}",
        f"{'size':>10} {'count':>12} {'dtype':>8} {'time(us)':>12} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12}",
    ]
    for r in rows:
        lines.append(
            f"{human(r['size']):>10} {r['count']:>12} {r['dtype']:>8} {r['time_s'] * 1e6:>12.1f} "
            f"{r['algbw_GBps']:>12.3f} {r['busbw_GBps']:>12.3f}"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from None
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["size"] for r in rows], [r["busbw_GBps"] for r in rows], marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("busbw (GB/s)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)


def cli(args: argparse.Namespace) -> int:
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    if args.workers < 1:
        raise SystemExit(f"psring bench: --workers must be at least 1, got {args.workers}")
    if args.topology == "ring" and getattr(args, "colocate", False):
        raise SystemExit("psring bench: --colocate applies to --topology ps only")
    rows = run_allreduce(
        topology=args.topology,
        workers=args.workers,
        sizes=sizes,
        dtype=args.dtype,
        iters=args.iters,
        warmup=args.warmup,
        servers=getattr(args, "servers", None),
        colocate=getattr(args, "colocate", False),
    )
    title = f"psring all_reduce, topology={args.topology}, workers={args.workers}"
    if getattr(args, "colocate", False):
        title += " (shards colocated with the workers)"
    if args.json:
        print(json.dumps({"title": title, "rows": rows}))
    else:
        print(format_table(rows, title))
    if args.plot:
        plot(rows, args.plot, title)
    return 0


if __name__ == "__main__":
    sys.exit(rank_main(sys.argv[1:]))
