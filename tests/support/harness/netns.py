"""Network namespaces on one bridge, as separate hosts would be: for tests and benchmarks.

Needs root (or CAP_NET_ADMIN) and iproute2; `netns_available()` says why not when it cannot.
Every namespace gets one address on a bridge that lives in a namespace of its own, so cutting
a host's link (`cut`) or shaping its traffic with tc netem (`netem`) touches only that host.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True, timeout=30)


def netns_available() -> str | None:
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"psr-probe-{uuid.uuid4().hex[:6]}"
    try:
        sh("ip", "netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"network namespaces cannot be created here: {getattr(exc, 'stderr', exc)}"
    sh("ip", "netns", "del", probe)
    return None


class NetnsCluster:
    """Namespaces on one bridge; processes started in them are ended by PID."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.bridge_ns = f"psr-{tag}-br"
        self.hosts: dict[str, str] = {}
        self.namespaces: list[str] = []
        self.procs: list[subprocess.Popen[str]] = []
        sh("ip", "netns", "add", self.bridge_ns)
        self.namespaces.append(self.bridge_ns)
        sh("ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.bridge_ns, "link", "set", "br0", "up")

    def host(self, name: str) -> str:
        ns = f"psr-{self.tag}-{len(self.hosts)}"
        index = len(self.hosts) + 1
        address = f"10.213.0.{index}"
        sh("ip", "netns", "add", ns)
        self.namespaces.append(ns)
        veth = f"v{self.tag[:6]}{index}"
        sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        sh("ip", "link", "set", veth, "netns", self.bridge_ns)
        sh("ip", "-n", self.bridge_ns, "link", "set", veth, "master", "br0", "up")
        sh("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
        sh("ip", "-n", ns, "link", "set", "eth0", "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        self.hosts[name] = ns
        self.addresses = getattr(self, "addresses", {})
        self.addresses[name] = address
        return ns

    def write_hosts(self, aliases: dict[str, str] | None = None) -> None:
        """Every host's /etc/hosts (as `ip netns exec` shows it) names every host; ``aliases`` maps
        more names (a service, a pod's DNS name) to a host."""
        lines = ["127.0.0.1 localhost"] + [f"{a} {n}" for n, a in self.addresses.items()]
        lines += [f"{self.addresses[host]} {alias}" for alias, host in (aliases or {}).items()]
        for name, ns in self.hosts.items():
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            with open(f"/etc/netns/{ns}/hosts", "w") as fh:
                fh.write("\n".join([*lines, f"{self.addresses[name]} {name}-self"]) + "\n")

    def run(self, name: str, cmd: list[str], env: dict[str, str], **kw) -> subprocess.Popen[str]:
        full = ["ip", "netns", "exec", self.hosts[name], "env", *[f"{k}={v}" for k, v in env.items()], *cmd]
        proc = subprocess.Popen(full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)
        self.procs.append(proc)
        return proc

    def close(self) -> dict[int, str]:
        out = {}
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            out[proc.pid] = proc.communicate(timeout=30)[0] or ""
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        return out

    def link(self, name: str) -> tuple[str, str]:
        """(namespace, device) of the bridge side of a host's link."""
        index = list(self.hosts).index(name) + 1
        return self.bridge_ns, f"v{self.tag[:6]}{index}"

    def cut(self, name: str, up: bool = False) -> None:
        """Take a host's link down (or back up), on both ends: its packets go nowhere."""
        ns, dev = self.link(name)
        state = "up" if up else "down"
        sh("ip", "-n", ns, "link", "set", dev, state)
        sh("ip", "-n", self.hosts[name], "link", "set", "eth0", state)

    def shape(self, name: str, spec: str) -> None:
        """Degrade a host's link: "rate 200mbit" (tc tbf, both ways), "loss 1%" (iptables: each
        packet this host receives is dropped with that chance), or anything tc netem takes
        ("delay 5ms", "corrupt 0.1%"), where the kernel has netem. Raises Unavailable if not."""
        ns, dev = self.link(name)
        words = spec.split()
        while words:
            what = words.pop(0)
            if what == "rate":
                rate = words.pop(0)
                for where, device in ((self.hosts[name], "eth0"), (ns, dev)):
                    self._tc(where, device, "tbf", "rate", rate, "burst", "64kb", "latency", "50ms")
            elif what == "loss":
                chance = float(words.pop(0).rstrip("%")) / 100
                if shutil.which("iptables") is None:
                    raise Unavailable("iptables is not installed (apt-get install iptables)")
                sh(
                    "ip",
                    "netns",
                    "exec",
                    self.hosts[name],
                    "iptables",
                    "-A",
                    "INPUT",
                    "-m",
                    "statistic",
                    "--mode",
                    "random",
                    "--probability",
                    f"{chance:.6f}",
                    "-j",
                    "DROP",
                )
            else:
                for where, device in ((self.hosts[name], "eth0"), (ns, dev)):
                    self._tc(where, device, "netem", what, *words)
                words = []

    @staticmethod
    def _tc(ns: str, device: str, *qdisc: str) -> None:
        proc = subprocess.run(
            ["tc", "-n", ns, "qdisc", "replace", "dev", device, "root", *qdisc],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if proc.returncode != 0:
            raise Unavailable(f"tc {' '.join(qdisc)}: {proc.stderr.strip()} (this kernel lacks sch_{qdisc[0]}?)")


class Unavailable(RuntimeError):
    """This machine cannot make that network condition."""
