"""The TCP small-message links' native loop (psring._native.tcp_read / tcp_exchange through TcpMesh.read
and TcpMesh.exchange) on real loopback sockets: what it reads, what it leaves for the event loop's
reader, how it ends, and the bits of its fold."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from psring.core import wire
from psring.core.fold import canonical_fold
from psring.transport.shmboard import fold_kind
from psring.transport.tcpmesh import TcpMesh

from .test_shmboard import _needs_native

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def mesh3() -> Iterator[tuple[TcpMesh, dict[int, socket.socket]]]:
    """Rank 0's mesh with TCP links to ranks 1 and 2, and the far ends of those links (blocking)."""
    _needs_native()
    mesh = TcpMesh(0, 2, lambda *a: None, lambda *a: None, native=True)
    far: dict[int, socket.socket] = {}
    lst = socket.create_server(("127.0.0.1", 0))
    try:
        for peer in (1, 2):
            a = socket.create_connection(lst.getsockname())
            b, _ = lst.accept()
            mesh.add(peer, a)
            far[peer] = b
        assert mesh.native
        yield mesh, far
    finally:
        lst.close()
        for link in mesh.links.values():
            link.sock.close()
        for s in far.values():
            s.close()


def _head(seq: int, nbytes: int, call: tuple = ("all_reduce", "float32", (3,), "sum", None, None)) -> bytes:
    return TcpMesh.head(wire.message_header(("0", seq, 0, call)), nbytes)


def test_read_takes_messages_in_pieces_and_leaves_the_next_one_for_the_loops_reader(mesh3) -> None:
    mesh, far = mesh3
    rows = np.zeros((3, 3), np.float32)
    head = _head(7, 12)
    msgs = {p: head + np.full(3, p, np.float32).tobytes() for p in (1, 2)}
    nxt = wire.message_header(("0", 8, 0, ("barrier", None, (), None, None, None)))
    far[1].sendall(msgs[1] + struct.pack("<I", len(nxt)) + nxt)  # the next message behind it
    far[2].sendall(msgs[2][:5])  # the rest a moment later, in two pieces

    def rest() -> None:
        time.sleep(0.05)
        far[2].sendall(msgs[2][5:-4])
        time.sleep(0.02)
        far[2].sendall(msgs[2][-4:])

    t = threading.Thread(target=rest)
    t.start()
    links, ranks = [mesh.links[1], mesh.links[2]], [1, 2]
    code = mesh.read(links, ranks, head, rows, 16, 0.001, 2.0)
    t.join()
    assert code == 0 and links == [] and ranks == []
    assert rows[1].tolist() == [1, 1, 1] and rows[2].tolist() == [2, 2, 2] and rows[0].tolist() == [0, 0, 0]
    assert mesh.links[2].bytes_received == len(msgs[2]) and mesh.links[2].start == mesh.links[2].end
    link1 = mesh.links[1]
    assert link1.bytes_received == len(msgs[1]) + 4 + len(nxt)
    got = mesh.peek(link1)  # what the C left in the buffer is the Python reader's, where it left off
    assert got is not None and got[0] == ("0", 8, 0, ("barrier", None, (), None, None, None))
    mesh.consume(link1)
    assert link1.start == link1.end


def test_read_stops_at_another_calls_message_and_leaves_it_whole(mesh3) -> None:
    mesh, far = mesh3
    rows = np.zeros((3, 3), np.float32)
    other = _head(9, 12) + bytes(12)  # the next call's message came first
    far[1].sendall(other)
    links, ranks = [mesh.links[1]], [1]
    code = mesh.read(links, ranks, _head(8, 12), rows, 0, 0.0, 1.0)
    assert code == 2 and ranks == [1] and not rows.any()
    got = mesh.peek(mesh.links[1])
    assert got is not None and got[0][1] == 9 and bytes(got[1]) == bytes(12)


