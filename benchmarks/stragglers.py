"""Backup workers against a straggler (#36): steps per second of SyncSGD over the ring, over ps,
and over ps with backup workers (SyncSGD(backup=b): a step completes once all but b workers
pushed), N workers of which one straggles, alternating the three in one run.

    python benchmarks/stragglers.py [--workers 4] [--backup 1] [--steps 60] [--compute-ms 20]
                                    [--size 262144] [--servers S] [--rounds 3] [--json]

Each worker "computes" for --compute-ms per step (a sleep: the cores stay free for the exchange,
as on hosts that compute elsewhere, e.g. on a GPU); the straggler (the last rank; set here, by
the benchmark, never by psring) sleeps a further random 0-2x of that each step (Chen et al.
2016's setting). Steps per second = steps / the slowest worker's time for its loop (the job's
time: a straggler over backup workers skips the steps completed without it, so it ends with the
others). The loop is driven by opt.step_count, as backup workers need.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

WORKER = """
import asyncio, json, os, random, time, numpy as np, psring
from psring.core.optim import SGD
from psring.training.sgd import SyncSGD

async def main():
    g = await psring.init_group(timeout=120)
    steps, compute = int(os.environ["STEPS"]), float(os.environ["COMPUTE_S"])
    straggler = g.rank == g.world_size - 1
    rng = random.Random(1234 + g.rank)
    opt = SyncSGD(g, {"w": np.zeros(int(os.environ["SIZE"]), np.float32)}, SGD(lr=0.01),
                  backup=int(os.environ["BACKUP"]))
    await opt.start()
    grad = {"w": np.full(int(os.environ["SIZE"]), 0.001 * (g.rank + 1), np.float32)}
    await g.barrier()
    t0, calls = time.perf_counter(), 0
    while opt.step_count < steps:
        await asyncio.sleep(compute + (rng.uniform(0.0, 2.0) * compute if straggler else 0.0))
        await opt.step(grad)
        calls += 1
    seconds = time.perf_counter() - t0
    done = {"rank": g.rank, "seconds": seconds, "calls": calls, "skipped": opt.skipped}
    print("DONE " + json.dumps(done), flush=True)
    await g.close()

asyncio.run(main())
"""

LAUNCH = """
import sys
from psring.rendezvous.launch import launch
from psring.transport.loop import new_event_loop
sys.exit(new_event_loop().run_until_complete(launch(int(sys.argv[1]), [sys.executable, sys.argv[2]],
                                                    topology=sys.argv[3])))
"""


def run(workers: int, topology: str, backup: int, args: argparse.Namespace, script: str) -> dict:  # type: ignore[type-arg]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PSRING_")}
    env.update(PYTHONPATH=str(ROOT), STEPS=str(args.steps), COMPUTE_S=str(args.compute_ms / 1e3),
               SIZE=str(args.size), BACKUP=str(backup), OMP_NUM_THREADS="1")  # fmt: skip
    if args.servers:
        env["PSRING_SERVERS"] = str(args.servers)
    res = subprocess.run([sys.executable, "-c", LAUNCH, str(workers), script, topology], env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    if res.returncode != 0:
        raise RuntimeError(f"{topology} backup={backup} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    done = [json.loads(m) for m in re.findall(r"DONE (\{.*\})", res.stdout)]
    if len(done) != workers:
        raise RuntimeError(f"{topology} backup={backup}: {len(done)} of {workers} workers reported:\n{res.stdout}")
    seconds = max(d["seconds"] for d in done)
    straggler = max(done, key=lambda d: d["rank"])
    return {"steps_per_s": args.steps / seconds, "straggler_calls": straggler["calls"],
            "straggler_skipped": straggler["skipped"]}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--backup", type=int, default=1)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--compute-ms", type=float, default=20.0)
    p.add_argument("--size", type=int, default=262_144, help="float32 parameters (default 1 MiB)")
    p.add_argument("--servers", type=int, default=0, help="ps shard processes (default: one per worker)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    configs = [("ring", 0), ("ps", 0), ("ps", args.backup)]
    results: dict[str, list[dict]] = {f"{t} backup={b}": [] for t, b in configs}  # type: ignore[type-arg]
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "worker.py")
        with open(script, "w") as fh:
            fh.write(WORKER)
        for _ in range(args.rounds):
            for t, b in configs:
                results[f"{t} backup={b}"].append(run(args.workers, t, b, args, script))
    ring = statistics.median(r["steps_per_s"] for r in results["ring backup=0"])
    rows = []
    for name, rs in results.items():
        sps = statistics.median(r["steps_per_s"] for r in rs)
        rows.append({"config": name, "steps_per_s": sps, "vs_ring": sps / ring,
                     "straggler_calls": statistics.median(r["straggler_calls"] for r in rs),
                     "straggler_skipped": statistics.median(r["straggler_skipped"] for r in rs),
                     "rounds": [round(r["steps_per_s"], 2) for r in rs]})  # fmt: skip
    if args.json:
        print(json.dumps({"args": vars(args), "rows": rows}))
        return
    print(f"{args.workers} workers, rank {args.workers - 1} straggles (+0-2x of {args.compute_ms:g} ms a step), "
          f"{args.size * 4 / 2**20:.1f} MiB of parameters, {args.steps} steps, "
          f"median of {args.rounds} rounds")  # fmt: skip
    print(f"{'config':<16} {'steps/s':>8} {'vs ring':>8} {'straggler calls/skipped':>24}")
    for r in rows:
        print(f"{r['config']:<16} {r['steps_per_s']:>8.2f} {r['vs_ring']:>7.2f}x "
              f"{r['straggler_calls']:>12.0f} / {r['straggler_skipped']:<10.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
