"""psring launch and psring bench as a user runs them: real processes, real exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from ..conftest import run_tree

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

PSRING = [sys.executable, "-m", "psring"]


def run(args: list[str], timeout: float = 100) -> subprocess.CompletedProcess[str]:
    return run_tree([*PSRING, *args], capture_output=True, text=True, timeout=timeout)


def test_launch_good_run(tmp_path) -> None:
    script = tmp_path / "job.py"
    script.write_text(
        "import os, numpy as np, psring\n"
        "g = psring.init()\n"
        "y = g.all_reduce(np.full(3, float(g.rank)))\n"
        "h = g.broadcast(np.arange(4.0) * (g.rank + 1), src=0, async_op=True)\n"
        "print('local', os.environ['LOCAL_RANK'], 'sum', y.tolist(), 'bcast', h.wait().tolist(), flush=True)\n"
        "g.close()\n"
    )
    proc = run(["launch", "-n", "3", "--", sys.executable, str(script)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for r in range(3):
        assert f"[rank {r}] local {r} sum [3.0, 3.0, 3.0] bcast [0.0, 1.0, 2.0, 3.0]" in proc.stdout


def test_launch_failing_rank_stops_the_others(tmp_path) -> None:
    script = tmp_path / "job.py"
    script.write_text("import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(7)\ntime.sleep(60)\n")
    proc = run(["launch", "-n", "3", "--", sys.executable, str(script)], timeout=60)
    assert proc.returncode == 7
    assert "rank 1 exited with code 7; stopping the others" in proc.stderr


def test_launch_bad_arguments() -> None:
    proc = run(["launch", "-n", "0", "--", "true"])
    assert proc.returncode == 2 and "-n must be at least 1" in proc.stderr
    proc = run(["launch", "-n", "2"])
    assert proc.returncode == 2 and "give the command to run after --" in proc.stderr


def test_bench_allreduce_table_and_json() -> None:
    proc = run(["bench", "allreduce", "--workers", "2", "--sizes", "4,256K", "--iters", "2", "--json"])
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    rows = data["rows"]
    assert [r["size"] for r in rows] == [4, 256 << 10]
    for r in rows:
        assert r["time_s"] > 0 and r["busbw_GBps"] == pytest.approx(r["algbw_GBps"])  # 2(N-1)/N = 1 at N=2
    proc = run(["bench", "allreduce", "--workers", "2", "--sizes", "1K", "--iters", "1"])
    assert proc.returncode == 0 and "busbw(GB/s)" in proc.stdout and "1K" in proc.stdout


@pytest.mark.timeout(180)
@pytest.mark.parametrize("topology, extra", [("ring", []), ("ps", ["--hand-written-ring"])])
def test_tutorial_example_runs_and_its_ring_equals_all_reduce(topology: str, extra: list[str]) -> None:
    import pathlib

    script = pathlib.Path(__file__).resolve().parents[2] / "examples" / "tutorial_sync_sgd.py"
    proc = run_tree(
        [
            sys.executable,
            "-m",
            "psring",
            "launch",
            "-n",
            "3",
            "--topology",
            topology,
            "--",
            sys.executable,
            str(script),
            "--epochs",
            "2",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("hand-written ring == all_reduce: True") == 3, proc.stdout
    assert proc.stdout.count("ranks agree: True") == 3, proc.stdout
    losses = [
        float(line.rsplit(" ", 1)[1]) for line in proc.stdout.splitlines() if "epoch" in line and "rank 0:" in line
    ]
    assert len(losses) == 2 and losses[1] < losses[0]


def test_launch_ps_colocated_starts_no_server_processes(tmp_path) -> None:
    script = tmp_path / "job.py"
    script.write_text(
        "import os, numpy as np, psring\n"
        "from psring.transport.local import LocalConnection\n"
        "g = psring.init()\n"
        "y = g.all_reduce(np.full(300_000, float(g.rank)))\n"
        "own = [type(c).__name__ for c in g._group.links.shards]\n"
        "print('shards', len(own), 'own', own.index('LocalConnection'), 'sum', y[0], flush=True)\n"
        "g.close()\n"
    )
    proc = run(["launch", "-n", "3", "--topology", "ps", "--colocate", "--", sys.executable, str(script)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[server" not in proc.stdout  # no `psring server` process was started
    for r in range(3):
        assert f"[rank {r}] shards 3 own {r} sum 3.0" in proc.stdout, proc.stdout
    proc = run(["bench", "allreduce", "--workers", "2", "--colocate", "--sizes", "4"])
    assert proc.returncode != 0 and "--colocate applies to --topology ps only" in proc.stderr


@pytest.mark.timeout(30)
def test_the_suites_runner_ends_what_a_timed_out_command_started(tmp_path) -> None:
    """run_tree (every launch/bench/train test runs through it): on a timeout the command's
    children die with it, where subprocess.run would leave them running."""
    pid_file = tmp_path / "child.pid"
    script = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(60)\n"
    )
    with pytest.raises(subprocess.TimeoutExpired):
        run_tree([sys.executable, "-c", script], timeout=3)
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.05)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False
