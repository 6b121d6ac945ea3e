"""Parameter-server payloads in shared memory (psring.transport.shmpool) between processes on one host.

Workers copy pieces of folding collectives into slots of their pool; shards fold straight
from those slots, write each result once into a slot of their own pool, and every worker
copies it out. Only headers and slot numbers cross the sockets. These tests check that the
bytes really go that way, that the bits are those of the TCP path, that every slot comes
back (after success, mismatch, loss), that too few slots fall back to the socket, and that
a client lying about slots or pools is dropped without hurting the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

import psring
from psring.rendezvous.client import connect_store, parse_store_address
from psring.rendezvous.store import StoreServer
from psring.topology.ps.shards import server as server_mod
from psring.topology.ps.shards.server import ShardServer, start_servers
from psring.topology.ps.worker import links as links_mod
from psring.transport.listener import open_connection
from psring.transport.mailbox import Mailbox
from psring.transport.samehost import host_key
from psring.transport.shmpool import PAGE, PeerPool, ShmPool

pytestmark = [pytest.mark.slow, pytest.mark.asyncio, pytest.mark.timeout(90)]

MiB = 1 << 20


async def until(ready: Any, what: Any, timeout: float = 5) -> None:
    """Poll ready() until it holds; fail naming what never happened (what: a text, or makes one)."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, what() if callable(what) else what
        await asyncio.sleep(0.005)


class Job:
    """n workers and S shards (in this event loop) of one job; closed by the fixture."""

    def __init__(self, groups: list[Any], server: ShardServer | None) -> None:
        self.groups = groups
        self.server = server

    async def settled(self) -> None:
        """Wait until every slot lent is handed back (the hand-backs are small frames in flight)."""
        await until(lambda: not self.in_use(), lambda: f"slots still lent: {self.in_use()}")

    def in_use(self) -> dict[str, int]:
        used = {f"rank {g.rank}": g.links.pool.in_use for g in self.groups if g.links.pool is not None}
        servers = [self.server] if self.server is not None else [g.links.own_servers for g in self.groups]
        for i, s in enumerate(servers):
            if s is not None and s.pool is not None:
                used[f"server {i}"] = s.pool.in_use
        return {k: v for k, v in used.items() if v}


@pytest_asyncio.fixture
async def make_job(store: StoreServer) -> AsyncIterator[Any]:
    jobs: list[Job] = []
    names = iter(range(1000))

    async def make(n: int, shards: int = 2, **kw: Any) -> Job:
        job = f"pool{next(names)}"
        os.environ["PSRING_JOB"] = job
        server = None
        try:
            if not kw.get("colocate"):
                client = await connect_store(parse_store_address(f"127.0.0.1:{store.port}"), secret=None, timeout=10)
                server = await start_servers(client, shards, job=job)
            groups = await asyncio.gather(
                *(
                    psring.init_group("ps", rank=r, world_size=n, store=f"127.0.0.1:{store.port}", timeout=20, **kw)
                    for r in range(n)
                )
            )
        finally:
            del os.environ["PSRING_JOB"]
        made = Job(list(groups), server)
        jobs.append(made)
        return made

    yield make
    for job in jobs:
        await asyncio.gather(*(g.close() for g in job.groups), return_exceptions=True)
        if job.server is not None:
            await job.server.close()


def _inputs(n: int, size: int, dtype: Any = np.float32) -> list[np.ndarray]:
    rng = np.random.default_rng(size + n)
    return [rng.standard_normal(size).astype(dtype) for _ in range(n)]


def _tcp(stats: dict[str, int], key: str) -> int:
    return stats[f"bytes_{key}"] - stats[f"shm_bytes_{key}"]


