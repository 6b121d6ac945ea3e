"""One DDP training step, three backends: gloo, psring over the ring, psring over the parameter server.

    python benchmarks/torch_backend.py [--workers 2,4] [--params 12.6M] [--steps 10] [--rounds 3]
                                       [--device cuda --variants gloo,ring,ps,nccl]

The script each rank runs is the same for every variant, an unmodified DDP loop
(``dist.init_process_group(BACKEND)``, ``DistributedDataParallel(model)``, SGD with momentum), but
for the backend name; psring's topology comes from PSRING_TOPOLOGY. One process per rank on this
machine, started like torch's env:// (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), one torch thread
each. Rounds alternate the variants so that they share the machine's conditions. Reported: the
median step time (forward + backward with DDP's bucketed all-reduce + optimizer step; the slowest
rank's time of each step) and its ratio to gloo's, and how far each variant's parameters after the
last step are from gloo's (the same data and seeds: only the reductions' order differs).

With ``--device cuda`` every rank's model and batches live on the one GPU (ranks share it); gloo
then reduces CUDA tensors through host copies of its own, psring through cupy, and ``nccl`` is the
anchor where NCCL accepts several ranks on one device (a variant that fails is reported, not fatal).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
from torch_ddp import build, free_port, parse_count  # the same model and helpers as the optimizer benchmark

VARIANTS = {"gloo": ("gloo", None), "ring": ("psring", "ring"), "ps": ("psring", "ps"), "nccl": ("nccl", None)}


def rank_main(spec: dict) -> None:  # type: ignore[type-arg]
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import psring.torch  # noqa: F401 - registers "psring"

    if spec.get("threads", 1) > 0:  # 0: torch's own default, a thread per core in every rank
        torch.set_num_threads(spec.get("threads", 1))
    dist.init_process_group(spec["backend"])
    rank = dist.get_rank()
    dev = torch.device(spec["device"])
    cuda = dev.type == "cuda"
    model = build(spec["params"]).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    ddp = DDP(model, device_ids=[dev.index or 0] if cuda else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    torch.manual_seed(rank)
    x, y = torch.randn(spec["batch"], 256).to(dev), torch.randn(spec["batch"], 256).to(dev)
    times = []
    for i in range(spec["warmup"] + spec["steps"]):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        if i >= spec["warmup"]:
            times.append(time.perf_counter() - t0)
    worst = torch.tensor(times, dtype=torch.float64, device=dev)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if rank == 0:
        flat = torch.cat([p.detach().double().flatten() for p in model.parameters()]).cpu()
        with open(spec["out"], "w") as fh:
            json.dump(
                {
                    "step_s": worst.tolist(),
                    "params": n_params,
                    "head": flat[:4096].tolist(),
                    "sum": float(flat.sum()),
                    "abs_sum": float(flat.abs().sum()),
                },
                fh,
            )
    dist.destroy_process_group()
    # gloo's worker threads can still hold work at interpreter exit and abort the process
    # ("terminate called without an active exception", pytorch/pytorch#179291): all is done, leave now
    sys.stdout.flush()
    os._exit(0)


def run_variant(variant: str, workers: int, spec: dict) -> dict:  # type: ignore[type-arg]
    backend, topology = VARIANTS[variant]
    with tempfile.TemporaryDirectory(prefix="psring-torch-backend-") as tmp:
        out = os.path.join(tmp, "out.json")
        payload = json.dumps({**spec, "backend": backend, "out": out})
        me = [sys.executable, os.path.abspath(__file__), "--rank-main", payload]
        port = free_port()
        procs = []
        for r in range(workers):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(workers), LOCAL_RANK=str(r))
            if spec.get("threads", 1) > 0:
                env["OMP_NUM_THREADS"] = str(spec.get("threads", 1))
            else:
                env.pop("OMP_NUM_THREADS", None)
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            if topology:
                env["PSRING_TOPOLOGY"] = topology
            procs.append(subprocess.Popen(me, env=env))
        try:
            codes = [p.wait(timeout=600) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        if any(codes):
            raise SystemExit(f"{variant}: ranks failed with exit codes {codes}")
        with open(out) as fh:
            return json.load(fh)  # type: ignore[no-any-return]


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--rank-main":
        rank_main(json.loads(sys.argv[2]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", default="2,4", help="comma-separated world sizes")
    p.add_argument("--params", default="12.6M", help="about this many parameters (K, M suffixes)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", default="gloo,ring,ps")
    p.add_argument("--device", default="cpu", help="cpu, or cuda (every rank on the one GPU)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (0: torch's default, every core)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    spec = {
        "params": parse_count(args.params),
        "batch": args.batch,
        "steps": args.steps,
        "warmup": args.warmup,
        "device": args.device,
        "threads": args.threads,
    }
    variants = args.variants.split(",")
    for v in variants:
        if v not in VARIANTS:
            p.error(f"--variants: {v!r} is not one of {', '.join(VARIANTS)}")
    rows = []
    for workers in [int(w) for w in args.workers.split(",")]:
        samples: dict[str, list[float]] = {v: [] for v in variants}
        failed: dict[str, str] = {}
        last: dict[str, dict] = {}  # type: ignore[type-arg]
        n_params = 0
        for _ in range(args.rounds):
            for v in variants:
                if v in failed:
                    continue
                try:
                    r = run_variant(v, workers, spec)
                except SystemExit as e:  # reported in the table: NCCL refuses two ranks on one GPU, say
                    failed[v] = str(e)
                    continue
                samples[v] += r["step_s"]
                n_params = r["params"]
                last[v] = r
        med = {v: float(np.median(s)) * 1e3 for v, s in samples.items() if s}
        vs_gloo = {}  # the largest difference of the first 4096 parameters, and of their sum, from gloo's
        if "gloo" in last:
            g = np.array(last["gloo"]["head"])
            for v, r in last.items():
                vs_gloo[v] = {
                    "max_abs_diff": float(np.abs(np.array(r["head"]) - g).max()),
                    "sum_rel_diff": abs(r["sum"] - last["gloo"]["sum"]) / max(last["gloo"]["abs_sum"], 1e-30),
                }
        rows.append(
            {
                "workers": workers,
                "params": n_params,
                "device": args.device,
                "median_step_ms": med,
                "vs_gloo": vs_gloo,
                "failed": failed,
            }
        )
    if args.json:
        print(json.dumps(rows))
        return 0
    for row in rows:
        med = row["median_step_ms"]
        print(
            f"# DDP, {row['params'] / 1e6:.1f}M-parameter MLP, batch {args.batch}/rank, {row['workers']} ranks,"
            f" {row['device']}"
        )
        print(f"{'backend':>12} {'ms/step':>9} {'vs gloo':>8} {'params vs gloo (max abs)':>25}")
        for v in variants:
            name = v if v in ("gloo", "nccl") else f"psring {v}"
            if v in row["failed"]:
                print(f"{name:>12}   failed: {row['failed'][v]}")
                continue
            ratio = f"{med[v] / med['gloo']:.2f}x" if "gloo" in med else "-"
            diff = f"{row['vs_gloo'][v]['max_abs_diff']:.2e}" if v in row["vs_gloo"] else "-"
            print(f"{name:>12} {med[v]:>9.1f} {ratio:>8} {diff:>25}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
