"""The slow-link bed: hosts on links with a rate *and a delay*, real TCP end to end (#81).

This kernel has tc tbf but no netem, so the delay is made in user space: every "host" is a network
namespace whose only link is a TUN device (``tun0``, 10.215.0.i/24, MTU 9000); this process holds the
devices' other ends and forwards each IP packet to its destination host's device, as a switch between
the hosts' links would, holding it for the link's serialisation at ``--rate`` on the sender's uplink and
on the receiver's downlink (a drop-tail queue of ``--queue-ms`` each, as a router's) and for ``--rtt-ms``
/ 2 of propagation each way. So a round trip between two hosts is the RTT asked for, and TCP sees real
losses and delays.

The variants -- all_reduce with no codec (``fp32``) and with each codec (``fp16``, ``bf16``, ``int8``) --
run in alternating rounds, one rank in each host (psring's ring, or ``--topology ps``, its shards in
the ranks). It prints, per size and variant, the slowest rank's median time, the busbw
(size/time x 2(N-1)/N), and the bytes the hosts' links carried per call as the kernel counts them (the
``tun0`` devices' tx bytes, as ``ip -s link`` shows them; the barriers and warm-up calls included), and
the ratios to fp32. Needs root (namespaces, TUN).

    sudo python benchmarks/slowlink.py --hosts 4 --rate 100mbit --rtt-ms 20 --sizes 64M --variants fp32,int8
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import heapq
import json
import os
import selectors
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from psring.cli.bench import human, parse_size  # noqa: E402
from psring.cluster.advise import parse_rate  # noqa: E402

VARIANTS = ("fp32", "fp16", "bf16", "int8")
TUNSETIFF, IFF_TUN, IFF_NO_PI = 0x400454CA, 0x0001, 0x1000
NET = "10.215.0"


class Forwarder(threading.Thread):
    """The switch between the hosts' links: reads each host's packets from its TUN device and writes
    them to the destination's, at ``rate`` bits/s on the sender's uplink and the receiver's downlink,
    ``delay`` seconds of propagation between, a drop-tail queue of ``queue`` seconds on each link."""

    def __init__(self, fds: list[int], rate: float, delay: float, queue: float) -> None:
        super().__init__(name="slowlink-forwarder", daemon=True)
        self.fds, self.rate, self.delay, self.queue = fds, rate, delay, queue
        self.up_free = [0.0] * len(fds)  # when each host's uplink is free again
        self.down_free = [0.0] * len(fds)
        self.dropped = 0
        self.forwarded = 0
        self._halt = threading.Event()
        for fd in fds:
            os.set_blocking(fd, False)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)

    def run(self) -> None:
        sel = selectors.DefaultSelector()
        for i, fd in enumerate(self.fds):
            sel.register(fd, selectors.EVENT_READ, i)
        due: list[tuple[float, int, int, bytes]] = []
        seq = 0
        n = len(self.fds)
        while not self._halt.is_set():
            now = time.monotonic()
            while due and due[0][0] <= now:
                _, _, dst, pkt = heapq.heappop(due)
                with contextlib.suppress(BlockingIOError, OSError):  # the host's queue full: a loss
                    os.write(self.fds[dst], pkt)
                    self.forwarded += 1
            timeout = max(0.0, min(due[0][0] - now, 0.05)) if due else 0.05
            for key, _ in sel.select(timeout):
                src = key.data
                while True:
                    try:
                        pkt = os.read(self.fds[src], 65536)
                    except BlockingIOError:
                        break
                    if len(pkt) < 20 or pkt[0] >> 4 != 4 or pkt[12:15] != pkt[16:19]:
                        continue  # IPv4 between the bed's hosts only
                    dst = pkt[19] - 1
                    if not 0 <= dst < n or dst == src:
                        continue
                    now = time.monotonic()
                    wire = len(pkt) * 8 / self.rate
                    start = max(now, self.up_free[src])
                    if start - now > self.queue:
                        self.dropped += 1
                        continue
                    self.up_free[src] = start + wire
                    arrive = self.up_free[src] + self.delay
                    begin = max(arrive, self.down_free[dst])
                    if begin - arrive > self.queue:
                        self.dropped += 1
                        continue
                    self.down_free[dst] = begin + wire
                    heapq.heappush(due, (self.down_free[dst], seq, dst, pkt))
                    seq += 1


class SlowBed:
    """``hosts`` namespaces, one TUN link each, and the forwarder between them; processes started in
    them are ended by PID."""

    def __init__(self, hosts: int, rate: float, rtt: float, queue: float) -> None:
        self.tag = uuid.uuid4().hex[:6]
        self.names = [f"psr-l{self.tag}-{i}" for i in range(hosts)]
        self.addresses = [f"{NET}.{i + 1}" for i in range(hosts)]
        self.fds: list[int] = []
        self.procs: list[subprocess.Popen[str]] = []
        try:
            for i, ns in enumerate(self.names):
                dev = f"sl{self.tag}{i}"
                fd = os.open("/dev/net/tun", os.O_RDWR)
                fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", dev.encode(), IFF_TUN | IFF_NO_PI))
                self.fds.append(fd)
                _sh("ip", "netns", "add", ns)
                _sh("ip", "link", "set", dev, "netns", ns)
                _sh("ip", "-n", ns, "link", "set", dev, "name", "tun0")
                _sh("ip", "-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", "tun0")
                _sh("ip", "-n", ns, "link", "set", "tun0", "mtu", "9000", "up")
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        self.forwarder = Forwarder(self.fds, rate, rtt / 2, queue)
        self.forwarder.start()

    def run(self, host: int, cmd: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
        full = ["ip", "netns", "exec", self.names[host], "env", *[f"{k}={v}" for k, v in env.items()], *cmd]
        proc = subprocess.Popen(full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.procs.append(proc)
        return proc

    def wait(self, procs: list[subprocess.Popen[str]], what: str, timeout: float) -> None:
        """Wait for the ranks ``procs`` (each killed, by PID, past ``timeout``); a RuntimeError naming
        every rank that failed or did not finish."""
        failed = []
        deadline = time.monotonic() + timeout
        for r, proc in enumerate(procs):
            try:
                said = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] or ""
            except subprocess.TimeoutExpired:
                proc.kill()
                said = proc.communicate(timeout=30)[0] or ""
                failed.append(f"rank {r} did not finish within {timeout:g}s: {said[-800:]}")
                continue
            if proc.returncode != 0:
                failed.append(f"rank {r} exited {proc.returncode}: {said[-800:]}")
        self.procs = [p for p in self.procs if p not in procs]
        if failed:
            raise RuntimeError(f"{what}: " + "; ".join(failed))

    def tx_bytes(self) -> list[int]:
        """Each host's link's transmitted bytes, as the kernel counts them (``ip -s link``)."""
        out = []
        for ns in self.names:
            text = subprocess.run(["ip", "netns", "exec", ns, "cat", "/sys/class/net/tun0/statistics/tx_bytes"],
                                  capture_output=True, text=True, timeout=10).stdout  # fmt: skip
            out.append(int(text.strip() or 0))
        return out

    def close(self) -> None:
        if hasattr(self, "forwarder"):
            self.forwarder.stop()
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(Exception):
                proc.communicate(timeout=30)
        for ns in self.names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)


def _sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


def exit_on_sigterm() -> None:
    """SIGTERM (``timeout``, a CI runner) ends the bed as Ctrl-C does: its namespaces and processes go."""

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(f"slowlink: signal {signum}")

    signal.signal(signal.SIGTERM, stop)


def add_bed_arguments(ap: argparse.ArgumentParser) -> None:
    """The bed's flags, the same in every benchmark that runs on it."""
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--rate", default="100mbit", help="each host's link, both ways (tc's units: 100mbit, 10mbit)")
    ap.add_argument("--rtt-ms", type=float, default=20.0, help="the round trip between two hosts")
    ap.add_argument("--queue-ms", type=float, default=50.0, help="each link's drop-tail queue, in time at the rate")


