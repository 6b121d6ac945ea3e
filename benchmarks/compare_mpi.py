"""psring's all_reduce against MPICH's (through mpi4py), side by side in one run (#38).

For each world size and path (one host; TCP only), every size goes through MPICH
(``COMM_WORLD.Allreduce(IN_PLACE, buf)``), psring's blocking API (``psring.init()``, the way a
training loop calls it) and psring's asyncio API (``await group.all_reduce`` under
``uvloop.run``, as docs/api.md recommends; ``--apis async-asyncio``: under ``asyncio.run``), alternating
rounds so that drift on a noisy machine hits all alike. Each rank runs ITERS back-to-back calls
after a warm-up; a call's time is the slowest rank's total / ITERS; the median over rounds is
reported, with busbw (2(N-1)/N x size / time) and the ratio to MPICH. Every rank checks its
result (float32, rank r contributes r+1: every element must be N(N+1)/2), on both sides.

    pip install -e ".[bench]"       # mpi4py and mpich (MPICH with its own mpiexec)
    python benchmarks/compare_mpi.py --workers 2,4 --sizes 4,64K,1M,64M --paths host,tcp [--json]

TCP only: psring with ``PSRING_SAME_HOST=off``; MPICH with its OFI netmod over the TCP provider
and no shared memory (``MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp MPIR_CVAR_NOLOCAL=1``: with UCX,
MPICH keeps shared memory even with NOLOCAL). With more ranks than cores (N=4 here on 2 cores)
the figures measure CPU shared by the ranks as much as the transport: compare within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from psring.cli.bench import mpiexec  # MPICH's, checked to be MPICH's

ROOT = Path(__file__).resolve().parent.parent

MPI_RANK = """
import json, sys, time
import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, n = comm.Get_rank(), comm.Get_size()
sizes, iters, warmup = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
out = []
for size in sizes:
    count = max(1, size // 4)
    buf = np.empty(count, np.float32)
    k = iters if size > 65536 else max(iters, 200 if size > 4096 else 2000)
    for _ in range(max(warmup, 20) if size <= 65536 else warmup):
        buf.fill(rank + 1)
        comm.Allreduce(MPI.IN_PLACE, buf)
    buf.fill(rank + 1)
    comm.Allreduce(MPI.IN_PLACE, buf)
    ok = bool(np.all(buf == n * (n + 1) / 2))
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(k):
        comm.Allreduce(MPI.IN_PLACE, buf)
    dt = (time.perf_counter() - t0) / k
    worst = comm.allreduce(dt, op=MPI.MAX)
    ok = comm.allreduce(ok, op=MPI.LAND)
    out.append({"size": count * 4, "time_s": worst, "ok": ok})
if rank == 0:
    print("RESULT " + json.dumps(out), flush=True)
"""

PSRING_RANK = """
import asyncio, json, sys, time
import numpy as np
import psring

sizes, iters, warmup, api = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]

# the timed loops call all_reduce directly, as MPI_RANK calls Allreduce: no harness between them
def cases(rank):
    for size in sizes:
        count = max(1, size // 4)
        warm = max(warmup, 20) if size <= 65536 else warmup
        k = iters if size > 65536 else max(iters, 200 if size > 4096 else 2000)
        yield count, np.full(count, rank + 1, np.float32), k, warm

def bench_blocking(g):
    out, n = [], g.world_size
    for count, x, k, warm in cases(g.rank):
        for _ in range(warm):
            g.all_reduce(x)
        ok = bool(np.all(g.all_reduce(x) == n * (n + 1) / 2))
        g.barrier()
        t0 = time.perf_counter()
        for _ in range(k):
            g.all_reduce(x)
        worst = g.all_reduce(np.array([(time.perf_counter() - t0) / k]), op="max")
        oks = g.all_reduce(np.array([1.0 if ok else 0.0]), op="min")
        out.append({"size": count * 4, "time_s": float(worst[0]), "ok": bool(oks[0] == 1.0)})
    return out

async def bench_async(g):
    out, n = [], g.world_size
    for count, x, k, warm in cases(g.rank):
        for _ in range(warm):
            await g.all_reduce(x)
        ok = bool(np.all((await g.all_reduce(x)) == n * (n + 1) / 2))
        await g.barrier()
        t0 = time.perf_counter()
        for _ in range(k):
            await g.all_reduce(x)
        worst = await g.all_reduce(np.array([(time.perf_counter() - t0) / k]), op="max")
        oks = await g.all_reduce(np.array([1.0 if ok else 0.0]), op="min")
        out.append({"size": count * 4, "time_s": float(worst[0]), "ok": bool(oks[0] == 1.0)})
    return out

def report(rank, out):
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)

def drive_blocking():
    g = psring.init()
    report(g.rank, bench_blocking(g))
    g.close()

async def drive_async():
    g = await psring.init_group()
    report(g.rank, await bench_async(g))
    await g.close()

if api == "blocking":
    drive_blocking()
elif api == "async-asyncio":
    asyncio.run(drive_async())
else:
    import uvloop
    uvloop.run(drive_async())
