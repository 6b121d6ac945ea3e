"""Prometheus metrics of a daemon: collectives, bytes, jobs, restarts, steps and their compute and
communication time (``prometheus-client``, optional)."""

from __future__ import annotations

from typing import Any

from ..topology.recorder import OBSERVERS
from ..topology.stall import STALL_OBSERVERS


class Metrics:
    """Prometheus metrics of one process, served on ``port`` (0: an ephemeral port)."""

    def __init__(self, port: int, role: str, host: str = "0.0.0.0") -> None:
        try:
            import prometheus_client as prom
        except ImportError:
            raise RuntimeError("--metrics-port needs prometheus-client: pip install prometheus-client") from None
        self.registry = prom.CollectorRegistry()
        labels = ["role"]
        self.role = role
        self.collectives = prom.Histogram(
            "psring_collective_seconds",
            "Time of one collective, by kind",
            ["role", "kind"],
            registry=self.registry,
            buckets=(1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0),
        )
        self.payload = prom.Counter(
            "psring_collective_bytes", "Tensor bytes passed to collectives", ["role", "kind"], registry=self.registry
        )
        self.errors = prom.Counter(
            "psring_errors", "Failed collectives and jobs", ["role", "what"], registry=self.registry
        )
        self.steps = prom.Counter("psring_steps", "Training steps taken", labels, registry=self.registry)
        self.sent = prom.Counter(
            "psring_bytes_sent", "Bytes sent on psring connections", labels, registry=self.registry
        )
        self.received = prom.Counter(
            "psring_bytes_received", "Bytes received on psring connections", labels, registry=self.registry
        )
        self.jobs = prom.Counter("psring_jobs", "Jobs run, by outcome", ["role", "outcome"], registry=self.registry)
        self.restarts = prom.Counter(
            "psring_job_restarts", "Attempts of a job after its first that this daemon ran", labels,
            registry=self.registry,
        )  # fmt: skip
        self.compute = prom.Gauge(
            "psring_step_compute_seconds", "Seconds per step computing, over this rank's recent steps", labels,
            registry=self.registry,
        )  # fmt: skip
        self.comm = prom.Gauge(
            "psring_step_comm_seconds", "Seconds per step in the exchange, over this rank's recent steps", labels,
            registry=self.registry,
        )  # fmt: skip
        self.job = prom.Gauge("psring_job", "The job this daemon runs now (0: none)", labels, registry=self.registry)
        self.stalls = prom.Counter(
            "psring_stalls", "Stall inspector verdicts reached in this process", ["role", "verdict"],
            registry=self.registry,
        )  # fmt: skip
        self.server, self.thread = prom.start_http_server(port, addr=host, registry=self.registry)
        self.port = int(self.server.server_address[1])
        OBSERVERS.append(self)
        STALL_OBSERVERS.append(self.on_stall)

    def __call__(self, record: dict[str, Any]) -> None:
        kind = record["kind"]
        self.collectives.labels(self.role, kind).observe(max(record["end"] - record["start"], 0.0))
        self.payload.labels(self.role, kind).inc(record.get("bytes", 0))
        if not record.get("ok", True):
            self.errors.labels(self.role, "collective").inc()

    def on_stall(self, verdict: str) -> None:
        self.stalls.labels(self.role, verdict).inc()

    def add_traffic(self, sent: int, received: int) -> None:
        self.sent.labels(self.role).inc(max(sent, 0))
        self.received.labels(self.role).inc(max(received, 0))

    def close(self) -> None:
        if self in OBSERVERS:
            OBSERVERS.remove(self)
        if self.on_stall in STALL_OBSERVERS:
            STALL_OBSERVERS.remove(self.on_stall)
        self.server.shutdown()
        self.server.server_close()
