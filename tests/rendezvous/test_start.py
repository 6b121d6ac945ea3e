"""Starting a job the ways people start jobs: plain processes with MASTER_ADDR in any form, torchrun
(one and several nodes, static and c10d rendezvous), psring launch on several nodes (on one machine,
and across network namespaces that know each other by host name), Kubernetes' environments.

Every run is the same user script (tests/support/jobs/check_job.py), whose every rank must report the right
sum and broadcast; processes are started in sessions of their own and ended by process group.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..support.harness.netns import NetnsCluster, netns_available

JOBS = Path(__file__).resolve().parents[1] / "support" / "jobs"
CHECK = str(JOBS / "check_job.py")
FAIL = str(JOBS / "fail_job.py")
ROOT = str(Path(__file__).resolve().parents[2])

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_all(cmds: list[list[str]], envs: list[dict[str, str]], timeout: float = 120) -> list[tuple[int, str]]:
    """Start every command in a session of its own, wait for all, kill what is left by process group."""
    procs = [
        subprocess.Popen(
            cmd,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        for cmd, env in zip(cmds, envs, strict=True)
    ]
    deadline = time.monotonic() + timeout
    out = []
    try:
        for proc in procs:
            try:
                text, _ = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                text = ""
            out.append((proc.returncode if proc.returncode is not None else -999, text or ""))
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            if proc.returncode is None:
                proc.communicate(timeout=30)
    return out


def results(outputs: list[tuple[int, str]]) -> dict[int, tuple[int, str, float, float, float]]:
    """rank -> (world, topology, sum, broadcast, seconds to the first collective), from RESULT lines."""
    found = {}
    for _code, text in outputs:
        for m in re.finditer(r"RESULT (\d+) (\d+) (ring|ps) (-?\d+(?:\.\d+)?) (-?\d+(?:\.\d+)?) (\d+\.\d{3})", text):
            found[int(m[1])] = (int(m[2]), m[3], float(m[4]), float(m[5]), float(m[6]))
    return found


def check(outputs: list[tuple[int, str]], world: int, topology: str) -> None:
    got = results(outputs)
    everything = "\n".join(text for _c, text in outputs)
    assert all(code == 0 for code, _ in outputs), everything
    assert sorted(got) == list(range(world)), everything
    for rank, (w, topo, total, bcast, _s) in got.items():
        assert (w, topo) == (world, topology), (rank, everything)
        assert total == world * (world + 1) / 2 and bcast == (world - 1) * 10.0, (rank, everything)


# ---------------------------------------------------------------- plain processes
@pytest.mark.parametrize("topology", ["ring", "ps"])
@pytest.mark.parametrize("master", ["hostname", "localhost", "127.0.0.1"])
def test_processes_meet_at_master_addr_in_any_form(master: str, topology: str) -> None:
    """RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set by hand (Slurm scripts, Kubernetes): rank 0
    serves the store whatever form MASTER_ADDR takes, as TCPStore's is_master does."""
    addr = socket.gethostname() if master == "hostname" else master
    port = free_port()
    envs = [
        {"RANK": str(r), "WORLD_SIZE": "3", "MASTER_ADDR": addr, "MASTER_PORT": str(port), "PSRING_TOPOLOGY": topology}
        for r in range(3)
    ]
    check(run_all([[sys.executable, CHECK, "30"]] * 3, envs), 3, topology)


