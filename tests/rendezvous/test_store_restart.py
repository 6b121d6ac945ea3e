"""A store that remembers (``--data-dir``) and clients that ride out its restart (#34)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import psring
from psring.errors import PeerLostError
from psring.rendezvous import storelog
from psring.rendezvous.client import StoreClient

from ..conftest import end, spawn

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]


async def _client(port: int, reconnect_s: float = 30.0) -> StoreClient:
    return await StoreClient.connect("127.0.0.1", port, timeout=10, reconnect_s=reconnect_s)


@pytest.mark.asyncio
async def test_a_restarted_store_has_every_key_back(tmp_path: Path) -> None:
    store = await psring.start_store(data_dir=str(tmp_path))
    client = await _client(store.port)
    await client.set("jobs/1/spec", b'{"id": 1}')
    assert await client.add("next-job", 5) == 5
    assert (await client.compare_set("jobs/1/state", None, b"running"))[0]
    await client.set("gone", b"x")
    assert await client.delete("gone")
    await client.close()
    epoch = store.epoch
    await store.close()

    again = await psring.start_store(data_dir=str(tmp_path))
    try:
        assert again.epoch == epoch + 1 and again.instance != store.instance
        client = await _client(again.port)
        assert await client.get("jobs/1/spec") == b'{"id": 1}'
        assert await client.get("jobs/1/state") == b"running"
        assert await client.get("gone") is None
        assert await client.add("next-job", 1) == 6  # counters go on
        await client.close()
    finally:
        await again.close()


@pytest.mark.asyncio
async def test_a_torn_last_record_is_cut_off(tmp_path: Path) -> None:
    store = await psring.start_store(data_dir=str(tmp_path))
    client = await _client(store.port)
    await client.set("kept", b"1")
    await client.close()
    await store.close()
    with open(tmp_path / "log", "ab") as fh:  # a crash in the middle of an append
        fh.write(b"\x40\x00\x00\x00\x01\x02")
    size = os.path.getsize(tmp_path / "log")
    again = await psring.start_store(data_dir=str(tmp_path))
    try:
        client = await _client(again.port)
        assert await client.get("kept") == b"1"
        await client.set("after", b"2")
        assert await client.get("after") == b"2"
        await client.close()
    finally:
        await again.close()
    assert os.path.getsize(tmp_path / "log") < size + 40  # the torn bytes are gone, one record more
    third = await psring.start_store(data_dir=str(tmp_path))
    try:
        client = await _client(third.port)
        assert [await client.get(k) for k in ("kept", "after")] == [b"1", b"2"]
        await client.close()
    finally:
        await third.close()


@pytest.mark.asyncio
async def test_compaction_keeps_the_state(tmp_path: Path) -> None:
    store = await psring.start_store(data_dir=str(tmp_path), compact_bytes=4096)  # (psring store --compact-bytes)
    client = await _client(store.port)
    for i in range(300):
        await client.set(f"k{i % 20}", f"value {i}".encode())
    await client.delete("k3")
    await client.close()
    await store.close()
    assert os.path.getsize(tmp_path / "snapshot") > 0
    assert os.path.getsize(tmp_path / "log") < 4096 + 200  # emptied at least once
    again = await psring.start_store(data_dir=str(tmp_path))
    try:
        client = await _client(again.port)
        got = {f"k{i}": await client.get(f"k{i}") for i in range(20)}
        await client.close()
    finally:
        await again.close()
    assert got == {f"k{i}": (None if i == 3 else f"value {280 + i}".encode()) for i in range(20)}


@pytest.mark.asyncio
async def test_a_retried_change_is_applied_once_even_across_a_restart(tmp_path: Path) -> None:
    store = await psring.start_store(data_dir=str(tmp_path))
    client = await _client(store.port)
    fields = {"key": "n", "amount": 1, "token": "client-a:7"}
    first, _ = await client._call_once(client._conn, "add", b"", dict(fields))
    retry, _ = await client._call_once(client._conn, "add", b"", dict(fields))  # the answer was lost, say
    assert first["value"] == retry["value"] == 1
    await client.close()
    await store.close()
    again = await psring.start_store(data_dir=str(tmp_path))
    try:
        client = await _client(again.port)
        retry, _ = await client._call_once(client._conn, "add", b"", dict(fields))
        assert retry["value"] == 1
        assert await client.add("n") == 2
        await client.close()
    finally:
        await again.close()


@pytest.mark.asyncio
async def test_two_stores_cannot_share_a_data_dir(tmp_path: Path) -> None:
    store = await psring.start_store(data_dir=str(tmp_path))
    try:
        with pytest.raises(ValueError, match="another psring store is using it"):
            await psring.start_store(data_dir=str(tmp_path))
    finally:
        await store.close()


def test_a_data_dir_that_cannot_be_used_is_named_at_start(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    run = subprocess.run(
        [sys.executable, "-m", "psring", "store", "--port", "0", "--data-dir", str(blocker / "data")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2, (run.stdout, run.stderr)
    assert re.search(r"--data-dir .*a-file/data: cannot use it", run.stderr), run.stderr


def _store_process(data_dir: Path, port: int = 0) -> tuple[subprocess.Popen[str], int]:
    proc = spawn(["-m", "psring", "store", "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(data_dir)])
    assert proc.stdout is not None
    line = proc.stdout.readline()
    found = re.search(r"listening on 127.0.0.1:(\d+)", line)
    assert found, line + end(proc)
    return proc, int(found.group(1))


@pytest.mark.asyncio
async def test_a_client_waits_through_a_store_restart(tmp_path: Path) -> None:
    proc, port = await asyncio.to_thread(_store_process, tmp_path)
    again = None
    try:
        client = await _client(port)
        await client.set("before", b"1")
        waiting = asyncio.ensure_future(client.get("after", timeout=60))
        await asyncio.sleep(0.3)
        os.kill(proc.pid, signal.SIGKILL)
        await asyncio.to_thread(proc.wait, 10)
        await asyncio.sleep(1.0)
        again, _ = await asyncio.to_thread(_store_process, tmp_path, port)
        other = await _client(port)
        await other.set("after", b"2")
        assert await asyncio.wait_for(waiting, 30) == b"2"
        assert await client.get("before") == b"1" and client.reconnects == 1
        await other.close()
        await client.close()
    finally:
        for p in (proc, again):
            if p is not None:
                end(p)


@pytest.mark.asyncio
async def test_past_the_bound_a_client_names_the_store_and_the_time(tmp_path: Path) -> None:
    proc, port = await asyncio.to_thread(_store_process, tmp_path)
    try:
        client = await _client(port, reconnect_s=1.5)
        await client.set("k", b"v")
        os.kill(proc.pid, signal.SIGKILL)
        await asyncio.to_thread(proc.wait, 10)
        start = time.monotonic()
        with pytest.raises(PeerLostError, match=rf"store at 127.0.0.1:{port} has been unreachable for \d+s"):
            await client.get("k")
        assert time.monotonic() - start < 8
        await client.close()
    finally:
        end(proc)


@pytest.mark.asyncio
async def test_a_heartbeat_does_not_wait_for_the_disk_and_survives_a_kill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record set with a ttl (a daemon's heartbeat) is answered without waiting for the log's fsync;
    a plain set still waits for it. A busy disk (each fsync 1.5 s here) made heartbeats as slow as the
    disk and a live daemon looked dead (CI failed a docker job so)."""
    real_fsync = os.fsync

    def slow_fsync(fd: int) -> None:
        time.sleep(1.5)
        real_fsync(fd)

    store = await psring.start_store(data_dir=str(tmp_path))
    client = await _client(store.port)
    try:
        monkeypatch.setattr(storelog.os, "fsync", slow_fsync)
        t0 = time.monotonic()
        for beat in range(5):
            await client.set("workers/w0", f"beat {beat}".encode(), ttl=3600)
        beats = time.monotonic() - t0
        t0 = time.monotonic()
        await client.set("jobs/1/state", b"running")
        durable = time.monotonic() - t0
        assert beats < 1.0 and durable >= 1.5, (beats, durable)
    finally:
        monkeypatch.undo()
        await client.close()
        await store.close()

    proc, port = await asyncio.to_thread(_store_process, tmp_path)
    again = None
    try:
        client = await _client(port)
        await client.set("workers/w1", b"beat 0", ttl=3600)  # appended, never waited for
        await client.close()
        os.kill(proc.pid, signal.SIGKILL)  # the process dies; the kernel still has what it wrote
        await asyncio.to_thread(proc.wait, 10)
        again, port = await asyncio.to_thread(_store_process, tmp_path)
        client = await _client(port)
        assert await client.get("workers/w0") == b"beat 4" and await client.get("workers/w1") == b"beat 0"
        assert await client.get("jobs/1/state") == b"running"
        await client.close()
    finally:
        for p in (proc, again):
            if p is not None:
                end(p)


