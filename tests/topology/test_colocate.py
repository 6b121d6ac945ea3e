"""ps with the shards colocated in the worker processes, and the in-process connection under it."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import numpy as np
import pytest

import psring
from psring.errors import PeerLostError
from psring.rendezvous.client import connect_store, parse_store_address
from psring.topology.ps.shards.paramstore import param_store
from psring.topology.ps.shards.server import start_servers
from psring.transport.local import LocalConnection, local_pair
from psring.transport.mailbox import Mailbox

from ..conftest import end, spawn
from ..transport.test_faults import RANK_SCRIPT

pytestmark = [pytest.mark.slow, pytest.mark.asyncio, pytest.mark.timeout(90)]


class _Sink:
    """A router that keeps what it is given (the far end of a local pair in these tests)."""

    def __init__(self) -> None:
        self.frames: list[tuple[dict[str, Any], bytes]] = []
        self.lost: list[PeerLostError | None] = []
        self.dest: memoryview | None = None

    def buffer_for(self, conn: Any, header: dict[str, Any]) -> memoryview | None:
        return self.dest

    def deliver(self, conn: Any, header: dict[str, Any], payload: Any) -> None:
        self.frames.append((header, bytes(memoryview(payload).cast("B")) if header["nbytes"] else b""))

    def connection_lost(self, conn: Any, error: PeerLostError | None) -> None:
        self.lost.append(error)


def _pair() -> tuple[LocalConnection, LocalConnection, _Sink, _Sink]:
    a, b = local_pair("worker", "shard")
    sa, sb = _Sink(), _Sink()
    a.router, b.router = sa, sb
    a.peer = {"role": "server", "shards": [0]}
    b.peer = {"role": "rank", "rank": 0}
    return a, b, sa, sb


async def test_local_pair_delivers_in_order_and_flush_means_taken() -> None:
    a, b, _sa, sb = _pair()
    sizes = [0, 1, 1000, 3 << 20, 7, 2 << 20]  # the megabyte ones come from the buffer pool
    arrays = [np.full(n, i + 1, np.uint8) for i, n in enumerate(sizes)]
    for i, x in enumerate(arrays):
        a.send_tensor({"kind": "data", "tag": ("g", i)}, x)
    assert sb.frames == []  # delivered on the next loop iteration, never inside send
    await a.flush()
    for x in arrays:
        x[...] = 0  # after flush the sender may reuse its memory: the receiver has its own copy
    assert [h["tag"] for h, _ in sb.frames] == [("g", i) for i in range(len(sizes))]
    for (header, payload), n, i in zip(sb.frames, sizes, range(len(sizes)), strict=True):
        assert header["nbytes"] == n and header["shape"] == (n,) and payload == bytes([i + 1]) * n
    assert a.bytes_sent == b.bytes_received > sum(sizes)
    # a posted buffer of the right size gets the payload directly
    sb.dest = memoryview(bytearray(5))
    a.send_frame({"kind": "data", "tag": ("g", 99)}, b"hello")
    await a.flush()
    assert bytes(sb.dest) == b"hello"


async def test_local_pair_close_is_a_goodbye_and_abort_a_loss() -> None:
    a, b, sa, sb = _pair()
    await a.close(farewell={"seqs": {"0": 4}})
    assert sb.lost == [None] and b.farewell is not None and b.farewell["seqs"] == {"0": 4}
    assert sa.lost == [None]
    with pytest.raises(PeerLostError, match="closed"):
        a.send_frame({"kind": "data", "tag": ("g", 1)})
    await a.close()  # idempotent
    assert sb.lost == [None] and sa.lost == [None]

    a, b, sa, sb = _pair()
    a.abort(PeerLostError("the worker went away"))
    assert len(sb.lost) == 1 and isinstance(sb.lost[0], PeerLostError) and "went away" in str(sb.lost[0])
    with pytest.raises(PeerLostError):
        b.send_frame({"kind": "data", "tag": ("g", 1)})


async def test_local_pair_drops_a_bad_frame_with_the_reason() -> None:
    a, b, _sa, sb = _pair()
    a.send_frame({"kind": "data", "tag": ("g", 1), "dtype": "complex64", "shape": [1]}, b"\0" * 8)
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert sb.frames == [] and len(sb.lost) == 1
    assert b.lost is not None and "'dtype' is 'complex64'" in str(b.lost.__cause__ or b.lost)


async def test_colocated_ps_gives_the_ring_bits_over_local_and_tcp_links(make_groups) -> None:
    world = 3
    ring = await make_groups(world, "ring")
    ps = await make_groups(world, "ps", colocate=True)
    for g in ps:  # one shard per rank: its own through no socket, the others' over TCP
        conns = g.links.shards  # type: ignore[attr-defined]
        assert len(conns) == world
        assert [isinstance(c, LocalConnection) for c in conns] == [r == g.rank for r in range(world)]
    rng = np.random.default_rng(7)
    for size in (1, 1000, 3_000_001):
        xs = [rng.standard_normal(size).astype(np.float32) for _ in range(world)]
        for op in ("sum", "avg", "max"):
            want = await asyncio.gather(*(g.all_reduce(x, op) for g, x in zip(ring, xs, strict=True)))
            got = await asyncio.gather(*(g.all_reduce(x, op) for g, x in zip(ps, xs, strict=True)))
            for w, y in zip(want, got, strict=True):
                assert y.tobytes() == w.tobytes()
        b = await asyncio.gather(*(g.broadcast(x, src=1) for g, x in zip(ps, xs, strict=True)))
        assert all(y.tobytes() == xs[1].tobytes() for y in b)
        ag = await asyncio.gather(*(g.all_gather(x) for g, x in zip(ps, xs, strict=True)))
        assert all(np.array_equal(y, np.stack(xs)) for y in ag)
    await asyncio.gather(*(g.barrier() for g in ps))
    x = np.arange(10, dtype=np.int64)
    _, got = await asyncio.gather(ps[0].send(x, dst=2), ps[2].recv(src=0))
    assert np.array_equal(got, x)
    local = [g.links.shards[g.rank] for g in ps]  # type: ignore[attr-defined]
    assert all(c.bytes_sent > 3_000_000 * 4 // world for c in local)  # the big pieces went in-process


async def test_colocated_rank_sigkilled_others_raise_peer_lost(store, tmp_path) -> None:
    """A colocated rank takes its shard with it: the other ranks raise PeerLostError in seconds."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    world = 3
    env = {
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "PSRING_TOPOLOGY": "ps",
        "PSRING_PS_COLOCATE": "1",
        "PSRING_JOB": "colokill",
    }
    procs = [spawn([str(script), "2000000"], {**env, "RANK": str(r)}) for r in range(world)]
    try:
        for p in procs:
            assert p.stdout is not None
            line = await asyncio.to_thread(p.stdout.readline)
            assert line.strip() == "ready", line
        await asyncio.sleep(0.3)
        os.kill(procs[1].pid, signal.SIGKILL)
        t0 = time.monotonic()
        codes = [await asyncio.to_thread(p.wait, 40) for p in (procs[0], procs[2])]
        detect = time.monotonic() - t0
        outs = [end(p) for p in procs]
        assert codes == [3, 3], outs
        assert detect < 15, outs
        for out in (outs[0], outs[2]):
            assert "LOST" in out and ("shard 1" in out or "rank 1" in out), out
            assert "AGAIN" in out, out
    finally:
        for p in procs:
            end(p)