def test_ipv6_master_addr() -> None:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    port = free_port()
    envs = [{"RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "::1", "MASTER_PORT": str(port)} for r in range(2)]
    check(run_all([[sys.executable, CHECK, "30"]] * 2, envs), 2, "ring")


def test_a_rank_that_cannot_reach_the_store_says_so_within_its_timeout() -> None:
    port = free_port()  # nobody serves it, and rank 1 does not serve stores
    t0 = time.monotonic()
    [(code, text)] = run_all(
        [[sys.executable, CHECK, "3"]],
        [{"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}],
    )
    assert code != 0 and time.monotonic() - t0 < 20
    assert f"cannot reach the rendezvous store at 127.0.0.1:{port} within 3s" in text, text
    [(code, text)] = run_all(
        [[sys.executable, CHECK, "3"]],
        [{"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "no-such-host.invalid", "MASTER_PORT": str(port)}],
    )
    assert code != 0 and "no-such-host.invalid" in text, text


def test_something_else_at_master_port_is_named_not_waited_on() -> None:
    with socket.socket() as other:  # a service that accepts and never answers (as torch's TCPStore would)
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        t0 = time.monotonic()
        [(code, text)] = run_all(
            [[sys.executable, CHECK, "60"]],
            [{"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}],
        )
    assert code != 0 and time.monotonic() - t0 < 40, text
    assert "did not answer as a psring store" in text, text


# ------------------------------------------------------------------------- torchrun
def _torchrun() -> str:
    pytest.importorskip("torch", reason="torchrun comes with torch (not installed here)")
    exe = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    if not os.path.exists(exe):
        pytest.skip("torch is installed but its torchrun command is not on PATH")
    return exe


@pytest.mark.parametrize("topology", ["ring", "ps"])
def test_torchrun_one_node(topology: str) -> None:
    out = run_all([[_torchrun(), "--nproc-per-node", "2", CHECK, "60"]], [{"PSRING_TOPOLOGY": topology}])
    check(out, 2, topology)


@pytest.mark.parametrize("rdzv, topology", [("static", "ring"), ("c10d", "ps")])
def test_torchrun_two_nodes(rdzv: str, topology: str) -> None:
    torchrun, port = _torchrun(), free_port()
    if rdzv == "static":
        node = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
        cmds = [[torchrun, *node, "--node-rank", str(i), "--nproc-per-node", "2", CHECK, "60"] for i in range(2)]
    else:
        node = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "j1"]
        cmds = [[torchrun, *node, "--nproc-per-node", "2", CHECK, "60"] for _ in range(2)]
    check(run_all(cmds, [{"PSRING_TOPOLOGY": topology}] * 2, timeout=180), 4, topology)


# --------------------------------------------------------------- psring launch, nodes
@pytest.mark.parametrize("topology", ["ring", "ps"])
def test_launch_two_nodes_on_one_machine(topology: str) -> None:
    port = free_port()
    cmds = [
        [sys.executable, "-m", "psring", "launch", "--nnodes", "2", "--node-rank", str(i), "--master-addr",
         "127.0.0.1", "--master-port", str(port), "-n", "2", "--topology", topology, "--", sys.executable, CHECK, "60"]
        for i in (1, 0)  # node 1 first: it waits for node 0's store
    ]  # fmt: skip
    out = run_all(cmds, [{}, {}])
    check(out, 4, topology)
    assert all(re.search(rf"^\[rank {r}\] RESULT", text, re.M) for r, (_c, text) in zip((2, 0), out, strict=True))


def test_a_failing_rank_on_one_node_ends_the_job_on_every_node() -> None:
    port = free_port()
    cmds = [
        [sys.executable, "-m", "psring", "launch", "--nnodes", "2", "--node-rank", str(i), "--master-addr",
         "127.0.0.1", "--master-port", str(port), "-n", "2", "--", sys.executable, FAIL]
        for i in (0, 1)
    ]  # fmt: skip
    t0 = time.monotonic()
    out = run_all(cmds, [{"FAIL_RANK": "3", "FAIL_AFTER": "2"}] * 2, timeout=60)
    took = time.monotonic() - t0
    assert [code for code, _ in out] == [1, 3], out  # node 0: failed elsewhere; node 1: rank 3's own code
    assert "rank 3 on node 1 exited with code 3" in out[0][1] and took < 15, (took, out)
    pids = [int(p) for _c, text in out for p in re.findall(r"STARTED \d+ (\d+)", text)]
    assert len(pids) == 4
    for pid in pids:  # every rank of every node was ended
        assert not os.path.exists(f"/proc/{pid}") or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_launch_refuses_a_node_rank_out_of_range_and_a_missing_master() -> None:
    for args, message in (
        (["--nnodes", "2", "--node-rank", "2", "--master-addr", "127.0.0.1", "--master-port", "1"], "--node-rank 2"),
        (["--nnodes", "2", "--node-rank", "1"], "needs --master-addr and --master-port"),
        (["--elastic", "--max-restarts", "1"], "--elastic goes on without a failed rank"),
    ):
        [(code, text)] = run_all([[sys.executable, "-m", "psring", "launch", *args, "-n", "1", "--", "true"]], [{}])
        assert code == 2 and message in text, text


# -------------------------------------------------- hosts known by name (namespaces)
@pytest.fixture
def hosts():
    why = netns_available()
    if why is not None:
        pytest.skip(f"needs network namespaces: {why}")
    cluster = NetnsCluster(f"st{os.getpid() % 10000}")
    try:
        yield cluster
    finally:
        cluster.close()


def _python_env() -> dict[str, str]:
    return {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": ROOT, "PYTHONUNBUFFERED": "1", "HOME": "/tmp"}


@pytest.mark.parametrize("topology", ["ring", "ps"])
def test_launch_across_hosts_known_by_name(hosts: NetnsCluster, topology: str) -> None:
    for name in ("node-a", "node-b"):
        hosts.host(name)
    hosts.write_hosts()
    port = 29400 + os.getpid() % 500
    procs = [
        hosts.run(name, [sys.executable, "-m", "psring", "launch", "--nnodes", "2", "--node-rank", str(i),
                         "--master-addr", "node-a", "--master-port", str(port), "-n", "2", "--topology", topology,
                         "--", sys.executable, CHECK, "60"], _python_env())
        for i, name in enumerate(("node-a", "node-b"))
    ]  # fmt: skip
    out = [(p.wait(timeout=150), p.stdout.read()) for p in procs]  # type: ignore[union-attr]
    check(out, 4, topology)


@pytest.mark.parametrize("flavour", ["statefulset", "indexed-job", "pytorchjob"])
def test_kubernetes_environments(hosts: NetnsCluster, flavour: str) -> None:
    """The env a StatefulSet (pod ordinal from the host name), an Indexed Job (JOB_COMPLETION_INDEX)
    and Kubeflow's PyTorchJob (RANK) give a pod, rank 0's address a service name in the hosts file."""
    pods = ["psring-0", "psring-1"]
    for pod in pods:
        hosts.host(pod)
    hosts.write_hosts(aliases={"psring-0.psring": "psring-0", "psring-master": "psring-0"})
    port = 29400 + os.getpid() % 500
    master = "psring-master" if flavour == "pytorchjob" else "psring-0.psring"
    procs = []
    for r, pod in enumerate(pods):
        env = {**_python_env(), "MASTER_ADDR": master, "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
        if flavour == "statefulset":
            env.update(KUBERNETES_SERVICE_HOST="10.96.0.1", HOSTNAME=pod)
        elif flavour == "indexed-job":
            env.update(JOB_COMPLETION_INDEX=str(r))
        else:
            env.update(RANK=str(r))
        procs.append(hosts.run(pod, [sys.executable, CHECK, "60"], env))
    out = [(p.wait(timeout=120), p.stdout.read()) for p in procs]  # type: ignore[union-attr]
    check(out, 2, "ring")


def test_a_file_store_shared_by_hosts(hosts: NetnsCluster, tmp_path: Path) -> None:
    """store=file:///shared/dir across hosts: each rank advertises its routed address, not loopback."""
    for name in ("node-a", "node-b"):
        hosts.host(name)
    hosts.write_hosts()
    shared = tmp_path / "rendezvous"
    shared.mkdir()
    procs = [
        hosts.run(
            name,
            [sys.executable, CHECK, "60"],
            {**_python_env(), "RANK": str(r), "WORLD_SIZE": "2", "PSRING_STORE": f"file://{shared}"},
        )
        for r, name in enumerate(("node-a", "node-b"))
    ]
    out = [(p.wait(timeout=120), p.stdout.read()) for p in procs]  # type: ignore[union-attr]
    check(out, 2, "ring")
    addresses = [path.read_text() for path in shared.iterdir() if "addr" in path.name]
    assert addresses and all(a.startswith("10.213.") for a in addresses), addresses


def test_server_flags_work_or_are_refused(tmp_path: Path) -> None:
    from psring.rendezvous.store import start_store  # noqa: F401  (the store runs as a process below)

    store = subprocess.Popen(
        [sys.executable, "-m", "psring", "store", "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        port = re.search(r":(\d+)", store.stdout.readline())[1]  # type: ignore[index, union-attr]
        [(code, text)] = run_all(
            [[sys.executable, "-m", "psring", "server", "--store", f"127.0.0.1:{port}", "--metrics-port", "9"]], [{}]
        )
        assert code == 2 and "--metrics-port applies to a server daemon (--cluster)" in text, text
        server = subprocess.Popen(
            [sys.executable, "-m", "psring", "server", "--store", f"127.0.0.1:{port}", "--host", "127.0.0.1",
             "--advertise", "127.0.0.7"],
            stdout=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        try:
            line = server.stdout.readline()  # type: ignore[union-attr]
            assert " on 127.0.0.7:" in line, line  # registered under the address it was told to advertise
        finally:
            os.killpg(server.pid, signal.SIGKILL)
            server.communicate(timeout=30)
    finally:
        os.killpg(store.pid, signal.SIGKILL)
        store.communicate(timeout=30)
