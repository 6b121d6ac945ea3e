"""Several all_reduces in flight at once from the blocking API (``async_op=True``), one rank a process: every
result in the canonical fold's bits, on every path the sizes take, on both topologies.

The in-process form (forty split board calls in flight, deterministic) is in tests/transport/test_shmboard.py;
this one runs the ranks as users do, under ``psring launch``, where a rank's own calls race each other and
its peers' on real cores (it found a rank posting over its own board slot before it had gathered from it:
before that fix about 6 runs in 10 of the same-host job had a wrong result, so two seeds run here).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.conftest import run_tree

pytestmark = [pytest.mark.slow]  # it starts processes

JOB = str(Path(__file__).resolve().parents[1] / "support" / "jobs" / "inflight_job.py")


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "topology,env",
    [
        ("ring", {"SEED": "7"}),
        ("ring", {"SEED": "8"}),
        ("ring", {"SEED": "3", "PSRING_SAME_HOST": "off"}),  # the TCP paths: one hop, two hops, the plane
        ("ring", {"SEED": "4", "HIER_HOSTS": "block:2"}),  # two levels
        ("ps", {"SEED": "5", "HIER_HOSTS": "block:2"}),  # reduced within the host before the push
    ],
    ids=["ring-7", "ring-8", "ring-tcp", "ring-hier", "ps-hier"],
)
def test_calls_in_flight_give_the_canonical_folds_bits(topology: str, env: dict[str, str]) -> None:
    cmd = [sys.executable, "-m", "psring", "launch", "-n", "4", "--topology", topology, "--", sys.executable, JOB]
    proc = run_tree(cmd, timeout=200, env={**os.environ, "ROUNDS": "8", **env})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    rows = [line.split("INFLIGHT ", 1)[1].split() for line in proc.stdout.splitlines() if "INFLIGHT " in line]
    assert sorted(int(r[0]) for r in rows) == [0, 1, 2, 3], out[-4000:]
    wrong = [line for line in proc.stdout.splitlines() if "WRONG " in line]
    assert all(r[1] == "0" and int(r[2]) >= 16 for r in rows) and not wrong, "\n".join(wrong) or out[-4000:]
