"""A new worker's heal time in an elastic job, by model size: from its ``init_group(join=True)`` to
its first completed step, the state streamed from the job (ps: the shards; ring: a live peer).

    python benchmarks/heal.py [--topology ps|ring|both] [--sizes 1M,100M] [--workers 3] [--trials 3] [--json]

Each trial launches an elastic job (``psring launch``'s machinery with elastic=True) of WORKERS
workers running SyncSGD(elastic=True) on one float32 parameter of SIZE bytes (and Adam, so the
optimizer state is twice that again), with a boundary (``admit_waiting``) before every step. Once the
job runs, the driver starts one more worker with ``join=True`` and the same settings; it reports the
time from before its ``init_group`` to the end of its first step, and how much of that was the
boundary wait (to its ``start`` returning). The job then ends; its survivors' parameters must agree.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent

WORKER = """
import asyncio, hashlib, json, os, time, numpy as np, psring
from psring.core.optim import Adam
from psring.training.sgd import SyncSGD

async def main():
    join = os.environ.get("JOIN") == "1"
    t0 = time.perf_counter()
    g = await psring.init_group(timeout=120, join=join)
    n = int(os.environ["SIZE"]) // 4
    opt = SyncSGD(g, {"w": np.zeros(n, np.float32)}, Adam(lr=1e-3), elastic=True)
    await opt.start()
    t1 = time.perf_counter()
    grads = {"w": np.full(n, 0.001, np.float32)}
    first, end = True, int(os.environ["STEPS"])  # (the members: until a few steps after the new worker came)
    while opt.step_count < end:
        if not (join and first):
            if await opt.admit_waiting({"end": opt.step_count + 3}):
                end = opt.step_count + 3
        elif join:
            end = opt.joined_with["end"]
        params = await opt.step(grads)
        if join and first:
            print("HEALED " + json.dumps({"to_start_s": t1 - t0, "to_step_s": time.perf_counter() - t0,
                                          "at": opt.step_count}), flush=True)
        first = False
        if not join:
            print(f"STEP {opt.step_count}", flush=True)
    await opt.close_joins()
    digest = hashlib.sha256(params["w"].tobytes()).hexdigest()[:16]
    print("DONE " + json.dumps({"members": opt.members, "digest": digest}), flush=True)
    await g.close()

asyncio.run(main())
"""

LAUNCH = """
import sys
from psring.rendezvous.launch import launch
from psring.transport.loop import new_event_loop
sys.exit(new_event_loop().run_until_complete(launch(int(sys.argv[1]), [sys.executable, sys.argv[2]],
                                                    topology=sys.argv[3], elastic=True)))
"""


def _rank0_env(launcher: int) -> dict[str, str]:
    for task in Path(f"/proc/{launcher}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                raw = Path(f"/proc/{child}/environ").read_bytes().decode().split("\0")
            except OSError:
                continue
            e = dict(x.split("=", 1) for x in raw if "=" in x)
            if e.get("RANK") == "0":
                return e
    raise RuntimeError("no rank 0 under the launcher")


def trial(topology: str, size: int, workers: int, script: str) -> dict:  # type: ignore[type-arg]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PSRING_")}
    steps = 100_000  # the members stop 3 steps after the new worker was admitted
    env.update(PYTHONPATH=str(ROOT), STEPS=str(steps), SIZE=str(size), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-c", LAUNCH, str(workers), script, topology], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    joiner = None
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if joiner is None and re.match(r"\[rank 0\] STEP 2\b", line):
                e = _rank0_env(proc.pid)
                where = {k: e[k] for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "PSRING_JOB") if k in e}
                jenv = dict(env, JOIN="1", PSRING_TOPOLOGY=topology, **where)
                joiner = subprocess.Popen([sys.executable, script], env=jenv, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True)  # fmt: skip
        proc.wait(timeout=300)
        jout = joiner.communicate(timeout=120)[0] if joiner is not None else ""
    finally:
        for p in (proc, joiner):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL) if p is proc else p.kill()
                p.communicate(timeout=30)
    healed = re.search(r"HEALED (\{.*\})", jout)
    done = [json.loads(m) for m in re.findall(r"DONE (\{.*\})", "".join(lines) + jout)]
    ok = (
        proc.returncode == 0
        and joiner is not None
        and joiner.returncode == 0
        and healed is not None
        and len(done) == workers + 1
        and len({d["digest"] for d in done}) == 1
    )
    row = {"topology": topology, "size": size, "ok": ok}
    if healed is not None:
        row.update(json.loads(healed.group(1)))
    if not ok:
        row["tail"] = "".join(lines[-10:]) + jout[-2000:]
    return row


def _size(text: str) -> int:
    m = re.fullmatch(r"(\d+)([KMG]?)", text.strip().upper())
    if m is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1M, 100M)")
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--topology", choices=["ps", "ring", "both"], default="both")
    p.add_argument("--sizes", default="1M,100M", help="model sizes, comma-separated (K, M, G)")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    sizes = [_size(s) for s in args.sizes.split(",")]
    topologies = ["ps", "ring"] if args.topology == "both" else [args.topology]
    script = str(Path(os.environ.get("TMPDIR", "/tmp")) / f"psring-heal-{os.getpid()}.py")
    Path(script).write_text(WORKER)
    rows = []
    try:
        for size in sizes:
            for _ in range(args.trials):
                for topology in topologies:  # alternating: both see the machine as it is then
                    row = trial(topology, size, args.workers, script)
                    rows.append(row)
                    if not args.json:
                        shown = (f"{row['to_step_s'] * 1e3:.0f} ms to the first step ({row['to_start_s'] * 1e3:.0f} ms "
                                 "to start)" if "to_step_s" in row else "no heal")  # fmt: skip
                        print(f"{topology} {size >> 20} MiB: {shown}{'' if row['ok'] else ' FAILED'}", flush=True)
                        if not row["ok"]:
                            print(row["tail"], flush=True)
    finally:
        os.unlink(script)
    summary = []
    for size in sizes:
        for topology in topologies:
            got = [r["to_step_s"] for r in rows if r["topology"] == topology and r["size"] == size and r["ok"]]
            summary.append({"topology": topology, "size": size, "runs": len(got),
                            "median_ms": float(np.median(got) * 1e3) if got else None})  # fmt: skip
    if args.json:
        print(json.dumps({"summary": summary, "runs": rows}))
    else:
        for s in summary:
            med = f"{s['median_ms']:.0f} ms" if s["median_ms"] is not None else "-"
            print(f"{s['topology']:4} {s['size'] >> 20:4d} MiB: median {med} ({s['runs']} runs)")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
