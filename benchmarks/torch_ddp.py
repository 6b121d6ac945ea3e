"""One torch model's training step: psring.torch.DistributedOptimizer (ring, ps) vs DistributedDataParallel (gloo).

    python benchmarks/torch_ddp.py [--workers 2] [--params 12.6M] [--steps 10] [--rounds 2]

Every variant runs the same model (an MLP of about --params parameters), the same batch and
SGD with momentum, one process per rank on this machine; rounds alternate the variants so
that they share the machine's conditions. Reported: the median step time over ranks' slowest
(forward + backward + gradient averaging + optimizer step), and its ratio to DDP's.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np


def build(params: int):  # type: ignore[no-untyped-def]
    import torch

    # width w: 4 square layers of w x w plus in/out layers of w x 256
    w = 256
    while 4 * w * w + 2 * 256 * w < params:
        w += 64
    torch.manual_seed(0)
    layers = [torch.nn.Linear(256, w), torch.nn.ReLU()]
    for _ in range(4):
        layers += [torch.nn.Linear(w, w), torch.nn.ReLU()]
    layers += [torch.nn.Linear(w, 256)]
    return torch.nn.Sequential(*layers)


def rank_main(spec: dict) -> None:  # type: ignore[type-arg]
    import torch

    torch.set_num_threads(1)
    variant = spec["variant"]
    model = build(spec["params"])
    n_params = sum(p.numel() for p in model.parameters())
    if variant == "ddp":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        net = ddp

        def sync() -> None:
            dist.barrier()

        def worst(x: list[float]) -> list[float]:
            t = torch.tensor(x)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return t.tolist()
    else:
        import psring
        import psring.torch as pt

        g = psring.init()
        rank, world = g.rank, g.world_size
        pt.broadcast_parameters(model, g)
        opt = pt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), g)
        net = model

        def sync() -> None:
            g.barrier()

        def worst(x: list[float]) -> list[float]:
            return g.all_reduce(np.array(x), op="max").tolist()  # type: ignore[no-any-return]

    torch.manual_seed(rank)
    x, y = torch.randn(spec["batch"], 256), torch.randn(spec["batch"], 256)
    times = []
    for i in range(spec["warmup"] + spec["steps"]):
        sync()
        t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        if i >= spec["warmup"]:
            times.append(time.perf_counter() - t0)
    times = worst(times)
    if rank == 0:
        with open(spec["out"], "w") as fh:
            json.dump({"step_s": times, "params": n_params, "world": world}, fh)
    if variant == "ddp":
        import torch.distributed as dist

        dist.destroy_process_group()
        # gloo's worker threads can still hold work at interpreter exit and abort the process
        # ("terminate called without an active exception", pytorch/pytorch#179291): all is done, leave now
        sys.stdout.flush()
        os._exit(0)
    else:
        g.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_variant(variant: str, workers: int, spec: dict) -> dict:  # type: ignore[type-arg]
    with tempfile.TemporaryDirectory(prefix="psring-torch-bench-") as tmp:
        out = os.path.join(tmp, "out.json")
        payload = json.dumps({**spec, "variant": variant, "out": out})
        me = [sys.executable, os.path.abspath(__file__), "--rank-main", payload]
        if variant == "ddp":
            port = free_port()
            procs = []
            for r in range(workers):
                env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(workers), LOCAL_RANK=str(r))
                env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
                procs.append(subprocess.Popen(me, env=env))
            codes = [p.wait(timeout=600) for p in procs]
        else:
            cmd = [sys.executable, "-m", "psring", "launch", "-n", str(workers), "--topology", variant, "--", *me]
            codes = [subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=600).returncode]
        if any(codes):
            raise SystemExit(f"{variant}: ranks failed with exit codes {codes}")
        with open(out) as fh:
            return json.load(fh)  # type: ignore[no-any-return]


def parse_count(text: str) -> int:
    t = text.upper()
    for suffix, mult in (("M", 10**6), ("K", 10**3)):
        if t.endswith(suffix):
            return int(float(t[:-1]) * mult)
    return int(t)


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--rank-main":
        rank_main(json.loads(sys.argv[2]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--params", default="12.6M", help="about this many parameters (K, M suffixes)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--variants", default="ddp,ring,ps")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    spec = {"params": parse_count(args.params), "batch": args.batch, "steps": args.steps, "warmup": args.warmup}
    variants = args.variants.split(",")
    samples: dict[str, list[float]] = {v: [] for v in variants}
    n_params = 0
    for _ in range(args.rounds):
        for v in variants:
            r = run_variant(v, args.workers, spec)
            samples[v] += r["step_s"]
            n_params = r["params"]
    med = {v: float(np.median(s)) * 1e3 for v, s in samples.items()}
    if args.json:
        print(json.dumps({"workers": args.workers, "params": n_params, "median_step_ms": med}))
        return 0
    print(f"# {n_params / 1e6:.1f}M-parameter MLP, batch {args.batch}/rank, {args.workers} ranks, SGD momentum")
    print(f"{'variant':>8} {'step (ms)':>10} {'vs ddp':>8}")
    for v in variants:
        ratio = f"{med[v] / med['ddp']:.2f}x" if "ddp" in med else "-"
        print(f"{v:>8} {med[v]:>10.1f} {ratio:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
