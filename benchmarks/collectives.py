"""broadcast, all_gather and all_reduce over the ring and the parameter server, side by side.

    python benchmarks/collectives.py --workers 4 --size 64M --iters 5 --rounds 2

Each round runs ``psring launch -n N`` once per topology (ring; ps with S=N server
processes), in turn; every rank times each collective --iters times after a warm-up call
and a barrier, and rank 0 reports the median. broadcast moves the whole --size from rank 0;
all_gather gathers --size / N from every rank (so every rank ends with --size); all_reduce
reduces --size. Cells are the medians over the rounds, in ms.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SIZES = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper()
    if text and text[-1] in SIZES:
        return int(float(text[:-1]) * SIZES[text[-1]])
    return int(text)


def inner(size: int, iters: int) -> None:
    """One rank, under psring launch: print rank 0's medians as one JSON line."""
    import numpy as np

    import psring

    g = psring.init()
    n = size // 4
    x = np.ones(n, np.float32)
    part = np.ones(n // g.world_size, np.float32)
    calls = {
        "broadcast": lambda: g.broadcast(x, src=0),
        "all_gather": lambda: g.all_gather(part),
        "all_reduce": lambda: g.all_reduce(x),
    }
    out = {}
    for name, call in calls.items():
        call()
        times = []
        for _ in range(iters):
            g.barrier()
            t = time.perf_counter()
            call()
            times.append(time.perf_counter() - t)
        out[name] = float(np.median(times)) * 1e3
    if g.rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    g.close()


def run(topology: str, workers: int, size: int, iters: int) -> dict[str, float]:
    cmd = [sys.executable, "-m", "psring", "launch", "-n", str(workers), "--topology", topology]
    if topology == "ps":
        cmd += ["--servers", str(workers)]
    cmd += ["--", sys.executable, os.path.abspath(__file__), "--inner", "--size", str(size), "--iters", str(iters)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    for line in proc.stdout.splitlines():
        if "RESULT " in line:
            return dict(json.loads(line.split("RESULT ", 1)[1]))
    raise SystemExit(f"{topology} run failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--size", default="64M")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    size = parse_size(args.size)
    if args.inner:
        inner(size, args.iters)
        return
    rounds: dict[str, list[dict[str, float]]] = {"ring": [], "ps": []}
    for _ in range(args.rounds):
        for topology in rounds:
            rounds[topology].append(run(topology, args.workers, size, args.iters))
    table = {}
    for name in ("broadcast", "all_gather", "all_reduce"):
        med = {t: statistics.median(r[name] for r in rs) for t, rs in rounds.items()}
        table[name] = {"ring_ms": med["ring"], "ps_ms": med["ps"], "ps_vs_ring": med["ps"] / med["ring"]}
    if args.json:
        print(json.dumps({"workers": args.workers, "size": size, "rounds": rounds, "table": table}))
        return
    print(f"# N={args.workers}, {args.size} float32, ps with S=N servers; ms, median of {args.rounds} round(s)")
    print(f"{'collective':>12} {'ring':>8} {'ps':>8} {'ps/ring':>8}")
    for name, row in table.items():
        print(f"{name:>12} {row['ring_ms']:8.1f} {row['ps_ms']:8.1f} {row['ps_vs_ring']:8.2f}")


if __name__ == "__main__":
    main()
