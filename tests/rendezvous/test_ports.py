"""Which TCP ports every process psring starts listens on, in every deployment shape, read from the
kernel (psutil) while a job holds its group open. The promise (docs/operations.md, "Ports"):

- a rank listens on at most one port of its own -- PSRING_PORT when set, else an ephemeral one
  (a ring rank always; a ps worker only when it hosts shards, which then take its port);
- the process that serves the store listens on the store's port too (MASTER_PORT);
- psring store, psring server and the launcher's store: one port each;
- a daemon listens on its declared port only, idle or running jobs (a server daemon serves
  every job's shards there; a worker daemon's job listens there while it runs).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ..cluster.test_cluster import Cluster
from .test_start import free_port

HOLD = str(Path(__file__).resolve().parents[1] / "support" / "jobs" / "hold_job.py")
ROOT = str(Path(__file__).resolve().parents[2])

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def listening(pid: int) -> set[int]:
    proc = psutil.Process(pid)
    return {c.laddr.port for c in proc.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}


class Held:
    """Processes started for a shape, and the ranks' PIDs once every rank holds its group open."""

    def __init__(self, tmp: Path, world: int) -> None:
        self.flags, self.world = tmp, world
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, cmd: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            cmd,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": ROOT, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def ranks(self) -> dict[int, tuple[int, str]]:
        """rank -> (pid, MASTER_PORT), waiting until every rank is ready."""
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            ready = sorted(p for p in self.flags.glob("ready-[0-9]*") if not p.name.endswith(".tmp"))
            if len(ready) == self.world:
                out = {}
                for path in ready:
                    pid, _, port = path.read_text().partition(" ")
                    out[int(path.name.split("-")[1])] = (int(pid), port)
                return out
            dead = [p for p in self.procs if p.poll() is not None]
            assert not dead, [p.communicate()[0] for p in dead]
            time.sleep(0.05)
        raise AssertionError(f"not every rank got ready: {sorted(self.flags.iterdir())}")

    def finish(self) -> list[str]:
        (self.flags / "go").touch()
        outs = []
        for proc in self.procs:
            try:
                outs.append(proc.communicate(timeout=60)[0])
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.communicate(timeout=30)
        assert all(p.returncode == 0 for p in self.procs), outs
        return outs


@pytest.mark.parametrize("topology", ["ring", "ps"])
def test_processes_with_their_own_ports(tmp_path: Path, topology: str) -> None:
    """No launcher: rank 0 serves the store on MASTER_PORT; each rank takes its PSRING_PORT (a ps
    worker only when it hosts shards: rank 0 on this local default)."""
    master, ports = free_port(), [free_port() for _ in range(3)]
    held = Held(tmp_path, 3)
    for r in range(3):
        env = {"RANK": str(r), "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master)}
        env.update(PSRING_PORT=str(ports[r]), PSRING_TOPOLOGY=topology)
        held.start([sys.executable, HOLD, str(tmp_path)], env)
    try:
        ranks = held.ranks()
        for r, (pid, _) in ranks.items():
            own = {ports[r]} if topology == "ring" or r == 0 else set()
            assert listening(pid) == own | ({master} if r == 0 else set()), (r, topology)
    finally:
        held.finish()


@pytest.mark.parametrize("topology, colocate", [("ring", False), ("ps", False), ("ps", True)])
def test_psring_launch(tmp_path: Path, topology: str, colocate: bool) -> None:
    held = Held(tmp_path, 2)
    launcher = held.start(
        [sys.executable, "-m", "psring", "launch", "-n", "2", "--topology", topology,
         *(["--colocate"] if colocate else []), "--servers", "2", "--", sys.executable, HOLD, str(tmp_path)],
        {},
    )  # fmt: skip
    try:
        ranks = held.ranks()
        store_port = int(ranks[0][1])
        assert listening(launcher.pid) == {store_port}
        rank_pids = {p for p, _ in ranks.values()}
        servers = [c.pid for c in psutil.Process(launcher.pid).children() if c.pid not in rank_pids]
        for pid, _ in ranks.values():
            assert len(listening(pid)) == (0 if topology == "ps" and not colocate else 1), (topology, colocate)
        assert len(servers) == (2 if topology == "ps" and not colocate else 0)
        for pid in servers:
            assert len(listening(pid)) == 1
    finally:
        held.finish()


def test_daemons_listen_on_their_declared_ports_idle_and_busy(tmp_path: Path) -> None:
    """Two worker daemons and a server daemon, each with a declared port: idle; running a ring job;
    running two ps jobs at once (the server daemon serves both jobs' shards on its one port)."""
    c = Cluster(tmp_path)
    c.env["PYTHONPATH"] += os.pathsep + ROOT  # the entrypoint, tests.support.jobs.hold_job
    try:
        w_ports = [free_port(), free_port()]
        workers = [c.worker(f"w{i}", "--port", str(p)) for i, p in enumerate(w_ports)]
        s_port = free_port()
        server = c.spawn_server_daemon("s0", "--port", str(s_port))
        for proc, port in [*zip(workers, w_ports, strict=True), (server, s_port)]:
            assert listening(proc.pid) == {port}
        client = c.client()
        try:
            flags = tmp_path / "ring"
            flags.mkdir()
            held = Held(flags, 2)
            job = client.submit("ring", 2, entrypoint="tests.support.jobs.hold_job:main", args={"flags": str(flags)})
            held.ranks()
            for proc, port in zip(workers, w_ports, strict=True):  # the job's ring listens on the declared port
                assert listening(proc.pid) == {port}
            (flags / "go").touch()
            job.wait(timeout=60)
            jobs = []
            for name in ("a", "b"):  # two ps jobs of one worker each, at once, on the one server daemon
                (tmp_path / name).mkdir()
                args = {"flags": str(tmp_path / name)}
                jobs.append(client.submit("ps", 1, entrypoint="tests.support.jobs.hold_job:main", args=args))
            for name in ("a", "b"):
                Held(tmp_path / name, 1).ranks()
            assert listening(server.pid) == {s_port}
            for proc in workers:  # a ps worker listens on nothing while its job runs
                assert listening(proc.pid) == set()
            for name in ("a", "b"):
                (tmp_path / name / "go").touch()
            for j in jobs:
                j.wait(timeout=60)
            deadline = time.monotonic() + 10  # back to idle: the declared ports again
            pairs = list(zip(workers, w_ports, strict=True))
            while time.monotonic() < deadline and any(listening(p.pid) != {port} for p, port in pairs):
                time.sleep(0.1)
            for proc, port in [*zip(workers, w_ports, strict=True), (server, s_port)]:
                assert listening(proc.pid) == {port}
        finally:
            client.close()
    finally:
        c.close()
