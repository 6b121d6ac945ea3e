"""PSRING_PS_SNDBUF: the kernel send buffer of a connection between a worker and a shard on another host,
set at both ends -- and left to the kernel between a worker and a shard on one host; and, with it and
PSRING_PS_WIRE_PIECES unset, what a job takes by itself for the links rank 0 measures at set-up.

Two hosts are network namespaces on one bridge: host a runs the store, a ``psring server`` shard and
rank 0; host b runs rank 1. While the job holds its connections, ``ss`` in each namespace reads the
kernel's send buffer (``tb``, which Linux keeps at twice what was set) of every connection to or from
the shard's port.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..support.harness.netns import NetnsCluster, Unavailable, netns_available

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

ROOT = str(Path(__file__).resolve().parents[2])
SNDBUF = 96 << 10

WORKER = """
import sys
import numpy as np
import psring
g = psring.init(timeout=60)
y = g.all_reduce(np.full(1 << 18, g.rank + 1.0, np.float32))
print("SUM", g.rank, float(y[0]), float(y[-1]), flush=True)
sys.stdin.readline()  # the test reads the sockets meanwhile
g.close()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _send_buffers(ns: str, port: int) -> dict[tuple[str, str], int]:
    """(local, peer) address -> the kernel's send buffer of each established TCP connection with ``port``
    at one end, in namespace ``ns``."""
    text = subprocess.run(
        ["ip", "netns", "exec", ns, "ss", "-tmnH", "state", "established"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    out = {}
    for m in re.finditer(r"(\S+):(\d+)\s+(\S+):(\d+)\s*\n?\s*skmem:\([^)]*?tb(\d+)", text):
        if port in (int(m[2]), int(m[4])):
            out[(f"{m[1]}:{m[2]}", f"{m[3]}:{m[4]}")] = int(m[5])
    return out


def _wait_for_port(cluster: NetnsCluster, host: str, address: str, port: int) -> None:
    probe = f"import socket; socket.create_connection(({address!r}, {port}), 1).close()"
    deadline = time.monotonic() + 30
    while subprocess.run(["ip", "netns", "exec", cluster.hosts[host], sys.executable, "-c", probe],
                         capture_output=True, timeout=30).returncode != 0:  # fmt: skip
        assert time.monotonic() < deadline, f"nothing listens on {address}:{port}"
        time.sleep(0.2)


def _start_job(
    cluster: NetnsCluster, job: str, script: str, rank_hosts: tuple[str, str], settings: dict[str, str]
) -> tuple[int, list[subprocess.Popen[str]]]:
    """A store and a ``psring server`` shard on host a, and a rank of ``script`` on each of rank_hosts
    (rank 0 first); returns the shard's port and the ranks, each waiting on its stdin to end."""
    a = cluster.addresses["a"]
    store_port, server_port = _free_port(), _free_port()
    base = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1", "HOME": "/tmp",
            "PSRING_JOB": job, **settings}  # fmt: skip
    cluster.run("a", [sys.executable, "-m", "psring", "store", "--port", str(store_port)], base)
    _wait_for_port(cluster, "a", a, store_port)
    store = f"{a}:{store_port}"
    cluster.run("a", [sys.executable, "-m", "psring", "server", "--store", store, "--shard", "0",
                      "--num-shards", "1", "--host", "0.0.0.0", "--port", str(server_port),
                      "--advertise", a, "--job", job], base)  # fmt: skip
    _wait_for_port(cluster, "a", a, server_port)
    ranks = []
    for rank, host in enumerate(rank_hosts):
        env = {**base, "RANK": str(rank), "WORLD_SIZE": "2", "PSRING_STORE": store, "PSRING_TOPOLOGY": "ps"}
        ranks.append(cluster.run(host, [sys.executable, "-c", script], env, stdin=subprocess.PIPE))
    return server_port, ranks


def _end(ranks: list[subprocess.Popen[str]]) -> None:
    """Let the ranks close their groups, and wait for them to exit cleanly."""
    for proc in ranks:
        assert proc.stdin is not None
        proc.stdin.write("\n")
        proc.stdin.flush()
    for proc in ranks:
        assert proc.wait(timeout=60) == 0


def test_send_buffer_is_set_between_hosts_only() -> None:
    why = netns_available()
    if why is not None:
        pytest.skip(f"needs network namespaces: {why}")
    cluster = NetnsCluster(f"sb{os.getpid() % 10000}")
    try:
        for name in ("a", "b"):
            cluster.host(name)
        a, b = cluster.addresses["a"], cluster.addresses["b"]
        server_port, ranks = _start_job(cluster, "sndbuf", WORKER, ("a", "b"), {"PSRING_PS_SNDBUF": str(SNDBUF)})
        for proc in ranks:  # the all_reduce went through the shard: 1 + 2 everywhere
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.split()[2:] == ["3.0", "3.0"], line + (proc.stdout.read() if proc.poll() is not None else "")
        at_a = _send_buffers(cluster.hosts["a"], server_port)
        at_b = _send_buffers(cluster.hosts["b"], server_port)
        # rank 1 (host b) and the shard (host a): both ends set (the kernel reports twice the setting)
        remote = {k: v for k, v in at_a.items() if k[1].startswith(f"{b}:")}
        assert list(remote.values()) == [2 * SNDBUF], (at_a, at_b)
        assert list(at_b.values()) == [2 * SNDBUF] and all(k[1] == f"{a}:{server_port}" for k in at_b), at_b
        # rank 0 and the shard share host a: the kernel sizes those buffers as it does any other's
        local = {k: v for k, v in at_a.items() if k[1].startswith(f"{a}:")}
        assert local and all(v != 2 * SNDBUF for v in local.values()), at_a
        _end(ranks)
    finally:
        cluster.close()


TUNED = """
import sys
import numpy as np
import psring
g = psring.init(timeout=60)
y = g.all_reduce(np.full(1 << 18, g.rank + 1.0, np.float32))
t = g._group.links.tuning  # the job's choice, as rank 0 measured it and every worker learned it
print("SUM", g.rank, float(y[0]), float(y[-1]), t.pieces, t.sndbuf, t.rate, flush=True)
sys.stdin.readline()  # the test reads the sockets meanwhile
g.close()
"""


def test_a_job_takes_advises_pieces_and_buffers_for_slow_links_it_measures() -> None:
    """No setting given, links of 200 Mbit/s: rank 0 (host b, the shard on host a) measures them at
    set-up and the job runs as `psring advise` says for such links -- 32 pieces a slice on every worker
    (rank 1, beside the shard, learns it from the store) and 128 KiB send buffers at both ends of the
    connection between hosts, none where worker and shard share a host."""
    why = netns_available()
    if why is not None:
        pytest.skip(f"needs network namespaces: {why}")
    cluster = NetnsCluster(f"sa{os.getpid() % 10000}")
    try:
        for name in ("a", "b"):
            cluster.host(name)
        try:
            for name in ("a", "b"):
                cluster.shape(name, "rate 200mbit")
        except Unavailable as exc:
            pytest.skip(f"needs tc tbf: {exc}")
        a, b = cluster.addresses["a"], cluster.addresses["b"]
        server_port, ranks = _start_job(cluster, "tuned", TUNED, ("b", "a"), {})
        for proc in ranks:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            words = line.split()
            assert words[2:6] == ["3.0", "3.0", "32", str(128 << 10)], line + (
                proc.stdout.read() if proc.poll() is not None else ""
            )
            assert 10e6 < float(words[6]) < 40e6, line  # 200 Mbit/s: 25 MB/s, as rank 0 measured it
        at_a = _send_buffers(cluster.hosts["a"], server_port)
        at_b = _send_buffers(cluster.hosts["b"], server_port)
        remote = {k: v for k, v in at_a.items() if k[1].startswith(f"{b}:")}
        assert list(remote.values()) == [2 * (128 << 10)], (at_a, at_b)  # the shard's end, told by rank 0
        assert list(at_b.values()) == [2 * (128 << 10)], at_b  # rank 0's end
        local = {k: v for k, v in at_a.items() if k[1].startswith(f"{a}:")}
        assert local and all(v != 2 * (128 << 10) for v in local.values()), at_a
        _end(ranks)
    finally:
        cluster.close()
