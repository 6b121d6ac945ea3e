"""Same-host posting boards (psring.transport.shmboard) and the ring's board path (psring.topology.ring.board):
small all_reduces through shared memory, from the event loop and from the blocking API's own thread."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest

import psring
from psring.core.fold import canonical_fold
from psring.topology.ring.board import SPLIT_BYTES
from psring.transport.shmboard import Board, board_possible, native_built

from ..conftest import blocking_job_end, run_blocking_job, run_tree

pytestmark = pytest.mark.skipif(not board_possible(), reason="the boards need x86's store order; not offered here")


def _pair() -> tuple[Board, Board]:
    a, b = Board(64), Board(32)
    a.attach({1: b.describe()})
    b.attach({0: a.describe()})
    return a, b


def test_a_post_is_seen_whole_checked_and_its_slot_reused_only_after_every_ack() -> None:
    a, b = _pair()
    try:
        assert a.limit == b.limit == 32  # the smaller board decides what every rank may post
        x = np.arange(4, dtype=np.float32)
        assert not a.all_posted(4) and a.missing(4) == [1]
        b.post(4, b"tag-4", memoryview(x).cast("B"))
        assert a.all_posted(4) and not a.all_posted(6) and a.missing(6) == [1]
        assert a.differs(4, b"tag-4", 16) is None
        assert a.differs(4, b"tag-X", 16) == 1 and a.differs(4, b"tag-4", 12) == 1 and a.differs(6, b"tag-4", 16) == 1
        (view,) = a.arrays(4, np.dtype(np.float32), 4)
        assert view.tobytes() == x.tobytes()
        assert a.read(1, 4)[:2] == (4, b"tag-4")
        # slot 0 holds post 4 until a says it is done with it -- and b itself (the split fold reads the
        # owner's post back after every peer is done with it)
        assert not b.clear_to_post(6) and b.clear_to_post(5)
        a.ack(5)
        a.ack(3)  # an ack never goes back
        assert not b.clear_to_post(6)
        b.ack(4)
        assert b.clear_to_post(6)
        with pytest.raises(ValueError, match="at most 32 bytes"):
            b.post(6, b"t", memoryview(np.zeros(9, np.float32)).cast("B"))
    finally:
        a.close()
        b.close()


def _needs_native() -> None:
    """Skip where the C extension was not built -- except in CI (PSRING_REQUIRE_NATIVE=1), which builds it."""
    if not native_built():
        assert os.environ.get("PSRING_REQUIRE_NATIVE") != "1", "psring._native did not build (setup.py)"
        pytest.skip("psring._native was not built here (no compiler when psring was installed)")


def test_the_native_extension_is_built_where_ci_requires_it() -> None:
    _needs_native()
    a, b = _pair()
    try:
        assert a.native and b.native
    finally:
        a.close()
        b.close()
    assert not a.native  # closed: its buffers released before the maps
    c, d = Board(64, native=False), Board(64, native=False)
    try:
        c.attach({1: d.describe()})
        assert not c.native
    finally:
        c.close()
        d.close()


@pytest.mark.parametrize("native_first", [True, False])
def test_a_native_board_and_a_python_one_read_each_others_posts(native_first: bool) -> None:
    """The C path writes and reads the same fields in the same order: a job may mix them."""
    _needs_native()
    a, b = Board(64, native=native_first), Board(64, native=not native_first)
    a.attach({1: b.describe()})
    b.attach({0: a.describe()})
    try:
        assert a.native == native_first and b.native != native_first
        for k in (0, 1, 2, 3):
            xa, xb = np.arange(5, dtype=np.float64) + k, np.arange(5, dtype=np.float64) * -k
            tag = f"call-{k}".encode()
            assert not a.all_posted(k) and not b.all_posted(k)
            a.post(k, tag, memoryview(xa).cast("B"))
            assert b.all_posted(k) and not a.all_posted(k)
            b.sleep_on(k + 1)
            assert a.post(k, tag, memoryview(xa).cast("B")) == []  # b sleeps on the next post, not this one
            b.post(k, tag, memoryview(xb).cast("B"))
            assert a.all_posted(k) and a.differs(k, tag, 40) is None and b.differs(k, tag, 40) is None
            assert a.differs(k, b"other", 40) == 1 and b.differs(k, tag, 32) == 0
            ref = canonical_fold([xa, xb], "sum", np.empty(5))
            for board, me, x in ((a, 0, xa), (b, 1, xb)):
                out = np.empty(5)
                assert board.fold(k, me, x, out, "sum") == board.native  # the Python board: its caller folds
                assert not board.native or out.tobytes() == ref.tobytes()
            a.mark(k)
            assert b.all_marked(k) and not a.all_marked(k)
            a.ack(k)
            b.ack(k)
        b.sleep_on(4)
        assert a.post(4, b"t", None) == [1]  # the sleeper is named, native or not
    finally:
        a.close()
        b.close()


def _boards(n: int) -> list[Board]:
    boards = [Board(1 << 14) for _ in range(n)]
    for r, board in enumerate(boards):
        board.attach({p: boards[p].describe() for p in range(n) if p != r})
    return boards


NATIVE_DTYPES = [np.float32, np.float64, np.int32, np.uint32, np.int64, np.uint64]


@pytest.mark.parametrize("n", [2, 3, 5])
def test_the_native_fold_gives_the_canonical_folds_bits(n: int) -> None:
    """Every dtype and op the C fold takes, sizes around the ring chunks' edges, every rank's place:
    the bits of psring.core.fold.canonical_fold; what it does not take (min, max, float16) it declines."""
    _needs_native()
    boards = _boards(n)
    rng = np.random.default_rng(n)
    k = 0
    try:
        for dtype in NATIVE_DTYPES:
            for size in (0, 1, 2, n - 1, n + 1, 37, 1000):
                if np.dtype(dtype).kind == "f":
                    # magnitudes far apart: any other order of the additions rounds differently
                    scale = [10.0 ** rng.integers(-8, 9, size) for _ in range(n)]
                    xs = [(rng.standard_normal(size) * scale[r]).astype(dtype) for r in range(n)]
                    if size > 3:
                        xs[0][1], xs[1][2], xs[-1][3] = np.inf, np.nan, -0.0
                else:
                    info = np.iinfo(dtype)
                    xs = [rng.integers(info.min, info.max, size, dtype=dtype, endpoint=True) for _ in range(n)]
                for op in ("sum", "prod", "avg", "min"):
                    if op == "avg" and np.dtype(dtype).kind != "f":
                        continue
                    tag = f"{dtype}-{size}-{op}".encode()
                    for r, board in enumerate(boards):
                        board.post(k, tag, memoryview(xs[r]).cast("B") if size else None)
                    with np.errstate(all="ignore"):
                        ref = canonical_fold(xs, op, np.empty(size, dtype))
                    for me, board in enumerate(boards):
                        assert board.differs(k, tag, xs[me].nbytes) is None
                        out = np.empty(size, dtype)
                        folded = board.fold(k, me, xs[me], out, op)
                        assert folded == (op != "min"), (dtype, op)
                        if folded:
                            assert out.tobytes() == ref.tobytes(), (dtype, size, op, me)
                    for board in boards:
                        board.ack(k)
                    k += 1
        x = np.ones(4, np.float16)
        for board in boards:
            board.post(k, b"h", memoryview(x).cast("B"))
        assert not boards[0].fold(k, 0, x, np.empty_like(x), "sum")
        # an input not aligned to its type (the C loops assume it): declined, the caller folds
        raw = np.zeros(4 * 5 + 1, np.uint8)
        x = raw[1:].view(np.float32)
        assert not x.flags.aligned
        for board in boards:
            board.ack(k)
        k += 1
        for board in boards:
            board.post(k, b"u", memoryview(np.ones(5, np.float32)).cast("B"))
        assert not boards[0].fold(k, 0, x, np.empty(5, np.float32), "sum")
        with pytest.raises(ValueError, match="does not take"):  # before anything is posted
            boards[0].exchange(k + 1, b"u", x, np.empty(5, np.float32), "f", "sum", 0, 0, 0.0)
        assert 0 in boards[1].missing(k + 1)  # rank 0 posted nothing
    finally:
        for board in boards:
            board.close()


def test_the_native_spin_polls_gives_the_core_up_and_stops_at_its_budget() -> None:
    _needs_native()
    a, b = _pair()
    try:
        t0 = time.monotonic()
        assert a.spin(0, False, 10, 0.05) is False
        assert 0.05 <= time.monotonic() - t0 < 2
        # the GIL is free between polls: a thread of this process posts meanwhile
        poster = threading.Timer(0.05, lambda: b.post(0, b"t", None))
        poster.start()
        t0 = time.monotonic()
        assert a.spin(0, False, 0, 5.0) is True
        assert time.monotonic() - t0 < 4
        poster.join()
        assert a.spin(0, True, 10, 0.0) is False  # posted, not marked
        b.mark(0)
        assert a.spin(0, True, 1, 0.0) is True
    finally:
        a.close()
        b.close()
    c, d = Board(64, native=False), Board(64, native=False)
    try:
        c.attach({1: d.describe()})
        assert c.spin(0, False, 1, 0.0) is None  # not native: the caller polls
    finally:
        c.close()
        d.close()


def test_a_description_that_is_not_a_board_is_refused() -> None:
    a, b = Board(64), Board(64)
    try:
        with pytest.raises(ValueError, match="is not a board"):
            a.attach({1: {**b.describe(), "max_bytes": 1 << 20}})  # more room than its slots have
        with pytest.raises(ValueError, match="is not a board"):
            a.attach({1: "board"})
        with pytest.raises(ValueError, match="token differs"):
            a.attach({1: {**b.describe(), "token": bytes(16)}})
        with pytest.raises(ValueError, match="1 byte to 1 GiB"):
            Board(0)
    finally:
        a.close()
        b.close()


# ------------------------------------------------------------------ groups in one event loop
@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.timeout(90)
async def test_small_all_reduces_cross_no_socket_and_give_the_canonical_bits(make_groups, monkeypatch) -> None:
    monkeypatch.setenv("PSRING_HEARTBEAT_INTERVAL", "60")  # no heartbeat bytes meanwhile
    groups = await make_groups(3)
    nets = [g.net for g in groups]  # type: ignore[attr-defined]
    assert all(n.board is not None and n.small.unix is not None for n in nets)
    await asyncio.gather(*(g.all_reduce(np.ones(1)) for g in groups))  # warm-up
    sockets = [n.stats()["bytes_sent"] - n.board.bytes_posted for n in nets]
    rng = np.random.default_rng(7)
    for size, dtype, op in [
        (1, np.float32, "sum"),
        (5, np.float64, "avg"),
        (4096, np.float32, "max"),
        (7, np.int64, "prod"),
        # from SPLIT_BYTES on each rank folds its ring chunk over its own post and copies the others'
        (100_003, np.float32, "sum"),
        (SPLIT_BYTES // 8, np.float64, "avg"),
        (70_001, np.int64, "prod"),
        (SPLIT_BYTES // 2 + 1, np.float16, "max"),
    ]:
        xs = [(rng.standard_normal(size) * 100).astype(dtype) for _ in groups]
        posted = [n.board.bytes_posted for n in nets]
        ys = await asyncio.gather(*(g.all_reduce(x, op) for g, x in zip(groups, xs, strict=True)))
        ref = canonical_fold(xs, op, np.empty(size, dtype))
        assert all(y.tobytes() == ref.tobytes() for y in ys), (size, op)
        assert all(
            n.board.bytes_posted - p == size * np.dtype(dtype).itemsize for n, p in zip(nets, posted, strict=True)
        )
    assert [n.stats()["bytes_sent"] - n.board.bytes_posted for n in nets] == sockets  # not one byte on a socket


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_large_all_reduces_stream_through_the_boards_with_the_canonical_bits(make_groups, monkeypatch) -> None:
    """From PSRING_RING_STREAM on (here 300 KiB, with 1 MiB boards), every rank native: the split fold a
    block at a time in C (Board.stream) -- every dtype and op it takes, sizes whose ring chunks end in part
    of a block, calls in flight at once (run in call order); what it does not fold takes the plane; a
    mismatched call is named and the group goes on."""
    _needs_native()
    monkeypatch.setenv("PSRING_RING_BOARD", "1M")
    monkeypatch.setenv("PSRING_RING_STREAM", "300K")
    groups = await make_groups(3)
    nets = [g.net for g in groups]  # type: ignore[attr-defined]
    assert all(n.board is not None and n.board.stream_min == 300 << 10 for n in nets)
    rng = np.random.default_rng(5)
    streamed = [g.streamed.ran for g in groups]  # type: ignore[attr-defined]
    cases = [
        (300 << 8, np.float32, "sum"),
        (100_001, np.float64, "avg"),
        (250_003, np.float32, "prod"),
        (77_777, np.int64, "sum"),
        (200_000, np.uint32, "prod"),
    ]
    for size, dtype, op in cases:
        xs = [(rng.standard_normal(size) * 3).astype(dtype) for _ in groups]
        ys = await asyncio.gather(*(g.all_reduce(x.reshape(-1, 1), op) for g, x in zip(groups, xs, strict=True)))
        ref = canonical_fold(xs, op, np.empty(size, dtype))
        assert all(y.shape == (size, 1) and y.tobytes() == ref.tobytes() for y in ys), (size, dtype, op)
    assert [g.streamed.ran - s for g, s in zip(groups, streamed, strict=True)] == [len(cases)] * 3  # type: ignore[attr-defined]
    # three in flight on every rank, a small board call between them: each in its turn, the same bits
    xs = [[rng.standard_normal(90_000 + i).astype(np.float32) for i in range(3)] for _ in groups]
    calls = [
        asyncio.gather(g.all_reduce(xs[g.rank][0]), g.all_reduce(np.ones(3)), g.all_reduce(xs[g.rank][1]),
                       g.all_reduce(xs[g.rank][2], "avg"))
        for g in groups
    ]
    ys = await asyncio.gather(*calls)
    for i, at, op in ((0, 0, "sum"), (1, 2, "sum"), (2, 3, "avg")):
        ref = canonical_fold([xs[r][i] for r in range(3)], op, np.empty_like(xs[0][i]))
        assert all(ys[r][at].tobytes() == ref.tobytes() for r in range(3)), i
    assert all(np.array_equal(y[1], np.full(3, 3.0)) for y in ys)
    # max is not the native fold's: the plane, and the same answer
    before = [g.streamed.ran for g in groups]  # type: ignore[attr-defined]
    xs1 = [rng.standard_normal(100_000).astype(np.float32) for _ in groups]
    ys1 = await asyncio.gather(*(g.all_reduce(x, "max") for g, x in zip(groups, xs1, strict=True)))
    assert all(np.array_equal(y, np.maximum.reduce(xs1)) for y in ys1)
    assert [g.streamed.ran for g in groups] == before  # type: ignore[attr-defined]
    # ranks that called different sizes: named on every rank; then the group goes on
    results = await asyncio.gather(
        *(g.all_reduce(np.ones(100_000 + (g.rank == 2), np.float32)) for g in groups), return_exceptions=True
    )
    assert all(isinstance(r, psring.MismatchError) for r in results), results
    ys = await asyncio.gather(*(g.all_reduce(np.full(100_000, g.rank + 1.0)) for g in groups))
    assert all(np.array_equal(y, np.full(100_000, 6.0)) for y in ys)


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.timeout(90)
async def test_many_calls_in_flight_post_in_call_order_and_reuse_slots_safely(make_groups) -> None:
    """Forty all_reduces in flight on every rank at once (two board slots each): each waits for its
    turn to post, and a slot is reused only once every peer is done with it."""
    groups = await make_groups(3)
    rng = np.random.default_rng(11)
    xs = [[rng.standard_normal(1 + i % 9).astype(np.float32) for i in range(40)] for _ in groups]
    ys = await asyncio.gather(*(asyncio.gather(*(g.all_reduce(x) for x in xs[g.rank])) for g in groups))
    for i in range(40):
        ref = canonical_fold([xs[r][i] for r in range(3)], "sum", np.empty_like(xs[0][i]))
        assert all(ys[r][i].tobytes() == ref.tobytes() for r in range(3)), i


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", [2, 4])
async def test_split_calls_in_flight_keep_their_folded_chunks_until_they_gather_them(make_groups, n: int) -> None:
    """Forty split-fold all_reduces in flight on every rank: a rank's later call posts over a slot only once
    this rank too has gathered the call before it there (its folded chunk lives in its own post: before
    the fix a rank whose peers were done with a slot posted over it and returned the next call's input
    as its own chunk of the result)."""
    groups = await make_groups(n)
    rng = np.random.default_rng(12)
    size = SPLIT_BYTES // 4 * 3
    xs = [[rng.standard_normal(size + i).astype(np.float32) for i in range(40)] for _ in groups]
    ys = await asyncio.gather(*(asyncio.gather(*(g.all_reduce(x) for x in xs[g.rank])) for g in groups))
    wrong = []
    for i in range(40):
        ref = canonical_fold([xs[r][i] for r in range(n)], "sum", np.empty_like(xs[0][i]))
        wrong += [(i, r) for r in range(n) if ys[r][i].tobytes() != ref.tobytes()]
    assert not wrong, f"(call, rank) not in the canonical fold's bits: {wrong}"


@pytest.mark.slow
@pytest.mark.asyncio
@pytest.mark.timeout(90)
async def test_a_board_call_against_another_call_is_a_named_mismatch_and_the_group_goes_on(make_groups) -> None:
    groups = await make_groups(2, timeout=30)
    t0 = time.monotonic()
    results = await asyncio.gather(
        groups[0].all_reduce(np.zeros(4)), groups[1].broadcast(np.zeros(4)), return_exceptions=True
    )
    assert all(isinstance(r, psring.MismatchError) for r in results), results
    assert all("broadcast(src=0) #0" in str(r) and "all_reduce(sum) #0" in str(r) for r in results), results
    results = await asyncio.gather(
        groups[0].all_reduce(np.zeros(4)), groups[1].all_reduce(np.zeros(5)), return_exceptions=True
    )
    assert all(isinstance(r, psring.MismatchError) for r in results), results
    assert any("shape [5]" in str(r) and "expected [4]" in str(r) for r in results), results
    results = await asyncio.gather(
        groups[0].all_reduce(np.zeros(4), "max"), groups[1].all_reduce(np.zeros(4)), return_exceptions=True
    )
    assert all("rank 0 called all_reduce(max) #2" in str(r) for r in results), results
    n = SPLIT_BYTES  # calls whose folds split over the ranks: checked before a rank writes over its post
    results = await asyncio.gather(
        groups[0].all_reduce(np.zeros(n)), groups[1].all_reduce(np.zeros(n + 1)), return_exceptions=True
    )
    assert all(isinstance(r, psring.MismatchError) for r in results), results
    ys = await asyncio.gather(*(g.all_reduce(np.full(n, g.rank + 1.0)) for g in groups))
    assert all(np.array_equal(y, np.full(n, 3.0)) for y in ys)
    # the other call comes while the board call sleeps: its rank learns of the board call when it begins
    results = await asyncio.gather(
        groups[0].all_reduce(np.zeros(4)), _late(groups[1].barrier()), return_exceptions=True
    )
    assert all("rank 0 called all_reduce(sum) #5, rank 1 called barrier #5" in str(r) for r in results), results
    assert time.monotonic() - t0 < 10  # named, not timed out (nor left to the stall inspector)
    # a broadcast's root sent (and returned) before the other rank's board call began: named there, and
    # the root's next call is abandoned on every rank (it had returned from the mismatched one)
    results = await asyncio.gather(
        _late(groups[0].all_reduce(np.zeros(4))), groups[1].broadcast(np.zeros(4), src=1), return_exceptions=True
    )
    assert isinstance(results[0], psring.MismatchError) and isinstance(results[1], np.ndarray), results
    assert "rank 1 called broadcast(src=1) #6, rank 0 called all_reduce(sum) #6" in str(results[0]), results
    results = await asyncio.gather(*(g.all_reduce(np.ones(3)) for g in groups), return_exceptions=True)
    assert all(isinstance(r, psring.MismatchError) and "had returned from" in str(r) for r in results), results
    ys = await asyncio.gather(*(g.all_reduce(np.full(3, g.rank + 1.0)) for g in groups))
    assert all(np.array_equal(y, np.full(3, 3.0)) for y in ys)


async def _late(call: Any) -> Any:
    await asyncio.sleep(0.3)
    return await call


# ------------------------------------------------------------------ the blocking API, one rank a process
BLOCKING_JOB = """
import os, sys, numpy as np, psring
from psring.core.fold import canonical_fold
if os.environ.get("OFF_RANK") == os.environ.get("RANK"):
    os.environ["PSRING_NATIVE"] = "off"  # this rank folds in numpy beside native ranks: the same board
