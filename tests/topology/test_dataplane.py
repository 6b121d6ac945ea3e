"""The ring's threaded data plane (psring.topology.ring.plane.dataplane): large all_reduces leave the event loop.

These are the cases where a byte stream shared by collectives could go wrong: a rank
that abandons a collective half-way (mismatch, timeout) leaves frames behind that the
next collective must skip; concurrent calls must reach the plane in one order; ranks
that cannot run the plane must make everyone fall back together.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import threading
import time

import numpy as np
import pytest

import psring
from psring.core.arrays import result_empty
from psring.core.fold import canonical_fold

from ..conftest import run_tree
from ..transport.test_shmboard import _needs_native

pytestmark = [pytest.mark.slow, pytest.mark.asyncio, pytest.mark.timeout(120)]


@pytest.fixture(autouse=True)
def _plane_for_small_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Everything above 64 KiB takes the plane here (8 MiB by default), in 100 kB pieces (4 MiB by
    default), so tests stay quick and still cut chunks into several pieces."""
    monkeypatch.setenv("PSRING_RING_PLANE_MIN", str(64 << 10))
    monkeypatch.setenv("PSRING_RING_PLANE_PIECE", "100000")  # several uneven pieces per chunk
    monkeypatch.setenv("PSRING_RING_BOARD", "0")  # one host: these sizes would take the boards (test_shmboard.py)
    monkeypatch.setenv("PSRING_RING_TWO_HOP", "0")  # over TCP from 4 ranks they would take two hops (test_two_hop.py)


BIG = 300_001  # float32 elements: 1.2 MB, above the one-hop size and not divisible by world sizes


def _plane_bytes(groups: list[psring.Group]) -> list[int]:
    return [g.net.plane.bytes_sent if g.net.plane is not None else 0 for g in groups]  # type: ignore[attr-defined]


async def test_large_all_reduce_runs_on_the_plane_in_canonical_order(make_groups) -> None:
    for world in (2, 3, 5):
        groups = await make_groups(world)
        rng = np.random.default_rng(world)
        xs = [rng.standard_normal(BIG).astype(np.float32) for _ in range(world)]
        before = _plane_bytes(groups)
        for op in ("sum", "avg", "max", "prod"):
            ys = await asyncio.gather(*(g.all_reduce(x, op=op) for g, x in zip(groups, xs, strict=True)))
            ref = canonical_fold(xs, op, np.empty(BIG, np.float32))
            assert all(y.tobytes() == ref.tobytes() for y in ys), (world, op)
        sent = [a - b for a, b in zip(_plane_bytes(groups), before, strict=True)]
        assert all(s >= 4 * 2 * (world - 1) / world * xs[0].nbytes for s in sent), sent


async def test_concurrent_large_all_reduces_stay_in_order(make_groups) -> None:
    groups = await make_groups(3)
    xs = {(r, k): np.full(BIG + k, r * 10.0 + k, np.float64) for r in range(3) for k in range(4)}

    async def rank(g: psring.Group) -> list[np.ndarray]:
        return list(await asyncio.gather(*(g.all_reduce(xs[g.rank, k]) for k in range(4))))

    results = await asyncio.gather(*(rank(g) for g in groups))
    for per_rank in results:
        for k, y in enumerate(per_rank):
            assert y.shape == (BIG + k,) and np.all(y == sum(r * 10.0 + k for r in range(3)))


async def test_mismatch_on_the_plane_is_named_and_the_group_recovers(make_groups) -> None:
    groups = await make_groups(3)
    xs = [np.ones(BIG, np.float32), np.ones(BIG + 4, np.float32), np.ones(BIG, np.float32)]
    t0 = time.monotonic()
    results = await asyncio.gather(*(g.all_reduce(x) for g, x in zip(groups, xs, strict=True)), return_exceptions=True)
    assert time.monotonic() - t0 < 10
    assert all(isinstance(r, psring.MismatchError) for r in results), results
    assert any("rank 1" in str(r) and f"[{BIG + 4}]" in str(r) for r in results), results
    # the frames the mismatched collective left on the links are skipped by the next one
    for k in range(3):
        ys = await asyncio.gather(*(g.all_reduce(np.full(BIG, g.rank + k, np.float32)) for g in groups))
        assert all(np.all(y == 3 + 3 * k) for y in ys)


