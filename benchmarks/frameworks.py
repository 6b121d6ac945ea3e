"""Each framework's training run over psring against the same run over gloo (#39): Lightning (its
ddp launcher), Accelerate (torchrun) and Ray Train, 2 processes on this host, alternating psring and
gloo in one run; ms per training step from rank 0's own clock around the training loop (process
start-up and the framework's set-up are not counted), the median of the rounds.

    python benchmarks/frameworks.py [--rounds 3] [--epochs 5] [--frameworks lightning,accelerate,ray] [--json]

Needs the frameworks extra (pip install -e ".[frameworks]"); a framework that is not installed is
reported as such.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
MODULES = {"lightning": "lightning", "accelerate": "accelerate", "ray": "ray.train"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_once(framework: str, backend: str, epochs: int, topology: str) -> float:
    """ms per step of one run (rank 0's record)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rec")
        port = str(free_port())
        if framework == "lightning":
            cmd = [sys.executable, str(EXAMPLES / "lightning_ddp.py"), "--devices", "2"]
        elif framework == "accelerate":
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                   "127.0.0.1", "--master-port", port, str(EXAMPLES / "accelerate_ddp.py")]  # fmt: skip
        else:
            cmd = [sys.executable, str(EXAMPLES / "ray_train.py"), "--workers", "2"]
        cmd += ["--backend", backend, "--epochs", str(epochs), "--out", out]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PSRING_")}
        env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, RAY_NODE_IP="127.0.0.1", PSRING_TOPOLOGY=topology)  # fmt: skip
        res = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            raise RuntimeError(f"{framework} over {backend} failed:\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
        with open(f"{out}.0.json") as fh:
            record = json.load(fh)
    return 1000.0 * record["seconds"] / max(record["steps"], 1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--topology", choices=("ring", "ps"), default="ring", help="psring's")
    p.add_argument("--frameworks", default="lightning,accelerate,ray")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    rows: list[dict[str, Any]] = []
    for framework in args.frameworks.split(","):
        if framework not in MODULES:
            p.error(f"--frameworks: {framework!r} is not one of {sorted(MODULES)}")
        if importlib.util.find_spec(MODULES[framework].split(".")[0]) is None:
            rows.append({"framework": framework, "unavailable": f"{MODULES[framework]} is not installed"})
            continue
        times: dict[str, list[float]] = {"psring": [], "gloo": []}
        for _ in range(args.rounds):
            for backend in ("psring", "gloo"):  # alternating: drift in the machine hits both alike
                times[backend].append(run_once(framework, backend, args.epochs, args.topology))
        psring_ms, gloo_ms = statistics.median(times["psring"]), statistics.median(times["gloo"])
        rows.append({"framework": framework, "topology": args.topology, "psring_ms_per_step": round(psring_ms, 3),
                     "gloo_ms_per_step": round(gloo_ms, 3), "speedup_vs_gloo": round(gloo_ms / psring_ms, 2),
                     "rounds": args.rounds})  # fmt: skip
    if args.json:
        print(json.dumps(rows))
    else:
        for r in rows:
            if "unavailable" in r:
                print(f"{r['framework']:11} unavailable: {r['unavailable']}")
            else:
                print(f"{r['framework']:11} psring {r['psring_ms_per_step']:8.3f} ms/step   gloo "
                      f"{r['gloo_ms_per_step']:8.3f} ms/step   {r['speedup_vs_gloo']:.2f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
