"""torch's own distributed test suite on the psring backend (#39), a representative slice: tests
gloo passes there (the full run: ``tests/support/harness/torch_suite.py``, docs/pytorch.md), which
psring must pass too, on both topologies -- collectives, coalesced ones, any-source receives,
tagged batches, groups made and destroyed, sparse all_reduce and DDP."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (CI installs torch==2.13.0)")
pytest.importorskip("expecttest", reason="expecttest is not installed (the frameworks extra): torch's suite imports it")

from ..conftest import pythonpath, run_tree  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.torch, pytest.mark.timeout(400)]
ROOT = Path(__file__).resolve().parents[2]
SLICE = [
    "test_all_reduce_sum",
    "test_all_reduce_coalesced_max",
    "test_reduce_sum",
    "test_all_gather_coalesced_simple",
    "test_scatter",
    "test_send_recv_any_source",
    "test_batch_isend_irecv_gloo_tags",
    "test_destroy_group",
    "test_sparse_all_reduce_sum",
    "test_DistributedDataParallelCPU",
]


@pytest.mark.parametrize("topology", ["ring", "ps"])
def test_a_slice_of_torchs_own_suite_passes_as_on_gloo(topology: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PSRING_")}
    env.update(PYTHONPATH=pythonpath(ROOT), OMP_NUM_THREADS="1", PSRING_TOPOLOGY=topology)
    cmd = [sys.executable, str(ROOT / "tests" / "support" / "harness" / "torch_suite.py"), "--backend", "psring",
           "--world-size", "2", "--topology", topology, "--tests", ",".join(SLICE), "--json"]  # fmt: skip
    res = run_tree(cmd, timeout=380, env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["tests"] == {name: "passed" for name in SLICE}, summary["why"]
    assert summary["patched"]  # and it says what it let through