async def test_timeout_on_the_plane_then_the_group_recovers(make_groups) -> None:
    groups = await make_groups(3, timeout=1.0)
    x = np.ones(1 << 20, np.float32)
    results = await asyncio.gather(groups[0].all_reduce(x), groups[1].all_reduce(x), return_exceptions=True)
    assert all(isinstance(r, psring.CollectiveTimeoutError) for r in results), results
    assert any("rank(s) 2" in str(r) for r in results), results
    with pytest.raises(psring.CollectiveTimeoutError):
        await groups[2].all_reduce(x)
    ys = await asyncio.gather(*(g.all_reduce(x * (g.rank + 1)) for g in groups))
    assert all(np.all(y == 6.0) for y in ys)


async def test_ranks_without_the_plane_make_everyone_fall_back(make_groups, monkeypatch) -> None:
    import psring.topology.ring.net as net

    real = net.plane_possible
    calls = iter(range(100))
    # rank order of creation is not fixed: let exactly one rank decline
    monkeypatch.setattr(net, "plane_possible", lambda settings: next(calls) != 1 and real(settings))
    groups = await make_groups(3)
    assert all(g.net.plane is None for g in groups)  # type: ignore[attr-defined]
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(BIG).astype(np.float32) for _ in range(3)]
    ys = await asyncio.gather(*(g.all_reduce(x) for g, x in zip(groups, xs, strict=True)))
    ref = canonical_fold(xs, "sum", np.empty(BIG, np.float32))
    assert all(y.tobytes() == ref.tobytes() for y in ys)


async def test_plane_can_be_turned_off(make_groups, monkeypatch) -> None:
    monkeypatch.setenv("PSRING_RING_THREADS", "0")
    groups = await make_groups(2)
    assert all(g.net.plane is None for g in groups)  # type: ignore[attr-defined]
    ys = await asyncio.gather(*(g.all_reduce(np.full(BIG, 2.0)) for g in groups))
    assert all(np.all(y == 4.0) for y in ys)


async def test_close_mid_collective_ends_the_threads(make_groups) -> None:
    groups = await make_groups(2, timeout=30.0)
    pending = asyncio.ensure_future(groups[0].all_reduce(np.ones(1 << 20, np.float32)))
    await asyncio.sleep(0.2)
    await groups[1].close()
    with pytest.raises(psring.PeerLostError, match="rank 1"):
        await asyncio.wait_for(pending, 10)
    await groups[0].close()
    planes = [g.net.plane for g in groups]  # type: ignore[attr-defined]
    for plane in planes:
        assert plane is not None and plane.closed
        assert all(not t.is_alive() for t in plane._threads)


async def test_results_are_recycled_only_after_release() -> None:
    x = np.ones(1 << 20, np.float32)
    a = result_empty(x)
    a[:] = 1.0
    view = a[10:20]
    del a
    b = result_empty(x)  # the first is still referenced through view: not handed out again
    b[:] = 2.0
    assert np.all(view == 1.0)
    address = b.__array_interface__["data"][0]
    del b
    c = result_empty(x)
    assert c.__array_interface__["data"][0] == address  # released: recycled
    assert c.shape == x.shape and c.dtype == x.dtype and c.flags.writeable
    small = result_empty(np.ones(4))
    assert small.base is None  # small results are plain arrays


async def test_ranks_agree_on_one_plane_threshold(make_groups, monkeypatch) -> None:
    from psring.topology.ring.net import PeerNet

    sizes = iter([64 << 10, 1 << 20, 64 << 10])
    real_init = PeerNet.__init__

    def init(self: PeerNet, *args: object, **kwargs: object) -> None:  # each rank its own threshold
        real_init(self, *args, **kwargs)  # type: ignore[arg-type]
        self.plane_offer = self.plane_shm_offer = next(sizes)

    monkeypatch.setattr(PeerNet, "__init__", init)
    groups = await make_groups(3)
    assert [g.net.plane_min for g in groups] == [1 << 20] * 3  # type: ignore[attr-defined]
    assert all(g.net.plane.shm_out is not None for g in groups)  # type: ignore[attr-defined]
    before = _plane_bytes(groups)
    ys = await asyncio.gather(*(g.all_reduce(np.ones(BIG, np.float32)) for g in groups))  # 1.2 MB: plane
    assert all(np.all(y == 3.0) for y in ys)
    assert all(a > b for a, b in zip(_plane_bytes(groups), before, strict=True))
    before = _plane_bytes(groups)
    ys = await asyncio.gather(*(g.all_reduce(np.ones(100_000, np.float32)) for g in groups))  # 400 KB: loop
    assert all(np.all(y == 3.0) for y in ys)
    assert _plane_bytes(groups) == before


