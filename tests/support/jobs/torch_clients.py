"""torch's current distributed clients as a user writes them, on one backend; one rank's results
into OUT/RANK.pt (a dict of name -> tensors, or ("error", type, message) where a client failed).

    python torch_clients.py BACKEND OUT [CLIENT ...]     # env:// from RANK, WORLD_SIZE, MASTER_*

The clients: torch's PowerSGD comm hook under DDP, FSDP2 (fully_shard) with full tensors and full
state dicts, DTensor redistributes, tensor parallel (parallelize_module), dcp.async_save, and FSDP2
loading a full state dict broadcast from rank 0. Each is what torch's docs show, unmodified.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

backend, out = sys.argv[1], Path(sys.argv[2])
wanted = sys.argv[3:]
if backend == "psring":
    import psring.torch  # noqa: F401  (registers the backend)

torch.manual_seed(0)
torch.set_num_threads(1)
dist.init_process_group(backend)
rank, world = dist.get_rank(), dist.get_world_size()
results: dict[str, Any] = {}
CLIENTS: dict[str, Callable[[], dict[str, Any]]] = {}


def client(fn: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    CLIENTS[fn.__name__] = fn
    return fn


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 32, generator=g), torch.randn(8, 4, generator=g)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


@client
def powersgd() -> dict[str, Any]:
    """DDP with torch's own PowerSGD hook: its callbacks issue all_reduces and wait on them."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd_hook

    model = nn.parallel.DistributedDataParallel(mlp())
    state = powersgd_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    model.register_comm_hook(state, powersgd_hook.powerSGD_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(int(os.environ.get("STEPS", "12"))):
        x, y = data(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@client
def fsdp2() -> dict[str, Any]:
    """fully_shard, train, then the full tensors and the full state dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    model = mlp()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(4):
        x, y = data(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    got = {f"full.{k}": v.full_tensor().clone() for k, v in model.state_dict().items()}
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    got.update({f"sd.{k}": v.clone() for k, v in sd.items()})
    return got


@client
def dtensor() -> dict[str, Any]:
    """DTensor: distribute, full_tensor, redistributes between placements, a matmul of shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(1)
    big = torch.randn(8, 12)
    other = torch.randn(12, 6)
    got: dict[str, Any] = {}
    d0 = distribute_tensor(big, mesh, [Shard(0)])
    got["shard0.local"] = d0.to_local().clone()
    got["shard0.full"] = d0.full_tensor()
    got["shard0->replicate"] = d0.redistribute(mesh, [Replicate()]).to_local().clone()
    got["shard0->shard1"] = d0.redistribute(mesh, [Shard(1)]).to_local().clone()
    d1 = distribute_tensor(big, mesh, [Shard(1)])
    got["shard1->shard0"] = d1.redistribute(mesh, [Shard(0)]).to_local().clone()
    got["shard1.full"] = d1.full_tensor()
    from torch.distributed.tensor import DTensor

    part = DTensor.from_local(big * (rank + 1), mesh, [Partial()])
    got["partial->replicate"] = part.redistribute(mesh, [Replicate()]).to_local().clone()
    part = DTensor.from_local(big * (rank + 1), mesh, [Partial()])
    got["partial->shard0"] = part.redistribute(mesh, [Shard(0)]).to_local().clone()
    part = DTensor.from_local(big * (rank + 1), mesh, [Partial("avg")])
    got["partial_avg->replicate"] = part.full_tensor()
    rep = distribute_tensor(other, mesh, [Replicate()])
    got["shard@replicate"] = (d0 @ rep).full_tensor()
    got["shard1@shard0"] = (d1 @ distribute_tensor(other, mesh, [Shard(0)])).full_tensor()
    got["sum"] = d0.sum().full_tensor()
    return got


@client
def tensor_parallel() -> dict[str, Any]:
    """parallelize_module with Colwise/Rowwise, a few steps, the weights read back whole."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    model = parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(7)  # tensor parallel: every rank sees the same batch
    got: dict[str, Any] = {}
    for step in range(4):
        x, y = torch.randn(8, 32, generator=g), torch.randn(8, 4, generator=g)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        got[f"loss{step}"] = loss.detach().clone()
    got.update({k: v.full_tensor().clone() for k, v in model.state_dict().items()})
    return got


@client
def async_save() -> dict[str, Any]:
    """dcp.async_save of a DDP model, then a load into a fresh model."""
    import torch.distributed.checkpoint as dcp

    model = nn.parallel.DistributedDataParallel(mlp())
    x, y = data(0)
    nn.functional.mse_loss(model(x), y).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    where = os.environ["CKPT_DIR"]
    future = dcp.async_save({"model": model.state_dict()}, checkpoint_id=where)
    future.result()
    fresh = nn.parallel.DistributedDataParallel(nn.Sequential(*[type(m)() if not isinstance(m, nn.Linear) else
                                                                nn.Linear(m.in_features, m.out_features)
                                                                for m in mlp()]))
    sd = {"model": fresh.state_dict()}
    dcp.load(sd, checkpoint_id=where)
    fresh.load_state_dict(sd["model"])
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True))
    return {"loaded_equal": torch.tensor(same), **{k: v.clone() for k, v in fresh.state_dict().items()}}


@client
def broadcast_load() -> dict[str, Any]:
    """FSDP2: a full state dict on rank 0 only, loaded with broadcast_from_rank0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    reference = mlp()
    torch.manual_seed(123)
    for p in reference.parameters():
        nn.init.uniform_(p, -1, 1)
    full_sd = reference.state_dict() if rank == 0 else {}
    torch.manual_seed(rank + 5)  # every rank's own init: the load must replace it
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    set_model_state_dict(model, full_sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    got = {k: v.clone() for k, v in sd.items()}
    ref = mlp()
    torch.manual_seed(123)
    for p in ref.parameters():
        nn.init.uniform_(p, -1, 1)
    got["is_rank0s"] = torch.tensor(all(torch.equal(got[k], v) for k, v in ref.state_dict().items()))
    return got


@client
def blocking_callback() -> dict[str, Any]:
    """A user's callback that blocks (on a gate the main thread opens only after more collectives
    end) must not hold up the completion of those collectives. Rank 0 comes late to the first
    all_reduce, so on every other rank its future is still pending when the callback is chained
    (a callback chained on a finished future runs at once, on the caller's thread)."""
    import threading
    import time

    gate = threading.Event()

    def blocks(_: Any) -> bool:
        if threading.current_thread() is threading.main_thread():
            return False  # ran at once, here: nothing to block
        return gate.wait(30)

    if rank == 0:
        time.sleep(1.0)
    first = torch.ones(2) * (rank + 1)
    chained = dist.all_reduce(first, async_op=True).get_future().then(blocks)
    t = torch.arange(4, dtype=torch.float32) + rank
    for root in range(world):
        dist.broadcast(t, src=root)
    summed = torch.ones(5) * (rank + 1)
    dist.all_reduce(summed)
    gathered = [torch.zeros(3) for _ in range(world)]
    dist.all_gather(gathered, torch.full((3,), float(rank)))
    in_time = not gate.is_set()  # the gate is still shut: the collectives above ended without it
    gate.set()
    return {"first": first, "broadcast": t, "summed": summed, "gathered": torch.stack(gathered),
            "ended_with_gate_shut": torch.tensor(in_time), "callback_saw_gate_open": torch.tensor(chained.wait())}


@client
def compress_hooks() -> dict[str, Any]:
    """DDP with torch's fp16 compression hook, and its wrapper around the PowerSGD hook (bf16's
    needs CUDA and NCCL, on gloo too)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    got: dict[str, Any] = {}
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd_hook

    for name in ("fp16", "fp16_wrapper"):
        model = nn.parallel.DistributedDataParallel(mlp())
        if name == "fp16":
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        else:
            state = powersgd_hook.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2)
            model.register_comm_hook(state, default_hooks.fp16_compress_wrapper(powersgd_hook.powerSGD_hook))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for step in range(4):
            x, y = data(step)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        got.update({f"{name}.{k}": v.detach().clone() for k, v in model.state_dict().items()})
    return got


@client
def post_local_sgd() -> dict[str, Any]:
    """torch's local SGD: post_localSGD_hook plus PostLocalSGDOptimizer (model averaging every 2 steps)."""
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as post_local
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    model = nn.parallel.DistributedDataParallel(mlp())
    state = post_local.PostLocalSGDState(process_group=None, subgroup=dist.group.WORLD, start_localSGD_iter=2)
    model.register_comm_hook(state, post_local.post_localSGD_hook)
    opt = PostLocalSGDOptimizer(optim=torch.optim.SGD(model.parameters(), lr=0.05),
                                averager=PeriodicModelAverager(period=2, warmup_steps=2))  # fmt: skip
    for step in range(8):
        x, y = data(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@client
def fsdp2_mixed() -> dict[str, Any]:
    """FSDP2 with a bf16 parameter / fp32 reduce mixed-precision policy and reshard_after_forward=False."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = mlp()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mp_policy=policy, reshard_after_forward=False)
    fully_shard(model, mp_policy=policy)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(3):
        x, y = data(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x).float(), y).backward()
        opt.step()
    return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}


@client
def functional() -> dict[str, Any]:
    """torch's functional collectives called directly (what torch.compile'd code runs)."""
    import torch.distributed._functional_collectives as funcol

    group = dist.group.WORLD

    def w(t: Any) -> Any:
        return t.wait() if hasattr(t, "wait") else t

    x = torch.arange(2 * world * 3, dtype=torch.float32).reshape(2 * world, 3) + 10 * rank
    got: dict[str, Any] = {
        "all_reduce": w(funcol.all_reduce(x, "sum", group)),
        "all_reduce_avg": w(funcol.all_reduce(x, "avg", group)),
        "all_reduce_max": w(funcol.all_reduce(x, "max", group)),
        "all_gather": w(funcol.all_gather_tensor(x, 0, group)),
        "all_gather_dim1": w(funcol.all_gather_tensor(x, 1, group)),
        "reduce_scatter": w(funcol.reduce_scatter_tensor(x, "sum", 0, group)),
        "all_to_all": w(funcol.all_to_all_single(x, None, None, group)),
        "broadcast": w(funcol.broadcast(x, 1, group)),
        "bf16_all_reduce": w(funcol.all_reduce(x.bfloat16(), "sum", group)),
        "int_all_reduce": w(funcol.all_reduce(x.long(), "sum", group)),
    }
    many = funcol.all_reduce_coalesced([x, x * 2, x[:1]], "sum", group)
    got.update({f"coalesced{i}": w(t) for i, t in enumerate(many)})
    gathered = funcol.all_gather_into_tensor_coalesced([x, x[:1], x * 2], group)
    got.update({f"gather_coalesced{i}": w(t) for i, t in enumerate(gathered)})
    # of several dtypes at once: gloo's gives garbage here (its one buffer read as the first dtype),
    # so each rank checks against what every rank's inputs are known to be
    mixed = [w(t) for t in funcol.all_gather_into_tensor_coalesced([x, x[:1].double(), x.bfloat16()], group)]
    theirs = [torch.arange(2 * world * 3, dtype=torch.float32).reshape(2 * world, 3) + 10 * r for r in range(world)]
    want = [torch.cat(theirs), torch.cat([t[:1].double() for t in theirs]), torch.cat([t.bfloat16() for t in theirs])]
    got["mixed_dtypes_gathered_right"] = torch.tensor(all(torch.equal(a, b) for a, b in zip(mixed, want, strict=True)))
    scattered = funcol.reduce_scatter_tensor_coalesced([x, x * 3], "sum", [0, 0], group)
    got.update({f"scatter_coalesced{i}": w(t) for i, t in enumerate(scattered)})
    return {k: torch.as_tensor(v).clone() for k, v in got.items()}


for name in wanted or list(CLIENTS):
    try:
        results[name] = CLIENTS[name]()
    except Exception as exc:  # the test compares: an error is a result too
        traceback.print_exc()
        results[name] = ("error", type(exc).__name__, str(exc)[:500])
    dist.barrier()
out.mkdir(parents=True, exist_ok=True)
torch.save(results, out / f"{rank}.pt")
dist.destroy_process_group()
print(f"rank {rank} done", flush=True)