"""

LAUNCH = """
import sys
from psring.rendezvous.launch import launch
from psring.transport.loop import new_event_loop
sys.exit(new_event_loop().run_until_complete(launch(int(sys.argv[1]), [sys.executable, *sys.argv[2:]])))
"""


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B")
    try:
        return int(text[:-1]) * units[text[-1]] if text and text[-1] in units else int(text)
    except ValueError:
        raise SystemExit(f"compare_mpi: size {text!r} does not parse (e.g. 4, 64K, 1M)") from None


def _result(stdout: str, what: str) -> list[dict[str, Any]]:
    for line in stdout.splitlines():
        if "RESULT " in line:
            return json.loads(line.split("RESULT ", 1)[1])  # type: ignore[no-any-return]
    raise RuntimeError(f"{what}: no result\n{stdout[-3000:]}")


def run_mpi(n: int, sizes: list[int], iters: int, warmup: int, path: str, script: str) -> list[dict[str, Any]]:
    exe = mpiexec()  # MPICH's, or a SystemExit saying why not
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PSRING_", "MPIR_", "FI_"))}
    env["OMP_NUM_THREADS"] = "1"
    if path == "tcp":
        env.update(MPIR_CVAR_CH4_NETMOD="ofi", FI_PROVIDER="tcp", MPIR_CVAR_NOLOCAL="1", FI_TCP_IFACE="lo")
    cmd = [exe, "-n", str(n), "-host", "localhost", sys.executable, script, json.dumps(sizes), str(iters), str(warmup)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise RuntimeError(f"MPICH n={n} {path} failed:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
    return _result(res.stdout, f"MPICH n={n} {path}")


def run_psring(
    n: int, sizes: list[int], iters: int, warmup: int, path: str, api: str, script: str
) -> list[dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PSRING_")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PSRING_TOPOLOGY="ring")
    if path == "tcp":
        env["PSRING_SAME_HOST"] = "off"
    cmd = [sys.executable, "-c", LAUNCH, str(n), script, json.dumps(sizes), str(iters), str(warmup), api]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if res.returncode != 0:
        raise RuntimeError(f"psring {api} n={n} {path} failed:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
    return _result(res.stdout, f"psring {api} n={n} {path}")


def compare(args: argparse.Namespace) -> list[dict[str, Any]]:
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="psring-mpi-") as tmp:
        mpi_script, ps_script = os.path.join(tmp, "mpi_rank.py"), os.path.join(tmp, "psring_rank.py")
        Path(mpi_script).write_text(MPI_RANK)
        Path(ps_script).write_text(PSRING_RANK)
        apis = args.apis.split(",")
        for n in (int(w) for w in args.workers.split(",")):
            for path in args.paths.split(","):
                runs: dict[str, list[list[dict[str, Any]]]] = {"mpich": [], **{a: [] for a in apis}}
                for _ in range(args.rounds):  # alternating: drift hits all alike
                    runs["mpich"].append(run_mpi(n, sizes, args.iters, args.warmup, path, mpi_script))
                    for api in apis:
                        runs[api].append(run_psring(n, sizes, args.iters, args.warmup, path, api, ps_script))
                for i, size in enumerate(sizes):
                    mpi_t = statistics.median(r[i]["time_s"] for r in runs["mpich"])
                    ok = all(r[i]["ok"] for v in runs.values() for r in v)
                    row: dict[str, Any] = {"workers": n, "path": path, "size": max(4, size // 4 * 4),
                                           "mpich_s": mpi_t, "ok": ok}  # fmt: skip
                    for api in apis:
                        t = statistics.median(r[i]["time_s"] for r in runs[api])
                        row[f"{api}_s"] = t
                        row[f"{api}_vs_mpich_time"] = t / mpi_t
                    rows.append(row)
    return rows


def busbw(size: int, n: int, t: float) -> float:
    return size / t * 2 * (n - 1) / n / 1e9


def human(n: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", default="2,4")
    p.add_argument("--sizes", default="4,1K,64K,1M,16M,64M")
    p.add_argument("--paths", default="host,tcp", help="host (shared memory allowed), tcp (TCP only), or both")
    p.add_argument("--apis", default="blocking,async",
                   help="psring's blocking API, asyncio API (under uvloop.run), async-asyncio (under asyncio.run)")
    p.add_argument("--iters", type=int, default=10, help="calls per size (at least 200 up to 64 KiB, 2000 up to 4 KiB)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    for what in args.paths.split(","):
        if what not in ("host", "tcp"):
            p.error(f"--paths: {what!r} is neither host nor tcp")
    for what in args.apis.split(","):
        if what not in ("blocking", "async", "async-asyncio"):
            p.error(f"--apis: {what!r} is none of blocking, async, async-asyncio")
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        print("compare_mpi: mpi4py is not installed (pip install -e '.[bench]')", file=sys.stderr)
        sys.exit(2)
    rows = compare(args)
    if args.json:
        print(json.dumps({"args": vars(args), "rows": rows}))
        return
    apis = args.apis.split(",")
    head = f"{'N':>2} {'path':>4} {'size':>8} {'MPICH':>10}" + "".join(f" {a:>10} {'x MPICH':>8}" for a in apis)
    print("time per all_reduce (the slowest rank's), median of rounds; x MPICH: psring's time / MPICH's")
    print(head + f" {'busbw MPICH':>12}" + "".join(f" {'busbw ' + a:>15}" for a in apis))
    for r in rows:
        n, size = r["workers"], r["size"]
        line = f"{n:>2} {r['path']:>4} {human(size):>8} {r['mpich_s'] * 1e6:>8.1f}us"
        for a in apis:
            line += f" {r[a + '_s'] * 1e6:>8.1f}us {r[a + '_vs_mpich_time']:>7.2f}x"
        line += f" {busbw(size, n, r['mpich_s']):>10.2f}GB/s"
        for a in apis:
            line += f" {busbw(size, n, r[a + '_s']):>13.2f}GB/s"
        print(line + ("" if r["ok"] else "  RESULTS DIFFER"))


if __name__ == "__main__":
    main()
