"""An operator's bad day (#59), the two cases that broke: a daemon told to stop while its store is gone,
and a store whose data disk is full. Real processes on loopback, a real tmpfs for the full disk."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from psring.cluster.client import JobError
from psring.errors import StoreDiskError
from psring.rendezvous.client import connect_store, parse_store_address
from psring.rendezvous.store import StoreServer

from ..conftest import end
from .test_cluster import Cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

#: docker stop's grace: a daemon must be gone within it, in every state
GRACE_S = 10.0


def _gone_within(proc: subprocess.Popen[str], seconds: float) -> float:
    t0 = time.monotonic()
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {seconds:g}s after SIGTERM:\n{end(proc)[-2000:]}")
    return time.monotonic() - t0


@pytest.mark.parametrize("when", ["idle", "mid-job", "mid-ps-job"])
def test_sigterm_ends_daemons_within_the_grace_while_their_store_is_gone(tmp_path: Path, when: str) -> None:
    """Before the fix an idle worker daemon waited out the whole reconnect window (60 s) after SIGTERM;
    and (the fault campaign found) a server daemon hosting a ps job's shards still did: the shards' own
    store client kept reconnecting."""
    c = Cluster(tmp_path)
    try:
        workers = [c.worker(f"w{i}") for i in range(2)]
        server = c.spawn_server_daemon("s0")
        if when != "idle":
            with c.client() as client:
                job = client.submit("ps" if when == "mid-ps-job" else "ring", 2, train={"epochs": 500})
                for rec in job.stream():
                    if rec.get("step", 0) >= 5:
                        break
        os.kill(c.store.pid, signal.SIGKILL)
        c.store.wait(timeout=10)
        time.sleep(1.5)  # the daemons found the store gone and are reconnecting
        for proc in (*workers, server):
            os.kill(proc.pid, signal.SIGTERM)
        for proc in (*workers, server):
            took = _gone_within(proc, GRACE_S)
            out = proc.stdout.read() if proc.stdout else ""
            assert proc.returncode == 0, (took, out[-2000:])  # a stop it was told to make: no failure
            assert "stopped" in out, out[-2000:]
            # its heartbeat thread ended before the process did (left running into interpreter shutdown,
            # its event loop crashed the process now and then: SIGSEGV after "stopped", once in CI)
            assert "heartbeat thread still running" not in out, out[-2000:]
    finally:
        c.close()


def test_a_worker_daemon_sigtermed_as_its_rank_sets_up_stops_that_rank_and_the_job_says_so(tmp_path: Path) -> None:
    """Found by the fault campaign (ring/worker/wire/rendezvous): SIGTERM to a worker daemon while its rank
    loaded the data and set up its group. The cancelled rank swallowed its one cancellation and trained on
    to the job's end, the daemon waited for it past the store's grace, its outcome never reached the store
    and the submitter waited on. Now the rank is stopped within the grace and the job fails naming it."""
    c = Cluster(tmp_path)
    try:
        workers = [c.worker(f"w{i}") for i in range(2)]
        with c.client() as client:
            job = client.submit("ring", 2, train={"epochs": 500})  # ~40 s: its end is no way out
            t0 = time.monotonic()
            os.kill(workers[1].pid, signal.SIGTERM)  # placed: its ranks load the data and meet
            took = _gone_within(workers[1], GRACE_S)
            assert took < 6.0, took  # (STOP_GRACE_S / 2 for the rank, the goodbyes, the data's import)
            with pytest.raises(JobError, match=r"rank 1 on worker w1: worker w1 was stopped \(SIGTERM\)"):
                job.wait()
            assert time.monotonic() - t0 < 30.0
    finally:
        c.close()


def test_sigterm_to_a_ps_cluster_all_at_once_ends_every_process_within_the_grace(tmp_path: Path) -> None:
    """docker compose down mid-job: the store and every daemon get SIGTERM together. Found by the fault
    campaign: a server daemon hosting a ps job's shards waited out the reconnect window (60 s) on the
    shards' own store client, which lost the store only after the daemon was told to stop."""
    c = Cluster(tmp_path)
    try:
        workers = [c.worker(f"w{i}") for i in range(2)]
        server = c.spawn_server_daemon("s0")
        with c.client() as client:
            job = client.submit("ps", 2, train={"epochs": 500})
            for rec in job.stream():
                if rec.get("step", 0) >= 5:
                    break
        everyone = (c.store, *workers, server)
        for proc in everyone:
            os.kill(proc.pid, signal.SIGTERM)
        for proc in everyone:
            _gone_within(proc, GRACE_S)
    finally:
        c.close()


