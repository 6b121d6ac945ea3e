"""docker-compose.yml without Docker: each service in its own network namespace, then a job.

Every service's command runs, with its environment, as a process in a namespace of its own
(one address each on a bridge that lives in a namespace too, names resolved through
/etc/netns/NAME/hosts), so the processes talk across distinct addresses as on separate hosts.
Also: the Kubernetes manifests parse and agree with the compose file and the code.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid

import pytest

from tests.support.harness.netns import NetnsCluster, netns_available

yaml = pytest.importorskip("yaml", reason="pyyaml is not installed (it is in the dev extra)")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def interpolate(value: str) -> str:
    """Compose's ``${VAR:-default}``, with the default (the file's own store unless one is chosen)."""
    return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: m[2], value)


def service_command(service: dict, tmp) -> tuple[list[str], dict[str, str]]:
    """The compose service's command and environment, with container paths mapped into tmp."""
    cmd = [interpolate(str(c)) for c in service["command"]]
    assert cmd[0] == "psring"
    cmd = [sys.executable, "-m", "psring", *cmd[1:]]
    cmd = [c.replace("/var/lib/psring", str(tmp / "var")) for c in cmd]
    env = {k: str(v) for k, v in (service.get("environment") or {}).items()}
    env["PSRING_SECRET_FILE"] = str(tmp / "psring-secret")
    env["PYTHONPATH"] = ROOT
    env["PYTHONUNBUFFERED"] = "1"
    return cmd, env


