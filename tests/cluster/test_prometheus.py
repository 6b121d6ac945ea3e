"""deploy/prometheus/prometheus.yml's scrape jobs on a real Prometheus (Debian's ``prometheus``)
against a live local cluster (#40): it scrapes the daemons of a running job, a PromQL query returns
the job's step counter as it grows, a stuck job's stall is counted, and every query of the Grafana
dashboard (deploy/grafana/psring.json) evaluates. Skips, saying why, without the binary."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from ..conftest import end, until
from .test_cluster import Cluster

yaml = pytest.importorskip("yaml", reason="pyyaml is not installed (it is in the dev extra)")
pytest.importorskip("prometheus_client", reason="prometheus-client is not installed (it is in the dev extra)")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def query(base: str, expr: str) -> list[dict[str, Any]]:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=10) as resp:
        answer = json.loads(resp.read())
    assert answer["status"] == "success", (expr, answer)
    return answer["data"]["result"]


def test_prometheus_scrapes_the_daemons_and_the_grafana_queries_evaluate(tmp_path: Path) -> None:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("no prometheus here (apt-get install prometheus)")
    c = Cluster(tmp_path)
    c.env["PSRING_STALL_S"] = "0.5"
    prom = None
    try:
        c.worker("m0", "--metrics-port", "0")
        c.worker("m1", "--metrics-port", "0")
        c.spawn_server_daemon("s0", "--metrics-port", "0")
        with c.client() as client:
            status = client.status()
            targets = {
                "psring-worker": [f"127.0.0.1:{w['metrics_port']}" for w in status["workers"]],
                "psring-server": [f"127.0.0.1:{s['metrics_port']}" for s in status["servers"]],
            }
            config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
            assert sorted(j["job_name"] for j in config["scrape_configs"]) == sorted(targets)
            for job in config["scrape_configs"]:  # the shipped jobs; Docker's DNS names swapped for loopback
                assert job["dns_sd_configs"][0]["port"] == 9100  # the daemons' --metrics-port in compose
                del job["dns_sd_configs"]
                job["static_configs"] = [{"targets": targets[job["job_name"]]}]
            config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
            (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
            port = free_port()
            prom = subprocess.Popen(
                [binary, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{port}"],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )  # fmt: skip
            base = f"http://127.0.0.1:{port}"

            def ready() -> bool:
                try:
                    with urllib.request.urlopen(f"{base}/-/ready", timeout=5) as resp:
                        return resp.status == 200
                except OSError:
                    assert prom is not None and prom.poll() is None, end(prom)  # type: ignore[arg-type]
                    return False

            until("prometheus ready", ready)
            up = until("every daemon scraped", lambda: (
                len(r := query(base, "up == 1")) == 3 and r), timeout=60)  # fmt: skip
            assert {r["metric"]["job"] for r in up} == {"psring-worker", "psring-server"}
            # a stuck job: the stall inspector's verdict is counted
            flag = tmp_path / "go"
            stuck = client.submit("ring", 2, entrypoint="tests.support.jobs.stuck_job:main", args={"flag": str(flag)})
            until("a stall counted", lambda: query(base, 'sum(psring_stalls_total{verdict="stall"}) > 0'))
            flag.write_text("go")
            assert stuck.wait(timeout=60)["sum"] == 2.0
            # a running main job: its step counter, per daemon, growing
            client.submit("ring", 2, train={"epochs": 400})  # ended with the daemons
            first = until("the step counter", lambda: (
                (r := query(base, "sum(psring_steps_total)")) and float(r[0]["value"][1]) > 0 and r))  # fmt: skip
            seen = float(first[0]["value"][1])
            steps = "sum(psring_steps_total)"
            until("the step counter growing", lambda: float(query(base, steps)[0]["value"][1]) > seen)
            running = query(base, "psring_job > 0")
            assert {r["metric"]["job"] for r in running} == {"psring-worker"} and len(running) == 2, running
            board = json.loads((ROOT / "deploy" / "grafana" / "psring.json").read_text())
            exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
            assert len(exprs) >= 10
            for expr in exprs:  # each evaluates (status success); the step-time ones have data now
                query(base, expr)
            for expr in ("psring_step_compute_seconds", "sum by (instance) (rate(psring_steps_total[1m]))"):
                until(f"data for {expr}", lambda expr=expr: query(base, expr))  # a rate needs two scrapes
    finally:
        if prom is not None:
            end(prom)  # type: ignore[arg-type]
        c.close()
