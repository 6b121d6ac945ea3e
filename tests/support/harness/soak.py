"""Soak: many small and large all_reduce calls over each topology, RSS and open files sampled.

    python tests/support/harness/soak.py                          # the long form: 10,000 small + 200 large per topology
    python tests/support/harness/soak.py --small 1000 --large 20  # the short form the test suite runs

Two ranks (and, for ps, two shards) share this process and event loop, so its RSS covers all
of them. Reported per topology: RSS at start and end, the RSS slope over the second half of
the run (KiB per 1000 calls: flat memory means a slope near 0), open file descriptors before
and after, and whether every result was right (no lost or corrupted data).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

import numpy as np


def rss_kib() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def soak(topology: str, small: int, large: int, large_bytes: int) -> dict:  # type: ignore[type-arg]
    import psring
    from psring.rendezvous.client import connect_store, parse_store_address
    from psring.topology.ps.shards.server import start_servers

    fds_before = open_fds()
    store = await psring.start_store("127.0.0.1", 0)
    address = f"127.0.0.1:{store.port}"
    os.environ["PSRING_JOB"] = f"soak-{topology}"
    client = servers = None
    if topology == "ps":
        client = await connect_store(parse_store_address(address), secret=None, timeout=10)
        servers = await start_servers(client, 2, job=f"soak-{topology}")
    groups = await asyncio.gather(
        *(psring.init_group(topology, rank=r, world_size=2, store=address, timeout=60) for r in (0, 1))
    )
    samples: list[tuple[int, int]] = []
    wrong = 0
    calls = 0
    big = np.ones(large_bytes // 4, np.float32)
    for i in range(small + large):
        is_large = i >= small
        xs = [big * (r + 1) for r in (0, 1)] if is_large else [np.full(16, i + r, np.float32) for r in (0, 1)]
        ys = await asyncio.gather(*(g.all_reduce(x) for g, x in zip(groups, xs, strict=True)))
        want = xs[0] + xs[1]
        wrong += sum(not np.array_equal(y, want) for y in ys)
        calls += 1
        if calls % (10 if is_large else 100) == 0:
            samples.append((calls, rss_kib()))
    await asyncio.gather(*(g.close() for g in groups))
    if servers is not None:
        await servers.close()
    if client is not None:
        await client.close()
    await store.close()
    await asyncio.sleep(0.2)

    def slope(lo: int, hi: int) -> float:
        """KiB per 1000 calls over the second half of calls lo..hi (after warm-up)."""
        part = [s for s in samples if (lo + hi) // 2 < s[0] <= hi]
        if len(part) < 2:
            return 0.0
        return float(np.polyfit([s[0] for s in part], [s[1] for s in part], 1)[0]) * 1000

    return {
        "topology": topology,
        "small_calls": small,
        "large_calls": large,
        "large_bytes": large_bytes,
        "wrong_results": wrong,
        "rss_start_kib": samples[0][1] if samples else rss_kib(),
        "rss_end_kib": rss_kib(),
        "rss_slope_small_kib_per_1000": slope(0, small),
        "rss_slope_large_kib_per_1000": slope(small, small + large),
        "fds_before": fds_before,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", type=int, default=10_000, help="16-element all_reduce calls")
    p.add_argument("--large", type=int, default=200, help="large all_reduce calls")
    p.add_argument("--large-bytes", type=int, default=4 << 20)
    p.add_argument("--topologies", default="ring,ps")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    from psring.transport.loop import new_event_loop

    results = []
    warm = new_event_loop()  # the first event loop and thread pool open a few fds for good: not a leak
    try:
        warm.run_until_complete(soak("ring", 10, 0, 4096))
    finally:
        warm.close()
    for topology in args.topologies.split(","):
        fds_before = open_fds()
        loop = new_event_loop()
        try:
            result = loop.run_until_complete(soak(topology, args.small, args.large, args.large_bytes))
        finally:
            loop.close()
        result["fds_before"], result["fds_after"] = fds_before, open_fds()
        results.append(result)
    if args.json:
        print(json.dumps(results))
        return 0
    head = ["topology", "calls", "wrong", "RSS start", "RSS end", "slope small", "slope large", "fds"]
    print(" ".join(f"{h:>12}" for h in head) + "   (slopes: KiB per 1000 calls)")
    for r in results:
        calls = r["small_calls"] + r["large_calls"]
        fds = f"{r['fds_before']}->{r['fds_after']}"
        row = [
            r["topology"],
            calls,
            r["wrong_results"],
            f"{r['rss_start_kib'] // 1024}Mi",
            f"{r['rss_end_kib'] // 1024}Mi",
            f"{r['rss_slope_small_kib_per_1000']:.1f}",
            f"{r['rss_slope_large_kib_per_1000']:.1f}",
            fds,
        ]
        print(" ".join(f"{c:>12}" for c in row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
