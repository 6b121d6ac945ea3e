"""Connection.send_frames: several frames in one write, as send_frame would send each."""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest

from psring.core import wire
from psring.core.arrays import byte_view
from psring.transport.listener import Listener, open_connection
from psring.transport.mailbox import Mailbox
from psring.transport.tcpsocket import kernel_round_trip, limit_send_buffer

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]


@pytest.mark.parametrize("checksum", [None, "crc32"])
@pytest.mark.parametrize("size", [3, 40_000])  # joined into one bytes object; written as a list (writelines)
async def test_frames_sent_together_arrive_whole_in_order_with_their_checksums(
    monkeypatch, checksum: str | None, size: int
) -> None:
    if checksum is not None:
        monkeypatch.setenv("PSRING_CHECKSUM", checksum)
    mailbox = Mailbox()
    listener = await Listener(lambda c: None, secret=None, router_for=lambda c: mailbox).start("127.0.0.1", 0)
    conn = None
    try:
        conn = await open_connection("127.0.0.1", listener.port, secret=None, hello={"role": "t"})
        xs = [np.arange(size, dtype=np.float32) * k for k in range(3)]
        futs = [mailbox.expect(("t", k)) for k in range(4)]
        frames = [({"kind": "data", "tag": ("t", 0)}, None)]  # a frame without a payload among them
        for k, x in enumerate(xs):
            frames.append(({"kind": "data", "tag": ("t", k + 1), **wire.tensor_fields(x)}, byte_view(x)))
        before = conn.frames_sent, conn.bytes_sent
        conn.send_frames(frames)
        await conn.flush()
        got = await asyncio.wait_for(asyncio.gather(*futs), 10)
        assert got[0][1]["nbytes"] == 0
        for k, x in enumerate(xs):
            _conn, header, payload = got[k + 1]
            assert np.array_equal(np.frombuffer(payload, np.float32), x), k
            assert ("sum" in header) == (checksum is not None), header
        assert conn.frames_sent - before[0] == 4
        assert conn.bytes_sent - before[1] > sum(x.nbytes for x in xs)
    finally:
        if conn is not None:
            await conn.close()
        await listener.close()


async def test_limit_send_buffer_sets_a_tcp_sockets_buffer_and_frames_still_flow() -> None:
    mailbox = Mailbox()
    listener = await Listener(lambda c: None, secret=None, router_for=lambda c: mailbox).start("127.0.0.1", 0)
    conn = None
    try:
        conn = await open_connection("127.0.0.1", listener.port, secret=None, hello={"role": "t"})
        sock = conn.transport.get_extra_info("socket")
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) != 2 * (48 << 10)  # the kernel's own size
        assert limit_send_buffer(conn, 48 << 10) is True
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == 2 * (48 << 10)  # Linux keeps twice it
        assert limit_send_buffer(conn, 0) is False  # nothing to set
        x = np.arange(1 << 20, dtype=np.float32)  # 4 MiB through the small buffer, whole
        fut = mailbox.expect(("t", 1))
        conn.send_tensor({"kind": "data", "tag": ("t", 1)}, x)
        await conn.flush()
        _conn, _header, payload = await asyncio.wait_for(fut, 10)
        assert np.array_equal(np.frombuffer(payload, np.float32), x)
        trip = kernel_round_trip(conn)  # the kernel's least round trip on loopback: microseconds
        assert trip is not None and 0 < trip < 0.05, trip
    finally:
        if conn is not None:
            await conn.close()
        await listener.close()
    assert limit_send_buffer(conn, 48 << 10) is False  # closed: no socket
    assert kernel_round_trip(conn) is None
