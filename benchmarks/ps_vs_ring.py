"""Parameter server against ring, side by side in one run.

For each worker count N: the ring, ps with S=N shards (server processes of their
own), ps with S=N shards colocated with the workers (each worker process hosts one
shard, reached in-process by its own worker) and ps with S=1 (the single-server
bottleneck); all_reduce of --size float32, median of --iters.

With --rounds R the four runs are repeated R times in turn (the machine's load drifts
over minutes) and each cell is the median over the rounds; the ratio columns give the
median of the per-round ratios, with their range.

    python benchmarks/ps_vs_ring.py --workers 2,3,4 --size 64M --iters 3 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from psring.cli.bench import human, parse_size, run_allreduce

#: (label, topology, shards, colocated): "N" shards means one per worker
RUNS = (
    ("ring", "ring", None, False),
    ("ps S=N", "ps", "N", False),
    ("ps S=N colo", "ps", "N", True),
    ("ps S=1", "ps", 1, False),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="2,3,4")
    parser.add_argument("--size", default="64M")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    size = parse_size(args.size)
    rows = []
    for n in (int(w) for w in args.workers.split(",")):
        times: dict[str, list[float]] = {label: [] for label, *_ in RUNS}
        for _ in range(args.rounds):
            for label, topology, servers, colocate in RUNS:
                r = run_allreduce(
                    topology=topology,
                    workers=n,
                    sizes=[size],
                    iters=args.iters,
                    servers=n if servers == "N" else servers,
                    colocate=colocate,
                )[0]
                times[label].append(r["time_s"])
        busbw = 2 * (n - 1) / n * size / 1e9 if n > 1 else size / 1e9
        row: dict = {"workers": n}
        for label, ts in times.items():
            t = statistics.median(ts)
            row[label] = {"time_s": t, "busbw_GBps": busbw / t, "times_s": ts}
        for label in ("ps S=N", "ps S=N colo"):
            ratios = [ring / t for ring, t in zip(times["ring"], times[label], strict=True)]
            row[label]["vs_ring"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
        rows.append(row)
        if not args.json:
            if len(rows) == 1:
                print(
                    f"# all_reduce {human(size)} float32, median of {args.iters} (and of {args.rounds} round(s));"
                    " time in ms (busbw GB/s)"
                )
                print(f"{'N':>3} " + " ".join(f"{label:>16}" for label, *_ in RUNS) + "   vs ring: S=N, colocated")
            cells = [f"{row[k]['time_s'] * 1e3:8.0f} ({row[k]['busbw_GBps']:.2f})" for k, *_ in RUNS]
            ratios = "  ".join(
                f"{v['median']:.2f} ({v['min']:.2f}-{v['max']:.2f})"
                for v in (row["ps S=N"]["vs_ring"], row["ps S=N colo"]["vs_ring"])
            )
            print(f"{n:>3} " + " ".join(f"{c:>16}" for c in cells) + "   " + ratios, flush=True)
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