async def test_colocate_setting_is_checked(store) -> None:
    os.environ["PSRING_PS_COLOCATE"] = "maybe"
    try:
        with pytest.raises(ValueError, match=r"PSRING_PS_COLOCATE='maybe': expected 1 or 0"):
            await psring.init_group("ps", rank=0, world_size=1, store=f"127.0.0.1:{store.port}", timeout=5)
    finally:
        del os.environ["PSRING_PS_COLOCATE"]
    with pytest.raises(TypeError, match="colocate='yes' must be True or False"):
        await psring.init_group("ps", rank=0, world_size=1, store=f"127.0.0.1:{store.port}", timeout=5, colocate="yes")


async def test_mailbox_is_what_workers_use_on_local_links() -> None:
    a, b = local_pair("worker", "shard")
    box_a, box_b = Mailbox(), Mailbox()
    a.router, b.router = box_a, box_b
    fut = box_b.expect(("g", 0, 1))
    a.send_tensor({"kind": "data", "tag": ("g", 0, 1)}, np.arange(4, dtype=np.float32))
    _conn, header, payload = await asyncio.wait_for(fut, 5)
    assert header["dtype"] == "float32" and np.frombuffer(payload, np.float32).tolist() == [0, 1, 2, 3]
    await a.close()


async def test_colocated_ps_over_tcp_no_copy_paths_survive_a_caller_that_overwrites_at_once(
    make_groups, monkeypatch
) -> None:
    """Over TCP a rank's own shard folds its slice straight out of that rank's input and into that
    rank's result (no copies), and sends the others the result from that memory. A caller that
    overwrites its input and its result the moment all_reduce returns must change nothing any
    rank gets: the rank gets its last piece only once those sends left its memory."""
    monkeypatch.setenv("PSRING_SAME_HOST", "off")
    monkeypatch.setenv("PSRING_PS_PIECE", "4M")  # pieces larger than a socket takes at once
    world = 3
    ring = await make_groups(world, "ring")
    ps = await make_groups(world, "ps", colocate=True)
    rng = np.random.default_rng(11)

    async def scribbling(g: psring.Group, x: np.ndarray, op: str) -> np.ndarray:
        y = await g.all_reduce(x, op)
        shards = g.links.own_servers.shards.values()  # type: ignore[attr-defined]
        unsent = [c.transport.get_write_buffer_size() for sh in shards for c in sh.conns if c.transport is not None]
        assert not any(unsent), f"rank {g.rank} got its result while its shard still sends it: {unsent}"
        got = y.copy()
        y[...] = np.nan
        x[...] = np.nan
        return got

    for size in (1_500_001, 12_000_000):
        for op in ("sum", "avg", "max"):
            xs = [rng.standard_normal(size).astype(np.float32) for _ in range(world)]
            want = await asyncio.gather(*(g.all_reduce(x, op) for g, x in zip(ring, xs, strict=True)))
            got = await asyncio.gather(*(scribbling(g, x.copy(), op) for g, x in zip(ps, xs, strict=True)))
            for r, (w, y) in enumerate(zip(want, got, strict=True)):
                assert y.tobytes() == w.tobytes(), f"rank {r}, {size} elements, {op}"
    # rank 2 stops reading what shard 0 (in rank 0) sends it for a while: rank 0's result waits for it
    slow = ps[2].links.shards[0].transport  # type: ignore[attr-defined]
    slow.pause_reading()
    asyncio.get_running_loop().call_later(0.5, slow.resume_reading)
    xs = [rng.standard_normal(30_000_000).astype(np.float32) for _ in range(world)]  # more than sockets hold
    want = await asyncio.gather(*(g.all_reduce(x) for g, x in zip(ring, xs, strict=True)))
    got = await asyncio.gather(*(scribbling(g, x.copy(), "sum") for g, x in zip(ps, xs, strict=True)))
    assert all(y.tobytes() == w.tobytes() for w, y in zip(want, got, strict=True))
    for g in ps:
        local = g.links.shards[g.rank]  # type: ignore[attr-defined]
        assert isinstance(local, LocalConnection) and local.bytes_sent > 12_000_000 * 4 // world


