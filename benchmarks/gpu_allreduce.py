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
    from psring.core.arrays import pinned_empty

    overlap = os.environ.get("PSRING_GPU_OVERLAP", "0")
    group = await psring.init_group(timeout=300)
    rows = []
    for size in spec["sizes"]:
        count = size // 4
        host = np.random.default_rng(group.rank).standard_normal(count).astype(np.float32)
        pinned = pinned_empty(host.shape, host.dtype)
        pinned[:] = host
        inputs = {"numpy": host, "pinned": pinned, "cupy": cp.asarray(host)}
        if spec["variants"]:  # the same cupy input with the opt-in overlap
            inputs["cupy-overlap"] = inputs["cupy"]  # PSRING_GPU_OVERLAP=1
        times: dict[str, list[float]] = {kind: [] for kind in inputs}
        for x in inputs.values():
            for _ in range(2):
                await group.all_reduce(x)
        for _ in range(spec["rounds"]):  # kinds interleaved, so a slow spell hits all of them
            for kind, x in inputs.items():
                os.environ["PSRING_GPU_OVERLAP"] = "1" if kind == "cupy-overlap" else overlap
                for _ in range(spec["iters"]):
                    await group.barrier()
                    if kind.startswith("cupy"):
                        cp.cuda.Device().synchronize()
                    t0 = time.perf_counter()
                    y = await group.all_reduce(x)
                    if kind.startswith("cupy"):
                        cp.cuda.Device().synchronize()
                    times[kind].append(time.perf_counter() - t0)
                    assert type(y).__module__.split(".")[0] == ("cupy" if kind.startswith("cupy") else "numpy")
        for kind, ts in times.items():
            slow = await group.all_reduce(np.array(ts), op="max")  # each call's slowest rank
            t = float(np.median(slow))
            n = group.world_size
            rows.append({"size": size, "kind": kind, "time_s": t, "busbw": size / t / 1e9 * 2 * (n - 1) / n})
    if group.rank == 0:
        with open(spec["out"], "w") as fh:
            json.dump(rows, fh)
    await group.close()


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        import uvloop

        uvloop.run(rank_main(json.loads(sys.argv[2])))
        return 0
    from psring.cli.bench import parse_size
    from psring.rendezvous.launch import launch

    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--sizes", default="1M,16M,64M")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variants", action="store_true", help="also cupy with PSRING_GPU_OVERLAP=1")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        spec = {
            "sizes": [parse_size(s) for s in args.sizes.split(",")],
            "iters": args.iters,
            "rounds": args.rounds,
            "variants": args.variants,
            "out": f"{tmp}/r.json",
        }
        code = asyncio.run(
            launch(args.workers, [sys.executable, __file__, "--rank", json.dumps(spec)], env=dict(os.environ))
        )
        if code:
            return code
        rows = json.load(open(spec["out"]))
    print(f"# all_reduce float32, {args.workers} ranks sharing one GPU")
    print("# busbw in GB/s; 'pinned' is a numpy array in page-locked memory (what a cupy array is staged into)")
    kinds = [r["kind"] for r in rows if r["size"] == spec["sizes"][0]]
    print(f"{'size':>8} " + " ".join(f"{k:>15}" for k in kinds) + f" {'cupy/numpy':>11}")
    for size in spec["sizes"]:
        bw = {r["kind"]: r["busbw"] for r in rows if r["size"] == size}
        print(f"{size >> 20:>7}M " + " ".join(f"{bw[k]:>15.3f}" for k in kinds) + f" {bw['cupy'] / bw['numpy']:>11.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
