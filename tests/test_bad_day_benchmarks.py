"""Short forms of the bad-day benchmarks: benchmarks/faults.py (the fault campaign, #59) runs a case and
checks its invariants; benchmarks/contention.py (psring against gloo under CPU hogs, #60) runs a cell and
ends its hogs. What they measure is theirs to say (docs/operations.md, docs/performance-history.md)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_tree

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[1]


def _case(case: str, *extra: str) -> dict[str, Any]:
    """Run one case of the campaign (its own process tree, bounded); its JSON line, checked to be the only
    one and the run's exit status to agree with it (a case the machine cannot make: skipped, saying why)."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "faults.py"), "--case", case, *extra, "--json"]
    res = run_tree(cmd, timeout=280)
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 1, res.stdout + res.stderr
    if "skipped" in rows[0]:
        pytest.skip(rows[0]["skipped"])
    assert rows[0]["case"] == case and rows[0]["held"], json.dumps(rows[0], indent=1)  # whole: tails and all
    assert res.returncode == 0, res.stdout + res.stderr
    return rows[0]


def test_the_fault_campaign_runs_a_case_and_it_holds() -> None:
    """The store SIGKILLed before the job and started again by the restart policy: the job still ends with
    the undisturbed run's bits, a fresh job after it too, SIGTERM ends everything, nothing is left."""
    _case("ring/store/kill/idle", "--workers", "2", "--epochs", "4")


@pytest.mark.parametrize(
    "case", ["ring/store/partition/idle", "ps/store/full-disk/idle", "ring/worker/partition-peer/idle"]
)
def test_the_fault_campaign_cuts_a_process_off_and_fills_a_disk(case: str) -> None:
    """A partition (the store's packets dropped, then healed; or a worker cut off from the other worker
    only, each a network namespace of its own) and a full disk (the store's, then emptied) held while the
    job is submitted: it ends with the bits or fails naming the fault, a fresh job after the fault healed
    gives the bits, and nothing is left (iptables rule, cgroup, namespaces, mount, processes)."""
    before = _left()
    row = _case(case, "--workers", "2", "--epochs", "4", "--stop-s", "2")
    if case.endswith("full-disk/idle"):  # submitted onto a full disk: refused, saying so
        assert "No space left" in row["job"] or row["job"] == "done, the bits", row
    # nothing of its own left: another campaign's (one running beside, or a killed one's) is not its
    assert _left() - before == set(), _left() - before


