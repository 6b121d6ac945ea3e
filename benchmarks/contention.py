"""psring against gloo on a busy machine (#60): 0, 1 and 2 CPU hogs, one host and TCP, side by side.

A hog is a process that spins (``sh -c 'while :; do :; done'``), as a data loader, another job or
torch's own intra-op threads would. For each number of hogs, path and world size the same sizes go
through psring and gloo in alternating rounds (benchmarks/compare_gloo.py's harness), with the hogs
running throughout; the table gives both times and psring's time as a fraction of gloo's.

    python benchmarks/contention.py                                   # 0-2 hogs x host,tcp x 2,4 ranks
    python benchmarks/contention.py --hogs 1 --workers 4 --sizes 64M --paths host --rounds 3

Needs torch (a CPU build) for gloo. The hogs are ended by PID however the run ends.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_gloo import compare

from psring.cli.bench import human, parse_size


@contextlib.contextmanager
def hogs(n: int) -> Iterator[list[int]]:
    """n processes that spin on a core each until the block ends."""
    procs = [subprocess.Popen(["sh", "-c", "while :; do :; done"], start_new_session=True) for _ in range(n)]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)


@contextlib.contextmanager
def path_env(path: str) -> Iterator[None]:
    """host: the same-host paths allowed (the default); tcp: TCP only (PSRING_SAME_HOST=off)."""
    before = os.environ.get("PSRING_SAME_HOST")
    if path == "tcp":
        os.environ["PSRING_SAME_HOST"] = "off"
    else:
        os.environ.pop("PSRING_SAME_HOST", None)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PSRING_SAME_HOST", None)
        else:
            os.environ["PSRING_SAME_HOST"] = before


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    rows = []
    for n_hogs in (int(h) for h in args.hogs.split(",") if h):
        with hogs(n_hogs):
            for path in args.paths.split(","):
                with path_env(path):
                    for workers in (int(w) for w in args.workers.split(",") if w):
                        result = compare(workers, sizes, args.iters, args.rounds, "ring", None)
                        for ours, theirs in zip(result["psring"], result["gloo"], strict=True):
                            rows.append({
                                "hogs": n_hogs, "path": path, "workers": workers, "size": ours["size"],
                                "psring_s": ours["time_s"], "gloo_s": theirs["time_s"],
                                "time_ratio": ours["time_s"] / theirs["time_s"],
                            })  # fmt: skip
                            if not args.json:
                                print(_line(rows[-1]), flush=True)
    return rows


def _line(r: dict[str, Any]) -> str:
    return (f"{r['hogs']:>4} {r['path']:>5} {r['workers']:>7} {human(r['size']):>8} "
            f"{r['psring_s'] * 1e3:>11.3f} {r['gloo_s'] * 1e3:>11.3f} {r['time_ratio']:>8.2f}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hogs", default="0,1,2", help="comma-separated numbers of spinning processes")
    p.add_argument("--paths", default="host,tcp", help="host (same-host paths allowed), tcp (TCP only), or both")
    p.add_argument("--workers", default="2,4")
    p.add_argument("--sizes", default="4,1M,64M")
    p.add_argument("--iters", type=int, default=5, help="timed calls per size (small sizes: at least 200)")
    p.add_argument("--rounds", type=int, default=2, help="alternating psring/gloo rounds; medians reported")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        import torch  # noqa: F401
    except ImportError:
        print("contention needs torch for gloo: pip install torch==2.13.0", file=sys.stderr)
        return 2
    if not args.json:
        print("# time per all_reduce (ms), psring's ring against gloo; ratio = psring / gloo (lower is better)")
        print(f"{'hogs':>4} {'path':>5} {'workers':>7} {'size':>8} {'psring ms':>11} {'gloo ms':>11} {'ratio':>8}")
    rows = run(args)
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
