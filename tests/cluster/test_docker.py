"""The repository's docker-compose.yml on a real Docker engine.

Installs nothing: where a Docker engine answers (CI installs docker.io, docker-compose and
debootstrap as root and starts dockerd, best effort), it builds the stand-in base image once
(tests/support/harness/docker_base.sh: no registry is reachable here), builds deploy/Dockerfile as it is,
brings the cluster up under a project name of its own (torn down at the end, volumes included)
and checks what a user would: jobs over both topologies reach the main job's accuracy, status and
doctor, metrics on the declared port, checkpoints in the volume -- and that the cluster heals: the
server daemon's process SIGKILLed (the restart policy brings it back) resumes the job; a worker's
process SIGKILLed restarts the job (--max-restarts). Where no engine answers, it skips saying why.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..rendezvous.test_start import free_port

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]
WORKERS = 4


@contextlib.contextmanager
def _engine_lock() -> Iterator[None]:
    """Held while the compose file's images are built: a file lock every test process on this machine takes
    (the stand-in base images: docker_base.sh takes one of its own)."""
    with open(os.path.join(tempfile.gettempdir(), "psring-test-docker-build.lock"), "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _why_not() -> str | None:
    for tool in ("docker", "docker-compose", "debootstrap"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            return f"{tool} is not installed (apt-get install docker.io docker-compose debootstrap)"
    try:
        info = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"no Docker engine answers: {exc}"
    if info.returncode != 0:
        return f"no Docker engine answers (start dockerd): {info.stderr.strip()[:200]}"
    return None


class Compose:
    """One compose project from the repository's file; every call names the project."""

    def __init__(self, tmp: Path, store: str = "store:29500", profiles: tuple[str, ...] = ()) -> None:
        self.project = f"psrt{uuid.uuid4().hex[:8]}"
        self.store = store  # the store the daemons use (PSRING_COMPOSE_STORE)
        secret = tmp / "psring-secret"
        secret.write_text(uuid.uuid4().hex + "\n")
        self.env = {
            **os.environ,
            "PSRING_STORE_PORT": str(free_port()),
            "PSRING_SECRET_PATH": str(secret),
            "PSRING_COMPOSE_STORE": store,
            "PSRING_PROMETHEUS_PORT": str(free_port()),
            "PSRING_DASHBOARD_PORT": str(free_port()),
        }
        self.base = ["docker-compose", "-f", str(ROOT / "docker-compose.yml"), "-p", self.project]
        for profile in profiles:
            self.base += ["--profile", profile]

    def __call__(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
        # one build at a time on this engine (the suite runs in two processes: test_docker_etcd.py builds the
        # same images): the second finds the first's layers
        with _engine_lock() if args[:1] == ("build",) else contextlib.nullcontext():
            proc = subprocess.run([*self.base, *args], env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(
                f"docker-compose {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}\n"
                f"the daemons' logs, their ends:\n{self.daemon_logs()}"
            )
        return proc

    def daemon_logs(self, lines: int = 40) -> str:
        """The ends of the store's, the server's and the workers' logs (for a failure's message: CI keeps
        nothing else once the project is torn down)."""
        logs = subprocess.run(
            [*self.base, "logs", "--no-color", "--timestamps", "--tail", str(lines), "store", "server", "worker"],
            env=self.env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        return logs.stdout[-12000:] + logs.stderr[-2000:]

    def psring(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
        """A psring command in a one-off container of the submit service (on the cluster's network)."""
        return self("run", "--rm", "-T", "submit", "psring", *args, timeout=timeout, check=check)

    def popen_psring(self, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [*self.base, "run", "--rm", "-T", "submit", "psring", *args],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def status(self) -> dict:
        return _summary(self.psring("status", "--store", self.store, "--json").stdout)

    def pid(self, container: str) -> int:
        out = subprocess.run(
            ["docker", "inspect", "-f", "{{.State.Pid}}", container], capture_output=True, text=True, timeout=30
        )
        return int(out.stdout.strip())

    def container_of(self, daemon_pid_in_record: int, hostname: str) -> str:
        """The container whose hostname a daemon's record names (compose sets it to the container id)."""
        out = subprocess.run(
            ["docker", "ps", "-q", "--no-trunc", "--filter", f"label=com.docker.compose.project={self.project}"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.split()
        for cid in out:
            if cid.startswith(hostname):
                return cid
        raise AssertionError(f"no container of {self.project} has host name {hostname}")


def engine_ready() -> None:
    """Skip, saying why, unless a Docker engine answers and the stand-in base images are built."""
    why = _why_not()
    if why is not None:
        pytest.skip(why)
    base = subprocess.run(  # (one at a time on the machine: the script takes a lock)
        ["bash", str(ROOT / "tests" / "support" / "harness" / "docker_base.sh")],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if base.returncode != 0:
        pytest.skip(f"the stand-in base images cannot be built here: {base.stderr.strip()[-300:]}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Compose]:
    engine_ready()
    compose = Compose(tmp_path_factory.mktemp("compose"))
    try:
        compose("build", timeout=900)
        compose("up", "-d", "--scale", f"worker={WORKERS}", timeout=300)
        deadline = time.monotonic() + 120
        while True:
            status = compose.status()
            idle = [w for w in status["workers"] if w["state"] == "idle"]
            if len(idle) == WORKERS and status["servers"]:
                break
            assert time.monotonic() < deadline, status
            time.sleep(1)
        yield compose
    finally:
        compose("down", "-v", "--remove-orphans", timeout=300, check=False)


def _summary(out: str) -> dict:
    """The job's JSON summary: the last output line that is a JSON object (whatever docker compose or
    the client's log lines put after it, the test still sees the summary, or the output it got)."""
    for line in reversed(out.strip().splitlines()):
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                summary = json.loads(line)
                if isinstance(summary, dict):
                    return summary
    raise AssertionError("no JSON summary in the output; its end:\n" + out[-4000:])


def _submit(cluster: Compose, topology: str, epochs: int, *extra: str) -> dict:
    out = cluster.psring(
        "submit", "--store", cluster.store, "--topology", topology, "--workers", str(WORKERS),
        "--epochs", str(epochs), *extra, "--json",
    ).stdout  # fmt: skip
    return _summary(out)


def test_jobs_status_doctor_metrics_and_checkpoints(cluster: Compose) -> None:
    ring = _submit(cluster, "ring", 20)
    ps = _submit(cluster, "ps", 20)
    for s in (ring, ps):
        assert s["test_accuracy"] >= 0.95 and s["ranks_agree"] and s["workers"] == WORKERS
    assert ring["param_digest"] == ps["param_digest"]  # one canonical order, across containers too
    status = cluster.status()
    assert len(status["workers"]) == WORKERS and len(status["servers"]) == 1
    assert {j["state"] for j in status["jobs"]} == {"done"}
    doctor = cluster.psring("doctor", "--store", "store:29500", check=False)
    assert doctor.returncode == 0 and "no problems found" in doctor.stdout, doctor.stdout + doctor.stderr
    for service in ("server", "worker"):  # Prometheus metrics on the declared port, from inside the network
        fetch = (
            f"import urllib.request as u; print(u.urlopen('http://{service}:9100/metrics', timeout=10).read().decode())"
        )
        metrics = cluster("run", "--rm", "-T", "submit", "python", "-c", fetch).stdout
        assert "psring_" in metrics, metrics[:500]
    ps_job = max(j["id"] for j in status["jobs"] if j["topology"] == "ps")
    listing = cluster(
        "exec", "-T", "server", "ls", "/var/lib/psring/checkpoints", f"/var/lib/psring/checkpoints/job{ps_job}"
    ).stdout
    assert "daemon-id" in listing and re.search(rf"psring-job{ps_job}-shard0-of{WORKERS}\.npz", listing), listing


def test_advise_probes_the_containers_links(cluster: Compose) -> None:
    """psring advise --store from a container: the probe runs as a job on the worker containers
    (each its own host), the model is fitted to what it measured, and the server daemon's container
    counts as a host free for servers (#36)."""
    out = cluster.psring("advise", "--store", cluster.store, "--sizes", "16M", "--json").stdout
    result = _summary(out)
    assert result["measured"]["world"] == WORKERS and len(set(result["measured"]["hosts"])) == WORKERS, result
    assert result["layout"]["hosts"] == WORKERS and result["layout"]["ranks_per_host"] == 1
    assert result["layout"]["server_hosts"] == 1 and "ps dedicated" in result["predicted_s"], result
    assert result["links"]["bandwidth"] > 0 and result["recommended"] in result["predicted_s"]
    assert all(w["state"] == "idle" for w in cluster.status()["workers"])  # an ordinary job, over


def _follow(proc: subprocess.Popen[str], until_step: int) -> tuple[int, list[tuple[float, int, str]]]:
    """Read a submit's progress lines until the step given; returns that step and the lines."""
    lines: list[tuple[float, int, str]] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        m = re.search(r"step (\d+)/", line)
        lines.append((time.monotonic(), int(m[1]) if m else -1, line))
        if m and int(m[1]) >= until_step:
            return int(m[1]), lines
    raise AssertionError("the job ended first:\n" + "".join(t for _w, _s, t in lines))


def test_a_killed_server_daemon_resumes_the_job(cluster: Compose) -> None:
    epochs = 80
    reference = _submit(cluster, "ps", epochs)
    proc = cluster.popen_psring(
        "submit", "--store", "store:29500", "--topology", "ps", "--workers", str(WORKERS), "--epochs", str(epochs),
        "--json",
    )  # fmt: skip
    try:
        at, _ = _follow(proc, 300)
        server = f"{cluster.project}_server_1"
        before = cluster.pid(server)
        os.kill(before, 9)  # a crash: the restart policy brings the container back (docker kill would not)
        killed = time.monotonic()
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    steps = [(line, int(m[1])) for line in out.splitlines() if (m := re.search(r"step (\d+)/", line))]
    assert steps and steps[-1][1] > at, out
    assert proc.returncode == 0, f"submit exited {proc.returncode}:\n{out[-4000:]}\n{cluster.daemon_logs()}"
    summary = _summary(out)
    assert summary["param_digest"] == reference["param_digest"], (summary["param_digest"], reference["param_digest"])
    assert summary["resumed_at"] is None  # the workers never stopped: they re-sent the step in flight
    assert cluster.pid(server) != before  # the same container, a new process
    logs = cluster("logs", "--no-color", "server").stdout
    assert re.search(r"resumed shards \[[\d, ]+\] of job \d+ from their checkpoints", logs), logs[-2000:]
    test_a_killed_server_daemon_resumes_the_job.took = time.monotonic() - killed  # type: ignore[attr-defined]


def test_a_killed_store_costs_no_job(cluster: Compose) -> None:
    """The store's process SIGKILLed mid ps job: the restart policy brings it back with its volume
    (--data-dir), everyone reconnects, the job ends with an uninterrupted run's parameters (#34)."""
    epochs = 80
    reference = _submit(cluster, "ps", epochs)
    jobs_before = {j["id"] for j in cluster.status()["jobs"]}
    proc = cluster.popen_psring(
        "submit", "--store", "store:29500", "--topology", "ps", "--workers", str(WORKERS), "--epochs", str(epochs),
        "--json",
    )  # fmt: skip
    try:
        at, _ = _follow(proc, 300)
        store = f"{cluster.project}_store_1"
        before = cluster.pid(store)
        os.kill(before, 9)
        killed = time.monotonic()
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, f"submit exited {proc.returncode}:\n{out[-4000:]}\n{cluster.daemon_logs()}"
    steps = [int(m[1]) for m in re.finditer(r"step (\d+)/", out)]
    assert steps and steps[-1] > at, out[-2000:]
    assert _summary(out)["param_digest"] == reference["param_digest"]
    assert cluster.pid(store) != before  # the same container, a new process, the same volume
    status = cluster.status()
    assert jobs_before < {j["id"] for j in status["jobs"]}  # the job table survived, the new job in it
    assert [j["state"] for j in status["jobs"] if j["id"] not in jobs_before] == ["done"]
    assert len(status["workers"]) == WORKERS and all(w["state"] == "idle" for w in status["workers"])
    time.sleep(8)  # past LOST_AFTER_S: every daemon still beats through the restarted store
    status = cluster.status()
    assert all(w["state"] == "idle" for w in status["workers"]) and status["servers"], (status, cluster.daemon_logs())
    test_a_killed_store_costs_no_job.took = time.monotonic() - killed  # type: ignore[attr-defined]


def test_a_killed_worker_restarts_the_job_from_its_checkpoint(cluster: Compose) -> None:
    epochs = 80
    reference = _submit(cluster, "ring", epochs)
    proc = cluster.popen_psring(
        "submit", "--store", "store:29500", "--topology", "ring", "--workers", str(WORKERS), "--epochs", str(epochs),
        "--max-restarts", "1", "--json",
    )  # fmt: skip
    try:
        _follow(proc, 300)
        busy = [w for w in cluster.status()["workers"] if w["state"] == "busy"]
        victim = busy[1]
        os.kill(cluster.pid(cluster.container_of(victim["pid"], victim["hostname"])), 9)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out + cluster.daemon_logs()
    assert re.search(
        rf"worker daemon {re.escape(victim['id'])} \(rank \d\) (was lost|stopped heartbeating).*restarting", out
    ), out
    summary = _summary(out)
    assert summary["param_digest"] == reference["param_digest"] and summary["resumed_at"] is not None
    status = cluster.status()
    assert {w["id"]: w["state"] for w in status["workers"]}[victim["id"]] == "lost"
    assert len([w for w in status["workers"] if w["state"] == "idle"]) == WORKERS  # the restarted one too


@pytest.mark.parametrize("topology", ["ring", "ps"])
def test_an_elastic_job_goes_on_without_a_killed_worker_container(cluster: Compose, topology: str) -> None:
    """submit --elastic: a worker container SIGKILLed mid-job (its restart policy starts it again,
    idle): the others train on -- over the ring the survivors re-form, over ps the server container's
    shards hold the model -- and the job ends well, saying which rank left."""
    proc = cluster.popen_psring(
        "submit", "--store", "store:29500", "--topology", topology, "--workers", str(WORKERS), "--epochs", "80",
        "--elastic", "--json",
    )  # fmt: skip
    try:
        _follow(proc, 300)
        status = cluster.status()
        [job] = [j for j in status["jobs"] if j["state"] == "running"]
        victim = next(w for w in status["workers"] if w["id"] == job["workers"][1])  # rank 1's daemon
        os.kill(cluster.pid(cluster.container_of(victim["pid"], victim["hostname"])), 9)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out + cluster.daemon_logs()
    summary = _summary(out)
    assert summary["elastic"] == {"departed": [1], "joined": []} and summary["workers"] == WORKERS - 1, summary
    assert summary["ranks_agree"] and summary["test_accuracy"] >= 0.95, summary
    assert [j["state"] for j in cluster.status()["jobs"] if j["id"] == job["id"]] == ["done"]


def test_cross_container_benchmark_short_form(cluster: Compose) -> None:
    """benchmarks/containers.py, short: it runs ranks in containers and reports sane figures."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "containers.py"), "--workers", "2", "--size", "1M", "--iters",
         "2", "--rounds", "1", "--backends", "ring,ps", "--json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {(r["workers"], r["backend"]) for r in rows} == {(2, "ring"), (2, "ps")}
    assert all(r["time_ms"] > 0 and r["busbw_GBps"] > 0 for r in rows)


def test_the_monitoring_and_dashboard_profiles_see_every_daemon(cluster: Compose) -> None:
    """Prometheus (deploy/prometheus, built from Debian's package) finds the server daemon and every
    worker replica through Docker's DNS and scrapes them; the dashboard container serves the page,
    asks for its token, and lists the daemons (#40)."""
    import urllib.error
    import urllib.parse
    import urllib.request

    try:
        cluster("up", "-d", "prometheus", "dashboard", timeout=600)
        base = f"http://127.0.0.1:{cluster.env['PSRING_PROMETHEUS_PORT']}"
        deadline = time.monotonic() + 120
        up: list[dict] = []  # type: ignore[type-arg]
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": "up == 1"})
                with urllib.request.urlopen(url, timeout=10) as resp:
                    up = json.loads(resp.read())["data"]["result"]
                if sorted(r["metric"]["job"] for r in up) == ["psring-server"] + ["psring-worker"] * WORKERS:
                    break
            time.sleep(2)
        assert sorted(r["metric"]["job"] for r in up) == ["psring-server"] + ["psring-worker"] * WORKERS, up
        page = f"http://127.0.0.1:{cluster.env['PSRING_DASHBOARD_PORT']}/api/status"
        with pytest.raises(urllib.error.HTTPError) as denied:
            urllib.request.urlopen(page, timeout=10)
        assert denied.value.code == 401  # it listens on the container's network: it wants the token
        denied.value.close()
        logs = cluster("logs", "--no-color", "dashboard").stdout
        token = re.search(r"\?token=(\S+)", logs)
        assert token, logs[-2000:]
        with urllib.request.urlopen(f"{page}?token={token[1]}", timeout=10) as resp:
            snapshot = json.loads(resp.read())
        live = [w for w in snapshot["workers"] if w["state"] != "lost"]  # a killed worker's old record shows lost
        assert len(live) == WORKERS and len(snapshot["servers"]) == 1, (snapshot, cluster.daemon_logs())
    finally:
        cluster("rm", "-s", "-f", "prometheus", "dashboard", timeout=120, check=False)