@pytest.mark.parametrize("all_native", [True, False])
async def test_over_tcp_the_native_threshold_holds_only_where_every_rank_runs_the_plane_in_c(
    make_groups, monkeypatch, all_native: bool
) -> None:
    """PSRING_RING_NATIVE_PLANE_MIN lowers the plane's threshold over TCP at any number of ranks, agreed
    like the others: a rank whose jobs would not run in C (no extension, PSRING_NATIVE=off) offers none,
    and then every rank keeps the plane's own threshold."""
    _needs_native()
    from psring.topology.ring.net import PeerNet

    monkeypatch.setenv("PSRING_SAME_HOST", "off")
    monkeypatch.setenv("PSRING_RING_PLANE_MIN", str(8 << 20))
    monkeypatch.setenv("PSRING_RING_NATIVE_PLANE_MIN", str(200 << 10))
    offers = iter([200 << 10, 200 << 10 if all_native else 0])
    real_init = PeerNet.__init__

    def init(self: PeerNet, *args: object, **kwargs: object) -> None:
        real_init(self, *args, **kwargs)  # type: ignore[arg-type]
        assert self.plane_native_offer == 200 << 10  # the setting, on a native rank
        self.plane_native_offer = next(offers)

    monkeypatch.setattr(PeerNet, "__init__", init)
    groups = await make_groups(2)
    want = 200 << 10 if all_native else 8 << 20
    assert [g.net.plane_min for g in groups] == [want] * 2  # type: ignore[attr-defined]
    before = _plane_bytes(groups)
    x = np.arange(1 << 18, dtype=np.float32)  # 1 MiB: the plane only with the native threshold
    ys = await asyncio.gather(*(g.all_reduce(x) for g in groups))
    assert all(np.array_equal(y, 2 * x) for y in ys)
    assert all((a > b) == all_native for a, b in zip(_plane_bytes(groups), before, strict=True))


@pytest.mark.timeout(60)
async def test_bad_sizes_in_the_environment_are_named() -> None:
    import sys

    for name in ("PSRING_BUFFER_POOL", "PSRING_RING_PLANE_MIN"):
        env = {**os.environ, name: "lots"}
        # named where settings are first resolved (importing psring resolves none: #35)
        proc = run_tree([sys.executable, "-m", "psring", "--help"], env=env, capture_output=True, text=True, timeout=50)
        assert proc.returncode == 2
        assert f"{name}='lots': expected a whole number of bytes" in proc.stderr


async def test_input_still_arriving_is_read_only_after_ready_in_ring_order(make_groups) -> None:
    """A cupy input is copied to the host range by range while the plane already sends
    (psring.core.gpu.StagedInput). Stand-in without a GPU: each rank's host buffer starts as NaN
    and a range is filled only when the plane asks for it through coll.input_wait; the
    result must still be exact, and the order announced must be the ring's."""
    from psring.core.fold import ring_chunk_bounds

    world = 3
    groups = await make_groups(world)
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal(BIG).astype(np.float32) for _ in range(world)]
    asked: dict[int, list[tuple[int, int]]] = {r: [] for r in range(world)}

    async def rank(g: psring.Group) -> np.ndarray:
        r = g.rank
        order = g._input_order(BIG, xs[r].nbytes)  # type: ignore[attr-defined]
        bounds = ring_chunk_bounds(BIG, world)
        assert order == [bounds[(r - k) % world] for k in range(world)]
        host = np.full(BIG, np.nan, np.float32)
        filled = np.zeros(BIG, bool)

        lock = threading.Lock()

        def wait(a: int, b: int) -> None:  # runs on the plane's two threads
            with lock:
                for lo, hi in order:
                    if lo < b and a < hi and not filled[lo:hi].all():
                        asked[r].append((lo, hi))
                        host[lo:hi] = xs[r][lo:hi]
                        filled[lo:hi] = True

        coll = g.begin("all_reduce", host, "sum")  # type: ignore[attr-defined]
        coll.input_wait = wait
        return await g.run(coll, g._all_reduce(coll, host, "sum"))  # type: ignore[attr-defined]

    ys = await asyncio.gather(*(rank(g) for g in groups))
    ref = canonical_fold(xs, "sum", np.empty(BIG, np.float32))
    assert all(y.tobytes() == ref.tobytes() for y in ys)
    for r in range(world):  # every chunk was waited for before it was read (the two threads race
        # for the first one: the send thread's own chunk or the first fold's)
        assert sorted(asked[r]) == ring_chunk_bounds(BIG, world), asked[r]