def _mount_tmpfs(where: Path, size: str) -> None:
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs for a disk that fills (needs root): {done.stderr.decode().strip()}")


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB filesystem of its own, unmounted at the end."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a disk that fills needs a tmpfs mount (root)")
    disk = tmp_path / "disk"
    _mount_tmpfs(disk, "1m")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _fill(disk: Path) -> Path:
    """Fill the filesystem to its last byte (what it holds stays)."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for chunk in (4096, 1):  # blocks, then the last bytes
            with contextlib.suppress(OSError):
                while True:
                    os.write(fd, b"\0" * chunk)
    finally:
        os.close(fd)
    return filler


@pytest.mark.timeout(60)
def test_a_store_whose_disk_is_full_answers_naming_it_makes_no_change_and_recovers(small_disk: Path) -> None:
    """Before the fix the OSError escaped the request's task: the request never got an answer."""

    async def main() -> None:
        data = small_disk / "data"
        server = await StoreServer(data_dir=str(data)).start()
        client = await connect_store(parse_store_address(f"127.0.0.1:{server.port}"), secret=None, timeout=10)
        try:
            await client.set("kept", b"before")
            filler = _fill(small_disk)
            t0 = time.monotonic()
            with pytest.raises(StoreDiskError, match=rf"ENOSPC.*{data}"):
                await client.set("kept", b"x" * 8192)
            with pytest.raises(StoreDiskError, match="ENOSPC"):  # every request says so while it lasts
                await client.get("kept")
            assert time.monotonic() - t0 < 5
            for extra in (disk for disk in small_disk.iterdir() if disk.name.startswith("filler")):
                extra.unlink()
            assert not filler.exists()
            # served at once: the store tries its disk at every request while it refuses (a probe only
            # every half second refused a job submitted just after the room was made: a CI failure)
            assert await client.get("kept") == b"before"  # the refused change was not made
            await client.set("after", b"1")
            assert await client.add("n", 2) == 2
        finally:
            await client.close()
            await server.close()
        again = await StoreServer(data_dir=str(data)).start()  # what was acknowledged, and only that
        client = await connect_store(parse_store_address(f"127.0.0.1:{again.port}"), secret=None, timeout=10)
        try:
            assert await client.get("kept") == b"before"
            assert await client.get("after") == b"1"
            assert await client.add("n", 1) == 3
        finally:
            await client.close()
            await again.close()

    asyncio.run(main())


def test_daemons_drop_orders_they_cannot_serve_and_serve_the_next_job(tmp_path: Path) -> None:
    """An order (server daemon) or an assignment (worker daemon) under a daemon's name that is not one --
    not JSON, a shard out of range, a negative job -- is said and dropped, not a crash of the daemon
    (before: the JSON error or start_servers' ValueError ended the process; and a store refusing a job's
    shards on a full disk did the same: the fault campaign's next job waited 30 s for the dead server);
    the next ps job then runs on them."""
    c = Cluster(tmp_path)
    try:
        workers = [c.worker("w0"), c.worker("w1")]
        server = c.spawn_server_daemon("s0")
        bad = {
            "serve/s0": [b"{not json", b'{"job": 7, "num_shards": 2, "shards": [5], "attempt": 0}'],
            "assign/w0": [b"\xff\xfe"],
            "assign/w1": [b'{"job": -1, "rank": 0}'],
        }

        async def orders() -> None:
            store = await connect_store(parse_store_address(c.address), secret=None, timeout=10)
            try:
                for name, values in bad.items():
                    for value in values:
                        await store.set(f"psring-cluster/{name}", value)
                        for _ in range(100):  # taken (deleted) within the daemon's 1 s poll
                            if await store.get(f"psring-cluster/{name}") is None:
                                break
                            await asyncio.sleep(0.1)
            finally:
                await store.close()

        asyncio.run(orders())
        with c.client() as client:
            summary = client.submit("ps", 2, train={"epochs": 2}).wait(timeout=120)
        assert summary["ranks_agree"], summary
        outs = {}
        for name, proc in (("s0", server), ("w0", workers[0]), ("w1", workers[1])):
            assert proc.poll() is None, end(proc)
            os.kill(proc.pid, signal.SIGTERM)
            _gone_within(proc, GRACE_S)
            outs[name] = proc.stdout.read() if proc.stdout else ""
            assert proc.returncode == 0, outs[name]
        assert "psring server s0: dropped an order: not JSON" in outs["s0"], outs["s0"]
        assert "dropped an order: expected job (a number), num_shards" in outs["s0"] and "[5]" in outs["s0"], outs
        assert "psring worker w0: dropped an assignment: not JSON" in outs["w0"], outs["w0"]
        assert "psring worker w1: dropped an assignment: expected job, rank and attempt" in outs["w1"], outs["w1"]
    finally:
        c.close()


