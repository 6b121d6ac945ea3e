"""The TCP small-message links between hosts (psring.transport.tcpmesh) and the small all_reduce that
runs on the caller's thread over them (psring.topology.ring.tcpdirect). ``PSRING_SAME_HOST=off`` makes
ranks of one machine behave as if on separate hosts: no Unix links, no boards, only TCP."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest

import psring
from psring.core.fold import canonical_fold

from ..conftest import blocking_job_end, run_blocking_job
from ..transport.test_shmboard import _needs_native


@pytest.fixture
def tcp_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PSRING_SAME_HOST", "off")
    monkeypatch.setenv("PSRING_HEARTBEAT_INTERVAL", "60")  # no heartbeat bytes meanwhile


def _conn_bytes(net: Any) -> int:
    return sum(c.bytes_sent for c in net._all_conns())


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.timeout(90)
async def test_small_collectives_between_hosts_take_the_tcp_links_and_give_the_canonical_bits(
    make_groups, tcp_only
) -> None:
    groups = await make_groups(3)
    nets = [g.net for g in groups]  # type: ignore[attr-defined]
    assert all(n.small.unix is None and n.board is None and n.small.tcp is not None for n in nets)
    assert all(sorted(n.small.tcp.links) == sorted(set(range(3)) - {n.rank}) for n in nets)
    assert all(g.net.paths.one_hop(3).value == "direct" for g in groups)  # type: ignore[attr-defined]
    await asyncio.gather(*(g.all_reduce(np.ones(1)) for g in groups))  # warm-up
    conns = [_conn_bytes(n) for n in nets]
    meshed = [n.small.tcp.stats()[0] for n in nets]
    rng = np.random.default_rng(5)
    for size, dtype, op in [
        (1, np.float32, "sum"),
        (5, np.float64, "avg"),
        (4096, np.float32, "max"),
        (7, np.int64, "prod"),
        (16_000, np.float32, "sum"),  # 64,000 bytes: the largest one-hop size (64 KiB) is still a message
    ]:
        xs = [(rng.standard_normal(size) * 100).astype(dtype) for _ in groups]
        ys = await asyncio.gather(*(g.all_reduce(x, op) for g, x in zip(groups, xs, strict=True)))
        ref = canonical_fold(xs, op, np.empty(size, dtype))
        assert all(y.tobytes() == ref.tobytes() for y in ys), (size, op)
    await asyncio.gather(*(g.barrier() for g in groups))
    ys = await asyncio.gather(*(g.broadcast(np.full(3, g.rank + 7.0), src=2) for g in groups))
    assert all(np.array_equal(y, np.full(3, 9.0)) for y in ys)
    assert [_conn_bytes(n) for n in nets] == conns  # not one byte on the connections
    assert all(n.small.tcp.stats()[0] > m for n, m in zip(nets, meshed, strict=True))
    # a large all_reduce still takes the ring's own links, and the small ones after it the TCP links
    xs = [rng.standard_normal(300_000).astype(np.float32) for _ in groups]
    ys = await asyncio.gather(*(g.all_reduce(x) for g, x in zip(groups, xs, strict=True)))
    ref = canonical_fold(xs, "sum", np.empty(300_000, np.float32))
    assert all(y.tobytes() == ref.tobytes() for y in ys)


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.timeout(90)
async def test_many_small_calls_in_flight_between_hosts_keep_their_order(make_groups, tcp_only) -> None:
    groups = await make_groups(3)
    rng = np.random.default_rng(3)
    xs = [[rng.standard_normal(1 + i % 9).astype(np.float32) for i in range(40)] for _ in groups]
    ys = await asyncio.gather(*(asyncio.gather(*(g.all_reduce(x) for x in xs[g.rank])) for g in groups))
    for i in range(40):
        ref = canonical_fold([xs[r][i] for r in range(3)], "sum", np.empty_like(xs[0][i]))
        assert all(ys[r][i].tobytes() == ref.tobytes() for r in range(3)), i


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.timeout(90)
async def test_a_small_call_between_hosts_against_another_call_is_a_named_mismatch(make_groups, tcp_only) -> None:
    groups = await make_groups(2, timeout=30)
    t0 = time.monotonic()
    results = await asyncio.gather(
        groups[0].all_reduce(np.zeros(4)), groups[1].broadcast(np.zeros(4)), return_exceptions=True
    )
    assert all(isinstance(r, psring.MismatchError) for r in results), results
    results = await asyncio.gather(
        groups[0].all_reduce(np.zeros(4)), groups[1].all_reduce(np.zeros(5)), return_exceptions=True
    )
    assert all(isinstance(r, psring.MismatchError) for r in results), results
    said = [str(r) for r in results]  # whichever rank found it names both shapes
    assert any(("[5]" in s and "expected [4]" in s) or ("[4]" in s and "expected [5]" in s) for s in said), said
    # a small call against a large one (which takes the ring's links, not the small-message ones)
    results = await asyncio.gather(
        groups[0].all_reduce(np.zeros(4)), groups[1].all_reduce(np.zeros(100_000)), return_exceptions=True
    )
    assert all(isinstance(r, psring.MismatchError) for r in results), results
    assert time.monotonic() - t0 < 15  # named, not timed out
    ys = await asyncio.gather(*(g.all_reduce(np.full(3, g.rank + 1.0)) for g in groups))
    assert all(np.array_equal(y, np.full(3, 3.0)) for y in ys)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_psring_ring_tcp_mesh_0_keeps_small_messages_on_the_connections(
    make_groups, tcp_only, monkeypatch
) -> None:
    monkeypatch.setenv("PSRING_RING_TCP_MESH", "0")
    groups = await make_groups(2)
    assert all(g.net.small.tcp is None for g in groups)  # type: ignore[attr-defined]
    ys = await asyncio.gather(*(g.all_reduce(np.full(3, g.rank + 1.0)) for g in groups))
    assert all(np.array_equal(y, np.full(3, 3.0)) for y in ys)


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.timeout(90)
async def test_a_slow_small_message_link_dial_leaves_no_heartbeat_on_the_links_already_open(
    make_groups, tcp_only, monkeypatch
) -> None:
    """A link whose dial took longer than a heartbeat interval (a lost SYN is retried after 1 s, the
    default interval) while the links dialed beside it were done: those were left in the event loop
    and pinged, and the peer, which had taken its end out of the loop, read the ping as a message and
    closed the link (the netfaults "loss 1%" run failed so). Each link leaves the loop as it opens."""
    from psring.topology.ring.net import PeerNet

    monkeypatch.setenv("PSRING_HEARTBEAT_INTERVAL", "0.1")
    dial = PeerNet.dial

    async def slow_dial(self: Any, rank: int, timeout: float, *, data: bool | str = False) -> Any:
        if data == "mesh" and self.rank == 0 and rank == 2:
            await asyncio.sleep(1.0)  # ten heartbeat intervals
        return await dial(self, rank, timeout, data=data)

    monkeypatch.setattr(PeerNet, "dial", slow_dial)
    groups = await make_groups(3)
    for i in range(20):
        xs = [np.full(1 + i, g.rank + i, np.float32) for g in groups]
        ys = await asyncio.gather(*(g.all_reduce(x) for g, x in zip(groups, xs, strict=True)))
        assert all(y.tobytes() == canonical_fold(xs, "sum", np.empty_like(xs[0])).tobytes() for y in ys), i
    assert all(not link.closed for g in groups for link in g.net.small.tcp.links.values())  # type: ignore[attr-defined]


# ------------------------------------------------------------------ the blocking API, one rank a process
BLOCKING_JOB = """
import os, sys, numpy as np, psring
from psring.core.fold import canonical_fold
if os.environ.get("MIXED") == "1" and int(os.environ["RANK"]) % 2:
    os.environ["PSRING_NATIVE"] = "off"  # every other rank without the C loop: the same messages, the same bits