async def test_pushes_and_results_cross_in_shared_memory_with_the_bits_of_tcp(make_job, monkeypatch) -> None:
    shm = await make_job(3, shards=2)
    xs = _inputs(3, 3 * MiB)  # 12 MiB: 6 MiB per shard, two pieces each
    await asyncio.gather(*(g.all_reduce(x) for g, x in zip(shm.groups, xs, strict=True)))  # sets the pools up
    before = [g.stats() for g in shm.groups]
    ys = await asyncio.gather(*(g.all_reduce(x) for g, x in zip(shm.groups, xs, strict=True)))
    after = [g.stats() for g in shm.groups]
    nbytes = xs[0].nbytes
    for b, a in zip(before, after, strict=True):
        assert a["shm_bytes_sent"] - b["shm_bytes_sent"] == nbytes  # every piece pushed through a slot
        assert a["shm_bytes_received"] - b["shm_bytes_received"] == nbytes  # every result read from one
        assert _tcp(a, "sent") - _tcp(b, "sent") < 8 << 10  # the sockets carried headers only
        assert _tcp(a, "received") - _tcp(b, "received") < 8 << 10
    await shm.settled()
    assert shm.server is not None and shm.server.pool is not None  # the results' pool was made

    monkeypatch.setenv("PSRING_SAME_HOST", "off")
    tcp = await make_job(3, shards=2)
    zs = await asyncio.gather(*(g.all_reduce(x) for g, x in zip(tcp.groups, xs, strict=True)))
    assert all(g.stats()["shm_bytes_sent"] == 0 for g in tcp.groups) and tcp.groups[0].links.pool is None
    for y, z in zip(ys, zs, strict=True):
        assert y.tobytes() == z.tobytes()  # the same bits as on the sockets (the ring's canonical fold)
    assert ys[0].tobytes() == ys[1].tobytes() == ys[2].tobytes()


async def test_every_folding_and_relaying_collective_goes_through_slots(make_job, monkeypatch) -> None:
    shm = await make_job(4, shards=3)
    xs = _inputs(4, 2 * MiB + 12345)  # uneven slices and pieces
    await asyncio.gather(*(g.all_reduce(x) for g, x in zip(shm.groups, xs, strict=True)))  # sets the pools up
    monkeypatch.setenv("PSRING_SAME_HOST", "off")  # read when pools are offered: the shm job keeps its own
    tcp = await make_job(4, shards=3)
    calls = [
        ("all_reduce", {"op": "sum"}),
        ("all_reduce", {"op": "avg"}),
        ("all_reduce", {"op": "max"}),
        ("all_reduce", {"op": "avg", "compression": "fp16"}),
        ("reduce", {"dst": 2, "op": "sum"}),
        ("reduce_scatter", {"op": "sum"}),
        ("broadcast", {"src": 1}),  # relays: one copy into a slot of the server's pool, lent to all
        ("all_gather", {}),
        ("gather", {"dst": 3}),
    ]
    for name, kw in calls:

        def moved() -> list[int]:
            return [g.stats()["shm_bytes_sent"] + g.stats()["shm_bytes_received"] for g in shm.groups]

        before = moved()
        got = await asyncio.gather(*(getattr(g, name)(x, **kw) for g, x in zip(shm.groups, xs, strict=True)))
        want = await asyncio.gather(*(getattr(g, name)(x, **kw) for g, x in zip(tcp.groups, xs, strict=True)))
        delta = [m - b for m, b in zip(moved(), before, strict=True)]
        assert all(d > 0 for d in delta), (name, delta)  # every rank sent or received through a slot
        for r, (y, z) in enumerate(zip(got, want, strict=True)):
            if z is None:
                assert y is None, (name, r)
                continue
            for a, b in zip(y if isinstance(y, list) else [y], z if isinstance(z, list) else [z], strict=True):
                assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), (name, kw, r)
        await shm.settled()


async def test_pieces_of_a_tensor_larger_than_the_pool_stream_through_it(make_job, monkeypatch) -> None:
    """One slot per pool: each piece waits for the slot the one before it is handed back from."""
    monkeypatch.setenv("PSRING_PS_SHM_SLOTS", "1")
    job = await make_job(3, shards=2)
    xs = _inputs(3, 5 * MiB)  # 20 MiB: 10 MiB per shard, three pieces each
    for _ in range(2):
        before = [g.stats() for g in job.groups]
        ys = await asyncio.gather(*(g.all_reduce(x) for g, x in zip(job.groups, xs, strict=True)))
        for g, b in zip(job.groups, before, strict=True):
            assert g.stats()["shm_bytes_sent"] - b["shm_bytes_sent"] == xs[0].nbytes  # all six pieces
    assert ys[0].tobytes() == ys[1].tobytes() == ys[2].tobytes()
    np.testing.assert_allclose(ys[0], xs[0] + xs[1] + xs[2], rtol=1e-5, atol=1e-5)
    assert job.groups[0].links.pool is not None and job.groups[0].links.pool.slots == 1
    await job.settled()


