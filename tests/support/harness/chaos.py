"""Chaos: SIGKILL a random worker or server shard mid-training, again and again; nothing may hang.

    python tests/support/harness/chaos.py --trials 20                # the long form, per topology
    python tests/support/harness/chaos.py --trials 2 --json          # the short form the test suite runs

Each trial starts a store, (for ps) a `psring server` process with 2 shards writing
checkpoints, and 3 worker processes running STEPS SyncSGD steps; after a random number of
steps it SIGKILLs a random worker (or, for ps, sometimes the server) at whatever moment that is.
Topology "ps-colo" is ps with the shards colocated in the workers (PSRING_PS_COLOCATE=1, one
shard each, no server process): a killed worker takes its shard with it.

- A killed worker: every survivor must exit with a psring error naming the loss. (Where every
  survivor finished instead, the victim had already sent its last step: the kill came too late on a
  loaded machine, and the trial is drawn again, up to REDRAWS times.)
- A killed server: it is restarted at once with --restore (unless --no-restart); the workers
  must reconnect, re-send the step in flight and finish, with final parameters bit-identical
  to an uninterrupted run's (one is made per invocation). With --no-restart the workers must
  raise once the group timeout (15 s) runs out.

Recorded per trial: what was killed, whether every survivor raised or recovered (never hung),
how long detection took (kill -> last survivor exited), and for restarts whether the
parameters match.
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
n = int(os.environ.get("CHAOS_ELEMENTS", "200000"))
opt = psring.SyncSGD(g, {"w": np.zeros(n, np.float32)}, psring.optim.SGD(lr=0.01, momentum=0.9))
opt.start()
try:
    for step in range(1, int(os.environ["CHAOS_STEPS"]) + 1):
        # gradients that change every step and differ per rank, so a step lost or applied
        # twice shows in the final parameters
        params = opt.step({"w": np.full(n, (g.rank + 1.0) * (1 + step % 7), np.float32)})
        print("STEP", step, flush=True)
    import hashlib
    print("DONE", hashlib.sha256(params["w"].tobytes()).hexdigest(), flush=True)
    g.close()
except psring.PsringError as exc:
    print("PSRING-ERROR", type(exc).__name__, exc, flush=True)
    sys.exit(3)
"""
STEPS = 48  # the kill comes after step 2..15: a loaded machine's lag still leaves steps to kill in
REDRAWS = 5  # a worker killed after its last step is no test of anything: the trial is drawn again


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


def start_cluster(topology: str, tmp: str, job: str, ckpt: str | None) -> tuple[list[subprocess.Popen[str]], dict]:
    """A store, (ps) a 2-shard server, 3 workers; returns (procs: store, server?, workers...), info."""
    procs: list[subprocess.Popen[str]] = []
    store = spawn(["-m", "psring", "store", "--host", "127.0.0.1", "--port", "0"], {})
    procs.append(store)
    port = re.search(r":(\d+)", read_until(store, "listening on", 30)).group(1)  # type: ignore[union-attr]
    env = {"PSRING_STORE": f"127.0.0.1:{port}", "PSRING_JOB": job, "WORLD_SIZE": "3",
           "PSRING_TOPOLOGY": topology, "CHAOS_STEPS": str(STEPS)}  # fmt: skip
    if topology == "ps-colo":
        env.update(PSRING_TOPOLOGY="ps", PSRING_PS_COLOCATE="1")
    server_args: list[str] = []
    server = None
    if topology == "ps":
        server_args = ["-m", "psring", "server", "--store", f"127.0.0.1:{port}", "--shards", "2",
                       "--host", "127.0.0.1", "--job", job]  # fmt: skip
        if ckpt is not None:
            server_args += ["--checkpoint-dir", ckpt]
        server = spawn(server_args, {})
        procs.append(server)
        read_until(server, "psring server: shard", 30)
    script = os.path.join(tmp, "worker.py")
    with open(script, "w") as fh:
        fh.write(WORKER)
    workers = [spawn([script], {**env, "RANK": str(r)}) for r in range(3)]
    procs += workers
    return procs, {"server": server, "server_args": server_args, "workers": workers}


