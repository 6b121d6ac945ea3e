"""A store SIGKILLed mid-job and started again on its data dir costs no job (#34): the daemons, the
submitter and the ranks reconnect; the job ends with an uninterrupted run's parameters; ``psring
status`` lists the same daemons and jobs; the next job runs."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..conftest import end, spawn
from .test_cluster import Cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

WORKERS = 3


def _start_store(cluster: Cluster, port: int, keep: bool = True) -> subprocess.Popen[str]:
    data = ["--data-dir", str(cluster.tmp / "data")] if keep else []
    proc = spawn(["-m", "psring", "store", "--host", "127.0.0.1", "--port", str(port), *data], cluster.env)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert "listening on" in line, line + end(proc)
    return proc


def _psring(cluster: Cluster, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "psring", *args],
        env={**os.environ, **cluster.env, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _submit(cluster: Cluster, topology: str, epochs: int) -> subprocess.Popen[str]:
    return _psring(
        cluster, "submit", "--store", cluster.address, "--topology", topology, "--workers", str(WORKERS),
        "--epochs", str(epochs), "--json",
    )  # fmt: skip


def _summary(out: str) -> dict:
    lines = [line for line in out.splitlines() if line.startswith("{") and "param_digest" in line]
    assert lines, out[-3000:]
    return json.loads(lines[-1])


@pytest.mark.parametrize(("topology", "keep"), [("ring", True), ("ps", True), ("ring", False)])
def test_a_store_restart_mid_job_costs_nothing(tmp_path: Path, topology: str, keep: bool) -> None:
    """``keep``: the store has a data dir. Without one it comes back empty, and the daemons put back
    what they own: their records and the job they run (not the finished jobs' history)."""
    cluster = Cluster(tmp_path)
    end(cluster.store)  # this test's store: started again (with a data dir if keep), on the same port
    port = int(cluster.address.rpartition(":")[2])
    cluster.store = _start_store(cluster, port, keep)
    submit = None
    try:
        for i in range(WORKERS):
            cluster.worker(f"w{i}")
        if topology == "ps":
            cluster.spawn_server_daemon("s0", "--checkpoint-dir", str(tmp_path / "ckpt"))
        epochs = 30
        reference = subprocess.run(
            [sys.executable, "-m", "psring", "submit", "--store", cluster.address, "--topology", topology,
             "--workers", str(WORKERS), "--epochs", str(epochs), "--json"],
            env={**os.environ, **cluster.env}, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]
        submit = _submit(cluster, topology, epochs)
        assert submit.stdout is not None
        at = 0
        for line in submit.stdout:
            found = re.search(r"step (\d+)/(\d+)", line)
            if found and int(found.group(1)) >= int(found.group(2)) // 4:
                at = int(found.group(1))
                break
        assert at, "the job made no progress"
        os.kill(cluster.store.pid, signal.SIGKILL)
        end(cluster.store)  # reaped, its pipe closed
        killed = time.monotonic()
        time.sleep(6)  # longer than the submitter's heartbeat bound (5 s): the outage must not count
        cluster.store = _start_store(cluster, port, keep)
        rest, _ = submit.communicate(timeout=300)
        assert submit.returncode == 0, f"submit exited {submit.returncode}:\n{rest[-4000:]}"
        steps = [int(m[1]) for m in re.finditer(r"step (\d+)/", rest)]
        assert steps and steps[-1] > at, rest[-2000:]
        summary = _summary(rest)
        assert summary["param_digest"] == _summary(reference.stdout)["param_digest"]
        status = subprocess.run(
            [sys.executable, "-m", "psring", "status", "--store", cluster.address, "--json"],
            env={**os.environ, **cluster.env}, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        state = json.loads(status.stdout)
        assert sorted(w["id"] for w in state["workers"]) == [f"w{i}" for i in range(WORKERS)]
        assert all(w["state"] != "lost" for w in state["workers"]), state["workers"]
        if keep:
            assert [(j["id"], j["state"]) for j in state["jobs"]] == [(1, "done"), (2, "done")], state["jobs"]
        else:  # the job that ran through the restart, put back by its workers
            assert [(j["id"], j["state"]) for j in state["jobs"]] == [(2, "done")], state["jobs"]
        after = subprocess.run(
            [sys.executable, "-m", "psring", "submit", "--store", cluster.address, "--topology", topology,
             "--workers", str(WORKERS), "--epochs", "2", "--json"],
            env={**os.environ, **cluster.env}, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert after.returncode == 0, after.stdout[-3000:]
        assert "job 3 placed" in after.stdout, after.stdout[-2000:]  # a new id, past the jobs the store knows
        test_a_store_restart_mid_job_costs_nothing.took = time.monotonic() - killed  # type: ignore[attr-defined]
    finally:
        if submit is not None and submit.poll() is None:
            submit.kill()
            submit.communicate(timeout=30)
        cluster.close()



def test_a_store_gone_past_the_bound_ends_every_process_naming_it(tmp_path: Path) -> None:
    """The store SIGKILLed for good mid-job: the submitter, the server daemon and every worker daemon
    say the store's address and how long they tried, and exit non-zero soon after the bound; nothing
    hangs, nothing prints a traceback."""
    bound = 3
    cluster = Cluster(tmp_path)
    cluster.env["PSRING_STORE_RECONNECT_S"] = str(bound)
    cluster.env["PYTHONFAULTHANDLER"] = "1"  # a process that dies of a signal says where (seen once in CI: no output)
    submit = None
    try:
        for i in range(2):
            cluster.worker(f"w{i}")
        cluster.spawn_server_daemon("s0")
        submit = _psring(cluster, "submit", "--store", cluster.address, "--topology", "ps", "--workers", "2",
                         "--epochs", "500")  # fmt: skip
        assert submit.stdout is not None
        for line in submit.stdout:
            if re.search(r"step \d+/", line):
                break
        os.kill(cluster.store.pid, signal.SIGKILL)
        killed = time.monotonic()
        procs = {**cluster.daemons, "submit": submit}
        outs = {}
        for name, proc in procs.items():
            try:
                out, _ = proc.communicate(timeout=bound + 30)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name} still runs {bound + 30}s after the store went for good")
            outs[name] = out
        took = time.monotonic() - killed
        for name, proc in procs.items():
            assert proc.returncode not in (0, None), f"{name} exited {proc.returncode}:\n{outs[name][-2000:]}"
            assert outs[name].strip(), f"{name} exited {proc.returncode} without a word after it was ready"
            last = outs[name].strip().splitlines()[-1]
            assert cluster.address in last and f"PSRING_STORE_RECONNECT_S={bound}s" in last, (name, last)
            assert "Traceback" not in outs[name] and "never retrieved" not in outs[name], outs[name][-3000:]
        assert took < bound + 20, took
    finally:
        if submit is not None and submit.poll() is None:
            submit.kill()
            submit.communicate(timeout=30)
        cluster.close()
