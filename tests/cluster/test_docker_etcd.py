"""docker-compose.yml's etcd profile on a real Docker engine (#34): three etcd members built from
Debian's packages (deploy/etcd.Dockerfile) are the cluster's store (PSRING_COMPOSE_STORE); a ps job
runs through the SIGKILL of the etcd leader's process and ends with an uninterrupted run's
parameters. Skips, saying why, where no Docker engine answers (as tests/cluster/test_docker.py)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator

import pytest

from .test_docker import Compose, _follow, _summary, engine_ready

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
WORKERS = 2
MEMBERS = ("etcd0", "etcd1", "etcd2")
ETCD = "etcd://" + ",".join(f"{m}:2379" for m in MEMBERS)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Compose]:
    engine_ready()
    compose = Compose(tmp_path_factory.mktemp("compose-etcd"), store=ETCD, profiles=("etcd",))
    try:
        compose("build", timeout=900)
        compose("up", "-d", "--scale", f"worker={WORKERS}", timeout=300)
        deadline = time.monotonic() + 180
        while True:
            status = compose.psring("status", "--store", ETCD, "--json", check=False)
            if status.returncode == 0:
                state = _summary(status.stdout)
                if len([w for w in state["workers"] if w["state"] == "idle"]) == WORKERS and state["servers"]:
                    break
            assert time.monotonic() < deadline, status.stdout[-2000:] + status.stderr[-2000:]
            time.sleep(2)
        yield compose
    finally:
        compose("down", "-v", "--remove-orphans", timeout=300, check=False)


def _leader(cluster: Compose) -> str:
    """The member that leads now, by etcd's own account (etcdctl endpoint status)."""
    endpoints = ",".join(f"http://{m}:2379" for m in MEMBERS)
    out = cluster("exec", "-T", "etcd0", "etcdctl", f"--endpoints={endpoints}", "endpoint", "status", "-w", "json")
    rows = json.loads(out.stdout)
    [leader] = [r["Endpoint"] for r in rows if r["Status"]["header"]["member_id"] == r["Status"]["leader"]]
    return leader.split("//")[1].split(":")[0]


def test_the_etcd_leader_killed_mid_job_costs_nothing(cluster: Compose) -> None:
    epochs = 40
    args = ("submit", "--store", ETCD, "--topology", "ps", "--workers", str(WORKERS), "--epochs", str(epochs), "--json")
    reference = _summary(cluster.psring(*args).stdout)  # the compose cluster runs its jobs through etcd
    leader = _leader(cluster)
    proc = cluster.popen_psring(*args)
    try:
        at, _ = _follow(proc, 100)
        container = f"{cluster.project}_{leader}_1"
        before = cluster.pid(container)
        os.kill(before, 9)  # a crash: the restart policy brings the member back, the others elect a leader
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, f"submit exited {proc.returncode}:\n{out[-4000:]}"
    summary = _summary(out)
    assert summary["param_digest"] == reference["param_digest"]
    assert summary["steps"] > at
    status = _summary(cluster.psring("status", "--store", ETCD, "--json").stdout)
    assert [j["state"] for j in status["jobs"]] == ["done", "done"], status["jobs"]
    assert len(status["workers"]) == WORKERS and all(w["state"] == "idle" for w in status["workers"])
    assert cluster.pid(container) != before
