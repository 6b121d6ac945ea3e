"""One replica of torchft 0.2.0's DiLoCo on the slow-link bed: the same model, data, inner and outer
optimizers and H as benchmarks/diloco_rank.py (psring's), over gloo (``pip install torchft==0.2.0``).

Each host is a replica group of one rank: its own TCPStore (this process serves it), a Manager that
heartbeats to the lighthouse (``torchft_lighthouse``, started on host 0 by the driver), gloo between
the replicas on the quorum's store. torchft's int8 quantization needs CUDA and Triton: on CPU its
pseudo-gradients travel as float32. Replica 0 writes the same fields as diloco_rank.py.

Environment: REPLICA, REPLICAS, HOST_ADDR (this host's address), STORE_PORT, TORCHFT_LIGHTHOUSE.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch.distributed import TCPStore
from torchft import Manager, ProcessGroupGloo
from torchft.local_sgd import DiLoCo

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diloco_rank import Task
from diloco_torch_rank import MLP, host_params


def main(spec: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    widths = [int(w) for w in spec.get("widths", [256, 1024, 1024, 1024, 256])]
    task = Task(widths, int(spec.get("seed", 0)))
    replica, replicas = int(os.environ["REPLICA"]), int(os.environ["REPLICAS"])
    addr, port = os.environ["HOST_ADDR"], int(os.environ["STORE_PORT"])
    timeout = timedelta(seconds=float(spec.get("timeout", 600)))
    store = TCPStore(addr, port, is_master=True, wait_for_workers=False)
    model = MLP(widths)
    inner = torch.optim.AdamW(model.parameters(), lr=float(spec.get("lr", 1e-3)), weight_decay=0.01)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "inner": inner.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner"])

    # DiLoCo needs a synchronous quorum; every replica starts from the same parameters, so no healing at
    # start (init_sync=False: its HTTP transport would advertise this machine's host name, the same in
    # every namespace)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout), min_replica_size=replicas, load_state_dict=load_state_dict,
        state_dict=state_dict, replica_id=str(replica), store_addr=addr, store_port=port, rank=0, world_size=1,
        lighthouse_addr=os.environ["TORCHFT_LIGHTHOUSE"], hostname=addr, port=0, use_async_quorum=False,
        init_sync=False, timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
    )  # fmt: skip
    steps, batch, h = int(spec["steps"]), int(spec.get("batch", 32)), int(spec["local_steps"])
    compute, curve = 0.0, []
    try:
        with DiLoCo(manager, [model], inner, outer, sync_every=h) as _diloco:
            t0 = time.perf_counter()
            for t in range(steps):
                x, y = (torch.from_numpy(a) for a in task.batch(replica, t, batch))
                c0 = time.perf_counter()
                inner.zero_grad()
                loss = ((model(x) - y) ** 2).mean()
                loss.backward()
                compute += time.perf_counter() - c0
                inner.step()
                if (t + 1) % max(1, steps // 20) == 0:
                    curve.append([t + 1, float(loss.detach())])
            wall = time.perf_counter() - t0
        params = host_params(model)
        if replica == 0 and spec.get("out"):
            nbytes = sum(v.nbytes for v in params.values())
            with open(spec["out"], "w") as fh:
                json.dump({
                    "spec": spec, "world": replicas, "model_bytes": nbytes, "steps": steps,
                    "samples_per_s": replicas * batch * steps / wall, "wall_s": wall, "grad_share": compute / wall,
                    "compute_use": float("nan"), "bytes_sent": [0], "test_loss": task.test_loss(params),
                    "curve": curve, "manager_step": manager.current_step(),
                }, fh)  # fmt: skip
    finally:
        manager.shutdown(wait=False)
        del store  # (held until here: the replica group's store)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
