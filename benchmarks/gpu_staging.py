"""Where a cupy all_reduce spends its time outside the network: one process, one GPU.

Times the staging steps psring takes (device -> pinned host buffer, pinned -> device)
against the alternatives (pageable copies, an extra host copy), and a reduction of one
1 MiB ring piece on the host against doing it on the device (copy in, add, copy out), which
is how psring decided where reductions run. Prints a table; needs cupy and a CUDA GPU.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np


def timed(fn: Callable[[], object], sync: Callable[[], None], iters: int) -> float:
    fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> int:
    import cupy as cp

    from psring.cli.bench import parse_size
    from psring.core import gpu
    from psring.core.arrays import pinned_empty

    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="64M")
    ap.add_argument("--piece", default="1M")
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    nbytes, piece = parse_size(args.size), parse_size(args.piece)
    sync = cp.cuda.Device().synchronize
    x = cp.random.standard_normal(nbytes // 4, dtype=cp.float32)
    dev_out = cp.empty_like(x)
    pinned = pinned_empty(x.shape, x.dtype)
    pageable = np.empty(x.shape, x.dtype)
    pageable[:] = 1.0
    rows = [
        ("device -> pinned host (x.get(out=pinned))", lambda: x.get(out=pinned)),
        ("device -> pageable host (x.get())", lambda: x.get()),
        ("pinned host -> device (set)", lambda: dev_out.set(pinned)),
        ("pageable host -> device (set)", lambda: dev_out.set(pageable)),
        ("host copy pageable -> pinned (np.copyto)", lambda: np.copyto(pinned, pageable)),
        ("pinned_empty (from cupy's pinned pool)", lambda: pinned_empty(x.shape, x.dtype)),
        ("gpu.to_host(x) (psring)", lambda: gpu.to_host(x)),
        ("gpu.to_device(pinned result) (psring)", lambda: gpu.to_device(pinned, cp)),
        ("gpu.to_device(pageable result)", lambda: gpu.to_device(pageable, cp)),
    ]
    print(f"# staging a {nbytes >> 20} MiB float32 tensor (median of {args.iters}, ms)")
    for name, fn in rows:
        ms = timed(fn, sync, args.iters)
        print(f"{name:<45} {ms:8.2f} ms  {nbytes / ms / 1e6:7.2f} GB/s")

    n = piece // 4
    a_h, b_h = pinned_empty((n,), np.float32), pinned_empty((n,), np.float32)
    a_h[:] = 1.0
    b_h[:] = 2.0
    a_d, b_d = cp.empty(n, cp.float32), cp.empty(n, cp.float32)

    def on_device() -> None:
        a_d.set(a_h)
        b_d.set(b_h)
        cp.add(a_d, b_d, out=a_d)
        a_d.get(out=a_h)

    print(f"# folding one {piece >> 10} KiB ring piece that arrived in host memory (median, ms)")
    for name, fn in (
        ("on the host (np.add)", lambda: np.add(a_h, b_h, out=a_h)),
        ("on the device (copy in, add, copy out)", on_device),
    ):
        print(f"{name:<45} {timed(fn, sync, args.iters * 10):8.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
