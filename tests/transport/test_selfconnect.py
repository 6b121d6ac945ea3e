"""A dial to a port nobody listens on can reach itself: where the port is in the kernel's ephemeral
range, connect() may bind the socket to that very port and TCP's simultaneous open connects it to
itself. open_connection must take that for what it is -- nothing listens there, try again -- and let
go of the port, which a restarting server needs (a store restarted at its port while its clients
redial). A network namespace of the test's own, whose ephemeral range is that one port, makes every
such dial a self-connect.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from ..support.harness.netns import netns_available, sh

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

ROOT = str(Path(__file__).resolve().parents[2])
PORT = 45123

DIAL = f"""
import asyncio
from psring.errors import PeerLostError
from psring.transport.listener import Listener, open_connection

async def main():
    try:
        await open_connection("127.0.0.1", {PORT}, secret=None, hello={{"role": "t"}}, timeout=1.0)
    except PeerLostError as exc:
        print("REFUSED", exc, flush=True)
    else:
        print("CONNECTED", flush=True)
    listener = await Listener(lambda c: None, secret=None, router_for=lambda c: None).start("127.0.0.1", {PORT})
    print("BOUND", listener.port, flush=True)
    await listener.close()

asyncio.run(main())
"""


def test_a_dial_that_reaches_itself_counts_as_refused_and_frees_the_port() -> None:
    why = netns_available()
    if why is not None:
        pytest.skip(f"needs network namespaces: {why}")
    ns = f"psr-sc-{uuid.uuid4().hex[:6]}"
    sh("ip", "netns", "add", ns)
    try:
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv4.ip_local_port_range={PORT} {PORT}")
        env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": ROOT, "HOME": "/tmp"}
        out = subprocess.run(
            ["ip", "netns", "exec", ns, sys.executable, "-c", DIAL],
            capture_output=True,
            text=True,
            timeout=50,
            env=env,
        )
        said = out.stdout + out.stderr
        assert out.returncode == 0, said
        # every attempt reached itself and was let go: the dial fails as one to a port nobody listens on
        assert f"REFUSED cannot connect to 127.0.0.1:{PORT}" in said and "reached itself" in said, said
        assert f"BOUND {PORT}" in said, said  # and the port is free for the server
    finally:
        sh("ip", "netns", "del", ns)
