"""The slow-link bed (benchmarks/slowlink.py), short form: two hosts on 100 Mbit/s links with a 20 ms
round trip made by its user-space forwarder, real TCP end to end; fp32 and int8 all_reduce of 1 MiB.

Asserts that both ran across the namespaces, that the links carried what the codec says (int8: about a
quarter of fp32's bytes, as the kernel counts them) and that the delay is there (a call takes at least
the ring's round trips); how fast is the benchmark's to say (run it long: ``python benchmarks/slowlink.py
--hosts 4 --rate 100mbit --rtt-ms 20 --sizes 64M --variants fp32,int8``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_tree

pytestmark = [pytest.mark.slow]  # it starts processes

ROOT = Path(__file__).resolve().parents[1]


def skip_without_the_bed() -> None:
    """Skip, saying why, where the bed cannot run (it needs root, TUN devices and ip netns)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from slowlink import available  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    why = available()
    if why is not None:
        pytest.skip(f"the slow-link bed {why}")


@pytest.mark.timeout(300)
def test_the_slow_link_bed_carries_a_codecs_bytes_over_delayed_links(tmp_path: Path) -> None:
    skip_without_the_bed()
    out = tmp_path / "rows.json"
    bed = ["--hosts", "2", "--rate", "100mbit", "--rtt-ms", "20", "--sizes", "1M", "--variants", "fp32,int8"]
    cmd = [sys.executable, str(ROOT / "benchmarks" / "slowlink.py"), *bed, "--iters", "2", "--json", str(out)]
    res = run_tree(cmd, timeout=280, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = {r["variant"]: r for r in json.loads(out.read_text())}
    fp32, int8 = rows["fp32"], rows["int8"]
    assert 0.15 < int8["wire_bytes_per_call"] / fp32["wire_bytes_per_call"] < 0.4, rows
    # 1 MiB at 100 Mbit/s: at least the bytes' time on a link (2 ranks: the whole tensor each way) plus a
    # round trip of 20 ms; a bed without its delay or its rate would be far faster on loopback
    assert fp32["time_s"] > (1 << 20) * 8 / 100e6 + 0.02, rows


@pytest.mark.timeout(300)
def test_local_sgd_on_the_bed_sends_h_times_fewer_bytes_and_streaming_overlaps(tmp_path: Path) -> None:
    """benchmarks/slowlink_diloco.py, short form: 2 hosts, a 1.3 MB MLP, 16 steps of synchronous SGD, of
    local SGD with H = 8 and int8, and of the same streamed in 2 fragments: the local runs send far fewer
    bytes across the links (the kernel's count) and finish far sooner; every run reports its loss."""
    skip_without_the_bed()
    out = tmp_path / "runs.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "slowlink_diloco.py"), "--hosts", "2", "--rate", "100mbit",
           "--rtt-ms", "20", "--steps", "16", "--widths", "128,512,512,128", "--runs", "1,8:int8,8:int8:K2",
           "--timeout", "200", "--json", str(out)]  # fmt: skip
    res = run_tree(cmd, timeout=280, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    runs = {r["name"]: r for r in json.loads(out.read_text())}
    sync, local, streamed = runs["1"], runs["8:int8"], runs["8:int8:K2"]
    for r in (local, streamed):
        assert r["wire_bytes"] < sync["wire_bytes"] / 10, (r["wire_bytes"], sync["wire_bytes"])
        assert r["wall_s"] < sync["wall_s"], (r["wall_s"], sync["wall_s"])
        assert 0.0 < r["compute_use"] <= 1.0 and r["test_loss"] > 0
    # 16 synchronous steps of 1.3 MB at 100 Mbit/s: at least the bytes' time on the links
    assert sync["wall_s"] > 16 * sync["model_bytes"] * 8 / 100e6


STALL_JOB = r'''
import asyncio, time, numpy as np, psring
async def main():
    g = await psring.init_group(topology="ring", timeout=60)
    await g.barrier()
    print("BEGIN", flush=True)
    for _ in range(2):  # 2 MiB a call: about 1.7 s each at 10 Mbit/s, the bytes moving all along
        await g.all_reduce(np.ones(1 << 19, np.float32))
    print("BULK DONE", flush=True)
    if g.rank == 1:
        await asyncio.sleep(1.5)  # a rank late, nothing moving: a stall
    await g.barrier()
    await g.close()
asyncio.run(main())
'''


@pytest.mark.timeout(240)
def test_a_slow_transfer_on_a_thin_link_is_not_called_a_stall_a_late_rank_is(tmp_path: Path) -> None:
    """#82 item 4: at 10 Mbit/s an all_reduce that takes seconds while its bytes keep arriving is a slow
    transfer, not a stall (no "psring stall" warning, with the threshold at 0.3 s); a rank that is late
    to a barrier with nothing moving still is, on the rank that waits."""
    skip_without_the_bed()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from slowlink import SlowBed  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    job = tmp_path / "job.py"
    job.write_text(STALL_JOB)
    bed = SlowBed(2, 10e6, 0.02, 0.05)
    try:
        procs = []
        for r in range(2):
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT), "RANK": str(r),
                   "WORLD_SIZE": "2", "MASTER_ADDR": bed.addresses[0], "MASTER_PORT": "29561",
                   "PSRING_STALL_S": "0.3", "PYTHONUNBUFFERED": "1"}  # fmt: skip
            procs.append(bed.run(r, [sys.executable, str(job)], env))
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=180)[0])
            except subprocess.TimeoutExpired:
                p.kill()
                outs.append(p.communicate(timeout=30)[0] + "\n(killed: still running after 180 s)")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=30)
        bed.close()
    assert all(p.returncode == 0 for p in procs), outs
    for out in outs:
        bulk = out[out.index("BEGIN") : out.index("BULK DONE")]
        assert "psring stall" not in bulk, out
    assert "psring stall: barrier" in outs[0] and "rank 1 has not called it" in outs[0], outs[0]