@pytest.mark.asyncio
async def test_a_change_made_while_the_log_is_compacted_is_answered_and_kept(tmp_path: Path) -> None:
    """Found by the fault campaign: a ps job stalled 30 s (its rank 0's checkpoint, written to the store
    as the store compacted, got no answer; the servers waited on that rank) -- and once, with nothing
    written after it, a rank's outcome never got its answer and the submitter waited for good. A change
    appended while the snapshot was being written waited on the log's byte count, which compaction had
    reset to 0, to grow back past it; and the truncation after the snapshot dropped it from the disk."""
    store = await psring.start_store(data_dir=str(tmp_path), compact_bytes=1 << 20)
    big, small = await _client(store.port), await _client(store.port)
    done = asyncio.Event()

    async def checkpoints() -> None:  # a value larger each time: every set outgrows the snapshot and is
        try:  # compacted before it is answered (the last one too), each snapshot a while
            for i in range(1, 9):
                try:
                    async with asyncio.timeout(15):
                        await big.set("big", bytes([i]) * (i << 20))
                except TimeoutError:
                    pytest.fail(f"the store did not answer a set of {i} MiB within 15s (it compacted meanwhile)")
        finally:
            done.set()

    async def records() -> list[str]:  # small changes all along, one after another, as daemons make
        keys = []
        while not done.is_set() or len(keys) < 5:  # (each a few records: the log does not outgrow a MiB)
            k = f"small/{len(keys)}"
            try:
                async with asyncio.timeout(15):
                    await small.set(k, k.encode())
            except TimeoutError:
                pytest.fail(f"the store did not answer {k} within 15s (set as it compacted)")
            keys.append(k)
            if done.is_set():
                await asyncio.sleep(0.01)
        return keys

    try:
        _, keys = await asyncio.gather(checkpoints(), records())
        assert os.path.getsize(tmp_path / "log") < 1 << 20  # the last set was compacted
    finally:
        await big.close()
        await small.close()
        await store.close()
    again = await psring.start_store(data_dir=str(tmp_path))
    try:
        client = await _client(again.port)
        lost = [k for k in keys if await client.get(k) != k.encode()]
        await client.close()
    finally:
        await again.close()
    assert not lost, f"{len(lost)} of {len(keys)} acknowledged changes lost across a restart: {lost[:5]}"