def finish(procs: list[subprocess.Popen[str]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        try:
            p.communicate(timeout=10)
        except (subprocess.TimeoutExpired, ValueError):
            pass


def digest(out: str) -> str | None:
    m = re.search(r"^DONE (\w+)", out, re.M)
    return m.group(1) if m else None


def uninterrupted(topology: str, tmp: str) -> str:
    """The final parameters' digest of a run nothing disturbs (the reference for restarts)."""
    ckpt = tempfile.mkdtemp(dir=tmp)
    procs, info = start_cluster(topology, tmp, f"ref{os.getpid()}", ckpt)
    try:
        outs = [w.communicate(timeout=120)[0] for w in info["workers"]]
        digests = {digest(o) for o in outs}
        if len(digests) != 1 or None in digests:
            raise RuntimeError(f"the uninterrupted run did not agree: {outs}")
        return digests.pop()  # type: ignore[no-any-return]
    finally:
        finish(procs)


def trial(  # type: ignore[type-arg]
    topology: str,
    rng: random.Random,
    tmp: str,
    victim_kinds: tuple[str, ...] = ("worker", "server"),
    hang_after: float = 60.0,
    restart: bool = True,
    reference: str | None = None,
) -> dict:
    job = f"chaos{rng.randrange(1 << 30)}"
    ckpt = tempfile.mkdtemp(dir=tmp) if restart else None
    procs, info = start_cluster(topology, tmp, job, ckpt)
    try:
        workers, server = info["workers"], info["server"]
        steps = rng.randint(2, 15)
        read_until(workers[0], rf"^STEP {steps}\b", 60)
        victims = [("worker", r) for r in range(3)] + ([("server", 0)] if server is not None else [])
        victims = [v for v in victims if v[0] in victim_kinds] or victims
        kind, index = rng.choice(victims)
        victim = workers[index] if kind == "worker" else server
        assert victim is not None
        time.sleep(rng.uniform(0, 0.05))  # anywhere inside a step, not just after one
        t_kill = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL)
        restarted = kind == "server" and restart
        if restarted:
            victim.communicate(timeout=10)
            procs.append(spawn([*info["server_args"], "--restore"], {}))
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
        recovered = sum(code == 0 and digest(out) is not None for code, _, out in outcomes)
        identical = sum(reference is not None and digest(out) == reference for _, _, out in outcomes)
        times = [t for _, t, _ in outcomes if t is not None]
        row = {
            "topology": topology,
            "killed": f"{kind} {index}",
            "after_steps": steps,
            "survivors": len(survivors),
            "restarted": restarted,
            "raised": raised,
            "named_the_loss": named,
            "recovered": recovered,
            "identical": identical,
            "hung": hung,
            "detect_s": max(times) if times else None,
        }
        # every survivor finished: the victim had sent its last step's share before it died (no
        # collective completes without it), the kill came too late to test anything
        row["late"] = not restarted and kind == "worker" and recovered == len(survivors) and (
            len({digest(out) for _, _, out in outcomes}) == 1
        )
        row["ok"] = hung == 0 and (
            recovered == identical == len(survivors) if restarted else raised == named == len(survivors)
        )
        if not row["ok"]:
            row["outputs"] = [out[-2000:] for _, _, out in outcomes]
        return row
    finally:
        finish(procs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=20, help="trials per topology")
    p.add_argument("--topologies", default="ring,ps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--victims", default="worker,server", help="what may be killed")
    p.add_argument("--no-restart", action="store_true", help="a killed server stays dead")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--elements", type=int, default=200_000,
        help="float32 parameters (2000000 = 8 MB: the ring's threaded, shared-memory data plane)",
    )  # fmt: skip
    args = p.parse_args()
    os.environ["CHAOS_ELEMENTS"] = str(args.elements)  # the workers inherit it
    rng = random.Random(args.seed)
    kinds = tuple(args.victims.split(","))
    topologies = args.topologies.split(",")
    rows = []
    with tempfile.TemporaryDirectory(prefix="psring-chaos-") as tmp:
        restart = not args.no_restart
        ref = uninterrupted("ps", tmp) if "ps" in topologies and "server" in kinds and restart else None
        for topology in topologies:
            for _ in range(args.trials):
                for _ in range(REDRAWS):
                    row = trial(topology, rng, tmp, kinds, restart=restart, reference=ref)
                    if not row["late"]:
                        break
                rows.append(row)
                if not args.json:
                    r = rows[-1]
                    print(f"  {topology:>4} killed {r['killed']:<8} after step {r['after_steps']:>2}: "
                          f"{'ok' if r['ok'] else 'FAILED'} in {r['detect_s'] or 0:.2f}s", flush=True)  # fmt: skip
    if args.json:
        print(json.dumps(rows))
        return 0 if all(r["ok"] for r in rows) else 1
    head = ("topology", 8), ("killed", 7), ("trials", 6), ("hangs", 5), ("outcome", 30), ("kill->exit median", 17)
    print(" ".join(f"{h:>{w}}" for h, w in head), f"{'max':>7}")
    for topology in topologies:
        for kind in ("worker", "server"):
            mine = [r for r in rows if r["topology"] == topology and r["killed"].startswith(kind)]
            if not mine:
                continue
            times = [r["detect_s"] for r in mine if r["detect_s"] is not None]
            ok = sum(r["ok"] for r in mine)
            what = "all survivors raised" if not mine[0]["restarted"] else "recovered, params identical"
            med = f"{np.median(times):.2f}s" if times else "-"
            top = f"{max(times):.2f}s" if times else "-"
            print(f"{topology:>8} {kind:>7} {len(mine):>6} {sum(r['hung'] for r in mine):>5} "
                  f"{f'{ok}/{len(mine)} {what}':>30} {med:>17} {top:>7}")  # fmt: skip
    for r in rows:
        if not r["ok"]:
            print("FAILED:", json.dumps(r, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