g = psring.init()
n, grp = g.world_size, g.group
for i in range(400):
    xs = [np.random.default_rng(1000 * i + r).standard_normal(1 + i % 37).astype(np.float32) for r in range(n)]
    if i % 50 == 7:  # a large call in flight: the small ones after it must take the loop, in order
        h = g.all_reduce(np.ones(300_000, np.float32), async_op=True)
        y = g.all_reduce(xs[g.rank])
        assert np.all(h.wait() == n), i
    elif i % 25 == 13:  # split over the ranks (SPLIT_BYTES and more): each folds its chunk, copies the rest
        xs = [np.random.default_rng(1000 * i + r).standard_normal(20_000 + i).astype(np.float32) for r in range(n)]
        y = g.all_reduce(xs[g.rank], "avg")
        ref = canonical_fold(xs, "avg", np.empty_like(xs[0]))
        assert y.tobytes() == ref.tobytes(), i
        continue
    elif i % 50 == 23:
        y = g.all_reduce(xs[g.rank], compression="fp16")  # a reserved number, then one more
        assert np.allclose(y, sum(xs), rtol=1e-2, atol=1e-2), i
        continue
    else:
        y = g.all_reduce(xs[g.rank], "max" if i % 3 == 0 else "sum")
    ref = canonical_fold(xs, "max" if i % 3 == 0 and i % 50 != 7 else "sum", np.empty_like(xs[0]))
    assert y.tobytes() == ref.tobytes(), i
    if g.rank == 1 and i % 100 in (12, 99):
        import time; time.sleep(0.2)  # a late rank: the others' calls (a split one after 12) are handed to the loop