def wait_for_line(proc: subprocess.Popen[str], text: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        seen.append(line)
        if text in line:
            return line
    raise AssertionError(f"{text!r} never appeared: {''.join(seen)[-2000:]}")


def test_compose_services_train_across_namespaces(tmp_path) -> None:
    why = netns_available()
    if why:
        pytest.skip(why)
    with open(os.path.join(ROOT, "docker-compose.yml")) as fh:
        compose = yaml.safe_load(fh)
    services = compose["services"]
    assert {"store", "server", "worker", "submit"} <= set(services)
    replicas = services["worker"].get("deploy", {}).get("replicas", 1)
    assert replicas >= 2
    (tmp_path / "psring-secret").write_text(uuid.uuid4().hex + "\n")
    cluster = NetnsCluster(uuid.uuid4().hex[:5])
    try:
        names = ["store", "server"] + [f"worker-{i + 1}" for i in range(replicas)] + ["submit"]
        for name in names:
            cluster.host(name)
        cluster.write_hosts()
        store_cmd, env = service_command(services["store"], tmp_path)
        store = cluster.run("store", store_cmd, env)
        wait_for_line(store, "listening on")
        server_cmd, env = service_command(services["server"], tmp_path)
        wait_for_line(cluster.run("server", server_cmd, env), "ready for ps jobs")
        workers = []
        worker_cmd, env = service_command(services["worker"], tmp_path)
        for i in range(replicas):
            workers.append(cluster.run(f"worker-{i + 1}", worker_cmd, env))
        for i, w in enumerate(workers):
            line = wait_for_line(w, "ready on")
            assert f"ready on {cluster.addresses[f'worker-{i + 1}']}:29600" in line  # its own address, not loopback
        submit_cmd, env = service_command(services["submit"], tmp_path)
        for extra in (["--epochs", "3"], ["--epochs", "3", "--topology", "ps"]):
            proc = cluster.run("submit", submit_cmd + extra, env)
            out = proc.communicate(timeout=180)[0]
            assert proc.returncode == 0, out
            accuracy = float(out.split("test accuracy")[1].split()[0])
            assert accuracy >= 0.85, out
            assert "ranks bit-identical True" in out
        status = cluster.run("submit", [*submit_cmd[:3], "status", "--store", "store:29500", "--json"], env)
        out = status.communicate(timeout=60)[0]
        assert status.returncode == 0, out
        import json

        state = json.loads(out.strip().splitlines()[-1])
        assert sorted(w["host"] for w in state["workers"]) == sorted(
            cluster.addresses[f"worker-{i + 1}"] for i in range(replicas)
        )
        assert [s["host"] for s in state["servers"]] == [cluster.addresses["server"]]
        assert [j["state"] for j in state["jobs"]] == ["done", "done"]
        # the ps job's shards ran on the server daemon and checkpointed into its volume
        assert os.listdir(tmp_path / "var" / "checkpoints" / "job2")
        doctor = cluster.run("submit", [*submit_cmd[:3], "doctor", "--store", "store:29500"], env)
        out = doctor.communicate(timeout=60)[0]
        assert doctor.returncode == 0 and "no problems found" in out, out
    finally:
        cluster.close()


def test_kubernetes_manifests_agree_with_compose_and_code(monkeypatch: pytest.MonkeyPatch) -> None:
    with open(os.path.join(ROOT, "deploy", "k8s", "psring.yaml")) as fh:
        docs = [d for d in yaml.safe_load_all(fh) if d]
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert set(by) == {
        ("Service", "psring-store"),
        ("StatefulSet", "psring-store"),
        ("Service", "psring-server"),
        ("StatefulSet", "psring-server"),
        ("Deployment", "psring-worker"),
        ("Service", "psring-dashboard"),
        ("Deployment", "psring-dashboard"),
    }
    store_port = by["Service", "psring-store"]["spec"]["ports"][0]["port"]

    def container(kind: str, name: str) -> dict:
        return by[kind, name]["spec"]["template"]["spec"]["containers"][0]

    store = container("StatefulSet", "psring-store")
    assert store["command"][:2] == ["psring", "store"]
    # the store's keys live on a volume of its own: a restarted store has them back
    data_dir = store["command"][store["command"].index("--data-dir") + 1]
    [mount] = [m for m in store["volumeMounts"] if m["mountPath"] == data_dir]
    claims = {c["metadata"]["name"] for c in by["StatefulSet", "psring-store"]["spec"]["volumeClaimTemplates"]}
    assert mount["name"] in claims
    assert store["command"][store["command"].index("--port") + 1] == str(store_port)
    assert store["ports"][0]["containerPort"] == store_port
    assert by["StatefulSet", "psring-server"]["spec"]["serviceName"] == "psring-server"
    for kind, name, role in (("StatefulSet", "psring-server", "server"), ("Deployment", "psring-worker", "worker")):
        c = container(kind, name)
        cmd = c["command"]
        assert cmd[1] == role
        declared = int(cmd[cmd.index("--port") + 1])
        assert declared in [p["containerPort"] for p in c["ports"]]
        env = {e["name"]: e for e in c["env"]}
        assert "--store" not in cmd and env["PSRING_STORE"]["value"] == f"psring-store:{store_port}"
        assert env["PSRING_SECRET"]["valueFrom"]["secretKeyRef"]["name"] == "psring-secret"
        assert env["PSRING_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        labels = by[kind, name]["spec"]["template"]["metadata"]["labels"]
        assert labels == by[kind, name]["spec"]["selector"]["matchLabels"]
    dash = container("Deployment", "psring-dashboard")
    assert dash["command"][:2] == ["psring", "dashboard"] and "--expose" in dash["command"]  # a token, then
    dash_port = int(dash["command"][dash["command"].index("--port") + 1])
    assert by["Service", "psring-dashboard"]["spec"]["ports"][0]["targetPort"] == dash_port
    assert {e["name"] for e in dash["env"]} >= {"PSRING_STORE", "PSRING_SECRET"}
    server_svc_ports = {p["port"] for p in by["Service", "psring-server"]["spec"]["ports"]}
    assert {p["containerPort"] for p in container("StatefulSet", "psring-server")["ports"]} == server_svc_ports
    # every command line parses with psring's own CLI (the pods' store comes from PSRING_STORE)
    from psring.cli import build_parser

    monkeypatch.setenv("PSRING_STORE", f"psring-store:{store_port}")
    parser = build_parser()
    with open(os.path.join(ROOT, "docker-compose.yml")) as fh:
        compose = yaml.safe_load(fh)
    commands = [container(k, n)["command"] for k, n in by if k != "Service"]
    psring_services = {n: s for n, s in compose["services"].items() if s.get("image") == "psring:latest"}
    assert {"store", "server", "worker", "submit", "dashboard"} <= set(psring_services)
    commands += [s["command"] for s in psring_services.values()]
    for cmd in commands:
        args = parser.parse_args([interpolate(str(c)) for c in cmd[1:]])
        assert callable(args.func)
    # the daemons and submit use one store, psring's own unless PSRING_COMPOSE_STORE names another
    for name in ("server", "worker", "submit"):
        cmd = compose["services"][name]["command"]
        assert cmd[cmd.index("--store") + 1] == "${PSRING_COMPOSE_STORE:-store:29500}", name
    # the etcd profile: three members that name each other, each with a volume; its address parses
    etcd = {n: s for n, s in compose["services"].items() if "etcd" in s.get("profiles", [])}
    assert sorted(etcd) == ["etcd0", "etcd1", "etcd2"]
    cluster = dict(kv.split("=", 1) for kv in etcd["etcd0"]["environment"]["ETCD_INITIAL_CLUSTER"].split(","))
    for name, service in etcd.items():
        cmd = service["command"]
        assert cmd[cmd.index("--name") + 1] == name
        assert cmd[cmd.index("--initial-advertise-peer-urls") + 1] == cluster[name] == f"http://{name}:2380"
        assert any(v.split(":")[1] == service["environment"]["ETCD_DATA_DIR"] for v in service["volumes"])
    from psring.rendezvous.client import parse_store_address

    address = parse_store_address("etcd://" + ",".join(f"{n}:2379" for n in sorted(etcd)))
    assert address.scheme == "etcd"
    # the etcd option: three members that name each other through the headless Service
    with open(os.path.join(ROOT, "deploy", "k8s", "etcd.yaml")) as fh:
        etcd_docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(fh) if d}
    assert set(etcd_docs) == {("Service", "psring-etcd"), ("StatefulSet", "psring-etcd")}
    sts = etcd_docs["StatefulSet", "psring-etcd"]["spec"]
    assert sts["serviceName"] == "psring-etcd" and etcd_docs["Service", "psring-etcd"]["spec"]["clusterIP"] == "None"
    members = [f"psring-etcd-{i}" for i in range(sts["replicas"])]
    member_env = {e["name"]: e.get("value") for e in sts["template"]["spec"]["containers"][0]["env"]}
    assert member_env["ETCD_INITIAL_CLUSTER"] == ",".join(f"{m}=http://{m}.psring-etcd:2380" for m in members)
    mount = sts["template"]["spec"]["containers"][0]["volumeMounts"][0]
    assert mount["mountPath"] == member_env["ETCD_DATA_DIR"]
    assert mount["name"] in {c["metadata"]["name"] for c in sts["volumeClaimTemplates"]}
    with open(os.path.join(ROOT, "deploy", "k8s", "etcd.yaml")) as fh:
        said = re.search(r"PSRING_STORE=(etcd://\S+)", fh.read())
    assert said and said[1] == "etcd://" + ",".join(f"{m}.psring-etcd:2379" for m in members)
    compose_store = compose["services"]["store"]["command"]
    assert compose_store[compose_store.index("--port") + 1] == str(store_port)
    data_dir = compose_store[compose_store.index("--data-dir") + 1]  # on a volume of its own
    assert any(v.split(":")[1] == data_dir for v in compose["services"]["store"]["volumes"])
