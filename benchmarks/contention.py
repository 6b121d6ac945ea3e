"""psring against gloo and MPICH on a busy machine (#60): 0, 1 and 2 CPU hogs, one host and TCP.

A hog is a process that spins (``sh -c 'while :; do :; done'``), as a data loader, another job or
torch's own intra-op threads would. For each number of hogs, path and world size the same sizes go
through psring, gloo (benchmarks/compare_gloo.py's harness) and, with ``--mpich``, MPICH
(benchmarks/compare_mpi.py's) in alternating rounds, with the hogs running throughout; the table
gives the times and psring's time as a fraction of each.

    python benchmarks/contention.py                                   # 0-2 hogs x host,tcp x 2,4 ranks
    python benchmarks/contention.py --hogs 1 --workers 4 --sizes 64M --paths host --rounds 3 --mpich
    python benchmarks/contention.py --ddp --hogs 0,1 --workers 4     # a DDP step, torch on every core

``--ddp``: instead of the collectives, one DDP training step (benchmarks/torch_backend.py: gloo and
psring's ring, alternating rounds) with torch's intra-op threads on every core in every rank -- the
oversubscription training itself brings -- under the same hogs.

Needs torch (a CPU build) for gloo; --mpich needs mpi4py and MPICH (pip install -e '.[bench]'). The
hogs are ended by PID however the run ends.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare_gloo import compare
from compare_mpi import MPI_RANK, run_mpi

from psring.cli.bench import human, mpich_problem, parse_size


@contextlib.contextmanager
def hogs(n: int, session: str = "own") -> Iterator[list[int]]:
    """n processes that spin on a core each until the block ends. ``own``: each in a session of its own,
    as another job's process is -- where the kernel groups processes by session for scheduling
    (/proc/sys/kernel/sched_autogroup_enabled) the ranks then share the cores with the hogs as one
    group; ``shared``: in the ranks' session, as a data loader of the same job is."""
    own = session == "own"
    procs = [subprocess.Popen(["sh", "-c", "while :; do :; done"], start_new_session=own) for _ in range(n)]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                if own:
                    os.killpg(p.pid, signal.SIGKILL)
                else:
                    p.kill()
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
    with tempfile.TemporaryDirectory(prefix="psring-contention-") as tmp:
        mpi_script = os.path.join(tmp, "mpi_rank.py")
        Path(mpi_script).write_text(MPI_RANK)
        for n_hogs in (int(h) for h in args.hogs.split(",") if h):
            with hogs(n_hogs, args.hog_session):
                for path in args.paths.split(","):
                    with path_env(path):
                        for workers in (int(w) for w in args.workers.split(",") if w):
                            for row in _cell(args, sizes, workers, path, mpi_script):
                                rows.append({"hogs": n_hogs, "path": path, "workers": workers, **row})
                                if not args.json:
                                    print(_line(rows[-1], args.mpich), flush=True)
    return rows


def ddp(args: argparse.Namespace) -> int:
    """The DDP step under each number of hogs (benchmarks/torch_backend.py, torch on every core)."""
    rows = []
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_backend.py")
    for n_hogs in (int(h) for h in args.hogs.split(",") if h):
        with hogs(n_hogs, args.hog_session):
            cmd = [sys.executable, script, "--workers", args.workers, "--variants", "gloo,ring", "--threads", "0",
                   "--params", args.params, "--steps", "5", "--warmup", "2", "--rounds", str(args.rounds),
                   "--json"]  # fmt: skip
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            if res.returncode != 0:
                why = res.stdout[-1500:] + res.stderr[-1500:]
                raise SystemExit(f"contention --ddp: torch_backend.py failed:\n{why}")
            for r in json.loads(res.stdout.strip().splitlines()[-1]):
                med = r["median_step_ms"]
                row = {"hogs": n_hogs, "workers": r["workers"], "params": r["params"], "gloo_ms": med.get("gloo"),
                       "psring_ms": med.get("ring")}  # fmt: skip
                row["time_ratio"] = row["psring_ms"] / row["gloo_ms"] if row["gloo_ms"] and row["psring_ms"] else None
                rows.append(row)
                if not args.json:
                    print(f"ddp step, {n_hogs} hogs, {r['workers']} ranks, {r['params']} params: psring "
                          f"{row['psring_ms']:.1f} ms, gloo {row['gloo_ms']:.1f} ms, ratio {row['time_ratio']:.2f}",
                          flush=True)  # fmt: skip
    if args.json:
        print(json.dumps(rows))
    return 0


