"""psring's ring against torch.distributed's gloo backend, side by side in one run.

For each world size, the same sizes go through psring (``--topology``, ring by
default) and through gloo (CPU tensors, file rendezvous), alternating rounds so
that drift on a noisy machine hits both alike. Prints both tables, the busbw and
latency ratios, and psring's peak RSS above idle during each size (the issue's
memory bound is 3x the tensor size).

Needs torch (``pip install torch==2.13.0``, a CPU build); psring itself does not.

    python benchmarks/compare_gloo.py --workers 2,4 --sizes 4,1M,16M,64M --iters 5 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

from psring.cli.bench import format_table, human, parse_size, run_allreduce


def _median_rows(runs: list[list[dict[str, Any]]], workers: int) -> list[dict[str, Any]]:
    rows = []
    for per_size in zip(*runs, strict=True):
        row = dict(per_size[0])
        row["time_s"] = statistics.median(r["time_s"] for r in per_size)
        row["algbw_GBps"] = row["size"] / row["time_s"] / 1e9
        row["busbw_GBps"] = row["algbw_GBps"] * 2 * (workers - 1) / workers
        if "peak_rss_over_idle" in row:
            row["peak_rss_over_idle"] = max(r["peak_rss_over_idle"] for r in per_size)
        rows.append(row)
    return rows


def compare(
    workers: int, sizes: list[int], iters: int, rounds: int, topology: str, servers: int | None
) -> dict[str, Any]:
    ours: list[list[dict[str, Any]]] = []
    gloo: list[list[dict[str, Any]]] = []
    for _ in range(rounds):
        ours.append(run_allreduce(topology=topology, workers=workers, sizes=sizes, iters=iters, servers=servers))
        gloo.append(run_allreduce(topology="ring", workers=workers, sizes=sizes, iters=iters, backend="gloo"))
    return {"workers": workers, "psring": _median_rows(ours, workers), "gloo": _median_rows(gloo, workers)}


def report(result: dict[str, Any], topology: str) -> str:
    n = result["workers"]
    lines = [
        format_table(result["psring"], f"psring {topology}, workers={n}"),
        format_table(result["gloo"], f"torch.distributed gloo, workers={n}"),
        f"# ratios, workers={n} (time: psring/gloo, lower is better; busbw: psring/gloo, higher is better)",
        f"{'size':>10} {'time ratio':>12} {'busbw ratio':>12} {'peak RSS over idle':>20} {'x tensor':>9}",
    ]
    for ours, theirs in zip(result["psring"], result["gloo"], strict=True):
        rss = ours.get("peak_rss_over_idle", 0)
        lines.append(
            f"{human(ours['size']):>10} {ours['time_s'] / theirs['time_s']:>12.2f} "
            f"{ours['busbw_GBps'] / theirs['busbw_GBps']:>12.2f} {rss / 2**20:>17.1f}MiB "
            f"{rss / max(ours['size'], 1):>9.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="2,4", help="comma-separated world sizes (default 2,4)")
    parser.add_argument("--sizes", default="4,1M,16M,64M")
    parser.add_argument(
        "--iters", type=int, default=5, help="timed calls per size (up to 64 KiB: at least 200; to 4 MiB: 50)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="alternating psring/gloo rounds; medians reported")
    parser.add_argument("--topology", default="ring", choices=["ring", "ps"])
    parser.add_argument("--servers", type=int, default=None, help="server shards for --topology ps")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        import torch  # noqa: F401
    except ImportError:
        print("compare_gloo needs torch: pip install torch==2.13.0", file=sys.stderr)
        return 2
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    results = []
    for n in (int(w) for w in args.workers.split(",") if w):
        result = compare(n, sizes, args.iters, args.rounds, args.topology, args.servers)
        results.append(result)
        if not args.json:
            print(report(result, args.topology), flush=True)
            print()
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