async def test_input_wait_is_honoured_off_the_plane_too(make_groups) -> None:
    """Below the plane threshold the ring needs the whole input at once: it waits for all of it."""
    groups = await make_groups(2)
    n = 40_000  # 160 KB: the loop path (plane threshold raised below)
    for g in groups:
        g.net.paths = dataclasses.replace(g.net.paths, plane_min=1 << 40)  # type: ignore[attr-defined]
    xs = [np.arange(n, dtype=np.float64) * (r + 1) for r in range(2)]

    async def rank(g: psring.Group) -> np.ndarray:
        assert g._input_order(n, xs[g.rank].nbytes) is None  # type: ignore[attr-defined]
        host = np.full(n, np.nan)
        calls = []

        def wait(a: int, b: int) -> None:
            calls.append((a, b))
            host[a:b] = xs[g.rank][a:b]

        coll = g.begin("all_reduce", host, "sum")  # type: ignore[attr-defined]
        coll.input_wait = wait
        y = await g.run(coll, g._all_reduce(coll, host, "sum"))  # type: ignore[attr-defined]
        assert calls == [(0, n)]
        return y

    ys = await asyncio.gather(*(rank(g) for g in groups))
    assert all(np.array_equal(y, xs[0] + xs[1]) for y in ys)


async def test_gpu_overlap_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from psring import settings

    monkeypatch.delenv("PSRING_GPU_OVERLAP", raising=False)
    assert settings.current().gpu_overlap is False
    monkeypatch.setenv("PSRING_GPU_OVERLAP", "1")
    assert settings.current().gpu_overlap is True
    monkeypatch.setenv("PSRING_GPU_OVERLAP", "maybe")
    with pytest.raises(ValueError, match=r"PSRING_GPU_OVERLAP='maybe': expected 1 or 0"):
        settings.current()


async def test_a_rank_that_finished_and_left_does_not_fail_a_slower_ranks_plane_collective(make_groups) -> None:
    """The plane's data travels on its own links, so a goodbye on the control connection can
    overtake the last pieces: a slower rank must still finish what the departed rank finished."""
    groups = await make_groups(3)
    plane = groups[2].net.plane  # type: ignore[attr-defined]
    real = plane._next
    calls: dict[int, int] = {}

    def slow_last_frame(job, reader):  # runs on rank 2's receive thread, once per frame
        calls[job.seq] = calls.get(job.seq, 0) + 1
        if calls[job.seq] == len(job.steps) + 1:  # its last frame: the others finish and leave meanwhile
            time.sleep(0.5)
        return real(job, reader)

    plane._next = slow_last_frame
    rng = np.random.default_rng(11)
    xs = [rng.standard_normal(BIG).astype(np.float32) for _ in range(3)]
    slow = asyncio.ensure_future(groups[2].all_reduce(xs[2]))
    fast = await asyncio.gather(groups[0].all_reduce(xs[0]), groups[1].all_reduce(xs[1]))
    assert not slow.done()
    await asyncio.gather(groups[0].close(), groups[1].close())
    ref = canonical_fold(xs, "sum", np.empty(BIG, np.float32))
    assert all(y.tobytes() == ref.tobytes() for y in [*fast, await slow])
    with pytest.raises(psring.PeerLostError, match=r"rank [01]"):
        await groups[2].barrier()


def _shm_files() -> list[str]:
    return sorted(f for f in os.listdir("/dev/shm") if f.startswith("psring-plane-"))


