"""Several hosts on one machine: all_reduce over rate-limited links, flat ring vs hierarchical vs ps vs gloo.

H "hosts" are network namespaces on one bridge, R ranks in each; the link between each host and
the bridge is shaped with tc tbf (both directions) at each ``--rates`` value (this kernel has no
netem, so no delay). Inside a namespace ranks talk over its loopback; between namespaces only
over the shaped links. For every rate the variants run in alternating rounds, so drift on a noisy
machine hits them alike:

  flat  psring ring, PSRING_HIERARCHICAL=off (every ring link carries 2(N-1)/N of the tensor)
  hier  psring ring, PSRING_HIERARCHICAL=on (reduce within hosts, then across; psring.topology.ring.hier)
  ps    psring ps with a shard on every rank (PSRING_PS_COLOCATE, S=N), every rank pushing its tensor
  psh   the same, reduced within each host before it is pushed (PSRING_HIERARCHICAL=on: the two-level
        order; psring.topology.ps.worker.hostreduce) -- as ps where hosts hold one rank
  psd   psring ps with its shards on ``--server-hosts K`` dedicated hosts (namespaces of their own,
        shaped alike, no rank on them; one ``psring server --shard i --num-shards K`` each)
  split the BytePS split: a shard in every rank and one on each of the K dedicated hosts, every tensor
        cut by the weights ``psring advise`` computes for the layout (PSRING_PS_DEDICATED=K,
        PSRING_PS_WEIGHTS; ``--weights`` to give others)
        (psd and split reduce within each host first, as psh, where hosts hold several ranks)
  gloo  torch.distributed gloo (needs torch), meeting through a file, GLOO_SOCKET_IFNAME=eth0

Any variant may be run under settings of its own, side by side with the others: ``--tuning NAME=K=V,K=V``
names them, ``VARIANT@NAME`` runs one with them (ranks and shards alike), as in ``--variants
flat,psd,psd@fixed,psd@tuned --tuning fixed=PSRING_PS_SNDBUF=0,PSRING_PS_WIRE_PIECES=8 --tuning
tuned=PSRING_PS_SNDBUF=128K,PSRING_PS_WIRE_PIECES=32`` (the ps's own choice, the fixed values psring used
before it measured its links, and advise's by hand).

Needs root (network namespaces, tc). Prints one table per rate (median time of the slowest rank,
busbw = size/time·2(N-1)/N) and the ratios; ``--json FILE`` writes the rows.

    sudo python benchmarks/hosts.py --hosts 2 --ranks 2 --rates 1gbit,10gbit --sizes 4,64M --rounds 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from psring.cli.bench import human, parse_size  # noqa: E402
from psring.cluster.advise import Layout, parse_rate, split_weights  # noqa: E402
from tests.support.harness.netns import NetnsCluster, netns_available, sh  # noqa: E402

VARIANTS = ("flat", "hier", "ps", "psh", "psd", "split", "gloo")
#: the variants that need --server-hosts
DEDICATED = ("psd", "split")


def shape(cluster: NetnsCluster, host: str, rate: str) -> None:
    """tbf at ``rate`` on both ends of a host's link, with a burst the rate can refill in 4 ms
    (a fixed 64 KiB burst caps a 10 Gbit/s tbf well below its rate)."""
    rate_bytes = int(parse_rate(rate))
    burst = max(64 << 10, rate_bytes // 250)
    bridge_ns, bridge_dev = cluster.link(host)
    for ns, dev in ((cluster.hosts[host], "eth0"), (bridge_ns, bridge_dev)):
        sh(
            "tc",
            "-n",
            ns,
            "qdisc",
            "replace",
            "dev",
            dev,
            "root",
            "tbf",
            "rate",
            rate,
            "burst",
            str(burst),
            "latency",
            "50ms",
        )


def _tuning() -> dict[str, str]:
    """The ps's tuning settings this benchmark was run with (PSRING_PS_*), for ranks and shards alike."""
    return {k: v for k, v in os.environ.items() if k.startswith("PSRING_PS_") and k != "PSRING_PS_COLOCATE"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_for_port(addr: str, port: int, host: str, cluster: NetnsCluster, timeout: float = 30.0) -> None:
    """Until something listens on addr:port, as seen from inside ``host``'s namespace."""
    probe = f"import socket; socket.create_connection(({addr!r}, {port}), 1).close()"
    deadline = time.monotonic() + timeout
    while subprocess.run(["ip", "netns", "exec", cluster.hosts[host], sys.executable, "-c", probe],
                         capture_output=True).returncode != 0:  # fmt: skip
        if time.monotonic() > deadline:
            raise RuntimeError(f"nothing listens on {addr}:{port} in {host} after {timeout:g}s")
        time.sleep(0.2)


def run_variant(
    cluster: NetnsCluster,
    variant: str,
    hosts: int,
    ranks: int,
    sizes: list[int],
    iters: int,
    timeout: float,
    weights: str | None = None,
    tunings: dict[str, dict[str, str]] | None = None,
) -> list[dict[str, Any]]:
    """Start every rank in its namespace, wait for all, return rank 0's rows (one per size)."""
    variant, _, tuned = variant.partition("@")
    extra = (tunings or {})[tuned] if tuned else {}
    world = hosts * ranks
    names = [n for n in cluster.hosts if n.startswith("host")]
    server_hosts = [n for n in cluster.hosts if n.startswith("srv")]
    if variant in DEDICATED and not server_hosts:
        raise ValueError(f"the {variant} variant needs --server-hosts K >= 1")
    # the split: shards 0..world-1 in the ranks, world..world+K-1 on the server hosts
    first, total = (world, world + len(server_hosts)) if variant == "split" else (0, len(server_hosts))
    if variant == "split" and weights is None:
        weights = ",".join(map(str, split_weights(Layout(hosts, ranks, len(server_hosts)))))
    with tempfile.TemporaryDirectory(prefix="psring-hosts-") as tmp:
        out = os.path.join(tmp, "result.json")
        spec = {
            "sizes": sizes,
            "dtype": "float32",
            "iters": iters,
            "warmup": 1,
            "small_iters": 200,
            "out": out,
            "backend": "gloo" if variant == "gloo" else "psring",
            "gloo_init": "file://" + os.path.join(tmp, "gloo-rendezvous"),
            "timeout": timeout,
        }
        port, job = _free_port(), f"hosts-{variant}-{uuid.uuid4().hex[:6]}"
        procs = []
        store_at = f"{cluster.addresses[names[0]]}:{port}"
        if variant in DEDICATED:
            # a store of its own (on the first worker host), as a cluster with dedicated servers runs one:
            # a rank 0 that served the store itself would start shards of its own beside them
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
            procs.append(cluster.run(names[0], [sys.executable, "-m", "psring", "store", "--port", str(port)], env))
            _wait_for_port(cluster.addresses[names[0]], port, names[0], cluster)
            # the shards, one per dedicated host
            for i, srv in enumerate(server_hosts):
                cmd = [sys.executable, "-m", "psring", "server", "--store", store_at,
                       "--shard", str(first + i), "--num-shards", str(total), "--host", "0.0.0.0",
                       "--advertise", cluster.addresses[srv], "--job", job, "--timeout", str(timeout)]  # fmt: skip
                env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT),
                       "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **_tuning(), **extra}  # fmt: skip
                procs.append(cluster.run(srv, cmd, env))
        servers = list(procs)  # the store and shards, ended once the ranks are done
        for r in range(world):
            host = names[r // ranks]
            env = {
                "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                "PYTHONPATH": str(ROOT),
                "PYTHONUNBUFFERED": "1",
                "RANK": str(r),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(r % ranks),
                "LOCAL_WORLD_SIZE": str(ranks),
                "MASTER_ADDR": cluster.addresses[names[0]],
                "MASTER_PORT": str(port),
                "PSRING_JOB": job,
                "PSRING_TOPOLOGY": "ps" if variant in ("ps", "psh", *DEDICATED) else "ring",
                # the dedicated placements reduce within the host before pushing, as psh (psring's default)
                "PSRING_HIERARCHICAL": "on" if variant in ("hier", "psh", *DEDICATED) else "off",
                "GLOO_SOCKET_IFNAME": "eth0",
                "OMP_NUM_THREADS": "1",
            }
            if variant in ("ps", "psh", "split"):
                env["PSRING_PS_COLOCATE"] = "1"
            if variant in DEDICATED:  # the ranks meet in the store the shards registered in
                env["PSRING_STORE"] = store_at
                del env["MASTER_ADDR"], env["MASTER_PORT"]
            env.update(_tuning())
            env.update(extra)
            if variant == "split":
                env.update(PSRING_PS_DEDICATED=str(len(server_hosts)), PSRING_PS_WEIGHTS=str(weights))
            cmd = [sys.executable, "-m", "psring.training.bench_ranks", json.dumps(spec)]
            procs.append(cluster.run(host, cmd, env))
        deadline = time.monotonic() + timeout
        for proc in procs[len(servers) :]:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        for proc in servers:  # the job is over: the shards go
            proc.terminate()
        failed = []
        for r, proc in enumerate(procs):  # ended by PID, whatever happened
            if proc in servers:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)
            late = proc.poll() is None
            if late:
                proc.kill()
            said = proc.communicate(timeout=30)[0] or ""
            if proc in servers:
                continue
            r -= len(servers)
            if late or proc.returncode != 0:
                what = f"did not finish within {timeout:g}s" if late else f"exited {proc.returncode}"
                failed.append(f"rank {r} {what}: {said[-1500:]}")
        cluster.procs = [p for p in cluster.procs if p not in procs]
        if failed:
            raise RuntimeError(f"{variant}: " + "; ".join(failed))
        with open(out) as fh:
            rows: list[dict[str, Any]] = json.load(fh)["results"]
    for row in rows:
        row["busbw_GBps"] = row["size"] / row["time_s"] / 1e9 * 2 * (world - 1) / world
    return rows


def bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    why = netns_available()
    if why is not None:
        raise SystemExit(f"hosts.py: {why} (run as root)")
    if "gloo" in args.variants:
        try:
            import torch  # noqa: F401
        except ImportError:
            raise SystemExit("hosts.py: the gloo variant needs torch (pip install torch), or leave it out") from None
    cluster = NetnsCluster(uuid.uuid4().hex[:6])
    results: list[dict[str, Any]] = []
    try:
        for h in range(args.hosts):
            cluster.host(f"host{h}")
        for k in range(args.server_hosts):
            cluster.host(f"srv{k}")
        for rate in args.rates:
            for name in cluster.hosts:
                shape(cluster, name, rate)
            runs: dict[str, list[list[dict[str, Any]]]] = {v: [] for v in args.variants}
            for _ in range(args.rounds):
                for variant in args.variants:
                    runs[variant].append(
                        run_variant(
                            cluster,
                            variant,
                            args.hosts,
                            args.ranks,
                            args.sizes,
                            args.iters,
                            args.timeout,
                            args.weights,
                            args.tunings,
                        )
                    )
            for variant, per_round in runs.items():
                for per_size in zip(*per_round, strict=True):
                    row = dict(per_size[0])
                    row["time_s"] = statistics.median(r["time_s"] for r in per_size)
                    row["busbw_GBps"] = statistics.median(r["busbw_GBps"] for r in per_size)
                    row.update(variant=variant, rate=rate, hosts=args.hosts, ranks=args.ranks, rounds=args.rounds,
                               server_hosts=args.server_hosts)  # fmt: skip
                    results.append(row)
    finally:
        cluster.close()
    return results