def _cell(args: argparse.Namespace, sizes: list[int], workers: int, path: str, mpi_script: str) -> list[dict[str, Any]]:
    """One cell's rows: psring, gloo (and MPICH) alternating round by round, medians."""
    ours: list[list[float]] = []
    gloo: list[list[float]] = []
    mpich: list[list[float]] = []
    for _ in range(args.rounds):
        result = compare(workers, sizes, args.iters, 1, "ring", None)
        ours.append([r["time_s"] for r in result["psring"]])
        gloo.append([r["time_s"] for r in result["gloo"]])
        if args.mpich:
            mpich.append([r["time_s"] for r in run_mpi(workers, sizes, args.iters, 3, path, mpi_script)])
    out = []
    for i, size in enumerate(sizes):
        t_ours = statistics.median(r[i] for r in ours)
        t_gloo = statistics.median(r[i] for r in gloo)
        row: dict[str, Any] = {"size": size, "psring_s": t_ours, "gloo_s": t_gloo, "time_ratio": t_ours / t_gloo}
        if args.mpich:
            row["mpich_s"] = statistics.median(r[i] for r in mpich)
            row["mpich_ratio"] = t_ours / row["mpich_s"]
        out.append(row)
    return out


def _line(r: dict[str, Any], mpich: bool = False) -> str:
    line = (f"{r['hogs']:>4} {r['path']:>5} {r['workers']:>7} {human(r['size']):>8} "
            f"{r['psring_s'] * 1e3:>11.3f} {r['gloo_s'] * 1e3:>11.3f} {r['time_ratio']:>8.2f}")  # fmt: skip
    if mpich:
        line += f" {r['mpich_s'] * 1e3:>11.3f} {r['mpich_ratio']:>8.2f}"
    return line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hogs", default="0,1,2", help="comma-separated numbers of spinning processes")
    p.add_argument(
        "--hog-session",
        choices=("own", "shared"),
        default="own",
        help="own: each hog in a session of its own (another job's); shared: in the ranks' (a data loader's)",
    )
    p.add_argument("--paths", default="host,tcp", help="host (same-host paths allowed), tcp (TCP only), or both")
    p.add_argument("--workers", default="2,4")
    p.add_argument("--sizes", default="4,1M,64M")
    p.add_argument(
        "--iters", type=int, default=5, help="timed calls per size (up to 64 KiB: at least 200; to 4 MiB: 50)"
    )
    p.add_argument("--rounds", type=int, default=2, help="alternating psring/gloo rounds; medians reported")
    p.add_argument("--mpich", action="store_true", help="MPICH too (mpi4py and MPICH's mpiexec)")
    p.add_argument("--ddp", action="store_true", help="a DDP step (gloo, psring's ring), torch on every core")
    p.add_argument("--params", default="3.2M", help="--ddp: the model's parameters")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.mpich and mpich_problem() is not None:
        print(f"contention --mpich: {mpich_problem()}", file=sys.stderr)
        return 2
    try:
        import torch  # noqa: F401
    except ImportError:
        print("contention needs torch for gloo: pip install torch==2.13.0", file=sys.stderr)
        return 2
    if args.ddp:
        return ddp(args)
    if not args.json:
        print("# time per all_reduce (ms), psring's ring against gloo (and MPICH); ratio = psring / them (lower is "
              "better)")  # fmt: skip
        print(f"{'hogs':>4} {'path':>5} {'workers':>7} {'size':>8} {'psring ms':>11} {'gloo ms':>11} {'ratio':>8}"
              + (f" {'mpich ms':>11} {'ratio':>8}" if args.mpich else ""))  # fmt: skip
    rows = run(args)
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
