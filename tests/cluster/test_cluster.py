"""The cluster: worker daemons, jobs, failures named, metrics, traces, doctor (real processes)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Any

import pytest

import psring
from psring.cluster.client import Client, _blame
from psring.cluster.daemons import JobError, key
from psring.rendezvous.scheduler import resolve_settings

from ..conftest import end, run_tree, spawn
from ..rendezvous.test_start import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(170)]


class Cluster:
    """A store and worker daemons as processes on loopback, ended by PID."""

    def __init__(self, tmp_path, secret: str | None = None) -> None:
        self.tmp = tmp_path
        self.secret = secret
        self.env = {"PSRING_SECRET": secret} if secret else {}
        self.env["PYTHONPATH"] = str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", "")
        self.store = spawn(["-m", "psring", "store", "--host", "127.0.0.1", "--port", "0"], self.env)
        line = self.store.stdout.readline()
        match = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
        assert match, line
        self.address = f"127.0.0.1:{match.group(1)}"
        self.daemons: dict[str, subprocess.Popen[str]] = {}

    def worker(self, name: str, *extra: str, wait: bool = True) -> subprocess.Popen[str]:
        proc = spawn(
            ["-m", "psring", "worker", "--store", self.address, "--host", "127.0.0.1", "--name", name, *extra],
            self.env,
        )
        self.daemons[name] = proc
        if wait:
            line = ""
            while "ready on" not in line:
                line = proc.stdout.readline()
                assert line or proc.poll() is None, f"worker {name} exited: {proc.poll()}"
        return proc

    def spawn_server_daemon(self, name: str, *extra: str) -> subprocess.Popen[str]:
        proc = spawn(
            [
                "-m",
                "psring",
                "server",
                "--cluster",
                "--store",
                self.address,
                "--host",
                "127.0.0.1",
                "--name",
                name,
                *extra,
            ],
            self.env,
        )
        self.daemons[name] = proc
        line = ""
        while "ready for ps jobs" not in line:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, f"server daemon {name} exited: {proc.poll()}"
        return proc

    def client(self) -> Client:
        return Client(self.address, secret=self.secret)

    def close(self) -> dict[str, str]:
        out = {name: end(p) for name, p in self.daemons.items()}
        out["store"] = end(self.store)
        return out


@pytest.fixture
def cluster(tmp_path):
    made: list[Cluster] = []

    def make(secret: str | None = None) -> Cluster:
        c = Cluster(tmp_path, secret)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


TRAIN = {"epochs": 3, "batch_size": 32}


def test_blame_names_the_lost_daemon_not_a_rank_stopped_after_it() -> None:
    """Rank 0 lost rank 3 and failed the job; rank 2 was then stopped ("failed elsewhere"). The blame
    goes to rank 3's daemon whichever outcomes the submitter read first (a docker CI run once blamed
    rank 2)."""
    chosen = ["w0", "w1", "w2", "w3"]
    lost = {"ok": False, "worker": "w0", "error": "PeerLostError: rank 3 was lost", "lost_rank": 3}
    stopped = {"ok": False, "worker": "w2", "error": "job 6 was failed elsewhere", "stopped": True}
    assert _blame(6, chosen, {0: lost, 2: stopped}).startswith("job 6 failed: worker daemon w3 (rank 3) was lost")
    assert "rank 2" not in _blame(6, chosen, {0: {**lost, "lost_rank": None}, 2: stopped})
    own = {"ok": False, "worker": "w1", "error": "ValueError: bad batch"}
    assert _blame(6, chosen, {1: own, 2: stopped}) == "job 6 failed: rank 1 on worker w1: ValueError: bad batch"


def test_blame_in_a_circle_of_lost_peers_names_the_first_to_fail_and_the_others() -> None:
    """Every rank reported and each lost another (rank 2 went first and rank 0 saw it close): the
    message names rank 2, by the time its daemon gave, and keeps what the others said (a docker CI run
    once blamed rank 0 alone, which told nothing)."""
    chosen = ["w0", "w1", "w2", "w3"]
    failed = {
        0: {"ok": False, "worker": "w0", "error": "PeerLostError: rank 2 closed", "lost_rank": 2, "at": 102.0},
        2: {"ok": False, "worker": "w2", "error": "PeerLostError: rank 3 silent", "lost_rank": 3, "at": 101.0},
        3: {"ok": False, "worker": "w3", "error": "job 6 was failed elsewhere", "stopped": True, "at": 103.0},
    }
    message = _blame(6, chosen, failed)
    assert message.startswith("job 6 failed: rank 2 on worker w2: PeerLostError: rank 3 silent (first to fail;")
    assert "rank 0: PeerLostError: rank 2 closed" in message and "failed elsewhere" not in message


def test_two_jobs_in_a_row_over_both_topologies(cluster) -> None:
    c = cluster()
    c.worker("w0")
    c.worker("w1")
    with c.client() as client:
        ring = client.submit("ring", 2, train=TRAIN).wait(timeout=120)
        ps = client.submit("ps", 2, train=TRAIN).wait(timeout=120)
        status = client.status()
    for summary, topology in ((ring, "ring"), (ps, "ps")):
        assert summary["topology"] == topology and summary["workers"] == 2
        assert summary["test_accuracy"] >= 0.85 and summary["ranks_agree"]
    assert ring["param_digest"] == ps["param_digest"]  # the same bits over either topology, here too
    workers = {w["id"]: w for w in status["workers"]}
    assert set(workers) == {"w0", "w1"}
    assert all(w["state"] == "idle" and w["jobs_run"] >= 2 for w in workers.values()), workers
    assert [j["state"] for j in status["jobs"]] == ["done", "done"]


def test_submit_command_prints_the_train_summary(cluster) -> None:
    c = cluster()
    c.worker("a")
    c.worker("b")
    proc = run_tree(
        [sys.executable, "-m", "psring", "submit", "--store", c.address, "--workers", "2", "--epochs", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "job 1 placed (ring, 2 workers)" in proc.stdout
    assert "[job 1] epoch 2" in proc.stdout
    assert re.search(r"test accuracy\s+0\.\d+", proc.stdout)
    assert "ranks bit-identical True" in proc.stdout


ENTRY = """
import numpy as np

