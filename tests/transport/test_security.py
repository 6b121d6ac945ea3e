"""With a secret configured, nobody without it gets through any door; optional TLS on every socket."""

from __future__ import annotations

import asyncio
import os
import subprocess

import numpy as np
import pytest

import psring
from psring.rendezvous.client import connect_store, parse_store_address
from psring.topology.ps.shards.server import start_servers
from psring.transport.listener import open_connection

pytestmark = [pytest.mark.slow, pytest.mark.asyncio, pytest.mark.timeout(120)]

SECRET = b"door-secret"


async def knock(port: int, secret: bytes | None) -> BaseException:
    """Try a connection with this secret; return what stopped it (fail if it got in)."""
    try:
        conn = await open_connection("127.0.0.1", port, secret=secret, hello={"role": "intruder"}, timeout=5)
    except (psring.PsringError, OSError) as exc:
        return exc
    await conn.close()
    raise AssertionError(f"port {port} let a client with secret {secret!r} in")


async def test_every_door_needs_the_secret(tmp_path) -> None:
    store = await psring.start_store("127.0.0.1", 0, secret=SECRET)
    address = f"127.0.0.1:{store.port}"
    made = []
    try:
        client = await connect_store(parse_store_address(address), secret=SECRET, timeout=5)
        await client.set("private/key", b"value")
        # door 1: the store (read a key)
        for bad in (b"wrong", None):
            with pytest.raises(psring.AuthError):
                intruder = await connect_store(parse_store_address(address), secret=bad, timeout=5)
                await intruder.get("private/key")
        # door 2: joining a ring, and a ring rank's own port
        os.environ["PSRING_JOB"] = "ring-door"
        ring = await asyncio.gather(
            *(psring.init_group("ring", rank=r, world_size=2, store=address, secret=SECRET, timeout=10) for r in (0, 1))
        )
        made += ring
        with pytest.raises(psring.AuthError):
            await psring.init_group("ring", rank=1, world_size=2, store=address, secret=b"wrong", timeout=5)
        ring_port = ring[0].net.listener.port
        assert isinstance(await knock(ring_port, b"wrong"), psring.AuthError)
        assert isinstance(await knock(ring_port, None), psring.AuthError)
        ys = await asyncio.gather(*(g.all_reduce(np.ones(3)) for g in ring))
        assert all(np.array_equal(y, np.full(3, 2.0)) for y in ys)  # the ring is unharmed
        # doors 3 and 4: a parameter-server shard (push a gradient, pull a parameter)
        os.environ["PSRING_JOB"] = "ps-door"
        servers = await start_servers(client, 1, job="ps-door", secret=SECRET)
        ps = await asyncio.gather(
            *(psring.init_group("ps", rank=r, world_size=2, store=address, secret=SECRET, timeout=10) for r in (0, 1))
        )
        made += ps
        opts = [psring.SyncSGD(g, {"w": np.ones(4, np.float32)}, psring.optim.SGD(lr=0.5)) for g in ps]
        await asyncio.gather(*(o.step({"w": np.ones(4, np.float32)}) for o in opts))
        shard_port = servers.listener.port
        for bad in (b"wrong", None):
            exc = await knock(shard_port, bad)
            assert isinstance(exc, psring.AuthError), exc
        assert np.array_equal(opts[0].params["w"], np.full(4, 0.5, np.float32))  # one honest step, nothing else
        # door 5: submitting a job
        with pytest.raises(psring.AuthError):
            await asyncio.to_thread(psring.Client, address, b"wrong")
        del os.environ["PSRING_JOB"]
        await client.close()
        await asyncio.gather(*(g.close() for g in made))
        await servers.close()
    finally:
        await store.close()


def _openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(tmp, name: str) -> tuple[str, str]:
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name}",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", cwd=tmp)  # fmt: skip
    return str(tmp / f"{name}.pem"), str(tmp / f"{name}.key")


def make_cert(tmp, ca: str, name: str) -> tuple[str, str]:
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", cwd=tmp)  # fmt: skip
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-days", "2", "-out", f"{name}.pem", cwd=tmp)  # fmt: skip
    return str(tmp / f"{name}.pem"), str(tmp / f"{name}.key")


async def test_tls_on_every_socket(tmp_path, monkeypatch) -> None:
    if subprocess.run(["openssl", "version"], capture_output=True).returncode != 0:
        pytest.skip("the openssl command is not installed (it generates the test certificates)")
    ca, _ = make_ca(tmp_path, "ca")
    cert, key = make_cert(tmp_path, "ca", "node")
    rogue_ca, _ = make_ca(tmp_path, "rogue")
    rogue_cert, rogue_key = make_cert(tmp_path, "rogue", "intruder")
    monkeypatch.setenv("PSRING_TLS_CERT", cert)
    monkeypatch.setenv("PSRING_TLS_KEY", key)
    monkeypatch.setenv("PSRING_TLS_CA", ca)
    store = await psring.start_store("127.0.0.1", 0, secret=SECRET)
    address = f"127.0.0.1:{store.port}"
    cleanup = []
    try:
        client = await connect_store(parse_store_address(address), secret=SECRET, timeout=5)
        servers = await start_servers(client, 2, job="tls-ps", secret=SECRET)
        cleanup.append(servers.close)
        for topology in ("ring", "ps"):
            monkeypatch.setenv("PSRING_JOB", f"tls-{topology}")
            groups = await asyncio.gather(
                *(
                    psring.init_group(topology, rank=r, world_size=2, store=address, secret=SECRET, timeout=10)
                    for r in (0, 1)
                )
            )
            x = np.arange(300_000, dtype=np.float32)
            cleanup += [g.close for g in groups]
            ys = await asyncio.gather(*(g.all_reduce(x) for g in groups))
            assert all(np.array_equal(y, 2 * x) for y in ys)
            conns = groups[0].net.conns if topology == "ring" else groups[0].links.shards
            assert all(c.transport.get_extra_info("ssl_object") is not None for c in conns)  # really TLS
            await asyncio.gather(*(g.close() for g in groups))
        # a plaintext client, and one whose certificate another CA signed, are turned away
        monkeypatch.delenv("PSRING_TLS_CERT")
        monkeypatch.delenv("PSRING_TLS_KEY")
        monkeypatch.delenv("PSRING_TLS_CA")
        for port in (store.port, servers.listener.port):
            exc = await knock(port, SECRET)
            assert isinstance(exc, (psring.PsringError, OSError)), exc
        monkeypatch.setenv("PSRING_TLS_CERT", rogue_cert)
        monkeypatch.setenv("PSRING_TLS_KEY", rogue_key)
        monkeypatch.setenv("PSRING_TLS_CA", rogue_ca)
        exc = await knock(store.port, SECRET)
        assert isinstance(exc, (psring.PsringError, OSError)), exc
        # the store still serves its own
        monkeypatch.setenv("PSRING_TLS_CERT", cert)
        monkeypatch.setenv("PSRING_TLS_KEY", key)
        monkeypatch.setenv("PSRING_TLS_CA", ca)
        again = await connect_store(parse_store_address(address), secret=SECRET, timeout=5)
        await again.set("k", b"v")
        assert await again.get("k") == b"v"
        await again.close()
        await client.close()
    finally:
        for close in cleanup:
            await close()
        await store.close()
