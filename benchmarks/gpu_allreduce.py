"""cupy vs numpy all_reduce, side by side in one run, N ranks sharing one GPU (real processes)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

import numpy as np


async def rank_main(spec: dict) -> None:
    import cupy as cp

    import psring
    from psring.arrays import pinned_empty

    group = await psring.init_group(timeout=300)
    rows = []
    for size in spec["sizes"]:
        count = size // 4
        host = np.random.default_rng(group.rank).standard_normal(count).astype(np.float32)
        pinned = pinned_empty(host.shape, host.dtype)
        pinned[:] = host
        for kind in ("numpy", "pinned", "cupy"):
            x = {"numpy": host, "pinned": pinned, "cupy": cp.asarray(host)}[kind]
            for _ in range(2):
                await group.all_reduce(x)
            times = []
            for _ in range(spec["iters"]):
                await group.barrier()
                if kind == "cupy":
                    cp.cuda.Device().synchronize()
                t0 = time.perf_counter()
                y = await group.all_reduce(x)
                if kind == "cupy":
                    cp.cuda.Device().synchronize()
                times.append(time.perf_counter() - t0)
            slow = await group.all_reduce(np.array(times), op="max")
            t = float(np.median(slow))
            n = group.world_size
            rows.append({"size": size, "kind": kind, "time_s": t, "busbw": size / t / 1e9 * 2 * (n - 1) / n})
            assert type(y).__module__.split(".")[0] == ("numpy" if kind == "pinned" else kind)
    if group.rank == 0:
        with open(spec["out"], "w") as fh:
            json.dump(rows, fh)
    await group.close()


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        import uvloop

        uvloop.run(rank_main(json.loads(sys.argv[2])))
        return 0
    from psring.bench import parse_size
    from psring.launch import launch

    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--sizes", default="1M,16M,64M")
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        spec = {"sizes": [parse_size(s) for s in args.sizes.split(",")], "iters": args.iters, "out": f"{tmp}/r.json"}
        code = asyncio.run(
            launch(args.workers, [sys.executable, __file__, "--rank", json.dumps(spec)], env=dict(os.environ))
        )
        if code:
            return code
        rows = json.load(open(spec["out"]))
    print(f"# all_reduce float32, {args.workers} ranks sharing one GPU")
    print("# busbw in GB/s; 'pinned' is a numpy array in page-locked memory (what a cupy array is staged into)")
    print(f"{'size':>8} {'numpy busbw':>12} {'pinned busbw':>13} {'cupy busbw':>12} {'cupy/numpy':>11}")
    for size in spec["sizes"]:
        bw = {r["kind"]: r["busbw"] for r in rows if r["size"] == size}
        print(
            f"{size >> 20:>7}M {bw['numpy']:>12.3f} {bw['pinned']:>13.3f} {bw['cupy']:>12.3f}"
            f" {bw['cupy'] / bw['numpy']:>11.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