""" + blocking_job_end("grp.board.ran_now, grp.board.adopted")


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world,native", [(2, "on"), (3, "on"), (3, "off"), (3, "mixed")])
def test_blocking_calls_run_on_the_callers_thread_and_hand_late_ones_to_the_loop(
    tmp_path, world: int, native: str
) -> None:
    """(PSRING_NATIVE: the boards' hot loop in C where it is built, the pure-Python path, and both in one
    job: rank 2 in Python.)"""
    script = tmp_path / "job.py"
    script.write_text(BLOCKING_JOB)
    env = {"PSRING_NATIVE": "off" if native == "off" else "on", "OFF_RANK": "2" if native == "mixed" else ""}
    for r, (on_thread, adopted) in run_blocking_job(script, world, **env).items():
        # calls ended on the caller's thread (on an idle machine most of the 400; under load fewer: a rank
        # that is not scheduled within the spin has its peers' calls handed to the loop)
        assert on_thread >= 20, (r, on_thread, adopted)
        if r != 1:
            assert adopted > 0, (r, on_thread, adopted)  # rank 1's naps made the others wait past their spin


STREAM_JOB = """
import os, time, numpy as np, psring
from psring.core.fold import canonical_fold
if os.environ.get("OFF_RANK") == os.environ.get("RANK"):
    os.environ["PSRING_NATIVE"] = "off"  # this rank does not offer to stream: no rank streams
