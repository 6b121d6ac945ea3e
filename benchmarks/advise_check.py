"""``psring advise`` checked on the hosts bed: its predictions against measured times, and whether the
topology it recommends is the measured fastest.

For each configuration (hosts x ranks, dedicated server hosts, link rate, tensor size) the bed of
benchmarks/hosts.py is built (network namespaces, tc-shaped links); the advise probe is run as
``psring advise --store`` runs it on a cluster (the flat ring's all-reduce at 4 KiB and 8 MiB, the
slowest rank's median) and the model's link latency and bandwidth are fitted to it; then every
topology the layout allows is measured at the configuration's size and set beside its prediction.

Needs root (namespaces, tc). ``--quick`` runs three configurations.

    sudo python benchmarks/advise_check.py [--quick] [--rounds 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from hosts import run_variant, shape  # noqa: E402

from psring.cli.bench import human  # noqa: E402
from psring.cluster.advise import MARGIN, Layout, advise, fit_links, parse_rate, predict, ps_tuning  # noqa: E402
from tests.support.harness.netns import NetnsCluster, netns_available  # noqa: E402

#: (hosts, ranks per host, server hosts, rate, size)
CONFIGS = [
    (2, 1, 0, "1gbit", 16 << 20),
    (2, 2, 0, "1gbit", 16 << 20),
    (4, 1, 0, "1gbit", 16 << 20),
    (2, 1, 2, "1gbit", 16 << 20),
    (4, 1, 4, "1gbit", 16 << 20),
    (2, 2, 0, "200mbit", 4 << 20),
    (2, 2, 0, "1gbit", 4),
    (4, 1, 2, "1gbit", 16 << 20),
    (2, 2, 2, "1gbit", 16 << 20),  # several ranks a host and server hosts: every ps placement reduces in the host
]
QUICK = [CONFIGS[1], CONFIGS[3], CONFIGS[6]]
MODEL = {"flat": "ring", "hier": "hierarchical", "ps": "ps colocated", "psh": "ps colocated", "psd": "ps dedicated",
         "split": "BytePS split"}  # fmt: skip


def measure(cluster: NetnsCluster, variant: str, hosts: int, ranks: int, sizes: list[int], rounds: int) -> list[float]:
    per_round = [run_variant(cluster, variant, hosts, ranks, sizes, 5, 300.0) for _ in range(rounds)]
    return [statistics.median(r[i]["time_s"] for r in per_round) for i in range(len(sizes))]


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """These variables set in this process (and so in the ranks and shards hosts.py starts) meanwhile."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def check(config: tuple[int, int, int, str, int], rounds: int) -> dict[str, Any]:
    hosts, ranks, servers, rate, size = config
    cluster = NetnsCluster(uuid.uuid4().hex[:6])
    try:
        for h in range(hosts):
            cluster.host(f"host{h}")
        for k in range(servers):
            cluster.host(f"srv{k}")
        for name in cluster.hosts:
            shape(cluster, name, rate)
        small, large = measure(cluster, "flat", hosts, ranks, [4 << 10, 8 << 20], rounds)
        links = fit_links(hosts * ranks, (4 << 10, small), (8 << 20, large))
        layout = Layout(hosts, ranks, servers)
        # the ps runs (and the model counts it) with the settings advise gives it for these links
        tuning = ps_tuning(layout, links)
        with _environ(tuning):
            predicted = predict(size, layout, links)
            # colocated shards as psring runs them: reduced within the host first where hosts hold several ranks
            variants = ["flat", "psh" if ranks > 1 else "ps"] + (["hier"] if ranks > 1 else [])
            variants += ["psd"] if servers else []
            variants += ["split"] if "BytePS split" in predicted else []  # its weights: advise's (hosts.py)
            measured = {MODEL[v]: measure(cluster, v, hosts, ranks, [size], rounds)[0] for v in variants}
            recommended = advise([size], layout, links)["recommended"]  # what psring advise says, as it says it
    finally:
        cluster.close()
    predicted = {name: t for name, t in predicted.items() if name in measured}
    best_measured = min(measured, key=lambda n: measured[n])
    return {
        "config": {"hosts": hosts, "ranks": ranks, "server_hosts": servers, "rate": rate, "size": size},
        "links": {
            "latency_s": links.latency + links.per_message,
            "bandwidth_Bps": links.bandwidth,
            "rate_Bps": parse_rate(rate),
        },
        "tuning": tuning,
        "predicted_s": predicted,
        "measured_s": measured,
        "error": {n: predicted[n] / measured[n] - 1 for n in measured},
        "recommended": recommended,
        "measured_fastest": best_measured,
        # a pick within the model's margin of the measured fastest is as good as it
        "right": measured[recommended] <= measured[best_measured] * (1 + MARGIN),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="three configurations")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    why = netns_available()
    if why is not None:
        raise SystemExit(f"advise_check.py: {why} (run as root)")
    rows = []
    for config in QUICK if args.quick else CONFIGS:
        row = check(config, args.rounds)
        rows.append(row)
        c = row["config"]
        print(f"# {c['hosts']}x{c['ranks']}, {c['server_hosts']} server hosts, {c['rate']}, {human(c['size'])}: "
              f"fitted {row['links']['latency_s'] * 1e6:.0f} us/step, "
              f"{row['links']['bandwidth_Bps'] * 8 / 1e9:.3f} Gbit/s; the ps with "
              f"{' '.join(f'{k}={v}' for k, v in row['tuning'].items()) or 'the defaults'}", flush=True)  # fmt: skip
        for name in row["measured_s"]:
            print(f"  {name:<14} predicted {row['predicted_s'][name] * 1e3:9.2f} ms  measured "
                  f"{row['measured_s'][name] * 1e3:9.2f} ms  error {row['error'][name]:+.0%}", flush=True)  # fmt: skip
        print(f"  recommended {row['recommended']}, measured fastest {row['measured_fastest']}: "
              f"{'right' if row['right'] else 'WRONG'}", flush=True)  # fmt: skip
    within = sum(all(abs(e) <= 0.2 for e in r["error"].values()) for r in rows)
    right = sum(r["right"] for r in rows)
    print(f"\npredictions within 20% in {within} of {len(rows)} configurations; the recommendation right in "
          f"{right} of {len(rows)}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
