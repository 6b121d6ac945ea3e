"""Network faults between hosts (network namespaces): cut links, slow and lossy links.

    sudo python tests/support/harness/netfaults.py                        # the long form
    sudo python tests/support/harness/netfaults.py --cuts 1 --steps 12 --conditions "none;loss 1%" --json

Every rank (3 of them), the store and (for ps) the server run in namespaces of their own on
one bridge, as on separate hosts. Two experiments, over each topology:

- cut: while the ranks train (SyncSGD), one host's link goes down (`ip link set ... down`:
  packets vanish, no reset is ever sent, so only heartbeats can tell). Every rank, the cut-off
  one included, must raise a psring error; recorded is how long after the cut each did,
  against the heartbeat bound (PSRING_HEARTBEAT_TIMEOUT, 3 s here, plus one 1 s interval).
  For ps the victim is a worker, or the server (then the workers wait for it to come back
  until the group timeout, 8 s here, by design: a restarted server is resumed; a cut-off ps
  worker has lost every shard and waits the same, the others see it gone within the bound).
- degraded: the same training run (fixed seeds, STEPS steps) with every host's link made
  worse: "rate 100mbit" (tc tbf), "loss 1%" (iptables drops each packet a host receives with
  that chance), or any tc netem condition ("delay 5ms", "corrupt 0.1%") where the kernel has
  netem (tests/support/harness/netns.py). The final parameters must be bit-identical to the undisturbed
  run's, and to the other topology's; recorded is the median step time. A condition this
  machine cannot make is reported as unavailable, not passed.

Needs root and iproute2 (tc; iptables for loss); says so and exits 2 where namespaces cannot
be made.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import threading
import time
import uuid
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, ROOT)

from tests.support.harness.netns import NetnsCluster, Unavailable, netns_available  # noqa: E402

HEARTBEAT_TIMEOUT = 3.0
GROUP_TIMEOUT = 8.0
#: a degraded run's ranks all end (DONE or an error) within this plus 3 s a step, or the run is
#: reported with each rank's last lines (the suite's short form has 270 s for all of it)
DEGRADED_WAIT = 60.0
WORKER = """
import hashlib, os, sys, time, numpy as np, psring
g = psring.init(timeout=float(os.environ["NETFAULT_TIMEOUT"]))
opt = psring.SyncSGD(g, {"w": np.zeros(100_000, np.float32), "b": np.zeros(7, np.float64)},
                     psring.optim.SGD(lr=0.01, momentum=0.9))
opt.start()
rng = np.random.default_rng(g.rank)
try:
    for step in range(1, int(os.environ["NETFAULT_STEPS"]) + 1):
        grads = {"w": rng.standard_normal(100_000).astype(np.float32), "b": rng.standard_normal(7)}
        t0 = time.perf_counter()
        params = opt.step(grads)
        print("STEP", step, f"{(time.perf_counter() - t0) * 1e3:.2f}", flush=True)
    digest = hashlib.sha256(params["w"].tobytes() + params["b"].tobytes()).hexdigest()
    print("DONE", digest, flush=True)
    g.close()
except psring.PsringError as exc:
    print("PSRING-ERROR", type(exc).__name__, exc, flush=True)
    sys.exit(3)