def _store_on(disk: Path, c: Cluster) -> None:
    c.store = subprocess.Popen(
        [sys.executable, "-m", "psring", "store", "--host", "127.0.0.1", "--port", "0", "--data-dir",
         str(disk / "data")],
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    line = c.store.stdout.readline() if c.store.stdout else ""
    assert "listening on 127.0.0.1:" in line, line
    c.address = "127.0.0.1:" + line.split("127.0.0.1:")[1].split(",")[0].split()[0]


def test_a_daemon_waiting_for_its_stores_disk_stops_at_once_on_sigterm(tmp_path: Path, small_disk: Path) -> None:
    """A worker daemon whose store's disk refuses changes waits for it (its heartbeat and its poll for
    work are refused); SIGTERM then ends it at once, saying why, instead of after the grace it gives
    the store's goodbyes -- which that disk would refuse too (the fault campaign's full-disk case once
    saw a daemon outlive docker's 10 s grace, so)."""
    c = Cluster.__new__(Cluster)
    c.tmp, c.secret, c.env, c.daemons = tmp_path, None, {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}, {}
    try:
        _store_on(small_disk, c)
        worker = c.worker("w0")
        _fill(small_disk)

        async def refused() -> None:  # a change the disk cannot take (the log's last page has room for small ones)
            store = await connect_store(parse_store_address(c.address), secret=None, timeout=10)
            try:
                with pytest.raises(StoreDiskError):
                    await store.set("big", b"x" * 65536)
            finally:
                await store.close()

        asyncio.run(refused())
        assert worker.stdout is not None
        line = ""
        while "retrying for up to" not in line:  # its heartbeat or its poll refused: it waits for the disk
            line = worker.stdout.readline()
            assert line or worker.poll() is None, end(worker)
        os.kill(worker.pid, signal.SIGTERM)
        _gone_within(worker, GRACE_S)
        out = worker.stdout.read()
        assert worker.returncode == 0, out
        # given up at once (before: after the 4 s grace; the time itself is not asserted on a busy machine)
        assert "not waiting for the store (its disk refuses changes)" in out, out
    finally:
        c.close()


def test_a_full_disk_fails_the_submitter_at_once_and_the_cluster_goes_on(tmp_path: Path, small_disk: Path) -> None:
    """The submitter fails naming the disk within seconds; the worker daemons wait for the store's disk
    within their bound (they do not exit); with room again the next job runs."""
    c = Cluster.__new__(Cluster)
    c.tmp, c.secret, c.env, c.daemons = tmp_path, None, {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}, {}
    try:
        _store_on(small_disk, c)
        workers = [c.worker(f"w{i}") for i in range(2)]
        _fill(small_disk)
        submit = [sys.executable, "-m", "psring", "submit", "--store", c.address, "--workers", "2", "--epochs", "1"]
        t0 = time.monotonic()
        done = subprocess.run(submit, capture_output=True, text=True, timeout=60)
        took = time.monotonic() - t0
        assert done.returncode == 1, done.stdout + done.stderr
        # (a page of slack may take the job's first changes: then it was placed, and fails the same way)
        lines = [ln for ln in done.stdout.splitlines() if ln.strip() and "job 1 placed" not in ln]
        assert len(lines) == 1 and "ENOSPC" in lines[0] and str(small_disk / "data") in lines[0], done.stdout
        assert took < 15, took
        time.sleep(2)
        assert all(w.poll() is None for w in workers)  # waiting for the disk, within their bound
        for extra in small_disk.iterdir():
            if extra.name.startswith("filler"):
                extra.unlink()
        done = subprocess.run(submit, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "ranks bit-identical True" in done.stdout, done.stdout[-3000:]
    finally:
        c.close()


def test_a_worker_daemon_restarted_under_its_name_takes_the_jobs_next_attempt(tmp_path: Path) -> None:
    """What a restart policy does: the worker daemon SIGKILLed mid-job comes back under its own name. Before
    the fix its previous life's claim stayed in the store, so the job's next attempt (and every job after)
    waited for it forever; found by benchmarks/faults.py (ring/worker/kill/mid-step)."""
    c = Cluster(tmp_path)
    try:
        c.worker("r0")
        victim = c.worker("r1")
        with c.client() as client:
            job = client.submit("ring", 2, train={"epochs": 60}, max_restarts=1)
            for rec in job.stream():
                if rec.get("step", 0) >= 100:
                    break
            os.kill(victim.pid, signal.SIGKILL)
            victim.wait(timeout=10)
            end(victim)  # (its pipe: the new daemon takes its place in the cluster's books)
            c.worker("r1")  # the same name again
            summary = job.wait(timeout=120)
            status = client.status()
        [rec] = [j for j in status["jobs"] if j["id"] == job.id]
        assert rec["state"] == "done" and rec["attempt"] == 1, rec
        assert summary["ranks_agree"] is True
    finally:
        c.close()


def _marked(tag: str) -> list[int]:
    """Processes whose environment carries PSRING_TEST_MARK=tag (the campaign's own scan of /proc)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from faults import marked_pids

    return marked_pids(tag, "PSRING_TEST_MARK")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_no_rank_outlives_its_launcher(tmp_path: Path, sig: signal.Signals) -> None:
    """psring train mid-job, told to stop (SIGTERM: it ends every rank and exits 143 within docker's grace)
    or killed (SIGKILL: each rank gets SIGTERM from the kernel as its parent dies). Before the fix both
    left the ranks running; found by benchmarks/faults.py (ring/launcher/*)."""
    tag = f"{os.getpid()}-{sig.name}-{time.monotonic_ns()}"
    env = {**os.environ, "PSRING_TEST_MARK": tag, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "psring", "train", "--workers", "2", "--epochs", "500"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while len(_marked(tag)) < 3 and time.monotonic() < deadline:  # the launcher and its two ranks
            time.sleep(0.2)
        assert len(_marked(tag)) >= 3, "the ranks never started"
        time.sleep(2.0)  # mid-job
        os.kill(proc.pid, sig)
        took = _gone_within(proc, GRACE_S)
        if sig == signal.SIGTERM:
            assert proc.returncode == 128 + signal.SIGTERM, (took, end(proc)[-2000:])
        deadline = time.monotonic() + GRACE_S
        while _marked(tag) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _marked(tag), f"left running {GRACE_S:g}s after the launcher ended: {_marked(tag)}"
    finally:
        for pid in _marked(tag):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        end(proc)


@pytest.mark.timeout(60)
def test_a_daemons_rank_0_waits_for_the_clusters_store_and_never_serves_its_own() -> None:
    """The fault campaign's ring/store/term/rendezvous: the store stopped just as a job's ranks met, and
    rank 0 on a worker daemon, finding nothing at the store's (local) address, served an empty store
    there itself -- the restarted store found its port taken and the job split from it. A daemon's rank
    takes the cluster's store as someone else's: with nothing at the address it says so within its
    timeout and leaves the port to the store. (Before the fix, this one-rank job set up on a store of
    its own and the port was held.)"""
    from psring import init_group
    from psring.cluster.daemons import rank_env
    from psring.errors import PeerLostError

    with socket.socket() as probe:  # a free port on loopback: where the cluster's store would be
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    spec = {"id": "j1", "attempt": 0, "topology": "ring", "workers": ["w0"], "timeout": 2.0}
    env = rank_env(spec, 0, store=f"127.0.0.1:{port}", port=0, advertise="127.0.0.1")

    async def meet() -> None:
        group = await init_group(env=env)
        await group.close()

    t0 = time.monotonic()
    with pytest.raises(PeerLostError, match=f"cannot reach the rendezvous store at 127.0.0.1:{port}"):
        asyncio.run(meet())
    assert time.monotonic() - t0 < 20
    with socket.socket() as again:  # nobody took the store's port
        again.bind(("127.0.0.1", port))


def test_sigusr1_prints_what_a_daemon_waits_in_and_it_goes_on(tmp_path: Path) -> None:
    """A process that hangs must be able to say where (the campaign's one unexplained case was a
    submitter waiting on ranks that said nothing): SIGUSR1 prints every asyncio task with the chain of
    awaits it is suspended in, and every thread's stack; the daemon goes on serving."""
    c = Cluster(tmp_path)
    try:
        proc = c.worker("w0")
        os.kill(proc.pid, signal.SIGUSR1)
        seen: list[str] = []
        deadline = time.monotonic() + 20
        assert proc.stdout is not None
        while time.monotonic() < deadline and not any("end of what it waits in" in line for line in seen):
            line = proc.stdout.readline()
            assert line, f"the worker ended on SIGUSR1: {proc.poll()}\n{''.join(seen)}"
            seen.append(line)
        text = "".join(seen)
        assert f"pid {proc.pid} on SIGUSR1" in text, text
        assert "task " in text and "daemons.py" in text and " in serve" in text, text  # the daemon's own await chain
        # and its threads' stacks, by name (the frames shown depend on where the signal found the thread:
        # inside the heartbeat coroutine's step, Python 3.11's stack stops at the coroutine -- beat, not
        # _heartbeat_thread -- which a busy CI machine once caught)
        beat = text.split("thread psring-heartbeat-w0 (most recent call last):\n", 1)
        assert len(beat) == 2 and "daemons.py" in beat[1].split("\nthread ", 1)[0], text
        assert proc.poll() is None, text
        with c.client() as client:  # and it goes on: a job on it still runs
            assert client.submit("ring", 1, train={"epochs": 1}).wait(timeout=120)["test_accuracy"] > 0.5
    finally:
        c.close()
