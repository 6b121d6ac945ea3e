"""Chaos for elastic training: SIGKILL workers of running elastic jobs; the job must go on.

    python benchmarks/chaos.py --elastic [--topology ps|ring|both] [--trials 10] [--workers 4] [--kills 2]
                               [--steps 300] [--local-steps H [--replace]] [--json]

Each trial launches an elastic job (``psring launch``'s machinery with elastic=True; over ps server
processes hold the model, over the ring every worker does and the survivors re-form) where WORKERS
workers run STEPS steps of SyncSGD(elastic=True) on a small model. ``both``: the two topologies'
trials alternate in one run, and each gets its own summary. At KILLS random steps the driver
SIGKILLs a random live worker (rank 0 included), found by its RANK among the launcher's children.
Recorded per kill: the time from the kill to the first step a survivor completes without the killed
worker (averaged over one worker fewer). Per job: whether it finished (every survivor ran every
step, the survivors' parameters agree) or was lost. The long chaos form of the elastic tests
(tests/topology/test_elastic.py and test_elastic_ring.py have the short ones).

``--local-steps H`` (DiLoCo's churn, #82): the workers run local SGD (AdamW inner, Nesterov outer at lr
0.7, momentum 0.9) on a small teacher-student MLP (benchmarks/diloco_rank.py's task), every rank on its
own data; each kill lands inside an outer step (the driver waits a random 0-5 ms after a rank says it
enters one). Recorded besides: the time from the kill to the survivors' next outer step, the ranks
repaired after a digest comparison (0 expected: the survivors never fork), and the final held-out loss
of the global parameters beside a job of the same seed without kills, run first on each topology.
``--replace``: after each kill a new worker is started (as a restart policy would), which joins at the
end of an outer step (``SyncSGD.admit_waiting``) with the global parameters and outer state, and
trains on data of its own; the workers admit at every outer step's end.
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
import threading
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

WORKER_LOCAL = """
import asyncio, hashlib, json, os, sys, time, numpy as np, psring
sys.path.insert(0, os.environ["BENCH_DIR"])
from diloco_rank import Task, init_params, loss_and_grads
from psring.core.optim import SGD, AdamW
from psring.training.sgd import SyncSGD

async def main():
    join, replace = os.environ.get("JOIN") == "1", os.environ.get("REPLACE") == "1"
    g = await psring.init_group(timeout=60, join=join)
    h, widths, steps = int(os.environ["LOCAL_STEPS"]), [32, 256, 256, 16], int(os.environ["STEPS"])
    task = Task(widths, 0)
    opt = SyncSGD(g, init_params(widths, 0), AdamW(lr=1e-3), elastic=True, local_steps=h,
                  outer=SGD(lr=0.7, momentum=0.9, nesterov=True))
    params = await opt.start()
    me = opt.members[opt.live_group().rank]  # this worker's id (a replacement's: a new one, its own data)
    t = begun = opt.step_count * h
    while t < steps:
        if replace and t % h == 0 and t and not (join and t == begun):  # the end of an outer step
            if t + h >= steps:
                await opt.close_joins()  # a replacement asking now would wait for nothing: it is told
            else:
                await opt.admit_waiting()
        _loss, grads = loss_and_grads(params, *task.batch(me, t, 32), task.layers)
        if (t + 1) % h == 0:
            print(f"OUTER {t} {time.time():.6f}", flush=True)
        params = await opt.step(grads)
        print(f"STEP {t} {time.time():.6f} {len(opt.members)}", flush=True)
        t += 1
    final = await opt.global_params()
    digest = hashlib.sha256(b"".join(final[k].tobytes() for k in sorted(final))).hexdigest()[:16]
    print("DONE " + json.dumps({"rank": me, "digest": digest, "members": opt.members, "repaired": opt.repaired,
                                "loss": task.test_loss(final)}), flush=True)
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


