"""``etcd://``: the store on a real etcd cluster of three members (Debian's etcd-server), started here
on loopback with their peer URLs pinned to 127.0.0.1, and ended by PID (#34)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import psring
from psring.rendezvous.etcd import EtcdStoreClient

from ..conftest import end
from .test_start import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


class Etcd:
    """Three etcd members on 127.0.0.1, each a process of this test."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.names = ["e0", "e1", "e2"]
        self.client_ports = {n: free_port() for n in self.names}
        self.peer_ports = {n: free_port() for n in self.names}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        cluster = ",".join(f"{n}=http://127.0.0.1:{self.peer_ports[n]}" for n in self.names)
        for n in self.names:
            self.procs[n] = self._start(n, cluster)

    def _start(self, name: str, cluster: str) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"{name}.log", "ab")
        try:
            return subprocess.Popen(
                ["etcd", "--name", name, "--data-dir", str(self.tmp / name),
                 "--listen-client-urls", f"http://127.0.0.1:{self.client_ports[name]}",
                 "--advertise-client-urls", f"http://127.0.0.1:{self.client_ports[name]}",
                 "--listen-peer-urls", f"http://127.0.0.1:{self.peer_ports[name]}",
                 "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_ports[name]}",
                 "--initial-cluster", cluster, "--initial-cluster-state", "new",
                 "--heartbeat-interval", "100", "--election-timeout", "1000"],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        finally:
            log.close()

    @property
    def address(self) -> str:
        return "etcd://" + ",".join(f"127.0.0.1:{self.client_ports[n]}" for n in self.names)

    def status(self, name: str) -> dict | None:
        try:
            req = urllib.request.Request(
                f"http://127.0.0.1:{self.client_ports[name]}/v3/maintenance/status", data=b"{}", method="POST"
            )
            with urllib.request.urlopen(req, timeout=2) as resp:
                return json.loads(resp.read())
        except OSError:
            return None

    def wait_healthy(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = [self.status(n) for n in self.names if self.procs[n].poll() is None]
            if states and all(s and s.get("leader") not in (None, "0") for s in states):
                return
            time.sleep(0.2)
        raise AssertionError("the etcd cluster did not elect a leader: " + (self.tmp / "e0.log").read_text()[-2000:])

    def leader(self) -> str:
        for n in self.names:
            s = self.status(n)
            if s and s["header"]["member_id"] == s["leader"]:
                return n
        raise AssertionError("no leader")

    def kill(self, name: str) -> None:
        os.kill(self.procs[name].pid, signal.SIGKILL)
        self.procs[name].wait(10)

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
            p.wait(10)


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[Etcd]:
    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    cluster = Etcd(tmp_path)
    try:
        cluster.wait_healthy()
        yield cluster
    finally:
        cluster.close()


@pytest.mark.asyncio
async def test_the_store_interface_on_etcd(etcd: Etcd) -> None:
    store = await psring.rendezvous.client.connect_store(
        psring.rendezvous.client.parse_store_address(etcd.address + "/t"), secret=None, timeout=10
    )
    assert isinstance(store, EtcdStoreClient)
    await store.set("a", b"1")
    assert await store.get("a") == b"1" and await store.get("missing") is None
    assert [await store.add("n"), await store.add("n", 4)] == [1, 5]
    assert await store.compare_set("c", None, b"x") == (True, b"x")
    assert await store.compare_set("c", None, b"y") == (False, b"x")
    assert await store.compare_set("c", b"x", b"z") == (True, b"z")
    assert await store.delete("a") and not await store.delete("a")
    assert await store.list("") == ["c", "n"]
    later = asyncio.ensure_future(asyncio.sleep(0.3))
    later.add_done_callback(lambda _: asyncio.ensure_future(store.set("w", b"late")))
    started = time.monotonic()
    assert await store.get("w", timeout=10) == b"late"  # a watch, not a poll: back as soon as it is put
    assert time.monotonic() - started < 3
    await store.set("record", b"r", ttl=60)  # a daemon's record: on a lease; its age is the lease's
    value, age = await store.get_aged("record")
    assert value == b"r" and age is not None and 0 <= age <= 2
    await store.barrier("b", 1, 10)
    await store.close()


@pytest.mark.asyncio
async def test_groups_meet_through_etcd(etcd: Etcd) -> None:
    for topology, options in (("ring", {}), ("ps", {"colocate": True})):
        groups = await asyncio.gather(
            *(
                psring.init_group(
                    topology, rank=r, world_size=3, store=etcd.address + f"/{topology}", timeout=30, **options
                )
                for r in range(3)
            )
        )
        try:
            ys = await asyncio.gather(*(g.all_reduce(np.full(1000, g.rank + 1.0, np.float32)) for g in groups))
            assert all(np.all(y == 6.0) for y in ys)
        finally:
            await asyncio.gather(*(g.close() for g in groups))


def _psring(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "psring", *args],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _ready(proc: subprocess.Popen[str], text: str) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        if text in line:
            return
    raise AssertionError(f"{text!r} never appeared (exit {proc.poll()})")


def _summary(out: str) -> dict:
    return json.loads([line for line in out.splitlines() if line.startswith("{") and "param_digest" in line][-1])


@pytest.mark.parametrize("fault", ["leader killed mid-job", "one member down throughout"])
def test_a_cluster_job_over_etcd_survives_a_member_lost(etcd: Etcd, fault: str) -> None:
    daemons = []
    submit = None
    try:
        if fault == "one member down throughout":
            etcd.kill(etcd.names[2])
        for i in range(2):
            daemons.append(_psring("worker", "--store", etcd.address, "--host", "127.0.0.1", "--name", f"w{i}"))
            _ready(daemons[-1], "ready on")
        daemons.append(_psring("server", "--cluster", "--store", etcd.address, "--host", "127.0.0.1", "--name", "s0"))
        _ready(daemons[-1], "ready for ps jobs")
        job = ["submit", "--store", etcd.address, "--topology", "ps", "--workers", "2", "--epochs", "20", "--json"]
        reference = subprocess.run([sys.executable, "-m", "psring", *job], capture_output=True, text=True, timeout=180)
        assert reference.returncode == 0, reference.stdout[-3000:]
        submit = _psring(*job)
        assert submit.stdout is not None
        if fault == "leader killed mid-job":
            for line in submit.stdout:
                m = re.search(r"step (\d+)/(\d+)", line)
                if m and int(m[1]) >= int(m[2]) // 4:
                    break
            etcd.kill(etcd.leader())
            killed = time.monotonic()
            seen = []
            for line in submit.stdout:  # the submitter follows the job through the store: it hears again
                seen.append(line)
                if re.search(r"step (\d+)/", line):
                    print(f"first step {time.monotonic() - killed:.2f}s after the leader was killed")
                    break
        out, _ = submit.communicate(timeout=180)
        out = "".join(locals().get("seen", [])) + out
        assert submit.returncode == 0, out[-3000:]
        assert _summary(out)["param_digest"] == _summary(reference.stdout)["param_digest"]
        status = subprocess.run(
            [sys.executable, "-m", "psring", "status", "--store", etcd.address, "--json"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        state = json.loads(status.stdout)
        assert sorted(w["id"] for w in state["workers"]) == ["w0", "w1"]
        assert [j["state"] for j in state["jobs"]] == ["done", "done"]
    finally:
        if submit is not None and submit.poll() is None:
            submit.kill()
            submit.communicate(timeout=30)
        for d in daemons:
            end(d)


def test_daemons_told_to_stop_while_etcd_is_gone_end_within_the_grace(etcd: Etcd) -> None:
    """docker compose down with an etcd store: the members go first. Found by the fault campaign: the
    daemons waited out PSRING_STORE_RECONNECT_S (60 s) retrying etcd, as they once did psring's store."""
    daemons = []
    try:
        daemons.append(_psring("worker", "--store", etcd.address, "--host", "127.0.0.1", "--name", "w0"))
        _ready(daemons[-1], "ready on")
        daemons.append(_psring("server", "--cluster", "--store", etcd.address, "--host", "127.0.0.1", "--name", "s0"))
        _ready(daemons[-1], "ready for ps jobs")
        for name in etcd.names:
            etcd.kill(name)
        time.sleep(1.5)  # the daemons found no member answering and are retrying
        for d in daemons:
            os.kill(d.pid, signal.SIGTERM)
        for d in daemons:
            t0 = time.monotonic()
            try:
                d.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pytest.fail(f"still running 10 s after SIGTERM: {end(d)[-2000:]}")
            assert time.monotonic() - t0 < 10
    finally:
        for d in daemons:
            end(d)


def test_an_etcd_address_that_is_not_etcd_is_named_at_start(tmp_path: Path) -> None:
    store = _psring("store", "--host", "127.0.0.1", "--port", "0")  # a psring store, not etcd
    try:
        assert store.stdout is not None
        port = re.search(r":(\d+)", store.stdout.readline())[1]  # type: ignore[index]
        run = subprocess.run(
            [sys.executable, "-m", "psring", "status", "--store", f"etcd://127.0.0.1:{port}"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert run.returncode == 2, (run.stdout, run.stderr)
        assert f"etcd://127.0.0.1:{port}" in run.stderr + run.stdout
    finally:
        end(store)