async def _mismatch_timeout_recovery(groups: list[psring.Group]) -> None:
    """4 ranks over TCP: a mismatch mid-call, then a timeout (rank 3 late), each named; the frames they
    left on the links are skipped, in order, by the calls after them."""
    bad = [np.ones(BIG, np.float32)] * 2 + [np.ones(BIG + 4, np.float32)] + [np.ones(BIG, np.float32)]
    results = await asyncio.gather(*(g.all_reduce(x) for g, x in zip(groups, bad, strict=True)), return_exceptions=True)
    assert all(isinstance(r, psring.MismatchError) for r in results), results
    assert any(f"[{BIG + 4}]" in str(r) for r in results), results
    x = np.ones(1 << 20, np.float32)
    results = await asyncio.gather(*(g.all_reduce(x) for g in groups[:3]), return_exceptions=True)
    assert all(isinstance(r, psring.CollectiveTimeoutError) for r in results), results
    with pytest.raises(psring.CollectiveTimeoutError):
        await groups[3].all_reduce(x)
    for k in range(3):
        ys = await asyncio.gather(*(g.all_reduce(np.full(BIG, g.rank + k, np.float32)) for g in groups))
        assert all(np.all(y == 6 + 4 * k) for y in ys)


@pytest.mark.parametrize("sndbuf", [0, 8192])
async def test_over_tcp_the_receive_thread_sends_at_once_what_the_kernel_takes(
    make_groups, monkeypatch, sndbuf: int
) -> None:
    """Over TCP links the receive thread hands a forwarded frame to the kernel itself when nothing of the
    job waits for the send thread, without blocking; what the kernel does not take (an 8 KiB send
    buffer here) goes to the send thread, in order. Bits, byte counts, concurrent calls, a mismatch
    and a timeout mid-call, as through the send thread alone."""
    monkeypatch.setenv("PSRING_SAME_HOST", "off")
    monkeypatch.setenv("PSRING_NATIVE", "off")  # the two threads (the native ring: the tests below)
    world = 4
    groups = await make_groups(world, timeout=2.0)
    planes = [g.net.plane for g in groups]  # type: ignore[attr-defined]
    assert all(p.shm_out is None and p.native is None for p in planes)
    if sndbuf:
        for p in planes:
            p.send_sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal(BIG).astype(np.float32) for _ in range(world)]
    before = _plane_bytes(groups)
    for op in ("sum", "avg", "max", "prod"):
        ys = await asyncio.gather(*(g.all_reduce(x, op=op) for g, x in zip(groups, xs, strict=True)))
        ref = canonical_fold(xs, op, np.empty(BIG, np.float32))
        assert all(y.tobytes() == ref.tobytes() for y in ys), op
    sent = [a - b for a, b in zip(_plane_bytes(groups), before, strict=True)]
    assert all(s >= 4 * 2 * (world - 1) / world * xs[0].nbytes for s in sent), sent
    assert all(s < 4 * 2 * (world - 1) / world * xs[0].nbytes + 8192 for s in sent), sent  # headers only
    assert all(p.right.frames_sent_here + p.right.frames_split_here > 0 for p in planes)
    if sndbuf:
        assert any(p.right.frames_split_here > 0 for p in planes)
    # calls in flight at once, a mismatch, a timeout: the frames left behind are skipped, in order
    inputs = {(g.rank, k): np.full(BIG + k, g.rank * 10.0 + k, np.float32) for g in groups for k in range(4)}

    async def rank(g: psring.Group) -> list[np.ndarray]:
        return list(await asyncio.gather(*(g.all_reduce(inputs[g.rank, k]) for k in range(4))))

    for per_rank in await asyncio.gather(*(rank(g) for g in groups)):
        for k, y in enumerate(per_rank):
            assert y.shape == (BIG + k,) and np.all(y == sum(r * 10.0 + k for r in range(world)))
    await _mismatch_timeout_recovery(groups)


