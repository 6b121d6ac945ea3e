"""torch on the slow-link bed (#81): psring's compressors and codecs against torch's own DDP hooks over gloo.

The hosts of ``benchmarks/slowlink.py`` (namespaces on delayed, rate-limited TUN links), one rank each,
the same MLP (``--width``: 2 hidden layers; 1280 gives 2.95M parameters, 11.8 MB), the same synthetic
batches, SGD with momentum. Variants, in alternating rounds:

  gloo-powersgd   DDP over gloo with torch's powerSGD_hook (matrix_approximation_rank=--rank, start_powerSGD_iter=2)
  gloo-fp16       DDP over gloo with torch's fp16_compress_hook
  psring-powersgd psring.torch.DistributedOptimizer(compression=psring.PowerSGD(--rank))
  psring-int8     psring.torch.DistributedOptimizer(compression="int8")
  gloo, psring    no compression

Prints steps/s (the slowest rank's, over the timed steps) and the final loss of each. Needs root and torch.

    sudo python benchmarks/slowlink_torch.py --hosts 4 --rate 100mbit --rtt-ms 20 --steps 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from slowlink import SlowBed, add_bed_arguments, available, bed_from, exit_on_sigterm  # noqa: E402

VARIANTS = ("gloo-powersgd", "gloo-fp16", "psring-powersgd", "psring-int8", "gloo", "psring")

RANK_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    import numpy as np, torch, torch.distributed as dist
    variant, width, steps, warmup, rank_k, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), \\
        int(sys.argv[5]), sys.argv[6]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                torch.nn.ReLU(), torch.nn.Linear(width, 10))
    rank = int(os.environ["RANK"])
    if variant.startswith("gloo"):
        dist.init_process_group("gloo")
        net = torch.nn.parallel.DistributedDataParallel(model)
        if variant == "gloo-powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ph
            net.register_comm_hook(ph.PowerSGDState(process_group=None, matrix_approximation_rank=rank_k,
                                                    start_powerSGD_iter=2), ph.powerSGD_hook)
        elif variant == "gloo-fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            net.register_comm_hook(None, default_hooks.fp16_compress_hook)
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        barrier = dist.barrier
    else:
        import psring, psring.torch as pt
        g = psring.init()
        pt.broadcast_parameters(model, g)
        kw = {"psring-powersgd": {"compression": psring.PowerSGD(rank_k)}, "psring-int8": {"compression": "int8"}}
        opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), g,
                                      **kw.get(variant, {}))
        net = model
        barrier = g.barrier
    times, loss = [], None
    for step in range(warmup + steps):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(32, 1024, generator=gen)
        y = torch.randint(0, 10, (32,), generator=gen)
        barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    with open(out, "w") as fh:
        json.dump({"rank": rank, "step_s": times, "loss": float(loss)}, fh)
    """
)


def run_variant(bed: SlowBed, variant: str, args: argparse.Namespace) -> dict[str, Any]:
    world = len(bed.names)
    with tempfile.TemporaryDirectory(prefix="psring-slowtorch-") as tmp:
        script = Path(tmp) / "rank.py"
        script.write_text(RANK_SCRIPT)
        port = 30000 + int(uuid.uuid4().int % 1000)
        procs = []
        for r in range(world):
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
                   "RANK": str(r), "WORLD_SIZE": str(world), "MASTER_ADDR": bed.addresses[0],
                   "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": "tun0", "OMP_NUM_THREADS": "1",
                   "PSRING_TIMEOUT": str(args.timeout)}  # fmt: skip
            cmd = [sys.executable, str(script), variant, str(args.width), str(args.steps), str(args.warmup),
                   str(args.rank), os.path.join(tmp, f"{r}.json")]  # fmt: skip
            procs.append(bed.run(r, cmd, env))
        bed.wait(procs, variant, args.timeout)
        ranks = [json.loads((Path(tmp) / f"{r}.json").read_text()) for r in range(world)]
    slowest = [max(per) for per in zip(*(r["step_s"] for r in ranks), strict=True)]
    return {"variant": variant, "steps_per_s": 1.0 / statistics.median(slowest), "loss": ranks[0]["loss"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bed_arguments(ap)
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--rank", type=int, default=4, help="PowerSGD's rank, torch's and psring's")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--variants", default=",".join(VARIANTS[:4]))
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    why = available()
    if why is not None:
        raise SystemExit(f"slowlink_torch: {why}")
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"slowlink_torch: unknown variants {unknown} (of {', '.join(VARIANTS)})")
    exit_on_sigterm()
    bed = bed_from(args)
    got: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    try:
        for _ in range(args.rounds):
            for v in variants:
                got[v].append(run_variant(bed, v, args))
    finally:
        bed.close()
    params = 1024 * args.width + args.width + args.width * args.width + args.width + args.width * 10 + 10
    print(f"# {args.hosts} hosts, {args.rate}, {args.rtt_ms:g} ms RTT; MLP of {params / 1e6:.2f}M parameters "
          f"({params * 4 / 1e6:.1f} MB); median over {args.rounds} round(s) of {args.steps} steps")  # fmt: skip
    rows = []
    for v in variants:
        rate = statistics.median(r["steps_per_s"] for r in got[v])
        loss = statistics.median(r["loss"] for r in got[v])
        rows.append({"variant": v, "steps_per_s": rate, "loss": loss})
        print(f"{v:>16} {rate:8.3f} steps/s   loss {loss:.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
