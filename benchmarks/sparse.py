"""An embedding table trained by N workers that each touch a few of its rows a step (#37): the
dense ring (the table's gradient all-reduced whole), the sparse ring (SyncSGD(sparse=[...]) over
the ring: the touched rows all-gathered, every rank holding the table) and sparse ps (the table on
the shards: rows pushed and pulled), steps per second side by side in one run, and each worker's
peak resident memory against the table's size.

    python benchmarks/sparse.py [--workers 4] [--rows 1000000] [--width 64] [--touch 0.01]
                                [--steps 20] [--variants dense-ring,sparse-ring,sparse-ps] [--rounds 1] [--json]
                                [--bed 1gbit]

With ``--bed RATE`` (root: network namespaces and tc, as benchmarks/hosts.py) every worker is a host
of its own, its link shaped to RATE both ways; over ps each worker process hosts one shard
(PSRING_PS_COLOCATE=1: a host per worker and shard, as a cluster without spare server hosts runs it).

Each step a worker draws its batch's row ids (uniform, --touch of the table), pulls those rows
(opt.pull_rows), makes a gradient of them (rows x 0.01: the exchange is what is measured) and steps,
naming the next batch's ids (``step(..., prefetch=...)``: over ps they come back with the step's
answer, so that pull asks nobody; ``--no-prefetch``: a pull of its own each step).
Over ps, ranks other than 0 pass an untouched np.empty table (no pages: rank 0's rows are what the
shards start from), so a worker never holds the table; the shards do (--servers, default one per
worker).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

WORKER = """
import asyncio, json, os, time, numpy as np, psring
from psring.optim import SGD

def peak_rss():
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0

async def main():
    variant, rows, width = os.environ["VARIANT"], int(os.environ["ROWS"]), int(os.environ["WIDTH"])
    touch, steps = float(os.environ["TOUCH"]), int(os.environ["STEPS"])
    PREFETCH = os.environ.get("PREFETCH") == "1"
    # the table first: making a large one holds this thread (and a loop on it) for seconds, longer
    # than the peers wait for a silent rank's heartbeat once the group is up
    if int(os.environ["RANK"]) == 0 or variant != "sparse-ps":
        table = np.random.default_rng(0).standard_normal((rows, width), dtype=np.float32)
        table *= np.float32(0.01)
    else:
        table = np.empty((rows, width), np.float32)  # untouched: no memory; the shards hold the rows
    g = await psring.init_group(timeout=300)
    sparse = [] if variant == "dense-ring" else ["emb"]
    opt = psring.SyncSGD(g, {"emb": table}, SGD(lr=0.1), sparse=sparse)
    del table
    await opt.start()
    rng = np.random.default_rng(1 + g.rank)
    k = max(1, int(rows * touch))
    ids = rng.integers(0, rows, k)
    await g.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        nxt = rng.integers(0, rows, k)  # the next batch
        if sparse:
            cur = await opt.pull_rows("emb", ids)  # after the first step: the rows came with it (prefetch)
            grad = {"emb": psring.SparseRows(ids, cur * np.float32(0.01), rows)}
            await opt.step(grad, prefetch={"emb": nxt} if PREFETCH else None)
        else:
            dense = np.zeros((rows, width), np.float32)
            dense[ids] = opt.params["emb"][ids] * np.float32(0.01)
            await opt.step({"emb": dense})
        ids = nxt
    seconds = time.perf_counter() - t0
    print("DONE " + json.dumps({"rank": g.rank, "seconds": seconds, "peak_rss": peak_rss()}), flush=True)
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

VARIANTS = ("dense-ring", "sparse-ring", "sparse-ps")