async def test_groups_called_in_different_orders_do_not_deadlock_on_slots(make_job, monkeypatch) -> None:
    """Rank 0 starts subgroup A's all_reduce, then B's; rank 1 starts B's, then A's. With one slot
    each, waiting for a slot whatever holds it would deadlock (each slot holds a piece the other
    rank has yet to push); a piece whose wait could deadlock goes on the socket instead."""
    monkeypatch.setenv("PSRING_PS_SHM_SLOTS", "1")
    job = await make_job(2, shards=2)
    subs = await asyncio.gather(*(g.new_group([0, 1]) for g in job.groups))
    subs2 = await asyncio.gather(*(g.new_group([0, 1]) for g in job.groups))
    xs, zs = _inputs(2, 3 * MiB), _inputs(2, 3 * MiB + 1)
    await asyncio.gather(*(g.all_reduce(x) for g, x in zip(job.groups, xs, strict=True)))  # pools set up

    async def rank(r: int) -> tuple[np.ndarray, np.ndarray]:
        a = subs[r].all_reduce(xs[r])
        b = subs2[r].all_reduce(zs[r])
        if r == 0:
            ta = asyncio.ensure_future(a)
            tb = asyncio.ensure_future(b)
        else:
            tb = asyncio.ensure_future(b)
            ta = asyncio.ensure_future(a)
        return await ta, await tb

    before = [g.stats() for g in job.groups]
    (a0, b0), (a1, b1) = await asyncio.wait_for(asyncio.gather(rank(0), rank(1)), 30)
    assert a0.tobytes() == a1.tobytes() and b0.tobytes() == b1.tobytes()
    np.testing.assert_allclose(a0, xs[0] + xs[1], rtol=1e-6)
    np.testing.assert_allclose(b0, zs[0] + zs[1], rtol=1e-6)
    for g, b in zip(job.groups, before, strict=True):
        st = g.stats()
        assert st["shm_bytes_sent"] > b["shm_bytes_sent"]  # the slot was used...
        assert _tcp(st, "sent") - _tcp(b, "sent") > MiB  # ...and pieces that could not wait took the socket
    await job.settled()


async def test_a_mismatch_and_a_lost_worker_hand_every_held_slot_back(make_job) -> None:
    job = await make_job(3, shards=2)
    xs = _inputs(3, 3 * MiB)
    await asyncio.gather(*(g.all_reduce(x) for g, x in zip(job.groups, xs, strict=True)))
    # rank 2 calls with another shape: the pieces ranks 0 and 1 pushed sit in slots, then are let go
    bad = [xs[0], xs[1], xs[2][: MiB + 7]]
    results = await asyncio.gather(
        *(g.all_reduce(x) for g, x in zip(job.groups, bad, strict=True)), return_exceptions=True
    )
    assert all(isinstance(r, psring.MismatchError) for r in results), results
    await job.settled()
    ys = await asyncio.gather(*(g.all_reduce(x) for g, x in zip(job.groups, xs, strict=True)))
    assert ys[0].tobytes() == ys[2].tobytes()
    # rank 2 pushes nothing and dies while the shards hold ranks 0 and 1's pieces in their slots
    pushed = [asyncio.ensure_future(g.all_reduce(x)) for g, x in zip(job.groups[:2], xs[:2], strict=True)]
    server = job.server
    assert server is not None
    await until(
        lambda: sum(len(p.held) for s in server.shards.values() for p in s.pending.values()) >= 2,
        "the shards never held the pushed pieces",
    )
    for conn in job.groups[2].links.shards:
        conn.abort(psring.PeerLostError("killed by the test"))
    results = await asyncio.gather(*pushed, return_exceptions=True)
    assert all(isinstance(r, psring.PeerLostError) and "rank 2" in str(r) for r in results), results
    await job.settled()  # the shards let go of the held pieces, and rank 2's end gave back what it was lent


