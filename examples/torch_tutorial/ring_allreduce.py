"""A ring all-reduce written by hand on isend / recv (the tutorial's), checked against dist.all_reduce."""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import psring.torch  # noqa: F401 - registers the backend "psring"


def allreduce(send, recv):
    """Implementation of a ring-reduce."""
    rank = dist.get_rank()
    size = dist.get_world_size()
    send_buff = send.clone()
    recv_buff = send.clone()
    accum = send.clone()

    left = ((rank - 1) + size) % size
    right = (rank + 1) % size

    for i in range(size - 1):
        if i % 2 == 0:
            # Send send_buff
            send_req = dist.isend(send_buff, right)
            dist.recv(recv_buff, left)
            accum[:] += recv_buff[:]
        else:
            # Send recv_buff
            send_req = dist.isend(recv_buff, right)
            dist.recv(send_buff, left)
            accum[:] += send_buff[:]
        send_req.wait()
    recv[:] = accum[:]


def run(rank, size):
    send = torch.arange(4, dtype=torch.float32) + rank
    recv = torch.zeros(4)
    allreduce(send, recv)
    expected = send.clone()
    dist.all_reduce(expected, op=dist.ReduceOp.SUM)
    print("Rank ", rank, " ring allreduce ", recv.tolist(), " matches all_reduce: ", torch.equal(recv, expected))


def init_process(rank, size, fn, backend="psring"):
    """Initialize the distributed environment."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = "29500"
    dist.init_process_group(backend, rank=rank, world_size=size)
    fn(rank, size)
    dist.destroy_process_group()


if __name__ == "__main__":
    world_size = 3
    processes = []
    mp.set_start_method("spawn")
    for rank in range(world_size):
        p = mp.Process(target=init_process, args=(rank, world_size, run))
        p.start()
        processes.append(p)
    for p in processes:
        p.join()
    sys.exit(max(p.exitcode for p in processes))