def bed_from(args: argparse.Namespace) -> SlowBed:
    """The bed those flags describe."""
    return SlowBed(args.hosts, parse_rate(args.rate) * 8, args.rtt_ms / 1e3, args.queue_ms / 1e3)


def available() -> str | None:
    """Why the bed cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, TUN devices)"
    if not os.path.exists("/dev/net/tun"):
        return "needs /dev/net/tun"
    if subprocess.run(["ip", "netns", "list"], capture_output=True).returncode != 0:
        return "needs ip netns"
    return None


def run_variant(bed: SlowBed, variant: str, topology: str, sizes: list[int], iters: int, warmup: int,
                timeout: float) -> tuple[list[dict[str, Any]], list[int]]:  # fmt: skip
    """Every rank in its host; rank 0's rows and the links' bytes over the run."""
    world = len(bed.names)
    with tempfile.TemporaryDirectory(prefix="psring-slowlink-") as tmp:
        out = os.path.join(tmp, "result.json")
        spec = {"sizes": sizes, "dtype": "float32", "iters": iters, "warmup": warmup, "small_iters": iters,
                "mid_iters": iters, "out": out, "backend": "psring", "timeout": timeout,
                "compression": None if variant == "fp32" else variant}  # fmt: skip
        port = 29000 + int(uuid.uuid4().int % 1000)
        before = bed.tx_bytes()
        procs = []
        for r in range(world):
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
                   "RANK": str(r), "WORLD_SIZE": str(world), "MASTER_ADDR": bed.addresses[0],
                   "MASTER_PORT": str(port), "PSRING_TOPOLOGY": topology, "PSRING_PS_COLOCATE": "1",
                   "PSRING_JOB": f"slow-{variant}", "OMP_NUM_THREADS": "1", "PSRING_TIMEOUT": str(timeout)}  # fmt: skip
            cmd = [sys.executable, "-m", "psring.training.bench_ranks", json.dumps(spec)]
            procs.append(bed.run(r, cmd, env))
        bed.wait(procs, variant, timeout)
        after = bed.tx_bytes()
        with open(out) as fh:
            rows: list[dict[str, Any]] = json.load(fh)["results"]
    for row in rows:
        row["busbw_GBps"] = row["size"] / row["time_s"] / 1e9 * 2 * (world - 1) / world
    return rows, [a - b for a, b in zip(after, before, strict=True)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bed_arguments(ap)
    ap.add_argument("--topology", choices=("ring", "ps"), default="ring")
    ap.add_argument("--sizes", default="64M")
    ap.add_argument("--variants", default="fp32,int8")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--json", default=None, help="write the rows to this file")
    args = ap.parse_args()
    why = available()
    if why is not None:
        raise SystemExit(f"slowlink: {why}")
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"slowlink: unknown variants {unknown} (of {', '.join(VARIANTS)})")
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    exit_on_sigterm()
    bed = bed_from(args)
    results: dict[str, list[tuple[list[dict[str, Any]], list[int]]]] = {v: [] for v in variants}
    try:
        for _ in range(args.rounds):
            for v in variants:
                results[v].append(run_variant(bed, v, args.topology, sizes, args.iters, args.warmup, args.timeout))
        dropped = bed.forwarder.dropped
    finally:
        bed.close()
    calls = args.warmup + args.iters
    rows = []
    for v in variants:
        for k, size in enumerate(sizes):
            times = [r[0][k]["time_s"] for r in results[v]]
            wire = [max(r[1]) / calls / len(sizes) for r in results[v]]  # the busiest link, per call
            t = statistics.median(times)
            rows.append({"variant": v, "size": size, "time_s": t, "busbw_GBps": size / t / 1e9 * 2 * (args.hosts - 1)
                         / args.hosts, "wire_bytes_per_call": statistics.median(wire),
                         "app_bytes_per_call": results[v][0][0][k].get("bytes_sent_per_call")})  # fmt: skip
    base = {r["size"]: r for r in rows if r["variant"] == "fp32"}
    print(f"# {args.hosts} hosts, {args.rate} links, {args.rtt_ms:g} ms RTT, {args.topology}; "
          f"{args.rounds} round(s), median of {args.iters} calls; forwarder dropped {dropped} packets")  # fmt: skip
    head = ("variant", "size", "time(ms)", "busbw(MB/s)", "x fp32", "wire/call", "x fp32")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (8, 6, 10, 12, 7, 11, 7), strict=True)))
    for r in rows:
        b = base.get(r["size"])
        speed = f"{r['busbw_GBps'] / b['busbw_GBps']:.2f}" if b else "-"
        wire = f"{r['wire_bytes_per_call'] / b['wire_bytes_per_call']:.3f}" if b else "-"
        print(f"{r['variant']:>8} {human(r['size']):>6} {r['time_s'] * 1e3:>10.1f} {r['busbw_GBps'] * 1e3:>12.2f} "
              f"{speed:>7} {r['wire_bytes_per_call'] / (1 << 20):>10.2f}M {wire:>7}")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