def report(results: list[dict[str, Any]], variants: list[str]) -> str:
    lines = []
    for rate in dict.fromkeys(r["rate"] for r in results):
        rows = {(r["variant"], r["size"]): r for r in results if r["rate"] == rate}
        first = next(r for r in results if r["rate"] == rate)
        lines.append(f"# {first['hosts']} hosts x {first['ranks']} ranks, links shaped to {rate} (tbf, both ways)")
        lines.append(f"{'size':>8} " + " ".join(f"{v + ' ms':>10} {v + ' GB/s':>10}" for v in variants))
        for size in dict.fromkeys(r["size"] for r in results):
            cells = []
            for v in variants:
                row = rows[(v, size)]
                cells.append(f"{row['time_s'] * 1e3:>10.3f} {row['busbw_GBps']:>10.3f}")
            lines.append(f"{human(size):>8} " + " ".join(cells))
        for size in dict.fromkeys(r["size"] for r in results):
            ratios = []
            for v in variants:
                for base in ("flat", "gloo"):
                    if v != base and base in variants and v != "gloo":
                        ratio = rows[(base, size)]["time_s"] / rows[(v, size)]["time_s"]
                        ratios.append(f"{v}/{base} busbw {ratio:.2f}x")
            lines.append(f"{human(size):>8} " + ", ".join(ratios))
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=2, help="ranks per host")
    parser.add_argument("--server-hosts", type=int, default=0, help="dedicated server hosts (psd, split)")
    parser.add_argument("--weights", default=None, help="split: PSRING_PS_WEIGHTS (default: psring advise's)")
    parser.add_argument("--rates", default="1gbit,10gbit", help="tc rates, comma-separated (as tc writes them)")
    parser.add_argument("--sizes", default="4,64M", help="all_reduce sizes in bytes (4, 1M, 64M)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"any of {', '.join(VARIANTS)}")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds one variant may take")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument(
        "--tuning",
        action="append",
        default=[],
        metavar="NAME=K=V,K=V",
        help="settings a variant written VARIANT@NAME runs with (repeatable)",
    )
    args = parser.parse_args()
    args.tunings = {}
    for spec in args.tuning:
        name, _, pairs = spec.partition("=")
        try:
            args.tunings[name] = dict(pair.split("=", 1) for pair in pairs.split(",") if pair)
        except ValueError:
            parser.error(f"--tuning {spec!r}: write NAME=K=V,K=V")
    args.rates = [r for r in args.rates.split(",") if r]
    args.sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    args.variants = [v for v in args.variants.split(",") if v]
    if args.server_hosts == 0:  # nothing to put the dedicated shards on
        args.variants = [v for v in args.variants if v.partition("@")[0] not in DEDICATED]

    def known(v: str) -> bool:
        base, at, name = v.partition("@")
        return base in VARIANTS and (not at or name in args.tunings)

    unknown = sorted(v for v in args.variants if not known(v))
    if unknown or args.hosts < 1 or args.ranks < 1 or not args.rates:
        parser.error(
            f"variants are {', '.join(VARIANTS)}, each with @NAME of a --tuning (not {unknown}); "
            "--hosts, --ranks and --rates need values"
        )
    if shutil.which("tc") is None:
        raise SystemExit("hosts.py: tc (iproute2) is not installed")
    results = bench(args)
    print(report(results, args.variants))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
