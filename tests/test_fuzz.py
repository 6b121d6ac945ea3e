"""Fuzzing of the live store, shard and ring sockets (short form of tests/support/harness/fuzz.py), and
regression tests for what it found."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import sys
import time

import msgpack
import numpy as np
import pytest

from psring.errors import ProtocolError, StoreError
from psring.rendezvous import store as store_mod
from psring.rendezvous.client import connect_store, parse_store_address
from psring.topology.ps.shards.server import start_servers
from psring.transport.listener import open_connection
from psring.transport.mailbox import Mailbox

from .conftest import run_tree

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]


def hello(**fields: object) -> bytes:
    header = {"kind": "hello", "version": 1, "nonce": os.urandom(32), "auth": False, **fields}
    return msgpack.packb({"nbytes": 0, **header}, use_bin_type=True)


async def closed_by_peer(reader: asyncio.StreamReader, within: float = 5.0) -> bool:
    try:
        while await asyncio.wait_for(reader.read(65536), within):
            pass
    except ConnectionError:
        pass
    return True


@pytest.mark.timeout(300)
def test_fuzz_short_form_no_crash_no_hang_bounded_memory() -> None:
    args = ["--inputs", "60", "--slowloris", "10", "--flood", "150", "--json"]
    proc = run_tree(
        [sys.executable, os.path.join(ROOT, "tests", "support", "harness", "fuzz.py"), *args],
        capture_output=True,
        text=True,
        timeout=280,
    )
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0, rows
    assert [r["target"] for r in rows] == ["store", "shard", "ring"]
    for r in rows:
        assert r["crashes"] == 0 and r["hangs"] == 0, r
        assert all(r["families"][f]["inputs"] == 60 for f in ("random", "mutated", "lying", "authed")), r
        # every lying size was refused before anything was allocated for it
        assert r["families"]["lying"].get("closed by target") == 60, r
        assert r["slowloris"]["max_held_s"] < 15, r  # the 10 s handshake bound, not forever
        assert r["flood"]["opened"] == 150, r
        assert r["peak_kib"] - r["rss_start_kib"] < 200 * 1024, r  # no input made a target balloon
    assert rows[2]["wrong_results"] == 0 and rows[2]["ring_all_reduces"] > 0


@pytest.mark.asyncio
async def test_a_payload_before_the_handshake_is_refused_unallocated(store) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", store.port)
    head = msgpack.packb({"kind": "hello", "nbytes": 2**31 - 1, "dtype": "uint8", "shape": [2**31 - 1]})
    writer.write(head + b"x" * 100)
    assert await closed_by_peer(reader)
    writer.close()
    # and a stream of handshake frames is not queued up either
    reader, writer = await asyncio.open_connection("127.0.0.1", store.port)
    writer.write(msgpack.packb({"kind": "auth", "nbytes": 0}) * 1000)
    assert await closed_by_peer(reader)
    writer.close()
    client = await connect_store(parse_store_address(f"127.0.0.1:{store.port}"), secret=None, timeout=5)
    await client.set("still", b"served")
    assert await client.get("still") == b"served"
    await client.close()


@pytest.mark.asyncio
async def test_store_forgets_a_gone_clients_waits_and_bounds_what_one_client_has_in_flight(store) -> None:
    address = parse_store_address(f"127.0.0.1:{store.port}")
    box = Mailbox()
    replies: list[dict] = []
    box.on_control = lambda c, h, p: replies.append(h) or True
    conn = await open_connection("127.0.0.1", store.port, secret=None, hello={"role": "fuzz"}, router=box)
    n = store_mod.STORE_MAX_INFLIGHT + 10
    for i in range(n):
        conn.send_frame({"kind": "store_req", "id": i, "op": "wait", "keys": [f"never/{i}"], "timeout": 3600})
    for _ in range(100):
        if len(replies) >= 10:
            break
        await asyncio.sleep(0.02)
    refused = [h for h in replies if "too many requests in flight" in h.get("error", "")]
    assert len(refused) == 10, replies[:3]
    assert len(store._tasks) == store_mod.STORE_MAX_INFLIGHT
    conn.abort(ConnectionResetError("client gone"))
    for _ in range(100):
        if not store._tasks:
            break
        await asyncio.sleep(0.02)
    assert not store._tasks and not store._waiters  # nothing waits for an hour on its behalf
    client = await connect_store(address, secret=None, timeout=5)
    assert await client.get("never/1") is None
    await client.close()


@pytest.mark.asyncio
async def test_store_bounds_the_bytes_it_holds(store, monkeypatch) -> None:
    monkeypatch.setattr(store_mod, "STORE_MAX_BYTES", 1000)
    client = await connect_store(parse_store_address(f"127.0.0.1:{store.port}"), secret=None, timeout=5)
    await client.set("a", b"x" * 600)
    with pytest.raises(StoreError, match=r"store is full \(1000 bytes.*'b' not set"):
        await client.set("b", b"y" * 600)
    await client.set("a", b"x" * 900)  # replacing a value counts only the difference
    await client.delete("a")
    await client.set("b", b"y" * 600)
    assert await client.get("b") == b"y" * 600
    await client.close()


@pytest.mark.asyncio
async def test_a_refused_hello_naming_a_real_rank_does_not_break_the_ring(make_groups) -> None:
    groups = await make_groups(4, "ring")
    xs = [np.full(1 << 20, r + 1.0) for r in range(4)]  # large: the ring path, links to neighbours only
    await asyncio.gather(*(g.all_reduce(x) for g, x in zip(groups, xs, strict=True)))
    # rank 0 has no link to rank 2 (not its ring neighbour); a stranger claims to be rank 2 of another job
    assert 2 not in groups[0].net.links
    reader, writer = await asyncio.open_connection("127.0.0.1", groups[0].net.listener.port)
    writer.write(hello(role="rank", rank=2, job="another-job"))
    assert await closed_by_peer(reader)
    writer.close()
    ys = await asyncio.gather(*(g.all_reduce(x) for g, x in zip(groups, xs, strict=True)))
    assert all(np.array_equal(y, np.full(1 << 20, 10.0)) for y in ys)


@pytest.mark.asyncio
async def test_shard_refuses_a_rank_of_another_world_and_ignores_a_strangers_loss(make_groups) -> None:
    groups = await make_groups(2, "ps", servers_n=1)
    host, _, port = groups[0].links.addresses[0].rpartition(":")
    job = groups[0].links.settings.job
    box = Mailbox()
    refused: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    box.on_control = lambda c, h, p: (refused.done() or refused.set_result(h.get("reason", ""))) or True
    try:  # the reject comes right after the welcome: the handshake itself may report it
        conn = await open_connection(
            host, int(port), secret=None, hello={"role": "rank", "rank": 2, "world_size": 3, "job": job, "shard": 0},
            router=box, timeout=5,
        )  # fmt: skip
        reason = await asyncio.wait_for(refused, 5)
        await asyncio.wait_for(conn.wait_closed(), 5)
    except ProtocolError as exc:
        reason = str(exc)
    assert "rank 2 says job" in reason and "has 3 ranks; the ranks connected to shard 0 say [2]" in reason, reason
    # a client outside the job (rank 7 of 2) comes and dies: the job does not care
    stranger = await open_connection(
        host, int(port), secret=None, hello={"role": "rank", "rank": 7, "world_size": 2, "job": job, "shard": 0},
        router=Mailbox(), timeout=5,
    )  # fmt: skip
    stranger.abort(ConnectionResetError("gone"))
    await asyncio.sleep(0.2)
    ys = await asyncio.gather(*(g.all_reduce(np.arange(4.0)) for g in groups))
    assert all(np.array_equal(y, np.arange(4.0) * 2) for y in ys)


@pytest.mark.asyncio
async def test_a_flood_of_bad_connections_does_not_flood_the_log(store, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="psring.transport.listener")
    t0 = time.monotonic()
    for _ in range(3):
        tasks = []
        for _ in range(20):
            tasks.append(asyncio.open_connection("127.0.0.1", store.port))
        for reader, writer in await asyncio.gather(*tasks):
            writer.write(b"\xc1" * 8)
            await closed_by_peer(reader)
            writer.close()
    windows = math.ceil(time.monotonic() - t0) + 1  # one-second windows the 60 rejections fell in
    rejected = [r for r in caplog.records if "rejected" in r.getMessage()]
    # at most 5 warnings a window, plus one "N more" line: fewer than one per connection
    assert 5 <= len(rejected) <= min(6 * windows, 59), [r.getMessage() for r in rejected]


@pytest.mark.asyncio
async def test_a_shard_keeps_nothing_of_strangers_that_left(store) -> None:
    client = await connect_store(parse_store_address(f"127.0.0.1:{store.port}"), secret=None, timeout=5)
    server = await start_servers(client, 1, job="strangers")
    try:
        for i in range(50):  # ranks outside the job's world (2): strangers, as fuzzing makes them
            hello = {"role": "rank", "rank": 2 + i, "world_size": 2, "job": "strangers", "shard": 0}
            conn = await open_connection("127.0.0.1", server.port, secret=None, hello=hello, router=Mailbox())
            conn.abort(ConnectionResetError("gone"))
        shard = server.shards[0]
        for _ in range(100):
            if not shard.by_rank and not shard.conns:
                break
            await asyncio.sleep(0.02)
        assert not shard.by_rank and not shard.conns  # each held a 256 KiB buffer: this leaked
    finally:
        await server.close()
        await client.close()


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_frames_a_server_sends_right_after_its_welcome_wait_for_the_dialer_and_arrive() -> None:
    """A server is done with the handshake once it sent welcome, and may send at once (a rank that
    accepted a link and has a message for the dialer): those frames can reach the dialer in the same
    read as the welcome, before its handshake coroutine has run. They must arrive, not break the link."""
    from psring.core import wire

    payload = np.arange(5, dtype=np.float64)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        unpacker = msgpack.Unpacker()
        while True:
            unpacker.feed(await reader.read(4096))
            hello = next(iter(unpacker), None)
            if hello is not None:
                break
        challenge = {"kind": "challenge", "auth": False, "role": "rank", "rank": 1, "nbytes": 0}
        head, body = wire.encode_tensor({"kind": "data", "tag": ("g", 0)}, payload)
        writer.write(msgpack.packb(challenge) + msgpack.packb({"kind": "welcome", "nbytes": 0}) + head + bytes(body))
        await writer.drain()
        await reader.read()  # until the dialer closes
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    box = Mailbox()
    conn = await open_connection("127.0.0.1", port, secret=None, hello={"role": "rank", "rank": 0}, router=box)
    try:
        _conn, header, got = await asyncio.wait_for(box.expect(("g", 0)), 5)
        assert np.array_equal(wire.decode_tensor(header, got), payload)
        assert conn.is_open
    finally:
        conn.abort(ConnectionResetError("done"))
        server.close()
        await server.wait_closed()
