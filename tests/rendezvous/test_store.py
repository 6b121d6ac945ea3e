"""The rendezvous store: its API across processes, rank assignment, and bad clients."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys

import msgpack
import numpy as np
import pytest

import psring
from psring.rendezvous.client import StoreClient, parse_store_address

from ..conftest import end, spawn

pytestmark = [pytest.mark.slow, pytest.mark.asyncio, pytest.mark.timeout(60)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_store_api_against_a_store_process() -> None:
    port = free_port()
    proc = spawn(["-m", "psring", "store", "--host", "127.0.0.1", "--port", str(port)])
    try:
        client = await StoreClient.connect("127.0.0.1", port, timeout=20)
        await client.set("a", b"1")
        assert await client.get("a") == b"1"
        assert await client.get("missing") is None
        assert await client.add("n") == 1 and await client.add("n", 5) == 6
        assert await client.compare_set("a", b"1", b"2") == (True, b"2")
        assert await client.compare_set("a", b"1", b"3") == (False, b"2")
        waiter = asyncio.ensure_future(client.get("late", timeout=10))
        await asyncio.sleep(0.05)
        other = await StoreClient.connect("127.0.0.1", port)
        await other.set("late", b"x")
        assert await waiter == b"x"
        assert await client.list("") == ["a", "late", "n"]
        assert await client.delete("a") and not await client.delete("a")
        await asyncio.gather(client.barrier("b", 2, 5), other.barrier("b", 2, 5))
        with pytest.raises(psring.StoreError, match=r"^timed out after 0.2s waiting for store keys \['nope'\]"):
            await client.wait(["nope"], 0.2)
        with pytest.raises(psring.StoreError, match="does not hold an integer"):
            await client.add("late")
        await client.close()
        await other.close()
    finally:
        end(proc)


async def test_rank_assignment_across_processes(store, tmp_path) -> None:
    script = tmp_path / "join.py"
    script.write_text(
        "import psring, numpy as np\n"
        "g = psring.init(world_size=3, timeout=30)\n"
        "total = g.all_reduce(np.array([g.rank], dtype=np.int64))\n"
        "print('RANK', g.rank, 'TOTAL', int(total[0]), flush=True)\n"
        "g.close()\n"
    )
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "PSRING_JOB": "assign"}
    procs = [spawn([str(script)], env) for _ in range(3)]
    try:
        outs = [await asyncio.to_thread(p.communicate, timeout=40) for p in procs]
        texts = [o[0] for o in outs]
        ranks = sorted(int(t.split("RANK ")[1].split()[0]) for t in texts)
        assert ranks == [0, 1, 2], texts
        assert all("TOTAL 3" in t for t in texts)
    finally:
        for p in procs:
            end(p)


async def _raw(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def test_store_survives_bad_clients(store) -> None:
    good = await StoreClient.connect("127.0.0.1", store.port)
    await good.set("k", b"v")
    # garbage bytes
    r1, w1 = await _raw(store.port)
    w1.write(b"\xc1\xc1 GET / HTTP/1.1\r\n\r\n")
    # half a frame, then stall
    _r2, w2 = await _raw(store.port)
    w2.write(msgpack.packb({"kind": "hello", "version": 1})[:5])
    # a header claiming a huge payload
    r3, w3 = await _raw(store.port)
    w3.write(msgpack.packb({"kind": "hello", "nbytes": 1 << 40}))
    # a client that connects and disconnects mid-call
    _r4, w4 = await _raw(store.port)
    w4.close()
    await asyncio.gather(w1.drain(), w2.drain(), w3.drain())
    assert await asyncio.wait_for(r1.read(), 5) == b""  # dropped
    assert await asyncio.wait_for(r3.read(), 5) == b""  # dropped
    # everyone else is still served, promptly
    assert await asyncio.wait_for(good.get("k"), 2) == b"v"
    assert await good.add("c") == 1
    for w in (w1, w2, w3, w4):
        w.close()
        with contextlib.suppress(ConnectionError):
            await w.wait_closed()
    await good.close()


async def test_bad_requests_get_errors_not_crashes(store) -> None:
    client = await StoreClient.connect("127.0.0.1", store.port)
    with pytest.raises(psring.StoreError, match=r"unknown store op 'explode'"):
        await client._call("explode")
    with pytest.raises(psring.StoreError, match=r"field 'key' must be a non-empty string"):
        await client._call("get", key=7)
    assert await client.add("ok") == 1
    await client.close()


async def test_store_addresses() -> None:
    assert str(parse_store_address("h:1")) == "h:1"
    assert str(parse_store_address("tcp://10.0.0.1:29500")) == "10.0.0.1:29500"
    assert parse_store_address("file:///shared/x").path == "/shared/x"
    with pytest.raises(ValueError, match=r"needs the environment variable\(s\) MASTER_ADDR, MASTER_PORT"):
        parse_store_address("env://", {})
    assert str(parse_store_address(None, {"MASTER_ADDR": "a", "MASTER_PORT": "5"})) == "a:5"
    with pytest.raises(ValueError, match="port 'x' is not a number"):
        parse_store_address("h:x")


async def test_file_rendezvous_across_processes(tmp_path) -> None:
    script = tmp_path / "join.py"
    script.write_text(
        "import sys, psring, numpy as np\n"
        f"g = psring.init(rank=int(sys.argv[1]), world_size=2, store='file://{tmp_path}/rdzv', timeout=30)\n"
        "print('SUM', float(g.all_reduce(np.array([1.0]))[0]), flush=True)\n"
        "g.close()\n"
    )
    procs = [spawn([str(script), str(r)], {"PSRING_JOB": "file"}) for r in range(2)]
    try:
        outs = [await asyncio.to_thread(p.communicate, timeout=40) for p in procs]
        assert all("SUM 2.0" in o[0] for o in outs), outs
    finally:
        for p in procs:
            end(p)


async def test_python_is_311_plus() -> None:
    assert sys.version_info >= (3, 11)
    assert np.__version__
