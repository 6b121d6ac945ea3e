"""Chaos: SIGKILL a random worker or server shard mid-training, again and again; nothing may hang.

    python benchmarks/chaos.py --trials 20                # the long form, per topology
    python benchmarks/chaos.py --trials 2 --json          # the short form the test suite runs

Each trial starts a store, (for ps) a `psring server` process with 2 shards, and 3 worker
processes running SyncSGD steps; after a random number of steps it SIGKILLs a random worker
(or, for ps, sometimes the server). Every survivor must exit with a psring error naming the
loss; recorded per trial: what was killed, whether every survivor raised (never hung), and
how long detection took (kill -> last survivor exited). Checkpoint/restore equality after a
server kill is covered by tests/test_sgd.py::test_server_sigkilled_and_restored_ends_with_uninterrupted_parameters.
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
import tempfile
import time

import numpy as np

WORKER = """
import os, sys, numpy as np, psring
g = psring.init(timeout=15)  # a killed ps server is waited for (to resume) this long
opt = psring.SyncSGD(g, {"w": np.zeros(200_000, np.float32)}, psring.optim.SGD(lr=0.01, momentum=0.9))
opt.start()
step = 0
try:
    while True:
        opt.step({"w": np.full(200_000, g.rank + 1.0, np.float32)})
        step += 1
        print("STEP", step, flush=True)
except psring.PsringError as exc:
    print("PSRING-ERROR", type(exc).__name__, exc, flush=True)
    sys.exit(3)
"""


def spawn(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, *args], env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def read_until(proc: subprocess.Popen[str], pattern: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        if re.search(pattern, line):
            return line
        if not line and proc.poll() is not None:
            break
    raise RuntimeError(f"{pattern!r} did not appear")


def trial(  # type: ignore[type-arg]
    topology: str,
    rng: random.Random,
    tmp: str,
    victim_kinds: tuple[str, ...] = ("worker", "server"),
    hang_after: float = 60.0,
) -> dict:
    procs: list[subprocess.Popen[str]] = []
    try:
        store = spawn(["-m", "psring", "store", "--host", "127.0.0.1", "--port", "0"], {})
        procs.append(store)
        port = re.search(r":(\d+)", read_until(store, "listening on", 30)).group(1)  # type: ignore[union-attr]
        job = f"chaos{rng.randrange(1 << 30)}"
        env = {"PSRING_STORE": f"127.0.0.1:{port}", "PSRING_JOB": job, "WORLD_SIZE": "3", "PSRING_TOPOLOGY": topology}
        server = None
        if topology == "ps":
            server = spawn(["-m", "psring", "server", "--store", f"127.0.0.1:{port}", "--shards", "2",
                            "--host", "127.0.0.1", "--job", job], {})  # fmt: skip
            procs.append(server)
            read_until(server, "psring server: shard", 30)
        script = os.path.join(tmp, "worker.py")
        with open(script, "w") as fh:
            fh.write(WORKER)
        workers = [spawn([script], {**env, "RANK": str(r)}) for r in range(3)]
        procs += workers
        steps = rng.randint(2, 15)
        read_until(workers[0], rf"^STEP {steps}\b", 60)
        victims = [("worker", r) for r in range(3)] + ([("server", 0)] if server is not None else [])
        victims = [v for v in victims if v[0] in victim_kinds] or victims
        kind, index = rng.choice(victims)
        victim = workers[index] if kind == "worker" else server
        assert victim is not None
        t_kill = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL)
        survivors = [w for w in workers if w is not victim]
        outcomes = []
        for w in survivors:
            remaining = max(hang_after - (time.monotonic() - t_kill), 0.1)
            try:
                out, _ = w.communicate(timeout=remaining)
                outcomes.append((w.returncode, time.monotonic() - t_kill, out))
            except subprocess.TimeoutExpired:
                outcomes.append((None, None, ""))
        hung = sum(code is None for code, _, _ in outcomes)
        raised = sum(code == 3 and "PSRING-ERROR" in out for code, _, out in outcomes)
        named = sum("PeerLostError" in out or "CollectiveTimeoutError" in out for _, _, out in outcomes)
        times = [t for _, t, _ in outcomes if t is not None]
        return {
            "topology": topology,
            "killed": f"{kind} {index}",
            "after_steps": steps,
            "survivors": len(survivors),
            "raised": raised,
            "named_the_loss": named,
            "hung": hung,
            "detect_s": max(times) if times else None,
        }
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            try:
                p.communicate(timeout=10)
            except (subprocess.TimeoutExpired, ValueError):
                pass


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=20, help="trials per topology")
    p.add_argument("--topologies", default="ring,ps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--victims", default="worker,server", help="what may be killed")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    rng = random.Random(args.seed)
    kinds = tuple(args.victims.split(","))
    rows = []
    with tempfile.TemporaryDirectory(prefix="psring-chaos-") as tmp:
        for topology in args.topologies.split(","):
            for _ in range(args.trials):
                rows.append(trial(topology, rng, tmp, kinds))
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{'topology':>8} {'trials':>6} {'hangs':>5} {'all raised':>10} {'detect median':>13} {'max':>6}")
    for topology in args.topologies.split(","):
        mine = [r for r in rows if r["topology"] == topology]
        times = [r["detect_s"] for r in mine if r["detect_s"] is not None]
        ok = sum(r["raised"] == r["survivors"] for r in mine)
        med = f"{np.median(times):.2f}s" if times else "-"
        top = f"{max(times):.2f}s" if times else "-"
        print(
            f"{topology:>8} {len(mine):>6} {sum(r['hung'] for r in mine):>5} {ok:>6}/{len(mine):<3} {med:>13} {top:>6}"
        )
    kills: dict[str, int] = {}
    for r in rows:
        kills[f"{r['topology']} {r['killed'].split()[0]}"] = (
            kills.get(f"{r['topology']} {r['killed'].split()[0]}", 0) + 1
        )
    print("kills:", ", ".join(f"{k} x{v}" for k, v in sorted(kills.items())))
    return 0 if all(r["hung"] == 0 and r["raised"] == r["survivors"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
