"""``psring advise``: the cost model against figures worked by hand, bad input named, and the probe
run as a real job on real worker daemons (``--store``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from psring.cluster.advise import (
    Layout,
    Links,
    advise,
    fit_links,
    parse_rate,
    predict,
    ps_tuning,
    settings_for,
    split_share,
    split_time,
    split_weights,
    step_times,
)
from psring.core.codec import INT8

from .test_cluster import Cluster

GBIT = 1e9 / 8


def test_the_model_gives_the_bytes_each_topology_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    links = Links(latency=0.0, bandwidth=GBIT, per_message=0.0)
    s = 100e6

    def drain(receivers: int, shards: int) -> float:
        """The first piece of a shard's slice, from the workers on other hosts before any result goes,
        and the last, sent to them after the bytes: across hosts a slice goes in 8 pieces (here between
        the 256 KiB floor and the 4 MiB ceiling)."""
        assert 256 << 10 < s / shards / 8 < 4 << 20
        return 2 * receivers * s / shards / 8 / GBIT

    four = predict(int(s), Layout(4), links)
    assert four["ring"] == pytest.approx(1.5 * s / GBIT)  # 2(N-1)/N S
    assert four["ps colocated"] == pytest.approx(1.5 * s / GBIT + drain(3, 4))  # 2R(H-1)/H S, R = 1
    dedicated = predict(int(s), Layout(4, server_hosts=4), links)
    assert dedicated["ps dedicated"] == pytest.approx(s / GBIT + drain(4, 4))  # S each way: BytePS's 1.5x at 4 + 4,
    assert dedicated["ring"] / dedicated["ps dedicated"] == pytest.approx(1.5 / (1 + 2 / 8))  # less 1st and last
    eight = predict(int(s), Layout(8, server_hosts=8), links)
    assert eight["ring"] / eight["ps dedicated"] == pytest.approx(1.75 / (1 + 2 / 8))
    two_by_two = predict(int(s), Layout(2, 2), Links(0.0, GBIT, 0.0, 1e15, 0.0))
    assert two_by_two["hierarchical"] == pytest.approx(s / GBIT)  # 2(H-1)/H S between the hosts
    # reduced within each host before pushing (PSRING_PS_HOST_REDUCE): S, as the hierarchical ring, the
    # last piece to the other host's pusher only, cut from a block's slice (8 MiB / 2 over 4 shards: 256 KiB)
    assert two_by_two["ps colocated"] == pytest.approx(s / GBIT + 2 * (256 << 10) / GBIT)
    with monkeypatch.context() as env:  # every rank pushing its own tensor: 2 S, what made ps 0.72x here
        env.setenv("PSRING_PS_HOST_REDUCE", "0")
        pushed = predict(int(s), Layout(2, 2), Links(0.0, GBIT, 0.0, 1e15, 0.0))
        assert pushed["ps colocated"] == pytest.approx(2 * s / GBIT + drain(2, 4))
        assert predict(int(s), Layout(2, 2, server_hosts=2), links)["ps dedicated"] == pytest.approx(
            max(2 * s, 4 * s / 2) / GBIT + 2 * 4 * (4 << 20) / GBIT  # max(R S, N S / k); 4 MiB pieces (ceiling)
        )
    hosts_push = predict(int(s), Layout(2, 2, server_hosts=2), Links(0.0, GBIT, 0.0, 1e15, 0.0))["ps dedicated"]
    assert hosts_push == pytest.approx(max(s, 2 * s / 2) / GBIT + 2 * 2 * (256 << 10) / GBIT)  # max(S, H S / k)
    # the split, 4 workers and 2 server hosts: a worker host's link carries 2 flows to the dedicated shards
    # (each at most 1/4 of it: a server host's link over 4 workers), 3 to the other colocated shards and 3
    # answers from its own; shared fairly. At BytePS's share x = 0.6 (equal bytes on both links) the 6
    # colocated flows (0.1 S each) and the dedicated ones (0.3 S) all run at 1/8 until 0.8 S / b, then the
    # dedicated ones at 1/4 for the 0.2 S left: 1.6 S / b, slower than the ring's 1.5 (the bed measured
    # 0.90-0.97x the ring there). At equal slices, x = 2/6, all 8 flows end together: 4/3 S / b.
    layout = Layout(4, server_hosts=2)
    assert split_time(layout, 0.6) == pytest.approx(1.6)
    assert split_time(layout, 2 / 6) == pytest.approx(4 / 3)
    assert split_share(layout) == pytest.approx(1 / 3)
    split = predict(int(s), layout, links)["BytePS split"]
    assert split == pytest.approx(4 / 3 * s / GBIT + drain(4, 6))  # pieces cut for all 4 + 2 shards
    assert split_weights(layout) == (1,) * 6  # every shard an equal slice
    assert split_weights(Layout(8, server_hosts=2)) == (1,) * 10
    assert split < min(predict(int(s), layout, links)[t] for t in ("ring", "ps dedicated", "ps colocated"))
    # as many server hosts as workers': all of it on them (ps dedicated), S / b, against 5/4 at equal slices
    assert split_share(Layout(4, server_hosts=4)) == 1.0
    assert split_time(Layout(4, server_hosts=4), 1.0) == pytest.approx(1.0)
    assert split_time(Layout(4, server_hosts=4), 0.5) == pytest.approx(1.25)


def test_latency_steps_decide_small_messages() -> None:
    links = Links(latency=100e-6, bandwidth=GBIT, per_message=10e-6)
    t = predict(4, Layout(8), links)
    assert t["ring"] == pytest.approx(14 * 110e-6, rel=1e-3)  # 2(N-1) steps of latency and CPU
    assert t["ps colocated"] == pytest.approx(200e-6 + 16 * 10e-6, rel=1e-3)  # 2 latencies, 2N messages
    # a two-level job's small calls go one hop, as a flat job's (ring.paths): the same time, and the ring is
    # the simpler (the model once gave the hierarchical ring 2(H-1) + 2(R-1) steps here: 39% under)
    two = predict(4, Layout(2, 2), links)
    assert two["hierarchical"] == pytest.approx(two["ring"]) and two["ring"] == pytest.approx(6 * 110e-6, rel=1e-3)
    fitted = Links(latency=10e-6, bandwidth=GBIT, per_message=90e-6)  # a step mostly CPU, as fit_links counts it
    assert advise([4], Layout(2, 2), fitted)["recommended"] == "ring"
    assert predict(1 << 20, Layout(2, 2), links)["hierarchical"] < predict(1 << 20, Layout(2, 2), links)["ring"]


def test_the_ring_between_hosts_takes_two_hops_where_psring_does(monkeypatch: pytest.MonkeyPatch) -> None:
    links = Links(latency=100e-6, bandwidth=GBIT, per_message=10e-6)
    s = 1 << 20  # from 48 KiB to 4 MiB at 4 ranks or more: two latency steps, the ring's bytes (R = 1)
    assert predict(s, Layout(4), links)["ring"] == pytest.approx(2 * 110e-6 + 1.5 * s / GBIT)
    assert predict(s, Layout(3), links)["ring"] == pytest.approx(4 * 110e-6 + 4 / 3 * s / GBIT)  # 3 ranks: ring
    assert predict(8 << 20, Layout(4), links)["ring"] == pytest.approx(6 * 110e-6 + 1.5 * (8 << 20) / GBIT)
    # several ranks a host: every rank's chunks cross to the other hosts, 2R(H-1)/H S
    assert predict(s, Layout(2, 2), links)["ring"] == pytest.approx(2 * 110e-6 + 2 * s / GBIT)
    monkeypatch.setenv("PSRING_RING_TWO_HOP", "0")
    assert predict(s, Layout(4), links)["ring"] == pytest.approx(6 * 110e-6 + 1.5 * s / GBIT)


def test_recommendations_and_their_reasons() -> None:
    links = Links(50e-6, GBIT)
    assert advise([25 << 20], Layout(4), links)["recommended"] == "ring"  # ties go to the simpler
    dedicated = advise([25 << 20], Layout(4, server_hosts=4), links)
    assert dedicated["recommended"] == "ps dedicated" and "1.20x the flat ring" in dedicated["reason"]
    three = advise([25 << 20], Layout(4, server_hosts=3), links)  # 3 server hosts for 4 workers: the split
    assert three["recommended"] == "BytePS split" and "43% of every tensor" in three["reason"]
    assert three["predicted_s"]["BytePS split"] < min(three["predicted_s"][t] for t in ("ring", "ps dedicated"))
    assert three["settings"] == {"PSRING_TOPOLOGY": "ps", "PSRING_PS_COLOCATE": "1", "PSRING_PS_DEDICATED": "3",
                                 "PSRING_PS_WIRE_PIECES": "32", "PSRING_PS_SNDBUF": "128K"}  # fmt: skip
    two = advise([25 << 20], Layout(4, server_hosts=2), links)  # 2: the split's edge is within the margin
    assert two["recommended"] == "ring" and "BytePS split" in two["predicted_s"]
    assert "BytePS split" not in advise([25 << 20], Layout(4, server_hosts=4), links)["predicted_s"]  # x = 1
    assert advise([25 << 20], Layout(2, 2), links)["recommended"] == "hierarchical"
    late = advise([1 << 20], Layout(4, straggler=0.05), links)
    assert late["recommended"] == "ps backup=1" and "backup=1" in late["reason"]
    assert step_times([1 << 20], Layout(4, straggler=0.05), links)["ring"] == pytest.approx(
        predict(1 << 20, Layout(4), links)["ring"] + 0.05
    )


def test_fitting_the_ring_gives_back_the_links() -> None:
    links = Links(80e-6, 0.3e9)
    small, large = 4096, 8 << 20
    t = [predict(n, Layout(4), links)["ring"] for n in (small, large)]
    fitted = fit_links(4, (small, t[0]), (large, t[1]))
    assert fitted.latency + fitted.per_message == pytest.approx(100e-6, rel=1e-6)  # a step's whole cost
    assert fitted.bandwidth == pytest.approx(0.3e9, rel=1e-6)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--hosts", "4x", "--rate", "1gbit"], "--hosts '4x': give N, NxR (N hosts, R ranks each) or host names"),
        (["--hosts", "4", "--rate", "fast"], "rate 'fast' does not parse"),
        (["--hosts", "4"], "--hosts needs --rate"),
        (["--hosts", "4", "--rate", "1gbit", "--sizes", "2Q"], "size '2Q' does not parse"),
        (["--hosts", "4", "--rate", "1gbit", "--backup", "4"], "backup must be in [0, 4) for 4 workers"),
        (["--hosts", "4", "--rate", "1gbit", "--server-hosts", "-1"], "--server-hosts must be >= 0"),
        (["--hosts", "1", "--rate", "1gbit"], "one worker needs no all-reduce"),
        (["--hosts", "4", "--rate", "1gbit", "--model", "nosuch.module:Net"], "cannot be loaded"),
        (["--hosts", "n1,n2", "--rate", "1gbit", "--server-hosts", "s1,n2"], "--server-hosts names n2, which"),
        (["--hosts", "n1,n1", "--rate", "1gbit"], "names a host twice"),
        (["--sizes", "4M"], "give --store HOST:PORT (measure a cluster's links) or --hosts"),
        (["--hosts", "4", "--rate", "1gbit", "--server-hosts", "s1,s1"], "a count or distinct host names"),
        (["--hosts", "4", "--rate", "1gbit", "--step-ms", "0"], "--step-ms must be a positive time"),
    ],
)
def test_bad_input_is_named(argv: list[str], says: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PSRING_STORE"}
    run = subprocess.run(
        [sys.executable, "-m", "psring", "advise", *argv], capture_output=True, text=True, timeout=60, env=env
    )
    assert run.returncode == 2 and says in run.stderr, (run.returncode, run.stdout, run.stderr)


def test_the_ps_on_slow_links_is_told_smaller_pieces_and_send_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PSRING_PS_SNDBUF", "PSRING_PS_WIRE_PIECES"):
        monkeypatch.delenv(name, raising=False)
    slow = Links(latency=15e-6, bandwidth=GBIT, per_message=135e-6)  # fit_links of the hosts bed at 1 Gbit/s
    got = advise([64 << 20], Layout(4, server_hosts=4), slow)
    assert got["recommended"] == "ps dedicated"
    assert got["settings"] == {"PSRING_TOPOLOGY": "ps", "PSRING_PS_WIRE_PIECES": "32", "PSRING_PS_SNDBUF": "128K"}
    split = Layout(4, server_hosts=2)
    assert settings_for("BytePS split", split, slow)["PSRING_PS_SNDBUF"] == "128K"
    # 10 Gbit/s: the pieces stay (a piece's CPU counts there); the buffer only where it covers 4x the
    # link's bandwidth-delay product (it caps a connection at the buffer / the round trip)
    assert ps_tuning(Layout(4, server_hosts=4), Links(10e-6, 10 * GBIT)) == {"PSRING_PS_SNDBUF": "128K"}
    assert ps_tuning(Layout(4, server_hosts=4), Links(50e-6, 10 * GBIT)) == {}
    assert ps_tuning(Layout(4, server_hosts=4), Links(1e-6, 40 * GBIT)) == {}
    assert ps_tuning(Layout(1, 4), slow) == {}  # one host: nothing crosses a link
    ring = advise([64 << 20], Layout(4), slow)
    assert ring["recommended"] == "ring" and set(ring["settings"]) == {"PSRING_TOPOLOGY", "PSRING_HIERARCHICAL"}
    # what the job sets already is left as it is
    monkeypatch.setenv("PSRING_PS_SNDBUF", "64K")
    monkeypatch.setenv("PSRING_PS_WIRE_PIECES", "64")
    assert ps_tuning(Layout(4, server_hosts=4), slow) == {}


def test_hosts_and_server_hosts_by_name() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "psring", "advise", "--hosts", "n1,n2,n3,n4", "--rate", "1gbit", "--server-hosts",
         "s1,s2,s3,s4", "--sizes", "25M", "--json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["layout"]["hosts"] == 4 and result["layout"]["server_hosts"] == 4
    assert result["recommended"] == "ps dedicated"


def test_described_hosts_print_a_table_and_a_recommendation() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "psring", "advise", "--hosts", "4", "--rate", "1gbit", "--server-hosts", "4",
         "--sizes", "25M,25M"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "recommended: ps dedicated" in run.stdout and "50.00 MiB in all" in run.stdout, run.stdout
    assert "run it with: PSRING_TOPOLOGY=ps PSRING_PS_WIRE_PIECES=32 PSRING_PS_SNDBUF=128K" in run.stdout, run.stdout
    assert "PSRING_PS_SNDBUF=128K psring server --store HOST:PORT --shard i --num-shards 4" in run.stdout, run.stdout


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_store_mode_probes_the_clusters_workers_with_a_real_job(tmp_path) -> None:
    cluster = Cluster(tmp_path)
    try:
        for i in range(3):
            cluster.worker(f"a{i}")
        run = subprocess.run(
            [sys.executable, "-m", "psring", "advise", "--store", cluster.address, "--sizes", "4M", "--json"],
            capture_output=True, text=True, timeout=150,
        )  # fmt: skip
        assert run.returncode == 0, run.stdout + run.stderr
        result = json.loads(run.stdout.strip().splitlines()[-1])
        measured = result["measured"]
        assert measured["world"] == 3 and len(measured["hosts"]) == 3 and len(set(measured["hosts"])) == 1
        assert measured["large"][1] > measured["small"][1] > 0  # 8 MiB takes longer than 4 KiB
        assert result["layout"]["hosts"] == 1 and result["layout"]["workers"] == 3
        assert result["links"]["bandwidth"] > 0 and result["recommended"] in result["predicted_s"]
        # the daemons are idle again: the probe was an ordinary job
        status = subprocess.run(
            [sys.executable, "-m", "psring", "status", "--store", cluster.address, "--json"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert {w["state"] for w in json.loads(status.stdout)["workers"]} == {"idle"}
        # a server host named where a worker daemon runs (this machine): refused before any probe
        import socket

        taken = subprocess.run(
            [sys.executable, "-m", "psring", "advise", "--store", cluster.address, "--server-hosts",
             socket.gethostname()],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert taken.returncode == 2 and "a server host must be free of workers" in taken.stderr, taken.stderr
    finally:
        cluster.close()


def test_parse_rate_reads_tc_and_byte_units() -> None:
    assert parse_rate("1gbit") == pytest.approx(GBIT) and parse_rate("125MB") == pytest.approx(125e6)
    assert parse_rate("100mbit") == pytest.approx(12.5e6)


def test_a_codec_is_advised_where_the_link_not_the_cpu_is_the_limit() -> None:
    """int8 on a 100 Mbit/s link (a quarter of the bytes, far more time saved than its CPU costs);
    none at 10 Gbit/s or on one host, where a codec's CPU costs more than its bytes save."""
    slow = advise([25 << 20], Layout(4), Links(100e-6, 100e6 / 8))["compression"]
    assert slow["recommended"] == "int8" and "25% of the bytes" in slow["reason"]
    plain = min(advise([25 << 20], Layout(4), Links(100e-6, 100e6 / 8))["predicted_s"].values())
    assert slow["predicted_s"]["int8"] < slow["predicted_s"]["bf16"] < plain
    for fast in (advise([25 << 20], Layout(4), Links(50e-6, 10 * GBIT))["compression"],
                 advise([25 << 20], Layout(1, 4), Links(50e-6, GBIT))["compression"]):  # fmt: skip
        assert fast["recommended"] is None and fast["reason"].startswith("none: on this link a codec's CPU")