@pytest.mark.parametrize("native", ["all", "mixed", "send-thread"])
async def test_over_tcp_the_native_ring_gives_the_same_frames_and_bits(make_groups, monkeypatch, native: str) -> None:
    """Over TCP links a job whose fold the C extension takes runs in C on the receive thread alone
    (psring._native.NRing): the threaded plane's frames, so native ranks and threaded ones (``mixed``:
    ranks 1 and 3 without it) share a ring. Bits for every op and dtype, byte counts, calls in flight
    at once beside threaded jobs (max), a mismatch and a timeout mid-call, and recovery after each.
    ``send-thread``: every native job but rank 2's sends from a thread of its own (PSRING_RING_SEND_THREAD)."""
    _needs_native()
    monkeypatch.setenv("PSRING_SAME_HOST", "off")
    if native == "send-thread":
        monkeypatch.setenv("PSRING_RING_SEND_THREAD", "1")
    world = 4
    groups = await make_groups(world, timeout=2.0)
    planes = [g.net.plane for g in groups]  # type: ignore[attr-defined]
    assert all(p.shm_out is None and p.native is not None for p in planes)
    if native == "mixed":
        planes[1].native = planes[3].native = None
    if native == "send-thread":
        assert all(p.native.send_thread == 1 for p in planes)
        planes[2].native.send_thread = 0  # one rank on one thread: the same frames
    rng = np.random.default_rng(7)
    for dtype in (np.float32, np.float64, np.int32, np.int64):
        xs = [(rng.standard_normal(BIG) * 100).astype(dtype) for _ in range(world)]
        before = _plane_bytes(groups)
        for op in ("sum", "avg", "max", "prod"):
            if op == "avg" and np.dtype(dtype).kind == "i":
                continue
            ys = await asyncio.gather(*(g.all_reduce(x, op=op) for g, x in zip(groups, xs, strict=True)))
            ref = canonical_fold(xs, op, np.empty(BIG, dtype))
            assert all(y.tobytes() == ref.tobytes() for y in ys), (dtype, op)
        sent = [a - b for a, b in zip(_plane_bytes(groups), before, strict=True)]
        calls = 3 if np.dtype(dtype).kind == "i" else 4
        assert all(s >= calls * 2 * (world - 1) / world * xs[0].nbytes for s in sent), sent
        assert all(s < calls * 2 * (world - 1) / world * xs[0].nbytes + 8192 for s in sent), sent  # headers only
    engines = [p.native for p in planes]
    native_jobs = [0 if e is None else e.jobs for e in engines]
    assert all((n >= 9) == (e is not None) == (n != 0) for n, e in zip(native_jobs, engines, strict=True))
    runs = [0 if e is None else e.send_thread_runs for e in engines]
    sends = [e is not None and 0 < e.send_thread <= BIG for e in engines]
    assert all((n >= 9) == s for n, s in zip(runs, sends, strict=True)), runs
    assert native != "send-thread" or runs[2] == 0 < runs[0], runs
    if native == "send-thread":  # its send buffer: bounded while a send thread runs, then the largest; the
        p = planes[0]  # receive buffer never set (a shrink under a granted window drops data: a 200 ms stall)
        assert p.send_sock is not None and p.recv_sock is not None
        rcvbuf = p.recv_sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        p.native.buffers(p.native.send_thread_buf)
        assert p.send_sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == 2 * p.native.send_thread_buf
        p.native.buffers(0)
        assert p.send_sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) > 4 * p.native.send_thread_buf
        assert p.recv_sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) == rcvbuf
    inputs = {(g.rank, k): np.full(BIG + k, g.rank * 10.0 + k, np.float32) for g in groups for k in range(4)}

    async def rank(g: psring.Group) -> list[np.ndarray]:
        ops = ("sum", "max", "sum", "sum")  # a threaded job between native ones: the frames stay in order
        return list(await asyncio.gather(*(g.all_reduce(inputs[g.rank, k], op=ops[k]) for k in range(4))))

    for per_rank in await asyncio.gather(*(rank(g) for g in groups)):
        for k, y in enumerate(per_rank):
            want = 30.0 + k if k == 1 else sum(r * 10.0 + k for r in range(world))
            assert y.shape == (BIG + k,) and np.all(y == want), k
    await _mismatch_timeout_recovery(groups)