async def test_colocated_shards_use_slots_to_the_other_processes_shards(make_job) -> None:
    job = await make_job(3, colocate=True)
    xs = _inputs(3, 3 * MiB)
    for _ in range(2):
        ys = await asyncio.gather(*(g.all_reduce(x) for g, x in zip(job.groups, xs, strict=True)))
    assert ys[0].tobytes() == ys[1].tobytes() == ys[2].tobytes()
    # in one process (this test) every shard is "another process's" for the ranks not hosting it
    assert all(g.stats()["shm_bytes_sent"] > 0 for g in job.groups)
    await job.settled()


async def test_a_client_lying_about_slots_or_pools_is_dropped_and_the_others_served(make_job, caplog) -> None:
    job = await make_job(2, shards=1)
    xs = _inputs(2, 3 * MiB)
    await asyncio.gather(*(g.all_reduce(x) for g, x in zip(job.groups, xs, strict=True)))
    host, _, port = job.groups[0].links.addresses[0].rpartition(":")
    hello = {"role": "rank", "world_size": 2, "job": job.groups[0].links.settings.job, "shard": 0, "host": host_key()}
    caplog.set_level("DEBUG", logger="psring.transport.connection")

    async def client(rank: int) -> Any:
        return await open_connection(host, int(port), secret=None, hello={**hello, "rank": rank}, router=Mailbox())

    async def dropped(conn: Any, reason: str) -> None:
        await asyncio.wait_for(conn.wait_closed(), 5)
        await until(  # the server says why
            lambda: any(reason in r.getMessage() for r in caplog.records),
            lambda: f"no {reason!r} in {[r.getMessage() for r in caplog.records]}",
        )

    # 1) a pool whose token is not the one in its memory: not mapped (it is told so), and the
    #    slot numbers it then sends are a protocol error that drops it
    conn = await client(5)
    fake = ShmPool(2, MiB)
    try:
        desc = {**fake.describe(), "token": bytes(16)}
        conn.send_frame({"kind": "pool", "offer": desc, "mapped": False})
        conn.send_frame({"kind": "ps_data", "tag": ("0", 99, "p", 0), "pool": 0, "call": None, "src": 5}, nbytes=64)
        await dropped(conn, "in shared-memory slot 0 of a pool this side never mapped")
        assert conn.shm.peer_pool is None and not conn.shm.peer_maps_pool
    finally:
        fake.close()
    # 2) handing back a slot it was never lent
    conn = await client(6)
    conn.send_frame({"kind": "free", "free": [3]})
    await dropped(conn, "handed back slots (3,) it was not lent")
    # 3) a slot number out of range of a pool that was mapped
    conn = await client(7)
    pool = ShmPool(2, MiB)
    try:
        assert await conn.shm.offer_pool(pool, 5)
        conn.send_frame({"kind": "ps_data", "tag": ("0", 99, "p", 0), "pool": 9, "call": None, "src": 7}, nbytes=64)
        await dropped(conn, "in shared-memory slot 9 of a pool of 2 x")
    finally:
        pool.close()
    # the honest workers never noticed
    ys = await asyncio.gather(*(g.all_reduce(x) for g, x in zip(job.groups, xs, strict=True)))
    assert ys[0].tobytes() == ys[1].tobytes()
    np.testing.assert_allclose(ys[0], xs[0] + xs[1], rtol=1e-6)
    await job.settled()