async def test_weighted_split_over_colocated_and_dedicated_shards_gives_the_ring_bits(store, make_groups) -> None:
    """The BytePS split: 3 colocated shards and 2 on a server of their own (PSRING_PS_DEDICATED), every
    large tensor cut 1:1:1:3:3 (PSRING_PS_WEIGHTS, rank 0's word): the ring's bits, each shard sent
    its weight's share, and SyncSGD's parameters (parameter mode, cut alike) the ring's too."""
    world, job = 3, "weighted"
    ring = await make_groups(world, "ring")
    client = await connect_store(parse_store_address(f"127.0.0.1:{store.port}"), secret=None, timeout=10)
    dedicated = await start_servers(client, world + 2, job=job, shard_ids=[3, 4])
    base = {**os.environ, "PSRING_JOB": job, "PSRING_PS_DEDICATED": "2"}
    # rank 0's weights are the job's: the others' differ and do not count
    envs = [{**base, "PSRING_PS_WEIGHTS": "1,1,1,3,3" if r == 0 else "9,9,9,9,9"} for r in range(world)]
    addr = f"127.0.0.1:{store.port}"
    groups = await asyncio.gather(
        *(psring.init_group("ps", rank=r, world_size=world, store=addr, timeout=20, env=envs[r], colocate=True)
          for r in range(world))
    )  # fmt: skip
    try:
        assert [len(g.links.shards) for g in groups] == [5] * world  # type: ignore[attr-defined]
        assert all(g.links.weights == (1, 1, 1, 3, 3) for g in groups)  # type: ignore[attr-defined]
        rng = np.random.default_rng(3)
        n = 900_000
        xs = [rng.standard_normal(n).astype(np.float32) for _ in range(world)]
        before = [list(g.links.per_shard()) for g in groups]  # type: ignore[attr-defined]
        want = await asyncio.gather(*(g.all_reduce(x) for g, x in zip(ring, xs, strict=True)))
        got = await asyncio.gather(*(g.all_reduce(x) for g, x in zip(groups, xs, strict=True)))
        assert all(y.tobytes() == w.tobytes() for w, y in zip(want, got, strict=True))
        sent = [b[0] - a[0] for a, b in zip(before[1], groups[1].links.per_shard(), strict=True)]  # type: ignore[attr-defined]
        share = [s / sum(sent) for s in sent]
        assert share == pytest.approx([1 / 9, 1 / 9, 1 / 9, 3 / 9, 3 / 9], abs=0.01), sent
        # parameter mode: rank 0 hands the buckets out cut by the weights; steps give the ring's parameters
        model = {"w": np.linspace(-1, 1, 200_000, dtype=np.float32), "b": np.zeros(10, np.float32)}
        grads = [{k: rng.standard_normal(v.shape).astype(np.float32) for k, v in model.items()} for _ in range(world)]
        outs = {}
        for name, gs in (("ring", ring), ("ps", groups)):
            opts = [psring.SyncSGD(g, {k: v.copy() for k, v in model.items()}) for g in gs]
            await asyncio.gather(*(o.start() for o in opts))
            for _ in range(2):
                res = await asyncio.gather(*(o.step(gr) for o, gr in zip(opts, grads, strict=True)))
            outs[name] = res
        for r in range(world):
            for k in model:
                assert outs["ps"][r][k].tobytes() == outs["ring"][0][k].tobytes()
        held = [(b.n, b.slice) for s in dedicated.shards.values() for b in param_store(s).buckets.values()]
        held = [(n, z - a) for n, (a, z) in held if n > 1000]
        assert len(held) == 2 and all(abs(m - n * 3 / 9) <= 1 for n, m in held), held  # 3/9 of the bucket each
    finally:
        await asyncio.gather(*(g.close() for g in groups), return_exceptions=True)
        await dedicated.close()
        await client.close()