g = psring.init()
n, grp = g.world_size, g.group
assert grp.net.small.tcp is not None and grp.net.small.unix is None
for i in range(400):
    dtype = np.float64 if i % 4 == 2 else np.float32
    xs = [np.random.default_rng(1000 * i + r).standard_normal(1 + i % 37).astype(dtype) for r in range(n)]
    op = ("max", "sum", "avg")[i % 3]
    if i % 50 == 7:  # a large call in flight: the small ones after it must take the loop, in order
        h = g.all_reduce(np.ones(300_000, np.float32), async_op=True)
        y = g.all_reduce(xs[g.rank], op)
        assert np.all(h.wait() == n), i
    elif i % 50 == 23:
        y = g.all_reduce(xs[g.rank], compression="fp16")  # the loop's path, then the thread's again
        assert np.allclose(y, sum(xs), rtol=1e-2, atol=1e-2), i
        continue
    elif i % 50 == 31:
        g.barrier()
        continue
    else:
        y = g.all_reduce(xs[g.rank], op)
    ref = canonical_fold(xs, op, np.empty_like(xs[0]))
    assert y.tobytes() == ref.tobytes(), i
    if g.rank == 1 and i % 100 == 99:
        import time; time.sleep(0.5)  # a late rank: the others' calls are handed to the loop