g = psring.init()
n, grp = g.world_size, g.group
for i in range(24):
    size = 80_000 + 7919 * i
    dtype, op = ((np.float32, "sum"), (np.float64, "avg"), (np.int64, "sum"))[i % 3]
    xs = [(np.random.default_rng(100 * i + r).standard_normal(size) * 3).astype(dtype) for r in range(n)]
    y = g.all_reduce(xs[g.rank], op)
    assert y.tobytes() == canonical_fold(xs, op, np.empty_like(xs[0])).tobytes(), i
    if g.rank == 1 and i % 8 == 3:
        time.sleep(0.2)  # a late rank: its peers wait for it inside their streams
""" + blocking_job_end("grp.streamed.ran, grp.board.ran_now")


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("off_rank", ["", "2"])
def test_blocking_large_calls_stream_where_every_rank_offers_to(tmp_path, off_rank: str) -> None:
    """The blocking API, one rank a process (psring launch): from PSRING_RING_STREAM on, every call streamed
    where every rank runs the C extension; with one rank on PSRING_NATIVE=off none is (the plane), and the
    same bits either way; a rank that vanishes afterwards is named by the others' next call."""
    _needs_native()
    script = tmp_path / "job.py"
    script.write_text(STREAM_JOB)
    env = {"PSRING_RING_BOARD": "1M", "PSRING_RING_STREAM": "300K", "OFF_RANK": off_rank}
    for r, (streamed, _on_thread) in run_blocking_job(script, 4, **env).items():
        assert streamed == (0 if off_rank else 24), (r, streamed)


