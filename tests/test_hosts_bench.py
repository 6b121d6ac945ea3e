"""The multi-host test bed (benchmarks/hosts.py), short form: two namespaces of two ranks over a shaped link.

Asserts that every variant ran across the namespaces and reported a time; how fast is the benchmark's
to say (run it long: ``python benchmarks/hosts.py --rates 1gbit,10gbit --sizes 4,64M --rounds 2``).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from psring.settings import load
from tests.conftest import run_tree
from tests.support.harness.netns import netns_available

pytestmark = [pytest.mark.slow]  # it starts processes

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(400)
def test_hosts_bench_runs_every_variant_across_namespaces(tmp_path: Path) -> None:
    why = netns_available()
    if why is not None:
        pytest.skip(f"needs network namespaces: {why}")
    if shutil.which("tc") is None:
        pytest.skip("needs tc (iproute2)")
    variants = ["flat", "hier", "ps", "psh", "psd", "split"]  # psd, split: shards on a dedicated server host (#36)
    try:
        import torch  # noqa: F401

        variants.append("gloo")
    except ImportError:
        pass
    out = tmp_path / "rows.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "hosts.py"), "--rates", "400mbit", "--sizes", "4,2M"]
    cmd += ["--iters", "1", "--rounds", "1", "--variants", ",".join(variants), "--timeout", "120", "--json", str(out)]
    cmd += ["--server-hosts", "1"]
    proc = run_tree(cmd, timeout=380, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert sorted((r["variant"], r["size"]) for r in rows) == sorted((v, s) for v in variants for s in (4, 2 << 20))
    assert all(r["time_s"] > 0 and r["hosts"] == 2 and r["ranks"] == 2 and r["server_hosts"] == 1 for r in rows), rows
    assert "hier/flat busbw" in proc.stdout, proc.stdout
    # each variant ran the topology it names; the ps variants push across hosts, so in the wire's pieces
    wire = load({}).ps_wire_piece
    pss = ("ps", "psh", "psd", "split")
    assert all(r["topology"] == ("ps" if r["variant"] in pss else "ring") for r in rows if "topology" in r)
    assert {r["ps_piece"] for r in rows if r["variant"] in pss} == {wire}, rows
    # the split: a shard in each of the 4 ranks and one on the server host, every shard an equal slice
    # (psring advise's weights for 2 hosts x 2 ranks and 1 server host)
    shards = {r["variant"]: (r["ps_shards"], r["ps_weights"]) for r in rows if r["variant"] in pss}
    assert shards == {"ps": (4, []), "psh": (4, []), "psd": (1, []), "split": (5, [1, 1, 1, 1, 1])}, rows
    # psh, psd and split reduce each 2 MiB all_reduce within the host before pushing it (one block each,
    # warm-up and timed calls); ps pushes every rank's tensor
    blocks = {r["variant"]: r["ps_host_blocks"] for r in rows if r["variant"] in pss and r["size"] == 2 << 20}
    assert blocks["ps"] == 0 and all(blocks[v] > 0 for v in ("psh", "psd", "split")), blocks
