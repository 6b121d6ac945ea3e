"""benchmarks/sparse.py, short form: the dense ring, the sparse ring and sparse ps all train the
same small table to the end (how fast is the benchmark's to say: docs/performance-history.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ..conftest import run_tree

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]


def test_sparse_bench_runs_every_variant() -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "sparse.py"), "--workers", "2", "--rows", "5000", "--width", "8",
           "--steps", "3", "--json"]  # fmt: skip
    res = run_tree(cmd, timeout=280)
    assert res.returncode == 0, res.stdout + res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert [r["variant"] for r in out["rows"]] == ["dense-ring", "sparse-ring", "sparse-ps"]
    assert all(r["steps_per_s"] > 0 and r["worker_peak_rss"] > 0 for r in out["rows"]), out
    bad = run_tree([sys.executable, str(ROOT / "benchmarks" / "sparse.py"), "--variants", "mesh"], timeout=60)
    assert bad.returncode == 2 and "'mesh' is not one of dense-ring, sparse-ring, sparse-ps" in bad.stderr