STREAM_LOSS_JOB = """
import os, signal, subprocess, threading, time, numpy as np, psring
g = psring.init()
x = np.ones(16 << 20, np.float32)  # 64 MiB: streamed, tens of milliseconds a call
for _ in range(2):
    assert np.all(g.all_reduce(x) == g.world_size)
print("streamed", g.group.streamed.ran, flush=True)
if g.rank == 1 and os.environ["HOW"] == "die":
    threading.Timer(0.02, os._exit, (0,)).start()  # gone mid-call, as a crash (0: launch waits for the rest)
elif g.rank == 1:  # stopped mid-call (SIGSTOP), woken 8 s later by a helper
    subprocess.Popen(["sh", "-c", f"sleep 8; kill -CONT {os.getpid()}"])
    threading.Timer(0.02, os.kill, (os.getpid(), signal.SIGSTOP)).start()
t0 = time.monotonic()
try:
    for _ in range(400):
        g.all_reduce(x)
    print("no error", flush=True)
except psring.PsringError as exc:
    print("raised", type(exc).__name__, "after %.1f s:" % (time.monotonic() - t0), str(exc)[:300], flush=True)
g.close()
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["die", "stop"])
def test_a_rank_lost_or_stopped_in_the_middle_of_a_streamed_call_is_named_without_a_hang(tmp_path, how: str) -> None:
    """A rank that dies (or stops) while its peers stream a call with it: they leave their waits (the stream
    thread stops first) and raise -- PeerLostError for the crash, a timeout or loss for the stopped rank
    (PSRING_TIMEOUT=3) -- naming it, and every process ends."""
    _needs_native()
    script = tmp_path / "job.py"
    script.write_text(STREAM_LOSS_JOB)
    res = run_tree(
        [sys.executable, "-m", "psring", "launch", "-n", "3", "--", sys.executable, str(script)],
        timeout=110,
        env={**os.environ, "PSRING_TIMEOUT": "3" if how == "stop" else "30", "HOW": how},
    )
    out = res.stdout + res.stderr
    for r in range(3):
        assert f"[rank {r}] streamed 2" in out, out[-4000:]
    for r in (0, 2):
        line = next((ln for ln in out.splitlines() if ln.startswith(f"[rank {r}] raised")), None)
        assert line is not None and ("rank 1" in line or "rank(s) 1" in line), out[-4000:]
        if how == "die":
            assert "PeerLostError" in line, line
        assert float(line.split("after ")[1].split(" s")[0]) < 15, line


def test_a_blocking_call_on_a_subgroup_this_rank_is_not_in_still_raises() -> None:
    """The blocking API looks for a group's caller-thread way by its class: a non-member subgroup
    answers every name with a refusing coroutine, which must raise, not come back as a result."""
    from psring.errors import GroupClosedError
    from psring.topology.blocking import BlockingGroup
    from psring.topology.group import NonMemberGroup
    from psring.transport.loop import Portal

    portal = Portal()
    try:
        sub = BlockingGroup(NonMemberGroup(2, [0, 1], "1"), portal, owns_portal=False)
        with pytest.raises(GroupClosedError, match="not a member of subgroup 1"):
            sub.all_reduce(np.ones(2, np.float32))
    finally:
        portal.stop()


def _inputs(rng: np.random.Generator, dtype: np.dtype, size: int, n: int) -> list[np.ndarray]:
    """n ranks' inputs: floats of magnitudes far apart (any other order of the additions rounds
    differently), integers over their whole range (sums and products wrap around)."""
    if dtype.kind == "f":
        scale = 10.0 ** rng.integers(-8, 9, (n, size))
        return list((rng.standard_normal((n, size)) * scale).astype(dtype))
    info = np.iinfo(dtype)
    return list(rng.integers(info.min, info.max, (n, size), dtype=dtype, endpoint=True))


def _split_round(
    boards: list[Board], k: int, tag: bytes, xs: list[np.ndarray], kind: str, op: str
) -> tuple[list[int], list[np.ndarray]]:
    """Board.exchange(split=True) of post k on every board, each rank on a thread of its own: codes, results."""
    n = len(boards)
    outs = [np.empty_like(x) for x in xs]
    codes = [-1] * n

    def run(r: int) -> None:
        codes[r] = boards[r].exchange(k, tag, xs[r], outs[r], kind, op, r, 0, 10.0, True)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return codes, outs


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 3, 5])
def test_the_native_split_exchange_gives_the_canonical_folds_bits(n: int) -> None:
    """Board.exchange(split=True), every rank on a thread of its own: each folds its ring chunk of every post
    over its own, marks it, and copies the others' folded chunks -- the bits of canonical_fold for every
    dtype and op the C fold takes, sizes around the ring chunks' edges; and a rank that marks while a peer
    sleeps on the mark says so (4), one whose peers do not mark within the spin says so (5)."""
    _needs_native()
    boards = _boards(n)
    rng = np.random.default_rng(n + 10)
    k = 0
    try:
        for dtype in NATIVE_DTYPES:
            for size in (n, n + 1, 37, 1000, 2047):
                xs = _inputs(rng, np.dtype(dtype), size, n)
                for op in ("sum", "prod", "avg"):
                    if op == "avg" and np.dtype(dtype).kind != "f":
                        continue
                    tag = f"{dtype}-{size}-{op}".encode()
                    kind = boards[0].native_kind(np.dtype(dtype), op)
                    assert kind is not None
                    codes, outs = _split_round(boards, k, tag, xs, kind, op)
                    assert codes == [0] * n, codes
                    with np.errstate(all="ignore"):
                        ref = canonical_fold(xs, op, np.empty(size, dtype))
                    for r in range(n):
                        assert outs[r].tobytes() == ref.tobytes(), (dtype, size, op, r)
                    for board in boards:
                        board.ack(k)
                    k += 1
        # rank 1 asleep on rank 0's mark: rank 0 posts, folds, marks and says so; then, nobody else marking, 5
        x = np.ones(4 * n, np.float32)
        for board in boards[1:]:
            board.post(k, b"m", memoryview(x).cast("B"))
        boards[1].sleep_on(k, marked=True)
        assert boards[0].exchange(k, b"m", x, np.empty_like(x), "f", "sum", 0, 0, 0.01, True) == 4
        boards[1].sleep_on(-1)
        for board in boards:
            board.ack(k)
        k += 1
        for board in boards[1:]:
            board.post(k, b"m", memoryview(x).cast("B"))
        assert boards[0].exchange(k, b"m", x, np.empty_like(x), "f", "sum", 0, 0, 0.01, True) == 5
        assert boards[0].unmarked(k) == list(range(1, n)) and 0 not in boards[1].unmarked(k)
    finally:
        for board in boards:
            board.close()


def _streamed(
    boards: list[Board],
    k: int,
    xs: list[np.ndarray],
    op: str,
    piece: int,
    depth: int,
    wait: tuple[int, int] = (-1, 50),
    stores: int = -1,
) -> list[np.ndarray]:
    """Streamed call k on every board, each rank on a thread of its own; the results. ``wait``: (yield_us,
    nap_us) of Board.stream; ``stores``: its stores."""
    n = len(boards)
    tag = f"stream-{k}".encode()
    for r, board in enumerate(boards):
        board.stream_post(k, tag, xs[r].nbytes)
    kind = boards[0].native_kind(xs[0].dtype, op)
    assert kind is not None
    outs = [np.empty_like(x) for x in xs]
    codes: list[int] = [-1] * n

    def run(r: int) -> None:
        assert boards[r].differs(k, tag, xs[r].nbytes) is None
        code = 1
        while code == 1:  # a rank the scheduler left behind: go on where it stands
            code = boards[r].stream(k, r, xs[r], outs[r], kind, op, piece, depth, 0, 0.05, r % 2 == 0, *wait, stores)
        codes[r] = code

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert codes == [0] * n
    for board in boards:
        board.ack(k)
    return outs


@pytest.mark.timeout(60)
@pytest.mark.parametrize("wait", [(-1, 50), (0, 20), (200, 50)], ids=["yields", "naps", "adaptive"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_streamed_call_gives_the_canonical_folds_bits(n: int, wait: tuple[int, int]) -> None:
    """The split fold a block at a time (Board.stream): every dtype and op the C fold takes, sizes whose ring
    chunks differ and end in part of a block, a depth smaller than the blocks (sub-slots reused), the same
    bits as psring.core.fold.canonical_fold on every rank, with streaming stores and without; a wait that
    only yields its core, one that naps at once (a crowded machine) and one that yields and then naps."""
    _needs_native()
    boards = _boards(n)
    rng = np.random.default_rng(n)
    k = 0
    try:
        for dtype in NATIVE_DTYPES:
            for op in ("sum", "prod", "avg"):
                if op == "avg" and np.dtype(dtype).kind != "f":
                    continue
                for size, piece, depth in ((n, 1, 1), (1000 + n - 1, 7, 3), (4099, 64, 2)):
                    xs = _inputs(rng, np.dtype(dtype), size, n)
                    want = canonical_fold(xs, op, np.empty_like(xs[0]))
                    outs = _streamed(boards, k, xs, op, piece, depth, wait)
                    for r in range(n):
                        assert outs[r].tobytes() == want.tobytes(), (dtype, op, size, piece, depth, r)
                    k += 1
    finally:
        for board in boards:
            board.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_streamed_call_stores_into_the_slots_plainly_or_streaming_with_the_same_bits(n: int) -> None:
    """Posts and folds go into the slots with plain stores, with streaming stores (which do not first take
    each line back from a peer's cache), or as each rank chooses (-1): the canonical bits every way, pieces
    whose copies begin off a 16-byte line; an adaptive call of enough blocks times posts of both kinds and
    the next call's stores follow board.c's rule (streaming once plain posts cost 1.5x)."""
    _needs_native()
    boards = _boards(n)
    rng = np.random.default_rng(10 + n)
    k = 0
    try:
        for dtype in (np.float32, np.float64, np.int64):
            for op in ("sum", "avg") if np.dtype(dtype).kind == "f" else ("sum", "prod"):
                xs = _inputs(rng, np.dtype(dtype), 20000 + n, n)
                want = canonical_fold(xs, op, np.empty_like(xs[0]))
                for stores in (0, 1, -1):
                    fresh = _boards(n) if stores == -1 else boards
                    try:
                        outs = _streamed(fresh, k, xs, op, 125, 2, stores=stores)
                        for r in range(n):
                            assert outs[r].tobytes() == want.tobytes(), (dtype, op, stores, r)
                        if stores == -1:  # 20000 / n / 125 blocks: a probe in each 16 -- both kinds timed
                            for board in fresh:
                                streaming, plain, stream = board.stream_stores()
                                assert plain > 0.0 and stream > 0.0, (plain, stream)
                                assert streaming == (plain > 1.5 * stream), (streaming, plain, stream)
                    finally:
                        if stores == -1:
                            for board in fresh:
                                board.close()
                    k += 1
    finally:
        for board in boards:
            board.close()


@pytest.mark.timeout(60)
def test_a_streamed_call_waits_on_a_late_peer_goes_on_and_can_be_cancelled() -> None:
    """A rank whose peer has not posted its first block posts as many blocks as it has sub-slots, returns 1
    within its budget and goes on where it stands once the peer runs; a cancelled call returns 2; closing a
    board waits for a running call."""
    _needs_native()
    a, b = _boards(2)
    try:
        assert a.stream_min == 0  # neither offered to stream (Board(..., stream=0))
        x = np.arange(4000, dtype=np.float32)
        y = np.ones(4000, np.float32)
        for board, v in ((a, x), (b, y)):
            board.stream_post(0, b"s", v.nbytes)
        out_a, out_b = np.empty_like(x), np.empty_like(y)
        t0 = time.monotonic()
        assert a.stream(0, 0, x, out_a, "f", "sum", 100, 4, 0, 0.05, False) == 1  # b has not begun
        assert time.monotonic() - t0 < 5
        # it ran ahead of b as far as its sub-slots go: a block posted into each of the 4, none folded
        assert a._counters(a._own.body[0]) == 4
        code_b = [-1]
        t = threading.Thread(
            target=lambda: code_b.__setitem__(0, b.stream(0, 1, y, out_b, "f", "sum", 100, 4, 0, 5.0, False))
        )
        t.start()
        assert a.stream(0, 0, x, out_a, "f", "sum", 100, 4, 0, 5.0, False) == 0
        t.join(10)
        assert code_b[0] == 0
        assert np.array_equal(out_a, x + 1) and np.array_equal(out_b, x + 1)
        a.ack(0)
        b.ack(0)
        # a call whose peer posted and never runs: cancelled from another thread, it returns at its wait
        a.stream_post(2, b"s", x.nbytes)
        b.stream_post(2, b"s", y.nbytes)
        timer = threading.Timer(0.2, a.cancel_stream)
        timer.start()
        assert a.stream(2, 0, x, out_a, "f", "sum", 100, 4, 0, 30.0, False) == 2
        a.cancel_stream(False)
        # and close() makes a call running in another thread return first
        runner = threading.Thread(target=lambda: a.stream(2, 0, x, out_a, "f", "sum", 100, 4, 0, 30.0, False))
        runner.start()
        time.sleep(0.1)
        a.close()
        runner.join(5)
        assert not runner.is_alive()
    finally:
        a.close()
        b.close()


def test_boards_stream_only_where_every_rank_offers_to() -> None:
    _needs_native()
    a, b, c = Board(1 << 12, stream=1 << 20), Board(1 << 12, stream=4 << 20), Board(1 << 12, stream=0)
    try:
        a.attach({1: b.describe()})
        assert a.stream_min == 4 << 20  # the largest offer: the same answer on both
        b.attach({0: a.describe(), 2: c.describe()})
        assert b.stream_min == 0  # c does not stream
        assert Board(64, native=False, stream=1 << 20).stream_offer == 0
        with pytest.raises(ValueError, match="streams calls from 0 bytes"):
            Board(64, stream=-1)
    finally:
        for board in (a, b, c):
            board.close()


@pytest.mark.timeout(60)
def test_a_streamed_calls_nap_out_of_range_is_refused() -> None:
    _needs_native()
    a, b = _boards(2)
    try:
        x = np.ones(400, np.float32)
        a.stream_post(0, b"s", x.nbytes)
        for nap_us in (-1, 2_000_000):
            with pytest.raises(ValueError, match="does not take"):
                a.stream(0, 0, x, np.empty_like(x), "f", "sum", 10, 2, 0, 0.01, False, 0, nap_us)
    finally:
        a.close()
        b.close()
