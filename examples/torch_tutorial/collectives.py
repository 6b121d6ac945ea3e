"""The six collectives: scatter, gather, reduce, all_reduce, broadcast, all_gather."""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import psring.torch  # noqa: F401 - registers the backend "psring"


def run(rank, size):
    # scatter: rank 0 hands out one tensor to each rank
    tensor = torch.zeros(2)
    scatter_list = [torch.full((2,), float(10 * r)) for r in range(size)] if rank == 0 else None
    dist.scatter(tensor, scatter_list, src=0)
    print("Rank ", rank, " scatter ", tensor.tolist())

    # gather: rank 0 collects every rank's tensor
    gather_list = [torch.zeros(2) for _ in range(size)] if rank == 0 else None
    dist.gather(torch.full((2,), float(rank)), gather_list, dst=0)
    if rank == 0:
        print("Rank ", rank, " gather ", [t.tolist() for t in gather_list])

    # reduce: rank 0 gets the sum
    tensor = torch.tensor([float(rank), 1.0])
    dist.reduce(tensor, dst=0, op=dist.ReduceOp.SUM)
    if rank == 0:
        print("Rank ", rank, " reduce ", tensor.tolist())

    # all_reduce: every rank gets the maximum
    tensor = torch.tensor([float(rank), -float(rank)])
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    print("Rank ", rank, " all_reduce ", tensor.tolist())

    # broadcast: every rank gets the last rank's tensor
    tensor = torch.arange(3, dtype=torch.float32) * rank
    dist.broadcast(tensor, src=size - 1)
    print("Rank ", rank, " broadcast ", tensor.tolist())

    # all_gather: every rank gets every rank's tensor
    tensor_list = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(tensor_list, torch.tensor([rank * rank]))
    print("Rank ", rank, " all_gather ", [t.item() for t in tensor_list])


def init_process(rank, size, fn, backend="psring"):
    """Initialize the distributed environment."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = "29500"
    dist.init_process_group(backend, rank=rank, world_size=size)
    fn(rank, size)
    dist.destroy_process_group()


if __name__ == "__main__":
    world_size = 4
    processes = []
    mp.set_start_method("spawn")
    for rank in range(world_size):
        p = mp.Process(target=init_process, args=(rank, world_size, run))
        p.start()
        processes.append(p)
    for p in processes:
        p.join()
    sys.exit(max(p.exitcode for p in processes))