def _left() -> set[str]:
    """What a fault case makes and must undo: iptables rules and network namespaces of a partition
    (benchmarks/faults.py's Hosts: "psr-x..."; other beds' tags are hex), a full disk's mount."""
    rules = subprocess.run(["iptables", "-S", "OUTPUT"], capture_output=True, text=True, timeout=30).stdout
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    mounts = Path("/proc/mounts").read_text()
    return (
        {line for line in rules.splitlines() if "psring-fault-" in line}
        | {line.split()[0] for line in spaces.splitlines() if line.startswith("psr-x")}
        | {line for line in mounts.splitlines() if "psring-faults-" in line}
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="a full disk's tmpfs needs root to mount")
def test_a_campaign_reclaims_the_mount_a_killed_campaign_left_and_not_a_live_ones(tmp_path: Path) -> None:
    """A campaign SIGKILLed mid full-disk case leaves its tmpfs mounted (CI once met one): the next
    campaign unmounts it, as its owner's pid is gone; one whose owner still runs stays mounted."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    bases = {}
    for who, pid in (("gone", gone.pid), ("live", os.getpid())):
        base = tmp_path / f"psring-faults-{who}"
        (base / "store-data").mkdir(parents=True)
        (base / "owner").write_text(str(pid))
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(base / "store-data")], check=True,
                       timeout=30)  # fmt: skip
        bases[who] = base
    try:
        code = "import sys; sys.path.insert(0, 'benchmarks'); import faults; print(faults.reclaim())"
        res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        mounts = Path("/proc/mounts").read_text()
        assert str(bases["gone"] / "store-data") not in mounts and not bases["gone"].exists(), res.stdout
        assert f"unmounted {bases['gone'] / 'store-data'}" in res.stdout, res.stdout
        assert str(bases["live"] / "store-data") in mounts, res.stdout
    finally:
        for base in bases.values():
            subprocess.run(["umount", "-l", str(base / "store-data")], capture_output=True, timeout=30)


def test_the_fault_campaign_restarts_a_daemon_as_another_wire_version() -> None:
    """A worker daemon stopped and started again as the next wire version (a rolling upgrade gone wrong):
    it ends within the grace naming both versions (the case checks it), the operator's right version then
    takes the job, which ends with the bits."""
    row = _case("ring/worker/wire/idle", "--workers", "2", "--epochs", "4")
    assert row["job"] == "done, the bits", row


def test_the_fault_campaign_kills_a_worker_of_an_elastic_job_as_it_admits_a_new_one() -> None:
    """The admission phase: two ps workers under psring launch --elastic admit a third; one of the two is
    SIGKILLed as they say so. Before psring launch took --elastic it stopped every rank on that loss; now
    the others and the joiner go on, every worker reports the same parameters at every step and the
    survivors agree on the live group (the case checks it)."""
    row = _case("ps/rank/kill/admission")
    assert row["job"] == "done, agreed", row


def test_the_fault_campaign_skips_what_its_log_says_held_on_this_code(tmp_path: Path) -> None:
    """--log: a campaign in parts. A case the log says held on this code, seed and bed is not run again
    (nothing starts: the run ends at once) and counts in the totals; one that held on other code does
    not count."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import faults
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    code = faults.code_digest()
    assert len(code) == 16 and code == faults.code_digest()
    log = tmp_path / "campaign.jsonl"
    bed = {"seed": 0, "workers": 2, "stop_s": 5.0, "epochs": 4}
    rows = [{"case": "ring/store/kill/idle", "held": True, "code": code, **bed},
            {"case": "ring/store/term/idle", "held": True, "code": "0" * 16, **bed}]  # fmt: skip
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd = [sys.executable, str(ROOT / "benchmarks" / "faults.py"), "--case", "ring/store/kill/idle", "--workers", "2",
           "--stop-s", "5", "--epochs", "4", "--log", str(log)]  # fmt: skip
    res = run_tree(cmd, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"1 of these cases held already on this code ({code}" in res.stdout, res.stdout
    assert f"with the log's: 1 of 1 held on this code ({code})" in res.stdout, res.stdout
    assert log.read_text().count("\n") == 2  # nothing ran, nothing appended
    held = faults.held_in_log(str(log), code, argparse.Namespace(**bed))
    assert held == {"ring/store/kill/idle"}  # the other held on other code


def test_sigterm_ends_the_campaign_and_the_case_under_way_stops_its_processes() -> None:
    """The campaign runs for hours: stopped midway (SIGTERM, or ^C), the case under way ends every process
    of its bed before the campaign exits (130, saying so), and nothing of it is left."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "faults.py"), "--case", "ring/store/kill/mid-step",
           "--workers", "2", "--epochs", "30"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not _marked_by(proc.pid) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert _marked_by(proc.pid), "the case's bed never came up"
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 130 and "interrupted (signal 15)" in err, out + err
        assert _marked_by(proc.pid) == [], "processes of the case left running"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _marked_by(campaign: int) -> list[int]:
    """Processes a campaign's case started (their marker names the campaign's pid)."""
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/environ", "rb") as f:
                    env = f.read().split(b"\0")
            except OSError:
                continue
            if any(v.startswith(b"PSRING_FAULT_CASE=") and f"-{campaign}-".encode() in v for v in env):
                found.append(int(d))
    return found


def test_the_fault_campaign_names_what_is_not_a_case() -> None:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "faults.py"), "--case", "ring/server/kill/idle"]
    res = run_tree(cmd, timeout=60)
    assert res.returncode == 2 and "no server daemon on the ring" in res.stderr, res.stderr


@pytest.mark.parametrize("session", ["own", "shared"])
def test_the_contention_benchmark_runs_a_cell_and_ends_its_hogs(session: str) -> None:
    pytest.importorskip("torch", reason="gloo comes with torch")
    before = set(_hogs())  # (spinners of someone else's: not this run's to end)
    cmd = [sys.executable, str(ROOT / "benchmarks" / "contention.py"), "--hogs", "1", "--paths", "host",
           "--workers", "2", "--sizes", "4", "--iters", "3", "--rounds", "1", "--json",
           "--hog-session", session]  # fmt: skip
    res = run_tree(cmd, timeout=280)
    assert res.returncode == 0, res.stdout + res.stderr
    [row] = json.loads(res.stdout.strip().splitlines()[-1])
    assert (row["hogs"], row["path"], row["workers"], row["size"]) == (1, "host", 2, 4)
    assert row["psring_s"] > 0 and row["gloo_s"] > 0
    left = set(_hogs()) - before
    assert not left, f"hogs left running: {left}"


def _hogs() -> list[str]:
    return [p for p in os.listdir("/proc") if p.isdigit() and _cmdline(p) == b"sh\0-c\0while :; do :; done\0"]


def _cmdline(pid: str) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def test_the_fault_campaign_keeps_timed_tails_and_what_a_silent_bed_waits_in(tmp_path: Path) -> None:
    """--tails keeps every process's last lines with when each came; --dump-silent S sends SIGUSR1 to the
    bed when the judged job says nothing for S seconds, and keeps what each process says it waits in --
    without disturbing the case (it still holds: the processes go on)."""
    log = tmp_path / "campaign.jsonl"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "faults.py"), "--case", "ring/store/kill/idle", "--workers", "2",
           "--stop-s", "5", "--epochs", "4", "--log", str(log), "--tails", "--dump-silent", "0.3"]  # fmt: skip
    res = run_tree(cmd, timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    (row,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert row["held"], row
    assert any(name.startswith("worker") for name in row["tails"]), row["tails"].keys()
    timed = row["tails"][next(n for n in row["tails"] if n.startswith("worker"))].splitlines()
    assert timed and all(re.match(r"\s*\d+\.\d\d ", line) for line in timed), timed
    said = "\n".join(row["dumps"].values())
    assert "on SIGUSR1: what it waits in" in said and "thread MainThread" in said, said[-2000:]
