"""Every torch.distributed operation on one backend, results saved for comparison across backends.

    python tests/support/jobs/torch_ops.py BACKEND OUT_DIR      (RANK, WORLD_SIZE, MASTER_ADDR/PORT set)

Each rank saves ``OUT_DIR/<rank>.pt``: {case name: result}, where a result is tensors, objects,
or ("error", type name, message). Inputs are small integers, so every reduction is exact in every
dtype and gloo's results and psring's must be the same bits.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist

import psring.torch  # noqa: F401 - registers the backend

DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
]
OPS = {
    "sum": dist.ReduceOp.SUM,
    "product": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "avg": dist.ReduceOp.AVG,
    "reduce_op.SUM": dist.reduce_op.SUM,  # the deprecated names
    "reduce_op.MAX": dist.reduce_op.MAX,
}


def data(rank: int, n: int = 6, dtype: torch.dtype = torch.float32, offset: int = 0) -> torch.Tensor:
    x = (torch.arange(n) % 3 + rank + 1 + offset).to(torch.float64)
    if dtype == torch.bool:
        return (x.long() % 2).bool()
    return x.to(dtype)


def main(backend: str, out_dir: str) -> None:
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    res: dict[str, Any] = {}

    def case(name: str, fn: Any) -> None:
        try:
            res[name] = fn()
        except Exception as exc:
            res[name] = ("error", type(exc).__name__, str(exc)[:200])

    # all_reduce: every op, every dtype
    for opname, op in OPS.items():
        for dt in (torch.int64, torch.float32):

            def ar(op: Any = op, dt: torch.dtype = dt) -> torch.Tensor:
                t = data(rank, dtype=dt)
                dist.all_reduce(t, op=op)
                return t

            case(f"all_reduce/{opname}/{dt}", ar)
    for dt in DTYPES:

        def ar_dt(dt: torch.dtype = dt) -> torch.Tensor:
            t = data(rank, dtype=dt)
            dist.all_reduce(t)
            return t

        case(f"all_reduce/sum/{dt}", ar_dt)

        def bc_dt(dt: torch.dtype = dt) -> torch.Tensor:
            t = data(rank, dtype=dt)
            dist.broadcast(t, src=world - 1)
            return t

        case(f"broadcast/{dt}", bc_dt)

    def ar_big() -> torch.Tensor:  # past the small-message path: the ring's chunks, the shards' slices
        t = (torch.arange(300_000) % 7 + rank).float()
        dist.all_reduce(t)
        return t

    case("all_reduce/large", ar_big)

    def ar_view() -> torch.Tensor:  # a non-contiguous tensor is reduced in place too
        base = data(rank, n=12).reshape(3, 4)
        view = base.t()
        dist.all_reduce(view)
        return base

    case("all_reduce/strided", ar_view)

    def reduce() -> Any:
        t = data(rank)
        dist.reduce(t, dst=1, op=dist.ReduceOp.SUM)
        return t if rank == 1 else "not dst"

    case("reduce", reduce)

    def all_gather() -> list[torch.Tensor]:
        outs = [torch.zeros(6) for _ in range(world)]
        dist.all_gather(outs, data(rank))
        return outs

    case("all_gather", all_gather)

    def all_gather_into_tensor() -> torch.Tensor:
        out = torch.zeros(world * 6, dtype=torch.int32)
        dist.all_gather_into_tensor(out, data(rank, dtype=torch.int32))
        return out

    case("all_gather_into_tensor", all_gather_into_tensor)

    def gather() -> Any:
        outs = [torch.zeros(6) for _ in range(world)] if rank == 0 else None
        dist.gather(data(rank), outs, dst=0)
        return outs

    case("gather", gather)

    def scatter() -> torch.Tensor:
        out = torch.zeros(6)
        parts = [data(r, offset=10) for r in range(world)] if rank == 1 else None
        dist.scatter(out, parts, src=1)
        return out

    case("scatter", scatter)

    def reduce_scatter() -> torch.Tensor:
        out = torch.zeros(6)
        dist.reduce_scatter(out, [data(rank, offset=r) for r in range(world)])
        return out

    case("reduce_scatter", reduce_scatter)

    def reduce_scatter_tensor() -> torch.Tensor:
        out = torch.zeros(6)
        dist.reduce_scatter_tensor(out, data(rank, n=6 * world))
        return out

    case("reduce_scatter_tensor", reduce_scatter_tensor)

    def all_to_all() -> list[torch.Tensor]:
        outs = [torch.zeros(2) for _ in range(world)]
        dist.all_to_all(outs, [torch.full((2,), float(10 * rank + r)) for r in range(world)])
        return outs

    case("all_to_all", all_to_all)

    def all_to_all_single() -> torch.Tensor:
        out = torch.zeros(world)
        dist.all_to_all_single(out, torch.arange(world, dtype=torch.float32) + 100 * rank)
        return out

    case("all_to_all_single", all_to_all_single)

    def all_to_all_uneven() -> torch.Tensor:
        # rank r sends r+1+j rows to rank j
        ins = [r + 1 + rank for r in range(world)]
        outs = [rank + 1 + r for r in range(world)]
        x = torch.arange(sum(ins), dtype=torch.float32) + 1000 * rank
        out = torch.zeros(sum(outs))
        dist.all_to_all_single(out, x, output_split_sizes=outs, input_split_sizes=ins)
        return out

    case("all_to_all_single/uneven", all_to_all_uneven)

    def p2p() -> Any:
        got = torch.zeros(3)
        if rank == 0:
            dist.send(torch.tensor([1.0, 2.0, 3.0]), dst=1)
            dist.recv(got, src=1)
        elif rank == 1:
            dist.recv(got, src=0)
            dist.send(got * 2, dst=0)
        return got

    case("send_recv", p2p)

    def p2p_immediate() -> Any:
        got = torch.zeros(3)
        if rank == 0:
            req = dist.isend(torch.tensor([4.0, 5.0, 6.0]), dst=1)
        elif rank == 1:
            req = dist.irecv(got, src=0)
        else:
            return "idle"
        req.wait()
        return got

    case("isend_irecv", p2p_immediate)

    def batch() -> torch.Tensor:  # a ring exchange in one batch
        send = torch.full((4,), float(rank))
        recv = torch.zeros(4)
        ops = [
            dist.P2POp(dist.isend, send, (rank + 1) % world),
            dist.P2POp(dist.irecv, recv, (rank - 1) % world),
        ]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        return recv

    case("batch_isend_irecv", batch)

    def recv_any_source() -> Any:  # rank 0 takes one tensor from each other rank, whoever is first
        if rank == 0:
            seen = []
            for _ in range(world - 1):
                got = torch.zeros(3)
                src = dist.recv(got)  # no src: any source; torch returns the sender
                seen.append((src, got.tolist()))
            return sorted(seen)
        dist.send(torch.full((3,), float(rank)), dst=0)
        return None

    case("recv_any_source", recv_any_source)

    def sparse_all_reduce() -> torch.Tensor:  # nn.Embedding(sparse=True)'s gradients: rows by index
        rows = torch.tensor([[rank % 3, 3 + rank]])  # ranks share some rows, each has one of its own
        t = torch.sparse_coo_tensor(rows, torch.full((2, 4), float(rank + 1)), (3 + world, 4))
        dist.all_reduce(t)
        return t.to_dense()

    case("all_reduce/sparse", sparse_all_reduce)

    def barrier() -> str:
        dist.barrier()
        return "ok"

    case("barrier", barrier)

    def subgroup() -> Any:
        g = dist.new_group([0, 1])
        t = data(rank)
        work = dist.all_reduce(t, group=g)  # not a member: torch's non-member behaviour (None, t untouched)
        return (t, work is None, dist.get_rank(g), dist.get_world_size(g) if rank < 2 else "non-member")

    case("new_group", subgroup)

    def subgroup_odd() -> Any:
        g = dist.new_group([world - 1, 0])  # a group listed out of order
        t = data(rank)
        if rank in (0, world - 1):
            dist.broadcast(t, src=world - 1, group=g)
        return t

    case("new_group/broadcast", subgroup_odd)

    def async_ops() -> Any:
        a, b = data(rank), data(rank, dtype=torch.float64)
        w1 = dist.all_reduce(a, async_op=True)
        w2 = dist.all_reduce(b, op=dist.ReduceOp.MAX, async_op=True)
        fut = w1.get_future().then(lambda f: f.value()[0] * 2)
        w2.wait()
        doubled = fut.wait()
        w1.wait()
        return (doubled, b, w1.is_completed() and w2.is_completed())

    case("async_op", async_ops)

    def objects() -> Any:
        objs: list[Any] = [{"from": 1, "x": [1, 2]}, "two"] if rank == 1 else [None, None]
        dist.broadcast_object_list(objs, src=1)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, {"rank": rank, "sq": rank * rank})
        at0: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(("r", rank), at0, dst=0)
        out: list[Any] = [None]
        dist.scatter_object_list(out, [f"for {r}" for r in range(world)] if rank == 0 else None, src=0)
        return (objs, gathered, at0, out)

    case("objects", objects)

    torch.save(res, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()
    # gloo's worker threads can still hold work at interpreter exit and abort the process
    # ("terminate called without an active exception", pytorch/pytorch#179291): all is done, leave now
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