async def async_job(group, scale=1.0):
    y = await group.all_reduce(np.full(4, float(group.rank) * scale))
    return {"sum": float(y[0]), "rank": group.rank, "world": group.world_size, "topology": group.topology}

def sync_job(group):
    y = group.all_reduce(np.ones(3))
    return {"sum": float(y[0])}

def broken_job(group):
    if group.rank == 1:
        raise RuntimeError("user code failed on purpose")
    group.barrier()
"""


def test_entrypoint_jobs_async_sync_and_failing(cluster, tmp_path) -> None:
    (tmp_path / "userjobs.py").write_text(ENTRY)
    c = cluster()
    for name in ("e0", "e1", "e2"):
        c.worker(name)
    with c.client() as client:
        r = client.submit("ring", 3, entrypoint="userjobs:async_job", args={"scale": 2.0}).wait(timeout=60)
        assert r == {"sum": 6.0, "rank": 0, "world": 3, "topology": "ring"}
        assert client.submit("ps", 3, entrypoint="userjobs:sync_job").wait(timeout=60) == {"sum": 3.0}
        with pytest.raises(JobError, match=r"rank 1 on worker e\d: RuntimeError: user code failed on purpose"):
            client.submit("ring", 3, entrypoint="userjobs:broken_job", timeout=20).wait(timeout=60)
        with pytest.raises(JobError, match=r"entrypoint 'userjobs:nope' cannot be loaded on worker"):
            client.submit("ring", 3, entrypoint="userjobs:nope").wait(timeout=60)
        # the daemons are back to idle and take another job
        assert client.submit("ring", 2, entrypoint="userjobs:sync_job").wait(timeout=60) == {"sum": 2.0}


def test_too_few_daemons_fails_or_waits_as_asked(cluster, tmp_path) -> None:
    (tmp_path / "userjobs.py").write_text(ENTRY)
    c = cluster()
    c.worker("only")
    with c.client() as client:
        with pytest.raises(JobError, match=r"needs 3 worker daemon\(s\); 1 registered, 1 idle"):
            client.submit("ring", 3, wait_for_workers=False)
        t0 = time.monotonic()
        with pytest.raises(JobError, match=r"waited 2s for 2 idle worker daemon\(s\); 1 registered"):
            client.submit("ring", 2, place_timeout=2.0)
        assert time.monotonic() - t0 < 10
        # a second daemon arrives while a job waits for it: the waiting job runs
        import threading

        threading.Timer(1.0, lambda: c.worker("late", wait=False)).start()
        assert client.submit("ring", 2, entrypoint="userjobs:sync_job").wait(timeout=60) == {"sum": 2.0}


def test_two_queued_jobs_share_two_daemons(cluster) -> None:
    c = cluster()
    c.worker("q0")
    c.worker("q1")
    with c.client() as first, c.client() as second:
        job1 = first.submit("ring", 2, train={"epochs": 4})
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(lambda: second.submit("ps", 2, train={"epochs": 2}).wait(timeout=120))
            assert job1.wait(timeout=120)["test_accuracy"] > 0.8
            assert fut.result(timeout=150)["topology"] == "ps"


def _long_job_under_way(client: Client) -> Any:
    """A ring job over the three daemons that will not end by itself, past its 20th step."""
    job = client.submit("ring", 3, train={"epochs": 500})
    for rec in job.stream():
        if rec.get("step", 0) >= 20:
            break
    return job


def test_sigkilled_daemon_fails_the_job_naming_it(cluster) -> None:
    c = cluster()
    c.worker("k0")
    victim = c.worker("k1")
    c.worker("k2")
    with c.client() as client:
        job = _long_job_under_way(client)
        t0 = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL)
        with pytest.raises(JobError, match=r"worker daemon k1 \(rank \d\) (was lost|stopped heartbeating)"):
            job.wait(timeout=60)
        assert time.monotonic() - t0 < 15
        # the survivors are idle again and run the next job
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            idle = [w["id"] for w in client.status()["workers"] if w["state"] == "idle" and w["id"] != "k1"]
            if len(idle) == 2:
                break
            time.sleep(0.2)
        assert client.submit("ring", 2, train={"epochs": 1}).wait(timeout=60)["workers"] == 2


def test_a_hung_daemon_is_named_alike_by_stream_and_by_wait_after_it(cluster) -> None:
    """A worker daemon hangs (SIGSTOP) mid-job: stream() ends on "stopped heartbeating"; the daemon
    wakes, its rank reports (stopped, the job failed elsewhere); wait() then says what stream() found,
    not a blame recomputed from outcomes that only followed it (CI printed a bystander's PeerLost)."""
    c = cluster()
    c.worker("h0")
    victim = c.worker("h1")
    c.worker("h2")
    with c.client() as client:
        job = _long_job_under_way(client)
        os.kill(victim.pid, signal.SIGSTOP)
        try:
            for _ in job.stream():  # ends when the submitter's verdict is in
                pass
        finally:
            os.kill(victim.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the woken rank reported and its daemon is idle again
            if {w["id"]: w["state"] for w in client.status()["workers"]}.get("h1") == "idle":
                break
            time.sleep(0.2)
        with pytest.raises(JobError, match=r"worker daemon h1 \(rank \d\) stopped heartbeating"):
            job.wait(timeout=30)


def test_sigterm_leaves_cleanly_idle_and_mid_job(cluster) -> None:
    c = cluster()
    idle = c.worker("t0")
    busy = c.worker("t1")
    c.worker("t2")
    os.kill(idle.pid, signal.SIGTERM)
    assert idle.wait(timeout=15) == 0
    assert "stopped after 0 job(s)" in idle.stdout.read()
    with c.client() as client:
        assert "t0" not in {w["id"] for w in client.status()["workers"]}  # deregistered
        job = client.submit("ring", 2, train={"epochs": 500})
        for rec in job.stream():
            if rec.get("step", 0) >= 10:
                break
        os.kill(busy.pid, signal.SIGTERM)
        with pytest.raises(JobError, match=r"t1"):
            job.wait(timeout=60)
        assert busy.wait(timeout=20) == 0


def test_metrics_and_trace_from_a_real_job(cluster, tmp_path) -> None:
    pytest.importorskip("prometheus_client", reason="prometheus-client is not installed")
    c = cluster()
    trace_dir = tmp_path / "trace"
    c.worker("m0", "--metrics-port", "0", "--trace-dir", str(trace_dir))
    c.worker("m1", "--trace-dir", str(trace_dir))
    with c.client() as client:
        client.submit("ring", 2, train={"epochs": 1}).wait(timeout=120)
        port = {w["id"]: w for w in client.status()["workers"]}["m0"]["metrics_port"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    count = re.search(r'psring_collective_seconds_count\{kind="all_reduce",role="worker"\} (\d+)', text)
    assert count and int(float(count.group(1))) >= 23, text[:2000]  # one per step (23 steps) and per epoch
    assert re.search(r'psring_jobs_total\{outcome="ok",role="worker"\} 1\.0', text)
    steps = re.search(r'psring_steps_total\{role="worker"\} ([\d.]+)', text)
    assert steps and float(steps[1]) == 23, text[:3000]  # this daemon's rank's steps, each counted once
    compute = re.search(r'psring_step_compute_seconds\{role="worker"\} ([\d.e-]+)', text)
    assert compute and float(compute[1]) > 0, text[:3000]
    assert re.search(r'psring_job\{role="worker"\} 0\.0', text)  # idle again
    out = tmp_path / "trace.json"
    proc = run_tree(
        [sys.executable, "-m", "psring", "trace", str(trace_dir), "-o", str(out)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    trace = json.loads(out.read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in slices} == {0, 1}  # one row per rank
    assert {"all_reduce", "broadcast", "all_gather"} <= {e["name"] for e in slices}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in slices)


def test_doctor_finds_planted_problems(cluster) -> None:
    c = cluster(secret="s3cret")
    c.worker("d0")

    def doctor(secret: str, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ, PSRING_SECRET=secret)
        return run_tree(
            [sys.executable, "-m", "psring", "doctor", "--store", c.address, "--timeout", "3"],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )

    healthy = doctor("s3cret")
    assert healthy.returncode == 0, healthy.stdout + healthy.stderr
    assert "no problems found" in healthy.stdout
    wrong = doctor("wrong")
    assert wrong.returncode == 1 and "rejected this secret" in wrong.stdout and "PSRING_SECRET" in wrong.stdout
    # a daemon record whose port nobody listens on, and one advertising 127.0.1.1
    with c.client() as client:
        import asyncio

        from psring.transport.loop import new_event_loop

        async def plant() -> None:
            inner = client._inner
            base = json.loads(await inner.store.get(key("workers", "d0")))
            await inner.store.set(key("workers", "ghost"), json.dumps({**base, "id": "ghost", "port": 1}))
            await inner.store.set(
                key("workers", "misnamed"), json.dumps({**base, "id": "misnamed", "host": "127.0.1.1"})
            )
            await inner.store.set(key("workers", "old"), json.dumps({**base, "id": "old", "version": "0.0.1"}))

        client._portal.call(plant())
        del asyncio, new_event_loop
    bad = doctor("s3cret")
    assert bad.returncode == 1
    lines = [line for line in bad.stdout.splitlines() if line.startswith("problem:")]
    assert any("worker ghost" in line and "unreachable on its declared port" in line for line in lines), lines
    assert any("misnamed" in line and "127.0.1.1" in line and "PSRING_ADVERTISE_HOST" in line for line in lines)
    assert any("worker old" in line and "runs psring 0.0.1" in line for line in lines), lines
    assert not any("d0" in line for line in lines), lines


@pytest.mark.parametrize(
    "env, rank, world, store",
    [
        ({"SLURM_PROCID": "3", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "node[07-09,12]"}, 3, 8, "node07:29500"),
        (
            {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "gpu1,gpu2", "MASTER_PORT": "1234"},
            0,
            2,
            "gpu1:1234",
        ),
        (
            {
                "KUBERNETES_SERVICE_HOST": "10.0.0.1",
                "HOSTNAME": "psring-worker-5",
                "WORLD_SIZE": "8",
                "PSRING_STORE": "psring-store:29500",
            },
            5,
            8,
            "psring-store:29500",
        ),
        ({"HOSTNAME": "psring-worker-5", "WORLD_SIZE": "8", "RANK": "2", "PSRING_STORE": "s:1"}, 2, 8, "s:1"),
    ],
)
def test_rank_world_and_store_from_schedulers(env, rank, world, store) -> None:
    settings = resolve_settings(env=env)
    assert (settings.rank, settings.world_size) == (rank, world)
    assert f"{settings.store.host}:{settings.store.port}" == store


def test_statefulset_ordinal_needs_kubernetes() -> None:
    from psring.rendezvous.scheduler import statefulset_ordinal

    assert statefulset_ordinal({"HOSTNAME": "web-3"}) is None  # not in Kubernetes: hostnames are not ranks
    assert statefulset_ordinal({"KUBERNETES_SERVICE_HOST": "x", "HOSTNAME": "web-3"}) == 3
    assert statefulset_ordinal({"KUBERNETES_SERVICE_HOST": "x", "HOSTNAME": "web"}) is None
    assert psring.__version__


def _reference_digest(topology: str, workers: int, epochs: int) -> tuple[int, float]:
    """The main job run without interruption (psring train), for the same settings."""
    proc = run_tree(
        [sys.executable, "-m", "psring", "train", "--topology", topology, "--workers", str(workers),
         "--epochs", str(epochs), "--json"],
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    return summary["param_digest"], summary["test_accuracy"]


def _stream_until(job, step: int) -> None:
    for rec in job.stream():
        if rec.get("step", 0) >= step:
            return
    raise AssertionError("the job ended before the step to interrupt it at")


@pytest.mark.parametrize("topology, server_daemon", [("ring", False), ("ps", False), ("ps", True)])
def test_a_lost_worker_daemon_restarts_the_job_from_its_checkpoint(cluster, tmp_path, topology, server_daemon) -> None:
    """submit --max-restarts: a worker daemon SIGKILLed mid-job; the job is stopped everywhere and
    placed again on the daemons idle then, resumes from its latest checkpoint (worker-side, in the
    store; over ps with a server daemon also the shards' own) and ends with an uninterrupted run's
    parameters, bit for bit."""
    epochs = 60
    ref_digest, ref_acc = _reference_digest(topology, 2, epochs)
    c = cluster()
    victim = c.worker("v0")
    c.worker("v1")
    if server_daemon:
        c.spawn_server_daemon("s0", "--checkpoint-dir", str(tmp_path / "ckpt"))
    with c.client() as client:
        job = client.submit(topology, 2, train={"epochs": epochs}, max_restarts=2)
        _stream_until(job, 400)
        spare = c.worker("v2")  # where the second attempt's rank goes
        os.kill(victim.pid, signal.SIGKILL)
        restarts = [rec for rec in job.stream() if "restart" in rec]
        summary = job.wait(timeout=120)
        status = client.status()
    assert len(restarts) == 1 and "v0" in restarts[0]["why"], restarts
    assert summary["param_digest"] == ref_digest and summary["test_accuracy"] == ref_acc
    assert summary["resumed_at"] is not None and summary["resumed_at"] >= 400 - 10 * 1
    [rec] = [j for j in status["jobs"] if j["id"] == job.id]
    assert rec["state"] == "done" and rec["attempt"] == 1 and len(rec["restarts"]) == 1
    assert spare.poll() is None


@pytest.mark.parametrize("topology", ["ring", "ps"])
def test_an_elastic_job_goes_on_without_a_lost_worker_daemon(cluster, topology) -> None:
    """submit(elastic=True): a worker daemon SIGKILLed mid-job costs the job a step, not the job: the
    others train on (over the ring they re-form; over ps the server daemon's shards hold the model),
    the job ends done, and its summary says who left."""
    c = cluster()
    victim = c.worker("e0")
    c.worker("e1")
    c.worker("e2")
    with c.client() as client:
        with pytest.raises(ValueError, match="elastic goes on without a lost worker"):
            client.submit(topology, 3, elastic=True, max_restarts=1)
        if topology == "ps":  # the shards must not live in a worker's daemon (rank 0's, without a server daemon)
            with pytest.raises(ValueError, match="elastic over ps needs a server daemon"):
                client.submit(topology, 3, elastic=True)
            c.spawn_server_daemon("es")
        job = client.submit(topology, 3, train={"epochs": 40}, elastic=True)
        _stream_until(job, 150)
        [placed] = [j for j in client.status()["jobs"] if j["id"] == job.id]
        rank = placed["workers"].index("e0")  # the victim's rank in the job
        os.kill(victim.pid, signal.SIGKILL)
        summary = job.wait(timeout=180)
        status = client.status()
    [rec] = [j for j in status["jobs"] if j["id"] == job.id]
    assert rec["state"] == "done", rec
    assert summary["workers"] == 2 and summary["ranks_agree"] and summary["test_accuracy"] >= 0.9, summary
    assert summary["elastic"]["joined"] == [], summary
    assert summary["elastic"]["departed"] == [rank], summary


def test_a_crashed_server_daemon_resumes_its_shards(cluster, tmp_path) -> None:
    """A server daemon SIGKILLed mid-job and started again (what a restart policy does): it keeps
    its identity in its checkpoint directory, resumes the job's shards from their checkpoints on
    its declared port, the workers reconnect and re-send the step in flight, and the job ends with
    an uninterrupted run's parameters."""
    epochs = 60
    ref_digest, ref_acc = _reference_digest("ps", 2, epochs)
    c = cluster()
    c.worker("p0")
    c.worker("p1")
    args = ("--checkpoint-dir", str(tmp_path / "ckpt"), "--port", str(free_port()))
    server = c.spawn_server_daemon("s-first", *args)  # --name is kept from the first start on
    with c.client() as client:
        sid = next(s["id"] for s in client.status()["servers"])
        job = client.submit("ps", 2, train={"epochs": epochs})
        _stream_until(job, 300)
        os.kill(server.pid, signal.SIGKILL)
        killed = time.monotonic()
        server.wait(timeout=10)
        restarted = spawn(
            ["-m", "psring", "server", "--cluster", "--store", c.address, "--host", "127.0.0.1", *args], c.env
        )
        c.daemons["s-again"] = restarted
        resumed = restarted.stdout.readline()
        assert f"psring server {sid}: resumed shards [0, 1] of job {job.id}" in resumed, resumed
        summary = job.wait(timeout=120)
        took = time.monotonic() - killed
    assert summary["param_digest"] == ref_digest and summary["test_accuracy"] == ref_acc
    assert summary["resumed_at"] is None  # the workers never stopped: they re-sent the step in flight
    assert took < 60


def test_status_tells_lost_daemons_and_why_a_job_failed(cluster) -> None:
    """Nobody waits on the job: its state still ends failed, with the reason, and the dead daemon
    shows as lost within seconds."""
    c = cluster()
    victim = c.worker("q0")
    c.worker("q1")
    with c.client() as client:
        job = client.submit("ring", 2, train={"epochs": 500})
        _stream_until(job, 50)
        os.kill(victim.pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            status = client.status()
            [rec] = [j for j in status["jobs"] if j["id"] == job.id]
            lost = {w["id"]: w["state"] for w in status["workers"]}
            if rec["state"] == "failed" and lost.get("q0") == "lost":
                break
            time.sleep(0.3)
        assert rec["state"] == "failed" and "rank" in rec["reason"], rec
        assert lost == {"q0": "lost", "q1": "idle"}, lost
        out = run_tree([sys.executable, "-m", "psring", "status", "--store", c.address], timeout=60).stdout
        assert re.search(r"q0\s+\S+\s+lost", out) and "failed" in out, out
        js = json.loads(
            run_tree([sys.executable, "-m", "psring", "status", "--store", c.address, "--json"], timeout=60).stdout
        )
        assert {w["id"]: w["state"] for w in js["workers"]} == lost


def test_doctor_job_shows_what_a_stuck_cluster_job_waits_in(cluster, tmp_path) -> None:
    """psring doctor --job ID on a running job: rank 0 waits in an all_reduce, rank 1 is elsewhere;
    once rank 1 comes, the job finishes and doctor says nothing is stuck."""
    c = cluster()
    c.env["PSRING_STALL_S"] = "0.5"
    c.worker("s0")
    c.worker("s1")
    flag = tmp_path / "go"

    def doctor(job: int) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "psring", "doctor", "--store", c.address, "--job", str(job)]
        return run_tree(cmd, timeout=60)

    with c.client() as client:
        job = client.submit("ring", 2, entrypoint="tests.support.jobs.stuck_job:main", args={"flag": str(flag)})
        deadline = time.monotonic() + 30
        report = doctor(job.id)
        while "waits" not in report.stdout and time.monotonic() < deadline:
            time.sleep(0.2)
            report = doctor(job.id)
        assert report.returncode == 1, report.stdout + report.stderr
        assert f"job job{job.id}: stall seen by rank" in report.stdout, report.stdout
        assert re.search(r"waits [\d.]+s in all_reduce\(sum\) #\d+ for rank\(s\) \d", report.stdout), report.stdout
        assert "not in a psring call" in report.stdout, report.stdout
        flag.write_text("go")
        assert job.wait(timeout=60)["sum"] == 2.0
        after = doctor(job.id)
        assert after.returncode == 0 and "nothing is stuck" in after.stdout, after.stdout