async def test_same_host_links_carry_payloads_in_shared_memory(make_groups, monkeypatch) -> None:
    """Between same-host ranks the payloads go through shared slots and the sockets carry only
    headers and slot hand-backs; the bits are those of the TCP links; no segment keeps a name."""
    bits: dict[str, list[bytes]] = {}
    world = 3
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal(BIG).astype(np.float32) for _ in range(world)]
    payload = 4 * 2 * (world - 1) / world * xs[0].nbytes - 64  # four ops (chunks differ by an element)
    for mode in ("auto", "off"):
        monkeypatch.setenv("PSRING_SAME_HOST", mode)
        groups = await make_groups(world)
        planes = [g.net.plane for g in groups]  # type: ignore[attr-defined]
        assert all((p.shm_out is not None and p.shm_in is not None) == (mode == "auto") for p in planes), mode
        assert not _shm_files()  # unlinked once mapped at both ends
        before = [(p.bytes_sent, p.right.shm_bytes_sent) for p in planes]
        bits[mode] = []
        for op in ("sum", "avg", "max", "prod"):
            ys = await asyncio.gather(*(g.all_reduce(x, op=op) for g, x in zip(groups, xs, strict=True)))
            ref = canonical_fold(xs, op, np.empty(BIG, np.float32))
            assert all(y.tobytes() == ref.tobytes() for y in ys), (mode, op)
            bits[mode].append(ys[0].tobytes())
        for p, (sent0, shm0) in zip(planes, before, strict=True):
            sent, shm = p.bytes_sent - sent0, p.right.shm_bytes_sent - shm0
            if mode == "auto":
                assert shm >= payload and sent - shm < 4096, (sent, shm)  # headers: 24 bytes a piece
                assert p.slots_filled_here > 0  # partial sums folded straight into the next slot
            else:
                assert shm == 0 and sent >= payload, (sent, shm)
        # link_stats names the plane's link by what carries it
        for g, p in zip(groups, planes, strict=True):
            links = g.link_stats()
            name = "shared memory" if mode == "auto" else "data plane (TCP)"
            assert links[name] == [p.bytes_sent, p.bytes_received], (mode, links)
            assert ("data plane (TCP)" if mode == "auto" else "shared memory") not in links
        for g in groups:
            await g.close()
    assert bits["auto"] == bits["off"]


async def test_a_rank_that_cannot_map_keeps_that_link_on_tcp(make_groups, monkeypatch) -> None:
    from psring.topology.ring.plane import links as plane
    from psring.transport.shmpool import PeerPool

    real = PeerPool.open
    calls = iter(range(100))

    def flaky(desc: dict) -> PeerPool:
        if next(calls) == 0:
            raise OSError("no mapping here (test)")
        return real(desc)

    monkeypatch.setattr(plane.PeerPool, "open", staticmethod(flaky))
    monkeypatch.setenv("PSRING_RING_BOARD", "0")  # the boards map with PeerPool.open too: only the plane's here
    groups = await make_groups(3)
    planes = [g.net.plane for g in groups]  # type: ignore[attr-defined]
    without = [g.rank for g, p in zip(groups, planes, strict=True) if p.shm_in is None]
    assert len(without) == 1, without
    left = (without[0] - 1) % 3
    assert [g.rank for g, p in zip(groups, planes, strict=True) if p.shm_out is None] == [left]
    assert not _shm_files()
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal(BIG).astype(np.float32) for _ in range(3)]
    ys = await asyncio.gather(*(g.all_reduce(x) for g, x in zip(groups, xs, strict=True)))
    ref = canonical_fold(xs, "sum", np.empty(BIG, np.float32))
    assert all(y.tobytes() == ref.tobytes() for y in ys)
    assert planes[left].right.shm_bytes_sent == 0 and all(
        p.right.shm_bytes_sent > 0 for r, p in enumerate(planes) if groups[r].rank != left
    )


async def test_a_rank_that_cannot_make_a_segment_keeps_that_link_on_tcp(make_groups, monkeypatch) -> None:
    """/dev/shm full (a container's 64 MB default) or missing: that link carries its payloads on TCP."""
    from psring.topology.ring.plane import links as plane
    from psring.transport.shmpool import ShmPool

    calls = iter(range(100))

    def full(slots: int, slot_bytes: int) -> ShmPool:
        if next(calls) == 1:
            raise OSError(28, "No space left on device (test)")
        return ShmPool(slots, slot_bytes)

    monkeypatch.setattr(plane, "ShmPool", full)
    groups = await make_groups(3)
    planes = [g.net.plane for g in groups]  # type: ignore[attr-defined]
    assert sum(p.shm_out is None for p in planes) == 1 and sum(p.shm_in is None for p in planes) == 1
    assert not _shm_files()
    xs = [np.full(BIG, g.rank + 0.5, np.float32) for g in groups]
    ys = await asyncio.gather(*(g.all_reduce(x) for g, x in zip(groups, xs, strict=True)))
    assert all(np.all(y == 4.5) for y in ys)