async def test_pools_map_only_what_they_describe(tmp_path) -> None:
    pool = ShmPool(3, 10_000)
    try:
        assert pool.slot_bytes % PAGE == 0 and pool.slot_bytes >= 10_000
        desc = pool.describe()
        peer = PeerPool.open(desc)
        k = pool.take()
        assert k is not None
        pool.view(k, 5)[:] = np.arange(5, dtype=np.uint8)
        assert peer.view(k, 5).tolist() == [0, 1, 2, 3, 4]
        with pytest.raises(ValueError):
            peer.view(k, 5)[0] = 1  # peers map it read-only
        pool.lend(k)
        pool.give_back(k)
        assert pool.in_use == 1
        pool.give_back(k)
        assert pool.in_use == 0
        peer.close()
        for bad, match in [
            ({**desc, "token": b"x" * 16}, "token differs"),
            ({**desc, "host": "elsewhere"}, "another host"),
            ({**desc, "slots": 4}, "not a pool of"),
            ({**desc, "slot_bytes": 4097}, "malformed"),
            ("nonsense", "is a map"),
        ]:
            with pytest.raises(ValueError, match=match):
                PeerPool.open(bad)
        with pytest.raises(FileNotFoundError):
            PeerPool.open({**desc, "fd": 999_999})
        with pytest.raises(ValueError, match="larger than"):
            PeerPool.open({**desc, "slots": 4096, "slot_bytes": 1 << 30})
        sparse = os.memfd_create("sparse")  # the right size, but holes: mapping it would allocate here
        try:
            os.ftruncate(sparse, PAGE + pool.slots * pool.slot_bytes)
            os.pwrite(sparse, pool.token, 0)
            with pytest.raises(ValueError, match="not reserved"):
                PeerPool.open({**desc, "fd": sparse})
        finally:
            os.close(sparse)
        with pytest.raises(ValueError, match="1 to"):
            ShmPool(0, 4096)
    finally:
        pool.close()


def _shmem_kib() -> int:
    with open("/proc/self/status") as f:
        status = f.read()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("RssShmem:")))


async def test_a_pool_maps_its_pages_by_need_and_reuses_the_slots_it_touched() -> None:
    """A 64 MiB pool (and a peer's map of it) enters this process's page tables only where touched,
    so what a process holds, and what its death costs its peers' wait for EOF (the kernel unmaps
    before it closes sockets), grows with what it uses; the pages stay reserved (fallocate). A slot
    given back is the next taken, so a pool cycles through the few slots it needs."""
    before = _shmem_kib()
    pool = ShmPool(16, 4 << 20)
    try:
        peer = PeerPool.open(pool.describe())
        try:
            assert _shmem_kib() - before < 4 << 10  # not the 64 MiB (in KiB) populated at once
            assert os.fstat(pool.fd).st_blocks * 512 >= 16 * (4 << 20)  # still reserved up front
            for _ in range(20):  # one call at a time: the same slot each time
                k = pool.take()
                assert k is not None
                pool.view(k, 4 << 20)[:] = 1
                assert int(peer.view(k, 4 << 20)[::PAGE].sum()) == (4 << 20) // PAGE
                pool.give_back(k)
            assert k == 0
            grew = _shmem_kib() - before
            assert 4 << 10 <= grew < 3 * (4 << 10), grew  # one slot (4 MiB), in the owner's map and the peer's
        finally:
            peer.close()
    finally:
        pool.close()


async def test_a_server_process_maps_the_workers_pools(store) -> None:
    """Separate processes: the server maps each worker's pool through /proc/<pid>/fd."""
    from ..conftest import end, ps_workers, spawn_server

    job = "pool-proc"
    args = ["--shards", "2", "--host", "127.0.0.1", "--store", f"127.0.0.1:{store.port}", "--job", job]
    server, _ = await spawn_server(args)
    groups: list[Any] = []
    try:
        groups = await ps_workers(store.port, job, 2, timeout=20)
        xs = _inputs(2, 3 * MiB)
        for _ in range(2):
            ys = await asyncio.gather(*(g.all_reduce(x) for g, x in zip(groups, xs, strict=True)))
        np.testing.assert_allclose(ys[0], xs[0] + xs[1], rtol=1e-6)
        assert all(g.stats()["shm_bytes_sent"] >= xs[0].nbytes for g in groups)
        assert all(g.stats()["shm_bytes_received"] >= xs[0].nbytes for g in groups)
        assert all(c.shm.peer_pool is not None and c.shm.peer_maps_pool for g in groups for c in g.links.shards)
    finally:
        await asyncio.gather(*(g.close() for g in groups), return_exceptions=True)
        with contextlib.suppress(Exception):
            end(server)