def test_local_steps_are_advised_from_a_steps_compute_against_the_exchange() -> None:
    """How often to talk (#82): H = 1 where a step's exchange is at most 10% of its compute; else the
    smallest H of the ladder that keeps compute use >= 90% unstreamed (H s / (H s + T) with T the
    cheapest exchange, a codec's CPU counted), or, where that H is larger, the H at which 4 fragments
    hide each exchange beside H/4 steps (H s >= T). Worked by hand from the model's own times."""
    links, sizes = Links(10e-3, 100e6 / 8), [10 << 20]
    assert advise(sizes, Layout(4), links)["local_steps"] is None  # no compute given: nothing said

    def exchange(step_s: float) -> tuple[dict, float, float]:  # type: ignore[type-arg]
        got = advise(sizes, Layout(4), links, step_s)
        return got["local_steps"], got["compression"]["predicted_s"]["int8"], min(got["predicted_s"].values())

    slow, t, plain = exchange(2.0)  # 100 Mbit/s: int8's exchange is the cheapest
    assert slow["compression"] == "int8" and slow["exchange_s"] == pytest.approx(t)
    assert 0.9 * t / 0.1 / 2.0 > 2 and slow["local_steps"] == 5 and slow["fragments"] == 1  # 9 T / s: 2.0..5
    assert slow["compute_use"] == pytest.approx(5 * 2.0 / (5 * 2.0 + t)) and slow["compute_use"] >= 0.9
    assert "20x fewer bytes" in slow["reason"]  # H 5 x int8's quarter of the bytes
    streamed, t, _ = exchange(0.05)  # 9 T / s = 80 -> 100 unstreamed; T / s = 8.9 -> 10 in 4 fragments
    assert (streamed["local_steps"], streamed["fragments"], streamed["compute_use"]) == (10, 4, 1.0)
    assert "in 4 fragments" in streamed["reason"]
    capped, t, _ = exchange(1e-4)  # the link stays the limit: the most the ladder has, streamed
    assert (capped["local_steps"], capped["fragments"]) == (500, 4)
    assert capped["compute_use"] == pytest.approx(500 * 1e-4 / t) and "the link stays the limit" in capped["reason"]
    sync, _t, plain = exchange(40.0)  # a 40 s step: the exchange is 3% of it
    assert (sync["local_steps"], sync["compression"]) == (1, None) and plain <= 0.1 * 40.0
    assert INT8.wire.itemsize == 1


def test_advise_prints_the_flags_of_the_local_steps_it_advises() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "psring", "advise", "--hosts", "4", "--rate", "100mbit", "--latency", "10ms",
         "--sizes", "10M", "--step-ms", "50"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "(psring train --local-steps 10 --fragments 4 --compression int8)" in run.stdout, run.stdout
    plain = subprocess.run(
        [sys.executable, "-m", "psring", "advise", "--hosts", "4", "--rate", "10gbit", "--sizes", "10M", "--json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert plain.returncode == 0 and json.loads(plain.stdout)["local_steps"] is None, plain.stderr