@pytest.mark.parametrize("slots", [1, 2])
async def test_few_slots_abandoned_frames_and_concurrent_calls(make_groups, monkeypatch, slots: int) -> None:
    """With one or two slots per link pieces wait for slots to be handed back, and the receive
    thread may fill one only if the frames queued before it still get theirs; a mismatched call
    leaves pieces in slots that the next call hands back unread."""
    monkeypatch.setenv("PSRING_RING_SHM_SLOTS", str(slots))
    groups = await make_groups(3)
    assert all(g.net.plane.shm_out.slots == slots for g in groups)  # type: ignore[attr-defined]
    xs = [np.ones(BIG, np.float32), np.ones(BIG, np.float64), np.ones(BIG, np.float32)]
    results = await asyncio.gather(*(g.all_reduce(x) for g, x in zip(groups, xs, strict=True)), return_exceptions=True)
    assert all(isinstance(r, psring.MismatchError) for r in results), results
    inputs = {(g.rank, k): np.full(BIG + k, g.rank * 10.0 + k, np.float32) for g in groups for k in range(4)}

    async def rank(g: psring.Group) -> list[np.ndarray]:
        return list(await asyncio.gather(*(g.all_reduce(inputs[g.rank, k]) for k in range(4))))

    for per_rank in await asyncio.gather(*(rank(g) for g in groups)):
        for k, y in enumerate(per_rank):
            assert y.shape == (BIG + k,) and np.all(y == sum(r * 10.0 + k for r in range(3)))


async def test_pieces_larger_than_a_slot_go_on_the_socket(make_groups, monkeypatch) -> None:
    groups = await make_groups(2)
    planes = [g.net.plane for g in groups]  # type: ignore[attr-defined]
    for g in groups:  # the slots were made for 100 kB pieces
        g.net.config = g.net.config.replace(ring_plane_piece=400_000)  # type: ignore[attr-defined]
    before = [p.right.shm_bytes_sent for p in planes]
    ys = await asyncio.gather(*(g.all_reduce(np.full(BIG, g.rank + 1.0, np.float32)) for g in groups))
    assert all(np.all(y == 3.0) for y in ys)
    assert [p.right.shm_bytes_sent for p in planes] == before


async def test_a_links_shared_memory_is_named_nowhere(make_groups) -> None:
    """A data link's shared memory is the sender's anonymous pool (memfd), mapped read-only by the
    receiver through /proc: nothing in /dev/shm, so a SIGKILLed rank leaves nothing behind."""
    from psring.transport.shmpool import PeerPool, ShmPool

    groups = await make_groups(3)
    planes = [g.net.plane for g in groups]  # type: ignore[attr-defined]
    assert all(isinstance(p.shm_out, ShmPool) and isinstance(p.shm_in, PeerPool) for p in planes)
    assert all(not p.shm_in.view(0, 8).flags.writeable for p in planes)
    assert not _shm_files() and not [f for f in os.listdir("/dev/shm") if "psring" in f]


async def test_same_host_threshold_applies_from_three_ranks(make_groups, monkeypatch) -> None:
    """On one host the plane starts at PSRING_RING_SHM_MIN from 3 ranks on; at 2 ranks, and across
    hosts (here: PSRING_SAME_HOST=off), at PSRING_RING_PLANE_MIN."""
    monkeypatch.setenv("PSRING_RING_PLANE_MIN", str(8 << 20))
    monkeypatch.setenv("PSRING_RING_SHM_MIN", str(1 << 20))
    monkeypatch.setenv("PSRING_RING_NATIVE_PLANE_MIN", str(8 << 20))  # (TCP's own threshold: the test above)
    for world, mode, expect in ((3, "auto", 1 << 20), (2, "auto", 8 << 20), (3, "off", 8 << 20)):
        monkeypatch.setenv("PSRING_SAME_HOST", mode)
        groups = await make_groups(world)
        assert [g.net.plane_min for g in groups] == [expect] * world, (world, mode)  # type: ignore[attr-defined]
        before = _plane_bytes(groups)
        x = np.arange(2 << 18, dtype=np.float32)  # 2 MiB
        ys = await asyncio.gather(*(g.all_reduce(x) for g in groups))
        assert all(np.array_equal(y, x * world) for y in ys)
        on_plane = [a > b for a, b in zip(_plane_bytes(groups), before, strict=True)]
        assert on_plane == [expect == 1 << 20] * world, (world, mode)
        for g in groups:
            await g.close()