async def test_slots_lent_to_a_lost_peer_wait_until_its_process_is_gone() -> None:
    """A peer that was lost (not one that said goodbye) may still be reading what it was lent:
    those slots are reused only once its process has ended (never, if nobody knows which)."""
    import subprocess
    import sys

    from ..conftest import end

    pool = ShmPool(2, 4096)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        k = pool.take()
        assert k is not None
        pool.lend(k)  # lent to the peer...
        pool.give_back(k)  # ...and the owner is done writing it
        pool.quarantine({k: 1}, proc.pid)  # the peer's connection was lost
        other = pool.take()
        assert other is not None and other != k
        assert pool.take() is None  # no free slot: the sweep finds the peer still alive
        end(proc)  # killed by PID and reaped
        assert pool.take() == k  # now the sweep gives it back
        pool.quarantine({k: 1}, None)  # a peer nobody can name
        pool.sweep()
        assert pool.quarantined and pool.in_use == 2
    finally:
        end(proc)
        pool.close()


def _big_model(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w": rng.standard_normal((1000, 700)).astype(np.float32), "b": rng.standard_normal(700).astype(np.float32)}


def _big_grads(step: int, rank: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1000 * step + rank)
    return {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in _big_model(0).items()}


async def _sgd(groups: list[Any], steps: range, opts: list[Any] | None = None) -> tuple[list[Any], list[Any]]:
    from psring.optim import Adam

    opts = opts or [psring.SyncSGD(g, _big_model(g.rank), Adam(lr=0.01)) for g in groups]
    outs: list[Any] = []
    for t in steps:
        outs = await asyncio.gather(*(o.step(_big_grads(t, g.rank)) for o, g in zip(opts, groups, strict=True)))
    return opts, outs


async def test_parameter_mode_pushes_and_parameters_cross_in_shared_memory(make_job, monkeypatch) -> None:
    shm = await make_job(3, shards=2)
    _, got = await _sgd(shm.groups, range(6))
    stats = [g.stats() for g in shm.groups]
    params = sum(v.nbytes for v in _big_model(0).values())
    assert all(s["shm_bytes_sent"] >= 5 * params for s in stats), stats  # the gradients went through slots
    assert all(s["shm_bytes_received"] >= 5 * params for s in stats), stats  # and the new parameters
    await shm.settled()
    monkeypatch.setenv("PSRING_SAME_HOST", "off")
    tcp = await make_job(3, shards=2)
    _, want = await _sgd(tcp.groups, range(6))
    assert all(g.stats()["shm_bytes_sent"] == 0 for g in tcp.groups)
    for k in want[0]:
        assert all(o[k].tobytes() == want[0][k].tobytes() for o in got + want), k


@pytest.mark.timeout(120)
async def test_a_server_sigkilled_while_holding_pushes_in_shared_memory_is_restored_exactly(
    store, make_job, tmp_path
) -> None:
    """The server dies holding the workers' slots: they come back to the workers once its process
    is gone, the restarted server maps the pools afresh, and training ends with the parameters of
    an uninterrupted run."""
    from ..conftest import end, ps_workers, spawn_server

    want = (await _sgd((await make_job(2, shards=2)).groups, range(8)))[1]
    job = "pool-ckpt"
    args = ["--shards", "2", "--host", "127.0.0.1", "--store", f"127.0.0.1:{store.port}", "--job", job]
    args += ["--checkpoint-every", "1", "--checkpoint-dir", str(tmp_path)]
    server, _ = await spawn_server(args)
    groups: list[Any] = []
    try:
        groups = await ps_workers(store.port, job, 2, timeout=20)
        opts, _ = await _sgd(groups, range(4))
        assert all(g.stats()["shm_bytes_sent"] > 0 for g in groups)
        # rank 0 pushes step 4 alone: the shards hold its pieces in its slots, waiting for rank 1
        early = asyncio.ensure_future(opts[0].step(_big_grads(4, 0)))
        pool = groups[0].links.pool
        assert pool is not None
        await until(lambda: pool.in_use > 0, "rank 0's pushes never sat in its slots", timeout=10)
        end(server)  # SIGKILL by PID, reaped
        server, line = await spawn_server([*args, "--restore"])
        assert "restored" in line, line
        late = asyncio.ensure_future(opts[1].step(_big_grads(4, 1)))
        await asyncio.gather(early, late)
        _, got = await _sgd(groups, range(5, 8), opts)
        for k in want[0]:
            assert got[0][k].tobytes() == got[1][k].tobytes() == want[0][k].tobytes(), k
        assert pool.in_use == 0 and not pool.quarantined  # the dead server's slots came back
    finally:
        await asyncio.gather(*(g.close() for g in groups), return_exceptions=True)
        end(server)


async def test_a_pool_that_cannot_be_made_leaves_that_side_on_the_socket(make_job, monkeypatch, caplog) -> None:
    """No memory for a pool (ENOMEM/ENOSPC at fallocate): a server without one still maps the
    workers' pools (pushes in shared memory, results on the socket); a worker without one
    pushes on the socket. The bits are the same either way."""

    def no_memory(*_a: Any, **_k: Any) -> Any:
        raise OSError(28, "No space left on device")

    xs = _inputs(2, 3 * MiB)
    monkeypatch.setattr(server_mod, "ShmPool", no_memory)
    half = await make_job(2, shards=2)
    ys = [await asyncio.gather(*(g.all_reduce(x) for g, x in zip(half.groups, xs, strict=True))) for _ in range(2)][-1]
    assert half.server is not None and half.server.pool is None
    assert "no shared memory for results" in caplog.text
    stats = [g.stats() for g in half.groups]
    assert all(s["shm_bytes_sent"] == 2 * xs[0].nbytes and s["shm_bytes_received"] == 0 for s in stats), stats
    await half.settled()
    monkeypatch.undo()
    monkeypatch.setattr(links_mod, "ShmPool", no_memory)
    none = await make_job(2, shards=2)
    zs = await asyncio.gather(*(g.all_reduce(x) for g, x in zip(none.groups, xs, strict=True)))
    assert all(g.links.pool is None and g.stats()["shm_bytes_sent"] == 0 for g in none.groups)
    assert "no shared memory for pushes" in caplog.text
    assert ys[0].tobytes() == ys[1].tobytes() == zs[0].tobytes() == zs[1].tobytes()


async def test_relayed_pieces_wait_in_their_slots_for_late_joiners(make_job) -> None:
    """Rank 0's all_gather pieces reach the shards before the others join: the shards keep them in
    rank 0's slots until everyone has joined, then forward them and hand the slots back."""
    job = await make_job(3, shards=2)
    xs = _inputs(3, 3 * MiB)
    await asyncio.gather(*(g.all_reduce(x) for g, x in zip(job.groups, xs, strict=True)))
    first = asyncio.ensure_future(job.groups[0].all_gather(xs[0]))
    server = job.server
    assert server is not None
    await until(
        lambda: sum(len(p.waiting) for s in server.shards.values() for p in s.pending.values()) >= 2,
        "rank 0's pieces never waited on the shards",
    )
    held = [k for s in server.shards.values() for p in s.pending.values() for k in p.held]
    assert held and all(k[0] == "w" and k[1] == 0 for k in held)  # in rank 0's slots
    rest = await asyncio.gather(*(g.all_gather(x) for g, x in zip(job.groups[1:], xs[1:], strict=True)))
    for out in [await first, *rest]:
        assert all(a.tobytes() == x.tobytes() for a, x in zip(out, xs, strict=True))
    await job.settled()


async def test_a_broadcast_as_the_first_large_call_reaches_its_receivers_through_slots(make_job) -> None:
    """Receivers push nothing, but offer their pools all the same: the result comes back in shared memory."""
    job = await make_job(3, shards=2)
    x = _inputs(1, 3 * MiB)[0]
    for _ in range(2):
        ys = await asyncio.gather(*(g.broadcast(x if g.rank == 2 else np.empty_like(x), src=2) for g in job.groups))
    assert all(y.tobytes() == x.tobytes() for y in ys)
    stats = [g.stats() for g in job.groups]
    assert stats[2]["shm_bytes_sent"] == 2 * x.nbytes
    assert stats[0]["shm_bytes_received"] == stats[1]["shm_bytes_received"] == 2 * x.nbytes
    await job.settled()