def trial(workers: int, kills: int, steps: int, rng: random.Random, script: str, topology: str,
          local_steps: int = 1, replace: bool = False) -> dict:  # type: ignore[type-arg]
    """One job; with local steps each kill is due at a random outer step and lands inside it, and with
    ``replace`` a new worker is started after each kill (a restart policy's), which joins the job at the
    end of an outer step."""
    h = local_steps
    at = sorted(rng.sample(range(5, steps - 20), kills)) if h == 1 else \
        [(k + 1) * h - 1 for k in sorted(rng.sample(range(2, steps // h - 6), kills))]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PSRING_")}
    env.update(PYTHONPATH=str(ROOT), STEPS=str(steps), PYTHONUNBUFFERED="1", LOCAL_STEPS=str(h),
               BENCH_DIR=str(ROOT / "benchmarks"), REPLACE="1" if replace else "0")  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCH, str(workers), script, topology],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    kill_times: list[tuple[int, float, int]] = []  # (rank, time, workers before it)
    step_times: list[tuple[float, int]] = []  # (time, workers the step averaged over)
    live = set(range(workers))
    done: list[dict] = []  # type: ignore[type-arg]
    lines: list[str] = []
    joiners: list[subprocess.Popen[str]] = []
    readers: list[threading.Thread] = []
    seen = [workers]  # the workers the last step averaged over

    def kill_one() -> None:
        victim = rng.choice(sorted(live))
        pids = _rank_pids(proc.pid)
        pid = pids.get(victim)
        if pid is None:
            return
        if replace:  # its replacement: a new worker of the job, in the job's environment
            environ = dict(x.split("=", 1) for x in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in x)
            for key in ("RANK", "LOCAL_RANK", "GROUP_RANK"):
                environ.pop(key, None)
        os.kill(pid, signal.SIGKILL)
        kill_times.append((victim, time.time(), seen[0]))
        live.discard(victim)
        if replace:
            joiner = subprocess.Popen([sys.executable, script], env={**environ, "JOIN": "1"}, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
            joiners.append(joiner)
            reader = threading.Thread(target=_read_joiner, args=(joiner, len(joiners), lines, done), daemon=True)
            reader.start()
            readers.append(reader)

    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            m = re.match(r"\[rank (\d+)\] OUTER (\d+) ", line)
            if m and at and int(m.group(2)) >= at[0]:  # a rank enters the outer step a kill is due in
                at.pop(0)
                time.sleep(rng.uniform(0.0, 0.005))
                kill_one()
            m = re.match(r"\[rank (\d+)\] STEP (\d+) ([\d.]+) (\d+)", line)
            if m:
                if (int(m.group(2)) + 1) % h == 0:  # (every step is an outer one without local steps)
                    step_times.append((float(m.group(3)), int(m.group(4))))
                    seen[0] = int(m.group(4))
                if h == 1 and at and int(m.group(2)) >= at[0]:
                    at.pop(0)
                    kill_one()
            m = re.match(r"\[rank \d+\] DONE (\{.*\})", line)
            if m:
                done.append(json.loads(m.group(1)))
        proc.wait(timeout=120)
        for joiner in joiners:
            joiner.wait(timeout=60)
        for reader in readers:
            reader.join(timeout=30)
    finally:
        for p in [proc, *joiners]:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate(timeout=30)
    # the first step completed without the killed worker: one averaged over fewer workers than were
    # there before the kill (steps completed right after the kill may have had its gradients already).
    # Local steps: the survivors' next outer step (one a replacement joined may have as many workers)
    recover = [
        min((s for s, n in step_times if s > t and (h > 1 or n <= before - 1)), default=float("nan")) - t
        for _v, t, before in kill_times
    ]
    finished = (
        proc.returncode == 0
        and all(j.returncode == 0 for j in joiners)
        and len(done) == len(live) + len(joiners)
        and sorted(d["rank"] for d in done)[: len(live)] == sorted(live)
        and len({d["digest"] for d in done}) == 1
        and all(d["members"] == sorted(d["rank"] for d in done) for d in done)
    )
    return {
        "killed": [v for v, _t, _n in kill_times],
        "recover_s": recover,
        "finished": finished,
        "joined": len(joiners),
        "repaired": sum(int(d.get("repaired", 0)) for d in done),
        "loss": done[0].get("loss") if done else None,
        "code": proc.returncode,
        "tail": "" if finished else "".join(lines[-15:]),
    }


def _read_joiner(joiner: subprocess.Popen[str], k: int, lines: list[str], done: list[dict]) -> None:  # type: ignore[type-arg]
    """A replacement's output: its lines (as the job's, marked) and its DONE."""
    assert joiner.stdout is not None
    for line in joiner.stdout:
        lines.append(f"[joiner {k}] {line}")
        if line.startswith("DONE "):
            done.append(json.loads(line[5:]))


def _summary(rows: list[dict], baseline: dict | None = None) -> dict:  # type: ignore[type-arg]
    recover = [r for row in rows for r in row["recover_s"]]
    out = {
        "jobs": len(rows),
        "kills": sum(len(r["killed"]) for r in rows),
        "lost_jobs": sum(not r["finished"] for r in rows),
        "recover_ms_median": float(np.median(recover) * 1e3) if recover else None,
        "recover_ms_max": float(np.max(recover) * 1e3) if recover else None,
        "repaired": sum(r["repaired"] for r in rows),
    }
    if baseline is not None:  # local steps: the final loss beside the job without kills
        out["loss_without_kills"] = baseline["loss"]
        ratios = [r["loss"] / baseline["loss"] for r in rows if r["loss"] is not None and baseline["loss"]]
        out["loss_ratio_min"] = min(ratios, default=None)
        out["loss_ratio_max"] = max(ratios, default=None)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--elastic", action="store_true", required=True, help="elastic jobs (the only mode here)")
    p.add_argument("--topology", choices=["ps", "ring", "both"], default="ps")
    p.add_argument("--trials", type=int, default=10, help="jobs")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--kills", type=int, default=2, help="workers killed per job (fewer than --workers)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--local-steps", type=int, default=1, metavar="H",
                   help="local SGD with H inner steps an outer step; kills land inside outer steps (default 1: off)")
    p.add_argument("--replace", action="store_true",
                   help="with --local-steps: start a new worker after each kill, which joins at an outer step's end")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.replace and args.local_steps == 1:
        p.error("--replace needs --local-steps (a replacement joins at the end of an outer step)")
    if args.local_steps < 1:
        p.error("--local-steps must be at least 1")
    if args.local_steps > 1 and args.steps // args.local_steps < 9 + args.kills:
        p.error("--steps must leave room for the kills: at least (9 + kills) outer steps of --local-steps")
    if not 0 < args.kills < args.workers:
        p.error("--kills must be at least 1 and fewer than --workers")
    if args.steps < 30 + args.kills:
        p.error("--steps must leave room for the kills (at least 30 + kills)")
    rng = random.Random(args.seed)
    script = str(Path(os.environ.get("TMPDIR", "/tmp")) / f"psring-chaos-elastic-{os.getpid()}.py")
    Path(script).write_text(WORKER if args.local_steps == 1 else WORKER_LOCAL)
    topologies = ["ps", "ring"] if args.topology == "both" else [args.topology]
    rows: dict[str, list[dict]] = {t: [] for t in topologies}  # type: ignore[type-arg]
    baselines: dict[str, dict | None] = {t: None for t in topologies}  # type: ignore[type-arg]
    try:
        if args.local_steps > 1:  # the same job without kills, for its final loss
            for topology in topologies:
                base = trial(args.workers, 0, args.steps, rng, script, topology, args.local_steps)
                if not base["finished"]:
                    print(f"{topology}: the job without kills did not finish\n{base['tail']}", file=sys.stderr)
                    return 1
                baselines[topology] = base
                if not args.json:
                    print(f"{topology} without kills: loss {base['loss']:.6g}", flush=True)
        for i in range(args.trials):
            for topology in topologies:  # alternating: both see the machine as it is at that time
                row = trial(args.workers, args.kills, args.steps, rng, script, topology, args.local_steps,
                            args.replace)
                rows[topology].append(row)
                if not args.json:
                    rec = ", ".join(f"{r * 1e3:.0f} ms" for r in row["recover_s"])
                    how = "finished" if row["finished"] else f"LOST (exit {row['code']})"
                    if row["loss"] is not None:
                        how += f", loss {row['loss']:.6g}, repaired {row['repaired']}"
                    print(f"{topology} job {i + 1}: killed ranks {row['killed']}, next step after {rec}, {how}",
                          flush=True)  # fmt: skip
                    if not row["finished"]:
                        print(row["tail"], flush=True)
    finally:
        os.unlink(script)
    summaries = {t: _summary(r, baselines[t]) for t, r in rows.items()}
    summary = summaries[topologies[0]] if len(topologies) == 1 else {
        "jobs": sum(s["jobs"] for s in summaries.values()),
        "kills": sum(s["kills"] for s in summaries.values()),
        "lost_jobs": sum(s["lost_jobs"] for s in summaries.values()),
        "repaired": sum(s["repaired"] for s in summaries.values()),
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
                f"step: median {s['recover_ms_median']:.0f} ms, max {s['recover_ms_max']:.0f} ms; "
                f"{s['repaired']} rank(s) repaired"
                + (f"; final loss {s['loss_ratio_min']:.4f}x-{s['loss_ratio_max']:.4f}x the job without kills"
                   if s.get("loss_ratio_min") is not None else "")
            )
    return 0 if summary["lost_jobs"] == 0 and summary["repaired"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