native = grp.net.small.tcp.native
assert native == (os.environ.get("PSRING_NATIVE") != "off"), native
# the sums and averages in one C call each (psring._native.tcp_exchange) where the rank is native
assert (grp.tcp.ran_native >= 100) if native else (grp.tcp.ran_native == 0), grp.tcp.ran_native
""" + blocking_job_end("grp.tcp.ran_now, grp.tcp.adopted")


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("world", "native"), [(2, "on"), (4, "on"), (4, "off"), (3, "mixed")])
def test_blocking_small_calls_between_hosts_run_on_the_callers_thread(tmp_path, world: int, native: str) -> None:
    if native != "off":
        _needs_native()
    script = tmp_path / "job.py"
    script.write_text(BLOCKING_JOB)
    env = {"PSRING_NATIVE": native} if native == "off" else {"MIXED": str(int(native == "mixed"))}
    for r, (on_thread, adopted) in run_blocking_job(script, world, PSRING_SAME_HOST="off", **env).items():
        assert on_thread >= 100, (r, on_thread, adopted)  # most of the 400 small calls ended on the caller's thread
        if r != 1:
            assert adopted > 0, (r, on_thread, adopted)  # rank 1's naps made the others wait past ADOPT_AFTER


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_catch_up_hands_on_what_a_peer_sent_before_its_link_ended_and_then_the_end() -> None:
    """A peer lost on its control link may have sent messages on its small-message link that the loop has
    not read yet: ``catch_up`` reads them at once, in order, then the link's end -- and only while the
    loop reads the links (held): otherwise a thread may be reading them."""
    import socket
    import struct

    from psring.core import wire
    from psring.transport.tcpmesh import TcpMesh

    events: list[Any] = []
    mesh = TcpMesh(0, 1, lambda p, h, pl: events.append((p, h[1], bytes(pl))), lambda p, e: events.append((p, e)))
    mine, theirs = socket.socketpair()
    mesh.add(1, mine)
    try:
        for seq in (7, 8):
            msg = wire.encode_message(("0", seq, 0, ("barrier", None, None, None, None, None)), b"ab" * seq)
            theirs.sendall(struct.pack("<I", len(msg)) + msg)
        theirs.close()
        mesh.catch_up(1)  # not held: left to whoever reads the link
        assert events == [] and not mesh.links[1].closed
        mesh.hold()
        events.clear()  # (hold hands on nothing: nothing was read)
        mesh.catch_up(1)
        assert events == [(1, 7, b"ab" * 7), (1, 8, b"ab" * 8), (1, None)], events
        assert mesh.links[1].closed
        mesh.release()
    finally:
        mesh.close()