def run(variant: str, args: argparse.Namespace, script: str, bed: Any = None) -> dict:  # type: ignore[type-arg]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PSRING_")}
    env.update(PYTHONPATH=str(ROOT), VARIANT=variant, ROWS=str(args.rows), WIDTH=str(args.width),
               TOUCH=str(args.touch), STEPS=str(args.steps), OMP_NUM_THREADS="1",
               PREFETCH="0" if args.no_prefetch else "1")  # fmt: skip
    if args.servers:
        env["PSRING_SERVERS"] = str(args.servers)
    topology = "ps" if variant == "sparse-ps" else "ring"
    if bed is not None:
        stdout = run_on_bed(bed, env, topology, args, script)
    else:
        res = subprocess.run([sys.executable, "-c", LAUNCH, str(args.workers), script, topology], env=env,
                             capture_output=True, text=True, timeout=3600)  # fmt: skip
        if res.returncode != 0:
            raise RuntimeError(f"{variant} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
        stdout = res.stdout
    done = [json.loads(m) for m in re.findall(r"DONE (\{.*\})", stdout)]
    if len(done) != args.workers:
        raise RuntimeError(f"{variant}: {len(done)} of {args.workers} workers reported\n{stdout[-3000:]}")
    return {"steps_per_s": args.steps / max(d["seconds"] for d in done),
            "worker_peak_rss": max(d["peak_rss"] for d in done),
            "rank0_peak_rss": max(d["peak_rss"] for d in done if d["rank"] == 0),
            "others_peak_rss": max((d["peak_rss"] for d in done if d["rank"] != 0), default=0)}  # fmt: skip


def make_bed(workers: int, rate: str) -> Any:
    """A host (network namespace) per worker on one bridge, each link shaped to ``rate`` both ways."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from hosts import shape  # benchmarks/hosts.py: the same bed and shaping

    from tests.support.harness.netns import NetnsCluster, netns_available

    why = netns_available()
    if why is not None:
        raise SystemExit(f"sparse.py --bed: {why} (run as root)")
    cluster = NetnsCluster(uuid.uuid4().hex[:6])
    try:
        for h in range(workers):
            cluster.host(f"host{h}")
            shape(cluster, f"host{h}", rate)
    except BaseException:
        cluster.close()
        raise
    return cluster


def run_on_bed(cluster: Any, env: dict[str, str], topology: str, args: argparse.Namespace, script: str) -> str:
    """Every worker in its own host, meeting at rank 0's store; their output, once all ended (by PID)."""
    names = [n for n in cluster.hosts if n.startswith("host")]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs, job = [], f"sparse-{uuid.uuid4().hex[:6]}"
    for r in range(args.workers):
        renv = {**env, "RANK": str(r), "WORLD_SIZE": str(args.workers), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": cluster.addresses[names[0]], "MASTER_PORT": str(port),
                "PSRING_JOB": job, "PSRING_TOPOLOGY": topology,
                "PYTHONUNBUFFERED": "1"}  # fmt: skip
        if topology == "ps":
            renv["PSRING_PS_COLOCATE"] = "1"
        procs.append(cluster.run(names[r], [sys.executable, script], renv))
    out, failed = [], []
    deadline = time.monotonic() + 3600
    for r, proc in enumerate(procs):
        try:
            said = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] or ""
        except subprocess.TimeoutExpired:
            proc.kill()
            said = proc.communicate(timeout=30)[0] or ""
        out.append(said)
        if proc.returncode != 0:
            failed.append(f"rank {r} exited {proc.returncode}: {said[-1500:]}")
    cluster.procs = [p for p in cluster.procs if p not in procs]
    if failed:
        for proc in procs:  # ended by PID, whatever happened
            if proc.poll() is None:
                proc.kill()
        raise RuntimeError("; ".join(failed))
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--touch", type=float, default=0.01, help="share of the rows each worker touches a step")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--servers", type=int, default=0, help="ps shard processes (default: one per worker)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-prefetch", action="store_true",
                   help="pull each batch's rows after the step (not with it: step(..., prefetch=...))")
    p.add_argument("--bed", metavar="RATE", help="a host per worker, links shaped to RATE (1gbit; root)")
    args = p.parse_args()
    variants = args.variants.split(",")
    for v in variants:
        if v not in VARIANTS:
            p.error(f"--variants: {v!r} is not one of {', '.join(VARIANTS)}")
    if not (args.workers >= 1 and args.rows >= 1 and args.width >= 1 and 0 < args.touch <= 1 and args.steps >= 1):
        p.error("--workers, --rows, --width and --steps must be positive and --touch in (0, 1]")
    results: dict[str, list[dict]] = {v: [] for v in variants}  # type: ignore[type-arg]
    bed = make_bed(args.workers, args.bed) if args.bed else None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            script = os.path.join(tmp, "worker.py")
            Path(script).write_text(WORKER)
            os.chmod(tmp, 0o755)
            for _ in range(args.rounds):  # alternating: drift hits all alike
                for v in variants:
                    results[v].append(run(v, args, script, bed))
    finally:
        if bed is not None:
            bed.close()
    table_bytes = args.rows * args.width * 4
    base = statistics.median(r["steps_per_s"] for r in results[variants[0]])
    rows = [{"variant": v, "steps_per_s": statistics.median(r["steps_per_s"] for r in rs),
             "vs_first": statistics.median(r["steps_per_s"] for r in rs) / base,
             "worker_peak_rss": max(r["worker_peak_rss"] for r in rs),
             "rank0_peak_rss": max(r["rank0_peak_rss"] for r in rs),
             "others_peak_rss": max(r["others_peak_rss"] for r in rs)} for v, rs in results.items()]  # fmt: skip
    if args.json:
        print(json.dumps({"args": vars(args), "table_bytes": table_bytes, "rows": rows}))
        return
    print(f"{args.workers} workers, a {args.rows} x {args.width} float32 table ({table_bytes / 2**20:.0f} MiB), "
          f"{args.touch:.1%} of its rows touched per worker and step, {args.steps} steps"
          + (f", a host each, links shaped to {args.bed}" if args.bed else ", one host"))  # fmt: skip
    print("peak RSS per worker: rank 0 (which makes the initial table) and the largest of the others")
    head = f"{'variant':<12} {'steps/s':>9} {'x ' + variants[0]:>16} {'rank 0 RSS':>12} {'others RSS':>12}"
    print(head + f" {'x table':>8}")
    for r in rows:
        print(f"{r['variant']:<12} {r['steps_per_s']:>9.2f} {r['vs_first']:>15.1f}x "
              f"{r['rank0_peak_rss'] / 2**20:>8.0f} MiB {r['others_peak_rss'] / 2**20:>8.0f} MiB "
              f"{r['others_peak_rss'] / table_bytes:>8.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
