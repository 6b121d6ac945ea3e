"""Point-to-point throughput: psring's connection layer against plain blocking sockets.

One process sends ``--iters`` frames of ``--size`` bytes to another over 127.0.0.1,
through psring (uvloop, authenticated Connection, payload read straight into a
preallocated buffer) and the same bytes over a plain blocking socket
(``sendall`` / ``recv_into``), rounds alternating between the two in the same run so the ratio means something on
a noisy machine. Each figure is the median over ``--repeats`` rounds.

    python benchmarks/p2p.py --size 64M --iters 20 --repeats 5 [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import time
from typing import Any

import numpy as np

from psring.cli.bench import parse_size
from psring.transport.connection import Connection
from psring.transport.listener import Listener, open_connection
from psring.transport.loop import new_event_loop

SECRET = b"p2p-bench"


# ---------------------------------------------------------------- psring side
class _Sink:
    """Router that reads every data frame straight into one preallocated buffer."""

    def __init__(self, size: int, iters: int) -> None:
        self.buf = memoryview(np.empty(size, dtype=np.uint8))
        self.iters = iters
        self.count = 0
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def buffer_for(self, conn: Connection, header: dict[str, Any]) -> memoryview | None:
        return self.buf

    def deliver(self, conn: Connection, header: dict[str, Any], payload: Any) -> None:
        if payload is not self.buf:
            raise RuntimeError("payload did not land in the posted buffer")
        self.count += 1
        if self.count == self.iters:
            conn.send_frame({"kind": "data", "tag": (0, "ack")})
            self.count = 0

    def connection_lost(self, conn: Connection, error: Any) -> None:
        if not self.done.done():
            self.done.set_result(None)


async def _psring_receiver(size: int, iters: int, port_file: str) -> None:
    sink = _Sink(size, iters)
    listener = await Listener(lambda conn: None, secret=SECRET, router_for=lambda conn: sink).start("127.0.0.1", 0)
    with open(port_file + ".tmp", "w") as fh:
        fh.write(str(listener.port))
    os.rename(port_file + ".tmp", port_file)
    await sink.done
    await listener.close()


class _Acks:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[None] = asyncio.Queue()

    def buffer_for(self, conn: Connection, header: dict[str, Any]) -> None:
        return None

    def deliver(self, conn: Connection, header: dict[str, Any], payload: Any) -> None:
        self.queue.put_nowait(None)

    def connection_lost(self, conn: Connection, error: Any) -> None:
        pass


class _PsringSender:
    def __init__(self, port: int, size: int, iters: int) -> None:
        self.port, self.size, self.iters = port, size, iters
        self.acks = _Acks()
        self.payload = memoryview(np.ones(size, dtype=np.uint8))

    async def connect(self) -> None:
        self.conn = await open_connection(
            "127.0.0.1", self.port, secret=SECRET, hello={"role": "bench"}, router=self.acks
        )

    async def round(self) -> float:
        t0 = time.perf_counter()
        for i in range(self.iters):
            self.conn.send_frame({"kind": "data", "tag": (0, "p2p", i)}, self.payload)
            await self.conn.flush()
        await self.acks.queue.get()
        return self.size * self.iters / (time.perf_counter() - t0) / 1e9


# --------------------------------------------------------------- socket side
def _socket_receiver(size: int, iters: int, port_file: str) -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    with open(port_file + ".tmp", "w") as fh:
        fh.write(str(srv.getsockname()[1]))
    os.rename(port_file + ".tmp", port_file)
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(np.empty(size, dtype=np.uint8))
    head = bytearray(8)
    try:
        while True:
            count = 0
            for _ in range(iters):
                got = conn.recv_into(head, 8, socket.MSG_WAITALL)
                if got == 0:
                    return
                (n,) = struct.unpack("<Q", head)
                off = 0
                while off < n:
                    r = conn.recv_into(buf[off:n])
                    if r == 0:
                        return
                    off += r
                count += 1
            conn.sendall(b"A")
    finally:
        conn.close()
        srv.close()


class _SocketSender:
    def __init__(self, port: int, size: int, iters: int) -> None:
        self.size, self.iters = size, iters
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.payload = memoryview(np.ones(size, dtype=np.uint8))
        self.head = struct.pack("<Q", size)

    def round(self) -> float:
        t0 = time.perf_counter()
        for _ in range(self.iters):
            self.sock.sendall(self.head)
            self.sock.sendall(self.payload)
        if self.sock.recv(1) != b"A":
            raise RuntimeError("socket receiver did not acknowledge")
        return self.size * self.iters / (time.perf_counter() - t0) / 1e9


# ------------------------------------------------------------------- driver
def _start_receiver(transport: str, size: int, iters: int, tmp: str) -> tuple[subprocess.Popen[bytes], int]:
    port_file = os.path.join(tmp, f"{transport}.port")
    proc = subprocess.Popen(
        [sys.executable, __file__, "--receiver", transport, "--size", str(size), "--iters", str(iters), port_file]
    )
    deadline = time.monotonic() + 30
    while not os.path.exists(port_file):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{transport} receiver did not start")
        time.sleep(0.01)
    with open(port_file) as fh:
        return proc, int(fh.read())


def measure(size: int, iters: int, repeats: int) -> tuple[list[float], list[float]]:
    """Alternate psring and socket rounds (after one warm-up round each) so drift hits both alike."""
    import tempfile

    procs: list[subprocess.Popen[bytes]] = []
    loop = new_event_loop()
    try:
        with tempfile.TemporaryDirectory(prefix="psring-p2p-") as tmp:
            ps_proc, ps_port = _start_receiver("psring", size, iters, tmp)
            procs.append(ps_proc)
            sk_proc, sk_port = _start_receiver("socket", size, iters, tmp)
            procs.append(sk_proc)
        ps = _PsringSender(ps_port, size, iters)
        loop.run_until_complete(ps.connect())
        sk = _SocketSender(sk_port, size, iters)
        ps_rates, sk_rates = [], []
        for r in range(repeats + 1):
            a = loop.run_until_complete(ps.round())
            b = sk.round()
            if r:
                ps_rates.append(a)
                sk_rates.append(b)
        loop.run_until_complete(ps.conn.close())
        sk.sock.close()
        return ps_rates, sk_rates
    finally:
        loop.close()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="64M", help="bytes per frame (default 64M)")
    parser.add_argument("--iters", type=int, default=20, help="frames per round (default 20)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds; the median is reported (default 5)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--receiver", choices=["psring", "socket"], help=argparse.SUPPRESS)
    parser.add_argument("port_file", nargs="?", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    size = parse_size(args.size) if isinstance(args.size, str) else args.size
    if args.receiver == "psring":
        loop = new_event_loop()
        try:
            loop.run_until_complete(_psring_receiver(size, args.iters, args.port_file))
        finally:
            loop.close()
        return 0
    if args.receiver == "socket":
        _socket_receiver(size, args.iters, args.port_file)
        return 0

    ps, sk = measure(size, args.iters, args.repeats)
    result = {
        "size": size,
        "iters": args.iters,
        "psring_GBps": statistics.median(ps),
        "socket_GBps": statistics.median(sk),
        "psring_rounds": ps,
        "socket_rounds": sk,
    }
    result["ratio"] = result["psring_GBps"] / result["socket_GBps"]
    if args.json:
        print(json.dumps(result))
    else:
        print(f"# p2p over 127.0.0.1, {args.size} frames x {args.iters}, median of {args.repeats} rounds")
        print(f"{'transport':>22} {'GB/s':>8}")
        print(f"{'psring Connection':>22} {result['psring_GBps']:>8.2f}")
        print(f"{'blocking sockets':>22} {result['socket_GBps']:>8.2f}")
        print(f"{'ratio psring/socket':>22} {result['ratio']:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