"""


class Run:
    """One job across namespaces: store, (ps) server, 3 ranks; lines are timestamped as they come."""

    def __init__(self, topology: str, steps: int, tmp: str) -> None:
        self.topology = topology
        self.cluster = NetnsCluster(uuid.uuid4().hex[:5])
        self.lines: dict[str, list[tuple[float, str]]] = {}
        names = ["store"] + (["server"] if topology == "ps" else []) + [f"rank{r}" for r in range(3)]
        for name in names:
            self.cluster.host(name)
        self.script = os.path.join(tmp, "netfault_worker.py")
        with open(self.script, "w") as fh:
            fh.write(WORKER)
        self.steps = steps
        self.job = f"nf{uuid.uuid4().hex[:6]}"

    def start(self) -> None:
        c = self.cluster
        env = {
            "PYTHONPATH": ROOT,
            "PYTHONUNBUFFERED": "1",
            "PSRING_SECRET": "netfaults",
            "PSRING_HEARTBEAT_TIMEOUT": str(HEARTBEAT_TIMEOUT),
        }
        store_at = f"{c.addresses['store']}:29500"
        self.spawn("store", [sys.executable, "-m", "psring", "store", "--host", "0.0.0.0", "--port", "29500"], env)
        self.wait("store", "listening on", 30)
        if self.topology == "ps":
            self.spawn(
                "server",
                [
                    sys.executable,
                    "-m",
                    "psring",
                    "server",
                    "--store",
                    store_at,
                    "--shards",
                    "2",
                    "--host",
                    "0.0.0.0",
                    "--advertise",
                    c.addresses["server"],
                    "--job",
                    self.job,
                    "--timeout",
                    "30",
                ],
                env,
            )
            self.wait("server", "psring server", 30)
        for r in range(3):
            name = f"rank{r}"
            self.spawn(
                name,
                [sys.executable, self.script],
                {
                    **env,
                    "PSRING_STORE": store_at,
                    "PSRING_JOB": self.job,
                    "RANK": str(r),
                    "WORLD_SIZE": "3",
                    "PSRING_TOPOLOGY": self.topology,
                    "PSRING_ADVERTISE_HOST": c.addresses[name],
                    "NETFAULT_STEPS": str(self.steps),
                    "NETFAULT_TIMEOUT": str(GROUP_TIMEOUT),
                },
            )

    def spawn(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        proc = self.cluster.run(name, cmd, env)
        self.lines[name] = []

        def follow() -> None:
            for line in proc.stdout:  # type: ignore[union-attr]
                self.lines[name].append((time.monotonic(), line.rstrip("\n")))

        threading.Thread(target=follow, daemon=True).start()

    def wait(self, name: str, pattern: str, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for t, line in list(self.lines[name]):
                if re.search(pattern, line):
                    return t
            time.sleep(0.02)
        raise RuntimeError(f"{name}: {pattern!r} did not appear: {[text for _, text in self.lines[name]][-5:]}")

    def ended(self, name: str) -> tuple[float, str] | None:
        for t, line in self.lines[name]:
            if line.startswith(("DONE", "PSRING-ERROR")):
                return t, line
        return None

    def close(self) -> None:
        self.cluster.close()


def cut_trial(topology: str, victim: str, tmp: str) -> dict[str, Any]:
    run = Run(topology, 100_000, tmp)
    try:
        run.start()
        run.wait("rank0", r"^STEP 5 ", 60)
        t_cut = time.monotonic()
        run.cluster.cut(victim)
        deadline = t_cut + GROUP_TIMEOUT + HEARTBEAT_TIMEOUT + 20
        ranks = [f"rank{r}" for r in range(3)]
        while time.monotonic() < deadline and not all(run.ended(n) for n in ranks):
            time.sleep(0.05)
        out: dict[str, Any] = {"topology": topology, "cut": victim, "ranks": {}}
        for n in ranks:
            end = run.ended(n)
            out["ranks"][n] = (
                {"hung": True}
                if end is None
                else {
                    "raised": end[1].startswith("PSRING-ERROR"),
                    "after_s": round(end[0] - t_cut, 2),
                    "error": end[1][:300],
                }
            )
        rows = out["ranks"].values()
        out["hangs"] = sum(1 for r in rows if r.get("hung"))
        out["all_raised"] = all(r.get("raised") for r in rows)
        out["detect_max_s"] = max((r["after_s"] for r in rows if "after_s" in r), default=None)
        return out
    finally:
        run.close()


def degraded_trial(topology: str, condition: str, steps: int, tmp: str) -> dict[str, Any]:
    run = Run(topology, steps, tmp)
    try:
        if condition != "none":
            try:
                for name in run.cluster.hosts:
                    run.cluster.shape(name, condition)
            except Unavailable as exc:
                return {"topology": topology, "condition": condition, "unavailable": str(exc)}
        run.start()
        deadline = time.monotonic() + DEGRADED_WAIT + 3 * steps
        hung = []
        for r in range(3):
            try:
                run.wait(f"rank{r}", r"^(DONE|PSRING-ERROR)", max(deadline - time.monotonic(), 0.1))
            except RuntimeError as exc:  # a run that neither ends nor raises: say where each rank was
                hung.append(str(exc))
        ends = [run.ended(f"rank{r}") for r in range(3)]
        digests = {e[1].split()[1] for e in ends if e and e[1].startswith("DONE")}
        times = [float(line.split()[2]) for _, line in run.lines["rank0"] if line.startswith("STEP")]
        return {
            "topology": topology,
            "condition": condition,
            "finished": sum(1 for e in ends if e and e[1].startswith("DONE")),
            "digest": digests.pop() if len(digests) == 1 else None,
            "ranks_agree": len(digests) <= 1,
            "step_ms_median": round(statistics.median(times[1:] or times), 2) if times else None,
            "errors": [e[1][:300] for e in ends if e and not e[1].startswith("DONE")],
            "hung": hung,
        }
    finally:
        run.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--topologies", default="ring,ps")
    p.add_argument("--cuts", type=int, default=5, help="cut-link trials per topology and victim")
    p.add_argument("--steps", type=int, default=40, help="training steps in each degraded run")
    p.add_argument(
        "--conditions",
        default="none;rate 100mbit;loss 1%;rate 100mbit loss 1%;loss 3%;delay 5ms loss 1%;corrupt 0.1%",
        help="link conditions, ';'-separated ('none' is the reference; see netns.shape)",
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    why = netns_available()
    if why:
        print(f"netfaults: {why}", file=sys.stderr)
        return 2
    import tempfile

    cuts: list[dict[str, Any]] = []
    netems: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="psring-netfaults-") as tmp:
        for topology in args.topologies.split(","):
            victims = ["rank2"] + (["server"] if topology == "ps" else [])
            for victim in victims:
                for _ in range(args.cuts):
                    cuts.append(cut_trial(topology, victim, tmp))
                    if not args.json:
                        c = cuts[-1]
                        print(
                            f"  cut {topology} {victim}: hangs {c['hangs']} all raised {c['all_raised']} "
                            f"max {c['detect_max_s']}s",
                            flush=True,
                        )
            for condition in args.conditions.split(";"):
                netems.append(degraded_trial(topology, condition.strip(), args.steps, tmp))
                if not args.json:
                    print("  degraded", json.dumps(netems[-1]), flush=True)
    made = [n for n in netems if "unavailable" not in n]
    reference = {n["digest"] for n in made if n["condition"] == "none"}
    digests = {n["digest"] for n in made}
    summary = {
        "cut_trials": len(cuts),
        "hangs": sum(c["hangs"] for c in cuts),
        "all_raised": all(c["all_raised"] for c in cuts),
        "identical_when_degraded": len(digests) == 1 and None not in digests and all(n["ranks_agree"] for n in made),
        "degraded_runs": len(made),
        "unavailable": sorted({n["condition"] for n in netems if "unavailable" in n}),
    }
    if args.json:
        print(json.dumps({"cuts": cuts, "degraded": netems, "summary": summary}))
    else:
        print(f"\n{'topology':>8} {'cut':>7} {'trials':>6} {'hangs':>5} {'all raised':>10} {'median':>7} {'max':>6}")
        for topology in args.topologies.split(","):
            for victim in ("rank2", "server"):
                mine = [c for c in cuts if c["topology"] == topology and c["cut"] == victim]
                if not mine:
                    continue
                worst = [c["detect_max_s"] for c in mine if c["detect_max_s"] is not None]
                print(
                    f"{topology:>8} {victim:>7} {len(mine):>6} {sum(c['hangs'] for c in mine):>5} "
                    f"{sum(c['all_raised'] for c in mine):>6}/{len(mine):<3} "
                    f"{statistics.median(worst) if worst else '-':>6}s {max(worst) if worst else '-':>5}s"
                )
        print(f"\n{'topology':>8} {'link condition':>22} {'finished':>8} {'step ms':>8}  params")
        ref = next(iter(reference)) if len(reference) == 1 else None
        for n in netems:
            if "unavailable" in n:
                print(f"{n['topology']:>8} {n['condition']:>22}  unavailable here: {n['unavailable']}")
                continue
            same = "identical" if n["digest"] is not None and n["digest"] == ref else f"DIFFERENT {n['errors']}"
            print(f"{n['topology']:>8} {n['condition']:>22} {n['finished']:>6}/3 {n['step_ms_median']:>8}  {same}")
        print(json.dumps(summary))
    ok = summary["hangs"] == 0 and summary["all_raised"] and summary["identical_when_degraded"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