async def test_weights_and_dedicated_shards_are_checked(store) -> None:
    addr = f"127.0.0.1:{store.port}"
    saved = dict(os.environ)
    try:
        os.environ["PSRING_PS_WEIGHTS"] = "1,two"
        with pytest.raises(ValueError, match=r"PSRING_PS_WEIGHTS='1,two': expected whole numbers"):
            await psring.init_group("ps", rank=0, world_size=1, store=addr, timeout=5, colocate=True)
        os.environ["PSRING_PS_WEIGHTS"] = "1,0"
        with pytest.raises(ValueError, match=r"PSRING_PS_WEIGHTS='1,0': expected weights from 1"):
            await psring.init_group("ps", rank=0, world_size=1, store=addr, timeout=5, colocate=True)
        os.environ.update(PSRING_PS_WEIGHTS="1,2,3", PSRING_JOB="w3")  # one shard: three weights
        with pytest.raises(ValueError, match=r"PSRING_PS_WEIGHTS \(rank 0's\): 3 shard weights \(1,2,3\) for 1 shards"):
            await psring.init_group("ps", rank=0, world_size=1, store=addr, timeout=5, colocate=True)
        del os.environ["PSRING_PS_WEIGHTS"]
        os.environ.update(PSRING_PS_DEDICATED="2", PSRING_JOB="d2")
        with pytest.raises(
            ValueError, match=r"PSRING_PS_DEDICATED=2 adds dedicated shards .* needs PSRING_PS_COLOCATE=1"
        ):
            await psring.init_group("ps", rank=0, world_size=1, store=addr, timeout=5)
    finally:
        os.environ.clear()
        os.environ.update(saved)
