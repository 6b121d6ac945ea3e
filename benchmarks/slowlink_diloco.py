"""Local SGD and streaming DiLoCo on the slow-link bed (#82): a 10.5 MB MLP, one rank a host.

Each run is named ``H[:codec][:Kk]``: ``1`` is synchronous SGD every step (AdamW), ``100:int8`` local SGD
with 100 inner AdamW steps and the int8 codec on the pseudo-gradients (outer Nesterov SGD, lr 0.7,
momentum 0.9), ``100:int8:K4`` the same streamed in 4 fragments. Every run takes the same steps (so the
same samples): the table has samples/s, compute use (the share of the loop's time not spent waiting on an
exchange), the bytes a rank sent, the held-out loss of the global parameters at the end, and each
run's ratios to the first run's. The ranks run ``benchmarks/diloco_rank.py`` (a blocking training loop:
the gradients in the main thread, a streaming exchange in the event loop's). Needs root.

    sudo python benchmarks/slowlink_diloco.py --rate 100mbit --rtt-ms 20 --steps 200 --runs 1,100:int8
    sudo python benchmarks/slowlink_diloco.py --rate 100mbit --rtt-ms 50 --steps 200 --runs 100:int8,100:int8:K4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from slowlink import SlowBed, add_bed_arguments, available, bed_from, exit_on_sigterm  # noqa: E402


def parse_run(text: str) -> dict[str, Any]:
    """``H[:codec][:Kk]`` as diloco_rank's spec fields (numpy, SyncSGD); ``torch:H[:codec][:Kk]`` the same
    through psring.torch.DistributedOptimizer on a torch model; ``torchft:H`` torchft's DiLoCo."""
    parts = text.split(":")
    if parts[0] == "torchft":
        return {"name": text, "local_steps": int(parts[1]), "peer": "torchft"}
    rank = "diloco_rank.py"
    if parts[0] == "torch":
        rank, parts = "diloco_torch_rank.py", parts[1:]
    out: dict[str, Any] = {"name": text, "local_steps": int(parts[0]), "compression": None, "fragments": 1,
                           "rank": rank}  # fmt: skip
    for p in parts[1:]:
        if p.startswith("K"):
            out["fragments"] = int(p[1:])
        else:
            out["compression"] = p
    return out


def run_one(bed: SlowBed, run: dict[str, Any], base: dict[str, Any], topology: str, timeout: float) -> dict[str, Any]:
    world = len(bed.names)
    with tempfile.TemporaryDirectory(prefix="psring-diloco-") as tmp:
        out = os.path.join(tmp, "result.json")
        spec = {**base, **{k: v for k, v in run.items() if k not in ("name", "rank")}, "out": out}
        port, job = 29000 + int(uuid.uuid4().int % 1000), f"diloco-{uuid.uuid4().hex[:6]}"
        before = bed.tx_bytes()
        procs = []
        if run.get("peer") == "torchft":
            return run_torchft(bed, run, {**spec, "timeout": timeout}, out, timeout)
        for r in range(world):
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
                   "RANK": str(r), "WORLD_SIZE": str(world), "MASTER_ADDR": bed.addresses[0],
                   "MASTER_PORT": str(port), "PSRING_TOPOLOGY": topology, "PSRING_PS_COLOCATE": "1",
                   "PSRING_JOB": job, "OMP_NUM_THREADS": "1",
                   "OPENBLAS_NUM_THREADS": "1", "PSRING_TIMEOUT": str(timeout),
                   **({"DILOCO_WATCH": "1"} if os.environ.get("DILOCO_WATCH") else {})}  # fmt: skip
            cmd = [sys.executable, str(ROOT / "benchmarks" / run["rank"]), json.dumps(spec)]
            procs.append(bed.run(r, cmd, env))
        bed.wait(procs, run["name"], timeout)
        after = bed.tx_bytes()
        with open(out) as fh:
            got: dict[str, Any] = json.load(fh)
    got["wire_bytes"] = max(a - b for a, b in zip(after, before, strict=True))  # the busiest link, the whole run
    got["name"] = run["name"]
    return got


