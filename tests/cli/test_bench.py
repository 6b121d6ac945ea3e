"""Short forms of the benchmarks, so they cannot rot: they run and report sane fields.

Speed is not asserted here; the figures come from the long runs (see README)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from psring.cli.bench import mpich_problem

from ..conftest import run_tree

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
ROOT = Path(__file__).resolve().parents[2]


def _json(args: list[str]) -> dict:
    proc = run_tree([sys.executable, *args], capture_output=True, text=True, timeout=170, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_p2p_benchmark_reports_both_transports() -> None:
    r = _json(["benchmarks/p2p.py", "--size", "4M", "--iters", "3", "--repeats", "2", "--json"])
    assert r["size"] == 4 << 20 and r["psring_GBps"] > 0 and r["socket_GBps"] > 0
    assert r["ratio"] == pytest.approx(r["psring_GBps"] / r["socket_GBps"])


@pytest.mark.parametrize("topology", ["ring", "ps"])
def test_bench_allreduce_table_fields(topology: str) -> None:
    r = _json(
        [
            "-m",
            "psring",
            "bench",
            "allreduce",
            "--topology",
            topology,
            "--workers",
            "2",
            "--sizes",
            "4,256K",
            "--iters",
            "2",
            "--json",
        ]
    )
    assert [row["size"] for row in r["rows"]] == [4, 256 << 10]
    for row in r["rows"]:
        assert row["time_s"] > 0 and row["busbw_GBps"] == pytest.approx(row["algbw_GBps"])  # N=2: busbw = algbw
        assert row["peak_rss_over_idle"] >= 0


@pytest.mark.parametrize("topology", ["ring", "ps"])
def test_bench_allreduce_with_a_codec_reports_its_bytes(topology: str) -> None:
    def rows(*extra: str) -> list[dict]:
        args = ["-m", "psring", "bench", "allreduce", "--topology", topology, "--workers", "2", "--sizes", "1M",
                "--iters", "2", "--json", *extra]  # fmt: skip
        return _json(args)["rows"]

    (plain,), (coded,) = rows(), rows("--compression", "bf16")
    assert plain["compression"] is None and coded["compression"] == "bf16"
    # 2 bytes an element instead of 4 (the barriers' few bytes beside them)
    assert 0.45 < coded["bytes_sent_per_call"] / plain["bytes_sent_per_call"] < 0.55, (coded, plain)


@pytest.mark.parametrize("topology", ["ring", "ps"])
def test_bench_sgd_splits_step_time(topology: str) -> None:
    r = _json(
        [
            "-m",
            "psring",
            "bench",
            "sgd",
            "--params",
            "1M",
            "--tensors",
            "40",
            "--topology",
            topology,
            "--workers",
            "2",
            "--steps",
            "2",
            "--json",
        ]
    )
    assert r["tensors"] == 40 and r["buckets"] >= 1
    assert r["step_ms"] > 0 and r["exchange_ms"] > 0
    assert (r["update_ms"] > 0) == (topology == "ring")


def test_ps_vs_ring_runs_every_setup_in_rounds() -> None:
    rows = _json(
        ["benchmarks/ps_vs_ring.py", "--workers", "2", "--size", "2M", "--iters", "1", "--rounds", "2", "--json"]
    )
    assert len(rows) == 1 and rows[0]["workers"] == 2
    row = rows[0]
    for label in ("ring", "ps S=N", "ps S=N colo", "ps S=1"):
        assert len(row[label]["times_s"]) == 2 and all(t > 0 for t in row[label]["times_s"])
        assert row[label]["busbw_GBps"] == pytest.approx((2 << 20) / 1e9 / row[label]["time_s"])
    for label in ("ps S=N", "ps S=N colo"):
        v = row[label]["vs_ring"]
        assert 0 < v["min"] <= v["median"] <= v["max"]


def test_collectives_benchmark_times_each_collective_on_both_topologies() -> None:
    r = _json(
        ["benchmarks/collectives.py", "--workers", "2", "--size", "4M", "--iters", "2", "--rounds", "1", "--json"]
    )
    assert r["workers"] == 2 and r["size"] == 4 << 20
    for name in ("broadcast", "all_gather", "all_reduce"):
        row = r["table"][name]
        assert row["ring_ms"] > 0 and row["ps_ms"] > 0
        assert row["ps_vs_ring"] == pytest.approx(row["ps_ms"] / row["ring_ms"])
        assert [len(r["rounds"][t]) for t in ("ring", "ps")] == [1, 1]


def test_bench_scale_reports_set_up_cost_beside_gloo_and_mpich() -> None:
    variants = "ring,ps,gloo"
    try:
        import torch  # noqa: F401
    except ImportError:
        variants = "ring,ps"  # gloo comes with torch
    if mpich_problem() is None:  # the bench extra: MPICH and its mpiexec (not another MPI's)
        variants += ",mpich"
    proc = run_tree(
        [sys.executable, "-m", "psring", "bench", "scale", "--worlds", "2,3", "--variants", variants, "--iters", "3",
         "--json"],
        capture_output=True, text=True, timeout=170, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [(r["world"], r["variant"]) for r in rows] == [(n, v) for n in (2, 3) for v in variants.split(",")]
    for r in rows:
        assert r["init_s"] > 0 and r["t4_s"] > 0 and r["t1m_s"] > 0, r
        assert r["fds"] >= r["sockets"] >= r["world"] - 1, r  # at least a link to each other rank or shard
    ring = {r["world"]: r for r in rows if r["variant"] == "ring"}
    assert ring[3]["sockets"] >= ring[2]["sockets"]
    bad = run_tree([sys.executable, "-m", "psring", "bench", "scale", "--variants", "mpi"], timeout=60, cwd=ROOT)
    assert bad.returncode != 0 and "--variants among ring, ps, gloo" in bad.stderr
