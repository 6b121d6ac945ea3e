"""Same-host Unix links (psring.transport.unixmesh): small ring collectives between ranks of one host go
over seqpacket sockets, with the same bits and the same errors as over TCP; peers are checked
by pid; a full kernel buffer queues instead of failing; one rank without them keeps all on TCP."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import psring
from psring import settings
from psring.core import wire
from psring.core.fold import canonical_fold
from psring.errors import ProtocolError
from psring.transport.unixmesh import UnixMesh

from ..conftest import run_tree

pytestmark = [pytest.mark.slow, pytest.mark.asyncio, pytest.mark.timeout(90)]


@pytest.fixture(autouse=True)
def _links_not_boards(monkeypatch) -> None:
    """Small all_reduces between ranks of one host go through shared-memory boards by default
    (test_shmboard.py); these tests are about the links under them."""
    monkeypatch.setenv("PSRING_RING_BOARD", "0")


def _tcp_sent(g: psring.Group) -> int:
    return sum(c.bytes_sent for c in g.net._all_conns())  # type: ignore[attr-defined]


def _unix_sent(g: psring.Group) -> int:
    return g.net.small.unix.stats()[0]  # type: ignore[attr-defined]


async def test_small_collectives_take_the_unix_links(make_groups, monkeypatch) -> None:
    monkeypatch.setenv("PSRING_HEARTBEAT_INTERVAL", "60")  # no heartbeat bytes on TCP meanwhile
    groups = await make_groups(3)
    for g in groups:
        mesh = g.net.small.unix  # type: ignore[attr-defined]
        assert mesh is not None and sorted(mesh.links) == [r for r in range(3) if r != g.rank]
        assert mesh.listener is None  # closed once every link was up: nobody else may join
    await asyncio.gather(*(g.all_reduce(np.ones(1)) for g in groups))  # warm-up
    tcp, unix = [_tcp_sent(g) for g in groups], [_unix_sent(g) for g in groups]
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal(1000).astype(np.float32) for _ in groups]
    ys = await asyncio.gather(*(g.all_reduce(x) for g, x in zip(groups, xs, strict=True)))
    await asyncio.gather(*(g.barrier() for g in groups))
    ref = canonical_fold(xs, "sum", np.empty(1000, np.float32))
    assert all(y.tobytes() == ref.tobytes() for y in ys)
    assert [_tcp_sent(g) for g in groups] == tcp  # not one byte over TCP
    assert all(_unix_sent(g) > u for g, u in zip(groups, unix, strict=True))


async def _battery(groups: list[psring.Group], world: int) -> list[bytes]:
    """Every small collective once, with data that makes the fold order visible."""
    rng = np.random.default_rng(world)
    out: list[bytes] = []
    for n in (1, 1000, 16384, 100_003):  # the last splits its fold over the ranks on the boards
        xs = [(rng.standard_normal(n) * 10.0 ** rng.integers(-6, 6, n)).astype(np.float32) for _ in groups]
        for op in ("sum", "avg", "max", "prod"):
            ys = await asyncio.gather(*(g.all_reduce(x, op) for g, x in zip(groups, xs, strict=True)))
            assert all(y.tobytes() == ys[0].tobytes() for y in ys)
            out.append(ys[0].tobytes())
        ys = await asyncio.gather(*(g.all_reduce(x, compression="fp16") for g, x in zip(groups, xs, strict=True)))
        out.append(ys[0].tobytes())
    x = rng.integers(0, 1000, (4, 5)).astype(np.int64)
    ys = await asyncio.gather(*(g.broadcast(x if g.rank == 1 else np.zeros_like(x), src=1) for g in groups))
    assert all(np.array_equal(y, x) for y in ys)
    parts = await asyncio.gather(*(g.all_gather(np.full(3, g.rank, np.int32)) for g in groups))
    assert all(np.array_equal(np.stack(p), np.repeat(np.arange(world), 3).reshape(world, 3)) for p in parts)
    xs = [rng.standard_normal(10).astype(np.float64) for _ in groups]
    ys = await asyncio.gather(*(g.reduce_scatter(x) for g, x in zip(groups, xs, strict=True)))
    out.append(b"".join(y.tobytes() for y in ys))
    got = await asyncio.gather(*(g.gather(np.full(2, g.rank), dst=world - 1) for g in groups))
    assert got[-1] is not None and [int(a[0]) for a in got[-1]] == list(range(world))
    await asyncio.gather(*(g.barrier() for g in groups))
    return out


@pytest.mark.parametrize("world", [2, 3, 5])
async def test_unix_links_and_tcp_give_the_same_bits(make_groups, monkeypatch, world: int) -> None:
    """The same bits over the boards, the Unix links and TCP."""
    results = {}
    for mode, board in (("auto", "16M"), ("auto", "0"), ("off", "16M")):
        monkeypatch.setenv("PSRING_SAME_HOST", mode)
        monkeypatch.setenv("PSRING_RING_BOARD", board)
        groups = await make_groups(world)
        assert all((g.net.small.unix is not None) == (mode == "auto") for g in groups)  # type: ignore[attr-defined]
        boards = (mode, board) == ("auto", "16M")
        assert all((g.net.board is not None) == boards for g in groups)  # type: ignore[attr-defined]
        results[mode, board] = await _battery(groups, world)
    assert results["auto", "16M"] == results["auto", "0"] == results["off", "16M"]


async def test_a_small_call_against_a_large_one_is_a_named_mismatch(make_groups) -> None:
    """Rank 0's call takes the Unix links, rank 1's the TCP ring: neither waits forever."""
    groups = await make_groups(2, timeout=30)
    t0 = time.monotonic()
    results = await asyncio.gather(
        groups[0].all_reduce(np.ones(4, np.float32)),
        groups[1].all_reduce(np.ones(1_000_000, np.float32)),
        return_exceptions=True,
    )
    assert time.monotonic() - t0 < 10
    assert all(isinstance(r, psring.MismatchError) for r in results), results
    assert all("shape" in str(r) for r in results), results
    ys = await asyncio.gather(*(g.all_reduce(np.ones(3)) for g in groups))  # the group goes on
    assert all(np.array_equal(y, np.full(3, 2.0)) for y in ys)


async def test_mismatch_over_unix_links_names_ranks_and_values(make_groups) -> None:
    groups = await make_groups(3)
    ops = ["sum", "max", "sum"]
    results = await asyncio.gather(
        *(g.all_reduce(np.ones(2, np.float32), op) for g, op in zip(groups, ops, strict=True)),
        return_exceptions=True,
    )
    assert all(isinstance(r, psring.MismatchError) for r in results), results
    assert all("rank 1 called all_reduce(max) #0" in str(r) and "all_reduce(sum) #0" in str(r) for r in results), (
        results
    )


async def test_many_concurrent_calls_overflow_the_kernel_buffer_and_all_arrive(make_groups) -> None:
    groups = await make_groups(2)
    rng = np.random.default_rng(5)
    calls = 200  # 200 messages of 64 KiB each way: far over a socket buffer
    xs = [[rng.standard_normal(16384).astype(np.float32) for _ in range(calls)] for _ in groups]
    ys = await asyncio.gather(*(asyncio.gather(*(g.all_reduce(x) for x in xs[g.rank])) for g in groups))
    for i in range(calls):
        ref = canonical_fold([xs[0][i], xs[1][i]], "sum", np.empty(16384, np.float32))
        assert ys[0][i].tobytes() == ref.tobytes() == ys[1][i].tobytes()
    links = [g.net.small.unix.links for g in groups]  # type: ignore[attr-defined]
    assert sum(link.deferred for ls in links for link in ls.values()) > 0  # the queue was used
    assert all(link.frames_sent >= calls and not link.pending for ls in links for link in ls.values())


async def test_a_bad_message_breaks_the_link_and_names_the_rank(make_groups) -> None:
    groups = await make_groups(2)
    groups[1].net.small.unix.links[0].sock.send(b"\x40\x00not msgpack at all")  # type: ignore[attr-defined]
    deadline = time.monotonic() + 10
    while True:
        try:
            await groups[0].barrier()
        except psring.PeerLostError as exc:
            if "bad same-host message" in str(exc) or time.monotonic() > deadline:
                assert "rank 1" in str(exc) and "bad same-host message" in str(exc), exc
                break
        await asyncio.sleep(0.2)


async def test_one_rank_without_unix_links_keeps_every_rank_on_tcp(make_groups, monkeypatch) -> None:
    real = UnixMesh.bind

    def bind(self: UnixMesh) -> dict:
        if self.rank == 1:
            raise OSError("no Unix sockets here")
        return real(self)

    monkeypatch.setattr(UnixMesh, "bind", bind)
    groups = await make_groups(3)
    assert all(g.net.small.unix is None for g in groups)  # type: ignore[attr-defined]
    ys = await asyncio.gather(*(g.all_reduce(np.full(5, g.rank + 1.0)) for g in groups))
    assert all(np.array_equal(y, np.full(5, 6.0)) for y in ys)


async def test_bad_setting_is_named(store, monkeypatch) -> None:
    monkeypatch.setenv("PSRING_SAME_HOST", "maybe")
    with pytest.raises(ValueError, match="PSRING_SAME_HOST='maybe'"):
        settings.current()
    with pytest.raises(ValueError, match="PSRING_SAME_HOST"):
        await psring.init_group("ring", rank=0, world_size=2, store=f"127.0.0.1:{store.port}", timeout=5)


STRANGER = """
import socket, sys, time, msgpack
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect("\\0" + sys.argv[1])
s.send(msgpack.packb({"rank": 0, "job": "j"}))
print("sent", flush=True)
time.sleep(30)
"""


async def test_a_stranger_cannot_pose_as_a_rank(caplog) -> None:
    got: list[tuple[int, tuple, bytes]] = []
    m0 = UnixMesh(0, "j", lambda p, h, b: got.append((p, h, bytes(b))), lambda p, e: None)
    m1 = UnixMesh(1, "j", lambda p, h, b: got.append((p, h, bytes(b))), lambda p, e: None)
    info0, info1 = m0.bind(), m1.bind()
    accepting = asyncio.ensure_future(m1.connect({0: info0}, timeout=20))
    stranger = subprocess.Popen(
        [sys.executable, "-c", STRANGER, info1["name"]], stdout=subprocess.PIPE, text=True
    )  # another process, so another pid than the one rank 0 published
    try:
        assert stranger.stdout is not None
        assert (await asyncio.to_thread(stranger.stdout.readline)).strip() == "sent"
        with caplog.at_level(logging.WARNING, logger="psring.transport.unixmesh"):
            await asyncio.sleep(0.2)
            assert not accepting.done()  # the stranger's claim to be rank 0 was not taken
            await m0.connect({1: info1}, timeout=20)
            await accepting
        assert f"from pid {stranger.pid}" in caplog.text
        assert sorted(m1.links) == [0]
        m0.send(1, wire.encode_message(("0", 7, 0, ("barrier", None, None, None, None, None)), b"abc"))
        for _ in range(100):
            if got:
                break
            await asyncio.sleep(0.01)
        assert got == [(0, ("0", 7, 0, ("barrier", None, None, None, None, None)), b"abc")]
        # and a dialer refuses a socket that is not held by the pid its rank published
        m2, m3 = UnixMesh(0, "j", lambda *a: None, lambda *a: None), UnixMesh(1, "j", lambda *a: None, lambda *a: None)
        info3 = m3.bind()
        m2.bind()
        with pytest.raises(ProtocolError, match="held by pid"):
            await m2.connect({1: {**info3, "pid": info3["pid"] + 1}}, timeout=5)
        m2.close()
        m3.close()
    finally:
        stranger.kill()
        stranger.wait()
        if stranger.stdout is not None:
            stranger.stdout.close()
        m0.close()
        m1.close()


SPIN_JOB = """
import numpy as np, psring
from psring.core.fold import canonical_fold
from psring.topology.ring.net import PeerNet
g = psring.init()
n, net = g.world_size, g._group.net
assert PeerNet.live == 1 and net.small.unix is not None, (PeerNet.live, net.small.unix)
for i in range(300):
    xs = [np.random.default_rng(1000 * i + r).standard_normal(1 + i % 50).astype(np.float32) for r in range(n)]
    if i % 4 == 3:  # two collectives, the second's number taken before the first runs
        y = g.all_reduce(xs[g.rank], compression="fp16")
        assert np.allclose(y, sum(xs), rtol=1e-2, atol=1e-2), i
        continue
    y = g.all_reduce(xs[g.rank], "max" if i % 3 == 0 else "sum")
    ref = canonical_fold(xs, "max" if i % 3 == 0 else "sum", np.empty_like(xs[0]))
    assert y.tobytes() == ref.tobytes(), i
g.barrier()
print("ok", net.small.unix.stats()[0] > 0, flush=True)
g.close()
"""


@pytest.mark.parametrize("board", ["0", "16K"])
@pytest.mark.parametrize("spin_us", ["0", "2000"])
async def test_one_rank_per_process_polls_before_it_sleeps(tmp_path, spin_us: str, board: str) -> None:
    """With one rank per process a rank polls its links or boards (PSRING_SPIN_US) before sleeping:
    the same bits either way, a long spin included. fp16 calls are in the mix: their messages come
    early for a number already reserved, and must be kept (a spin once made that a hang); with the
    boards, the blocking calls run on the caller's thread between them."""
    script = tmp_path / "job.py"
    script.write_text(SPIN_JOB)
    env = {**os.environ, "PSRING_SPIN_US": spin_us, "PSRING_TIMEOUT": "20", "PSRING_RING_BOARD": board}
    proc = await asyncio.to_thread(
        run_tree,
        [sys.executable, "-m", "psring", "launch", "-n", "3", "--", sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert all(f"[rank {r}] ok True" in proc.stdout for r in range(3)), proc.stdout