def run_torchft(bed: SlowBed, run: dict[str, Any], spec: dict[str, Any], out: str, timeout: float) -> dict[str, Any]:
    """torchft 0.2.0's DiLoCo, one replica a host, its lighthouse on host 0, gloo on the links."""
    world = len(bed.names)
    lighthouse_port, store_port = 29510, 29600
    path = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    lighthouse = bed.run(0, ["torchft_lighthouse", "--min_replicas", str(world), "--bind", f"[::]:{lighthouse_port}",
                             "--join_timeout_ms", "10000"], path)  # fmt: skip
    before = bed.tx_bytes()
    procs = []
    for r in range(world):
        env = {**path, "REPLICA": str(r), "REPLICAS": str(world), "HOST_ADDR": bed.addresses[r],
               "STORE_PORT": str(store_port), "TORCHFT_LIGHTHOUSE": f"http://{bed.addresses[0]}:{lighthouse_port}",
               "GLOO_SOCKET_IFNAME": "tun0", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}  # fmt: skip
        cmd = [sys.executable, str(ROOT / "benchmarks" / "torchft_diloco_rank.py"), json.dumps(spec)]
        procs.append(bed.run(r, cmd, env))
    try:
        bed.wait(procs, run["name"], timeout)
    finally:
        lighthouse.kill()
        lighthouse.communicate(timeout=30)
        bed.procs = [p for p in bed.procs if p is not lighthouse]
    after = bed.tx_bytes()
    with open(out) as fh:
        got: dict[str, Any] = json.load(fh)
    got["wire_bytes"] = max(a - b for a, b in zip(after, before, strict=True))
    got["bytes_sent"] = [got["wire_bytes"]]  # (torchft does not count them: the busiest link's, by the kernel)
    got["name"] = run["name"]
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bed_arguments(ap)
    ap.add_argument("--topology", choices=("ring", "ps"), default="ring")
    ap.add_argument("--runs", default="1,100:int8", help="comma-separated [torch:]H[:codec][:Kk] or torchft:H")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--widths", default="256,1024,1024,1024,256")
    ap.add_argument("--timeout", type=float, default=1800.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    why = available()
    if why is not None:
        raise SystemExit(f"slowlink_diloco: {why}")
    runs = [parse_run(r) for r in args.runs.split(",") if r]
    base = {"steps": args.steps, "batch": args.batch, "widths": [int(w) for w in args.widths.split(",")]}
    exit_on_sigterm()
    bed = bed_from(args)
    results = []
    try:
        for run in runs:
            results.append(run_one(bed, run, base, args.topology, args.timeout))
            r = results[-1]
            print(f"# {r['name']}: {r['wall_s']:.1f} s, {r['samples_per_s']:.1f} samples/s", flush=True)
        dropped = bed.forwarder.dropped
    finally:
        bed.close()
    first = results[0]
    print(f"# {args.hosts} hosts, {args.rate} links, {args.rtt_ms:g} ms RTT, {args.topology}; {args.steps} steps "
          f"of {args.batch} a rank; model {first['model_bytes'] / 1e6:.1f} MB; forwarder dropped {dropped} packets")
    head = ("run", "samples/s", "x", "compute use", "MB sent/rank", "x fewer", "wire MB", "test loss", "x")
    print(" ".join(f"{h:>12}" for h in head))
    for r in results:
        sent = max(r["bytes_sent"])
        print(" ".join(f"{v:>12}" for v in (
            r["name"], f"{r['samples_per_s']:.1f}", f"{r['samples_per_s'] / first['samples_per_s']:.2f}",
            f"{100 * r['compute_use']:.1f}%", f"{sent / 1e6:.2f}", f"{max(first['bytes_sent']) / max(sent, 1):.1f}",
            f"{r['wire_bytes'] / 1e6:.2f}", f"{r['test_loss']:.4f}", f"{r['test_loss'] / first['test_loss']:.3f}",
        )))  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
