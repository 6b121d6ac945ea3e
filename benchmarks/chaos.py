"""Chaos for elastic training: SIGKILL workers of running elastic jobs; the job must go on.

    python benchmarks/chaos.py --elastic [--topology ps|ring|both] [--trials 10] [--workers 4] [--kills 2]
                               [--steps 300] [--json]

Each trial launches an elastic job (``psring launch``'s machinery with elastic=True; over ps server
processes hold the model, over the ring every worker does and the survivors re-form) where WORKERS
workers run STEPS steps of SyncSGD(elastic=True) on a small model. ``both``: the two topologies'
trials alternate in one run, and each gets its own summary. At KILLS random steps the driver
SIGKILLs a random live worker (rank 0 included), found by its RANK among the launcher's children.
Recorded per kill: the time from the kill to the first step a survivor completes without the killed
worker (averaged over one worker fewer). Per job: whether it finished (every survivor ran every
step, the survivors' parameters agree) or was lost. The long chaos form of the elastic tests
(tests/topology/test_elastic.py and test_elastic_ring.py have the short ones).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent

WORKER = """
import asyncio, hashlib, json, os, time, numpy as np, psring
from psring.core.optim import SGD
from psring.training.sgd import SyncSGD

async def main():
    g = await psring.init_group(timeout=60)
    rng = np.random.default_rng(g.rank)
    opt = SyncSGD(g, {"w": np.zeros(50_000, np.float32), "b": np.zeros(10, np.float32)}, SGD(lr=0.01, momentum=0.9),
                  elastic=True)
    params = await opt.start()
    for t in range(int(os.environ["STEPS"])):
        grads = {k: (rng.standard_normal(v.shape) * 0.01 + v * 0.1).astype(np.float32) for k, v in params.items()}
        params = await opt.step(grads)
        print(f"STEP {t} {time.time():.6f} {len(opt.members)}", flush=True)
    digest = hashlib.sha256(b"".join(params[k].tobytes() for k in sorted(params))).hexdigest()[:16]
    print("DONE " + json.dumps({"rank": g.rank, "digest": digest, "members": opt.members}), flush=True)
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


def _rank_pids(launcher: int) -> dict[int, int]:
    out = {}
    for task in Path(f"/proc/{launcher}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            for item in environ:
                if item.startswith(b"RANK="):
                    out[int(item[5:])] = int(child)
    return out


def trial(workers: int, kills: int, steps: int, rng: random.Random, script: str, topology: str) -> dict:  # type: ignore[type-arg]
    at = sorted(rng.sample(range(5, steps - 20), kills))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PSRING_")}
    env.update(PYTHONPATH=str(ROOT), STEPS=str(steps), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCH, str(workers), script, topology],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    kill_times: list[tuple[int, float]] = []  # (rank, time)
    step_times: list[tuple[float, int]] = []  # (time, workers the step averaged over)
    live = set(range(workers))
    done: list[dict] = []  # type: ignore[type-arg]
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            m = re.match(r"\[rank (\d+)\] STEP (\d+) ([\d.]+) (\d+)", line)
            if m:
                step_times.append((float(m.group(3)), int(m.group(4))))
                if at and int(m.group(2)) >= at[0]:
                    at.pop(0)
                    victim = rng.choice(sorted(live))
                    pid = _rank_pids(proc.pid).get(victim)
                    if pid is not None:
                        os.kill(pid, signal.SIGKILL)
                        kill_times.append((victim, time.time()))
                        live.discard(victim)
            m = re.match(r"\[rank \d+\] DONE (\{.*\})", line)
            if m:
                done.append(json.loads(m.group(1)))
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
    # the first step completed without the killed worker: one averaged over fewer workers than were
    # left before the kill (steps completed right after the kill may have had its gradients already)
    recover = [
        min((s for s, n in step_times if s > t and n <= workers - 1 - k), default=float("nan")) - t
        for k, (_v, t) in enumerate(kill_times)
    ]
    finished = (
        proc.returncode == 0
        and sorted(d["rank"] for d in done) == sorted(live)
        and len({d["digest"] for d in done}) == 1
        and all(d["members"] == sorted(live) for d in done)
    )
    return {
        "killed": [v for v, _t in kill_times],
        "recover_s": recover,
        "finished": finished,
        "code": proc.returncode,
        "tail": "" if finished else "".join(lines[-15:]),
    }


def _summary(rows: list[dict]) -> dict:  # type: ignore[type-arg]
    recover = [r for row in rows for r in row["recover_s"]]
    return {
        "jobs": len(rows),
        "kills": sum(len(r["killed"]) for r in rows),
        "lost_jobs": sum(not r["finished"] for r in rows),
        "recover_ms_median": float(np.median(recover) * 1e3) if recover else None,
        "recover_ms_max": float(np.max(recover) * 1e3) if recover else None,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--elastic", action="store_true", required=True, help="elastic jobs (the only mode here)")
    p.add_argument("--topology", choices=["ps", "ring", "both"], default="ps")
    p.add_argument("--trials", type=int, default=10, help="jobs")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--kills", type=int, default=2, help="workers killed per job (fewer than --workers)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if not 0 < args.kills < args.workers:
        p.error("--kills must be at least 1 and fewer than --workers")
    if args.steps < 30 + args.kills:
        p.error("--steps must leave room for the kills (at least 30 + kills)")
    rng = random.Random(args.seed)
    script = str(Path(os.environ.get("TMPDIR", "/tmp")) / f"psring-chaos-elastic-{os.getpid()}.py")
    Path(script).write_text(WORKER)
    topologies = ["ps", "ring"] if args.topology == "both" else [args.topology]
    rows: dict[str, list[dict]] = {t: [] for t in topologies}  # type: ignore[type-arg]
    try:
        for i in range(args.trials):
            for topology in topologies:  # alternating: both see the machine as it is at that time
                row = trial(args.workers, args.kills, args.steps, rng, script, topology)
                rows[topology].append(row)
                if not args.json:
                    rec = ", ".join(f"{r * 1e3:.0f} ms" for r in row["recover_s"])
                    how = "finished" if row["finished"] else f"LOST (exit {row['code']})"
                    print(f"{topology} job {i + 1}: killed ranks {row['killed']}, next step after {rec}, {how}",
                          flush=True)  # fmt: skip
                    if not row["finished"]:
                        print(row["tail"], flush=True)
    finally:
        os.unlink(script)
    summaries = {t: _summary(r) for t, r in rows.items()}
    summary = summaries[topologies[0]] if len(topologies) == 1 else {
        "jobs": sum(s["jobs"] for s in summaries.values()),
        "kills": sum(s["kills"] for s in summaries.values()),
        "lost_jobs": sum(s["lost_jobs"] for s in summaries.values()),
    }
    if args.json:
        out = {"summary": summary, "jobs": [r for t in topologies for r in rows[t]]}
        if len(topologies) > 1:
            out["by_topology"] = summaries
        print(json.dumps(out))
    else:
        for topology, s in summaries.items():
            print(
                f"{topology}: {s['kills']} kills in {s['jobs']} jobs, {s['lost_jobs']} lost; kill -> next completed "
                f"step: median {s['recover_ms_median']:.0f} ms, max {s['recover_ms_max']:.0f} ms"
            )
    return 0 if summary["lost_jobs"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
