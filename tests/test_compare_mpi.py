"""benchmarks/compare_mpi.py (psring against MPICH through mpi4py), short form: it runs both
sides on one host and over TCP only, through psring's blocking and asyncio APIs, and every rank's
result is right on both. How fast is the benchmark's to say (docs/performance-history.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from psring.cli.bench import mpich_problem
from tests.conftest import run_tree

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[1]


def test_compare_mpi_runs_both_sides_and_the_results_agree() -> None:
    if (problem := mpich_problem()) is not None:
        pytest.skip(problem)
    cmd = [sys.executable, str(ROOT / "benchmarks" / "compare_mpi.py"), "--workers", "2", "--sizes", "4,64K",
           "--iters", "3", "--warmup", "1", "--rounds", "1", "--paths", "host,tcp", "--json"]  # fmt: skip
    res = run_tree(cmd, timeout=280)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = json.loads(res.stdout.strip().splitlines()[-1])["rows"]
    assert [(r["path"], r["size"]) for r in rows] == [("host", 4), ("host", 65536), ("tcp", 4), ("tcp", 65536)]
    for r in rows:
        assert r["ok"] is True, r  # every rank's sum right, MPICH's and psring's
        assert r["mpich_s"] > 0 and r["blocking_s"] > 0 and r["async_s"] > 0, r


def test_compare_mpi_names_bad_input() -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "compare_mpi.py"), "--paths", "shm"]
    res = run_tree(cmd, timeout=60)
    assert res.returncode == 2 and "--paths: 'shm' is neither host nor tcp" in res.stderr
