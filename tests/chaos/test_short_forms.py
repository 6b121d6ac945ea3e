"""Short forms of the chaos and soak harnesses (the long forms: benchmarks/chaos.py, benchmarks/soak.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = [pytest.mark.timeout(280)]


def run(script: str, *args: str, timeout: float = 260) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", script), *args, "--json"],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_chaos_short_form_no_hangs_every_survivor_raises_or_recovers() -> None:
    rows = run("chaos.py", "--trials", "2", "--victims", "worker", "--seed", "1")
    rows += run("chaos.py", "--trials", "1", "--topologies", "ps", "--victims", "server", "--seed", "2")
    assert {r["topology"] for r in rows} == {"ring", "ps"}
    for r in rows:
        assert r["hung"] == 0 and r["ok"], r
        if r["killed"].startswith("worker"):
            # a killed worker is noticed at once, and every survivor says who was lost
            assert r["raised"] == r["survivors"] == r["named_the_loss"], r
            assert r["detect_s"] < 10, r
        else:
            # a killed server restarts from its checkpoints; the workers reconnect, re-send the
            # step in flight and end with the parameters of a run nothing disturbed
            assert r["restarted"] and r["recovered"] == r["identical"] == r["survivors"] == 3, r
    assert any(r["killed"].startswith("server") for r in rows)


def test_chaos_server_that_stays_dead_makes_every_worker_raise() -> None:
    rows = run("chaos.py", "--trials", "1", "--topologies", "ps", "--victims", "server", "--no-restart")
    (r,) = rows
    assert r["hung"] == 0 and not r["restarted"], r
    assert r["raised"] == r["survivors"] == r["named_the_loss"] == 3, r
    assert r["detect_s"] < 40, r  # the workers wait the group timeout (15 s) for it to come back


def test_soak_short_form_memory_flat_no_fd_growth_no_wrong_results() -> None:
    rows = run("soak.py", "--small", "2000", "--large", "30")
    assert [r["topology"] for r in rows] == ["ring", "ps"]
    for r in rows:
        assert r["wrong_results"] == 0, r
        assert r["fds_after"] <= r["fds_before"], r
        assert abs(r["rss_slope_small_kib_per_1000"]) < 512, r  # under 0.5 KiB per call
        assert r["rss_end_kib"] - r["rss_start_kib"] < 200 * 1024, r
