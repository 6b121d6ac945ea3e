"""Opt-in payload checksums (PSRING_CHECKSUM): correct results, and corruption is caught by name."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import psring
from psring import settings
from psring.core import wire
from psring.transport.connection import CHECKSUMS

pytestmark = [pytest.mark.timeout(60)]


@pytest.mark.parametrize("name", ["crc32", "crc32c"])
@pytest.mark.asyncio
async def test_checksummed_collectives_give_the_same_results(make_groups, topology, monkeypatch, name) -> None:
    pytest.importorskip("crc32c") if name == "crc32c" else None
    monkeypatch.setenv("PSRING_CHECKSUM", name)
    groups = await make_groups(3, topology)
    for size in (5, 300_001):  # the one-hop path and the pipelined ring / sharded path
        xs = [np.random.default_rng(r).standard_normal(size).astype(np.float32) for r in range(3)]
        ys = await asyncio.gather(*(g.all_reduce(x) for g, x in zip(groups, xs, strict=True)))
        want = await asyncio.gather(*(g.all_gather(x) for g, x in zip(groups, xs, strict=True)))
        assert all(np.allclose(y, np.sum(want[0], axis=0), rtol=1e-5, atol=1e-5) for y in ys)
        assert all(np.array_equal(y, ys[0]) for y in ys)


@pytest.mark.asyncio
async def test_a_corrupted_payload_is_caught_and_named(make_groups, monkeypatch) -> None:
    monkeypatch.setenv("PSRING_CHECKSUM", "crc32")
    groups = await make_groups(2, "ring")
    x = np.arange(1000, dtype=np.float32)
    await asyncio.gather(*(g.all_reduce(x) for g in groups))
    # rank 0 sends rank 1 a frame whose bytes changed after the checksum was taken
    conn = groups[0].net.links[1]
    payload = bytearray(x.tobytes())
    header = {"kind": "data", "tag": ("0", "p2p", 0, 0), **wire.tensor_fields(x)}
    header["sum"] = ("crc32", CHECKSUMS["crc32"](bytes(payload)))
    payload[17] ^= 0x04  # one flipped bit
    conn.transport.write(wire.encode_header(header) + bytes(payload))
    with pytest.raises(psring.PeerLostError, match=r"checksum mismatch .* from rank 0 .*corrupted in transit"):
        await asyncio.wait_for(groups[1].recv(0), 10)


def test_an_unknown_checksum_name_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("PSRING_CHECKSUM", "md5")
    with pytest.raises(ValueError, match=r"PSRING_CHECKSUM='md5': expected one of crc32, crc32c"):
        settings.current()
    monkeypatch.setenv("PSRING_CHECKSUM", "0")
    assert settings.current().checksum is None


@pytest.mark.asyncio
async def test_a_server_with_a_bad_checksum_setting_does_not_start(monkeypatch) -> None:
    from psring.rendezvous.store import start_store

    monkeypatch.setenv("PSRING_CHECKSUM", "sha1")
    with pytest.raises(ValueError, match="PSRING_CHECKSUM='sha1'"):
        await start_store("127.0.0.1", 0)
