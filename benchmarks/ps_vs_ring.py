"""Parameter server against ring, side by side in one run.

For each worker count N: the ring, ps with S=N shards and ps with S=1 (the
single-server bottleneck), all_reduce of --size float32, median of --iters.

    python benchmarks/ps_vs_ring.py --workers 2,3,4 --size 64M --iters 3
"""

from __future__ import annotations

import argparse
import json
import sys

from psring.bench import human, parse_size, run_allreduce


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="2,3,4")
    parser.add_argument("--size", default="64M")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    size = parse_size(args.size)
    rows = []
    for n in (int(w) for w in args.workers.split(",")):
        row = {"workers": n}
        for label, topology, servers in (("ring", "ring", None), ("ps S=N", "ps", n), ("ps S=1", "ps", 1)):
            r = run_allreduce(topology=topology, workers=n, sizes=[size], iters=args.iters, servers=servers)[0]
            row[label] = {"time_s": r["time_s"], "busbw_GBps": r["busbw_GBps"]}
        rows.append(row)
        if not args.json:
            if len(rows) == 1:
                print(f"# all_reduce {human(size)} float32, median of {args.iters}; time in ms (busbw GB/s)")
                print(f"{'N':>3} {'ring':>16} {'ps S=N':>16} {'ps S=1':>16} {'S=N/ring busbw':>15}")
            cells = [
                f"{row[k]['time_s'] * 1e3:8.0f} ({row[k]['busbw_GBps']:.2f})" for k in ("ring", "ps S=N", "ps S=1")
            ]
            ratio = row["ps S=N"]["busbw_GBps"] / row["ring"]["busbw_GBps"]
            print(f"{n:>3} {cells[0]:>16} {cells[1]:>16} {cells[2]:>16} {ratio:>15.2f}", flush=True)
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
