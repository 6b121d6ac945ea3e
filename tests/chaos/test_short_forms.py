"""Short forms of the chaos and soak harnesses (the long forms: tests/support/harness/chaos.py and
tests/support/harness/soak.py)."""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

from ..conftest import run_tree

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = [pytest.mark.slow, pytest.mark.timeout(280)]


def run(script: str, *args: str, timeout: float = 260) -> list[dict]:  # (or one dict)
    proc = run_tree(
        [sys.executable, os.path.join(ROOT, "tests", "support", "harness", script), *args, "--json"],
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


def test_chaos_colocated_shards_die_with_their_worker_and_every_survivor_says_so() -> None:
    rows = run("chaos.py", "--trials", "2", "--topologies", "ps-colo", "--victims", "worker", "--seed", "3")
    assert len(rows) == 2
    for r in rows:
        assert r["topology"] == "ps-colo" and r["killed"].startswith("worker"), r
        assert r["hung"] == 0 and r["ok"], r
        assert r["raised"] == r["survivors"] == r["named_the_loss"] == 2, r
        assert r["detect_s"] < 10, r  # a colocated shard never comes back: nobody waits for it


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


def test_netfaults_short_form_cut_links_raise_degraded_links_give_identical_results() -> None:
    from tests.support.harness.netns import netns_available

    why = netns_available()
    if why:
        pytest.skip(why)
    conditions = ["none", "rate 200mbit", "loss 1%"]
    out: dict = run("netfaults.py", "--cuts", "1", "--steps", "12", "--conditions", ";".join(conditions), timeout=270)  # type: ignore[assignment]
    cuts, degraded, summary = out["cuts"], out["degraded"], out["summary"]
    assert [(c["topology"], c["cut"]) for c in cuts] == [("ring", "rank2"), ("ps", "rank2"), ("ps", "server")]
    for c in cuts:
        # packets to and from the cut host vanish (no reset): every rank, the cut-off one too,
        # raises; a lost peer within the heartbeat bound (3 s timeout + 1 s interval), a lost
        # server once the workers stop waiting for it to come back (the 8 s group timeout). A ps
        # rank cut off from everything has lost every shard, and waits for them as for a lost
        # server (its store is away too: a host that ran both may be rebooting); the others see
        # it gone within the heartbeat bound
        assert c["hangs"] == 0 and c["all_raised"], c
        for name, r in c["ranks"].items():
            waits = c["cut"] == "server" or (c["topology"] == "ps" and name == c["cut"])
            assert r["after_s"] <= (8 if waits else 0) + 3 + 1 + 2, (name, c)
    for d in degraded:
        if d["condition"] == "loss 1%" and shutil.which("iptables") is None:
            assert "iptables" in d["unavailable"], d
            continue
        assert d["finished"] == 3 and d["ranks_agree"], d
    # ring and ps, clean and degraded links: the same bits
    assert summary["identical_when_degraded"] and summary["degraded_runs"] >= 4, summary