def test_read_times_out_with_nothing_used_up(mesh3) -> None:
    mesh, far = mesh3
    rows = np.zeros((3, 3), np.float32)
    head = _head(3, 12)
    far[2].sendall(head[:4])  # a piece of it only
    links, ranks = [mesh.links[1], mesh.links[2]], [1, 2]
    t0 = time.monotonic()
    code = mesh.read(links, ranks, head, rows, 4, 0.0005, 0.05)
    assert code == 1 and 0.04 <= time.monotonic() - t0 < 1.0
    assert ranks == [1, 2] and mesh.links[2].end - mesh.links[2].start == 4


@pytest.mark.parametrize("reset", [False, True])
def test_read_names_a_link_that_ended(mesh3, reset: bool) -> None:
    mesh, far = mesh3
    if reset:  # an abortive close: the reader sees ECONNRESET
        far[1].setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    far[1].close()
    links, ranks = [mesh.links[1]], [1]
    code = mesh.read(links, ranks, _head(1, 12), np.zeros((3, 3), np.float32), 0, 0.0, 1.0)
    assert code == 3 and ranks == [1]
    error = mesh.links[1].error
    assert (isinstance(error, ConnectionResetError) if reset else error is None), error
    assert mesh.fill(mesh.links[1]) == -1  # and the Python reader sees its end too


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64])
@pytest.mark.parametrize("op", ["sum", "avg", "prod"])
def test_exchange_sends_reads_and_folds_the_canonical_bits(mesh3, dtype, op: str) -> None:
    mesh, far = mesh3
    kind = fold_kind(np.dtype(dtype), op)
    if kind is None:
        assert op == "avg" and np.dtype(dtype).kind == "i"
        return
    rng = np.random.default_rng(5)
    size = 37
    xs = [(rng.standard_normal(size) * 50).astype(dtype) for _ in range(3)]
    call = ("all_reduce", np.dtype(dtype).name, (size,), op, None, None)
    head = _head(11, xs[0].nbytes, call)
    for p in (1, 2):
        far[p].sendall(head + xs[p].tobytes())
    bufs = np.empty((3, size), dtype)
    out = np.empty(size, dtype)
    links, ranks = [mesh.links[2], mesh.links[1]], [2, 1]
    code = mesh.exchange(links, ranks, head, xs[0], bufs, 0, out, kind, op, 8, 0.001, 1.0)
    assert code == 0 and ranks == []
    assert out.tobytes() == canonical_fold(xs, op, np.empty_like(xs[0])).tobytes()
    for p in (1, 2):  # what each peer got: rank 0's message, once
        data = far[p].recv(1 << 16)
        assert data == head + xs[0].tobytes()
        assert mesh.links[p].bytes_sent == len(data) and mesh.links[p].frames_sent == 1


def test_exchange_queues_what_the_kernel_did_not_take_in_order(mesh3) -> None:
    mesh, far = mesh3
    for link in mesh.links.values():
        link.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    for s in far.values():
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    x = np.arange(16 << 10, dtype=np.float32)  # 64 KiB: more than the two buffers hold
    head = _head(2, x.nbytes, ("all_reduce", "float32", (x.size,), "sum", None, None))
    bufs, out = np.empty((3, x.size), np.float32), np.empty_like(x)
    links, ranks = [mesh.links[1], mesh.links[2]], [1, 2]
    code = mesh.exchange(links, ranks, head, x, bufs, 0, out, "f", "sum", 0, 0.0, 0.2)
    assert code == 4 and ranks == [1, 2] and mesh.backlog >= 1
    frame = head + x.tobytes()
    for p in (1, 2):  # each link: what went, then what is queued, is the whole message
        link = mesh.links[p]
        assert link.pending, p
        queued = b"".join(bytes(m) for m in link.pending)
        assert link.bytes_sent + len(queued) == len(frame), p
        got = b""
        with contextlib.suppress(BlockingIOError):
            far[p].setblocking(False)
            while len(got) < link.bytes_sent:
                got += far[p].recv(1 << 20)
        assert got + queued == frame, p
