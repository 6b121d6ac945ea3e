"""Seeing what happens: a per-collective flight recorder, Prometheus metrics, Chrome traces.

- :class:`FlightRecorder` appends one JSON line per collective (seq, rank, kind, bytes,
  start, end, ok, error, ...) to ``DIR/<job>-rank<r>-<pid>.jsonl``. ``PSRING_TRACE_DIR``
  turns it on for any process that calls ``init_group``; ``psring worker --trace-dir`` too.
- :func:`to_chrome_trace` turns a directory of those files into one Chrome trace
  (chrome://tracing, https://ui.perfetto.dev): a row per rank, a slice per collective.
- :class:`Metrics` exposes counters and histograms over HTTP for Prometheus
  (``prometheus-client``, optional: ``pip install prometheus-client``).
"""

from __future__ import annotations

import glob
import json
import os
import threading
from typing import Any

from .group import OBSERVERS


class FlightRecorder:
    """Append every collective of this process to a JSON-lines file."""

    def __init__(self, directory: str, job: str) -> None:
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"{job}-{os.getpid()}.jsonl")
        self.job = job
        self._fh = open(self.path, "a", buffering=1)
        self._lock = threading.Lock()
        OBSERVERS.append(self)

    def __call__(self, record: dict[str, Any]) -> None:
        line = json.dumps({"job": self.job, **{k: v for k, v in record.items() if v is not None}, "pid": os.getpid()})
        with self._lock:
            if not self._fh.closed:
                self._fh.write(line + "\n")

    def close(self) -> None:
        if self in OBSERVERS:
            OBSERVERS.remove(self)
        with self._lock:
            self._fh.close()


_process_recorders: dict[str, FlightRecorder] = {}


def process_recorder(directory: str, job: str) -> FlightRecorder:
    """The one recorder of this process for ``directory`` (every group's collectives go there)."""
    rec = _process_recorders.get(directory)
    if rec is None or rec._fh.closed:
        rec = _process_recorders[directory] = FlightRecorder(directory, job)
    return rec


def read_events(directory: str) -> list[dict[str, Any]]:
    events = []
    for path in sorted(glob.glob(os.path.join(directory, "*.jsonl"))):
        with open(path) as fh:
            for line in fh:
                line = line.strip()
                if line:
                    try:
                        events.append(json.loads(line))
                    except json.JSONDecodeError:
                        continue  # a line cut short by a crash
    return events


def to_chrome_trace(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Chrome trace-event JSON: one process row per (job, rank), one complete event per collective."""
    if not events:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    t0 = min(e["start"] for e in events)
    rows: dict[tuple[str, int], int] = {}
    out: list[dict[str, Any]] = []
    for e in sorted(events, key=lambda e: (e.get("job", ""), e["rank"], e["start"])):
        key = (str(e.get("job", "")), int(e["rank"]))
        if key not in rows:
            rows[key] = len(rows)
            out.append(
                {"ph": "M", "name": "process_name", "pid": rows[key], "args": {"name": f"{key[0]} rank {key[1]}"}}
            )
        out.append(
            {
                "ph": "X",
                "name": e["kind"] + ("" if e.get("ok", True) else " (failed)"),
                "cat": e.get("topology", "psring"),
                "pid": rows[key],
                "tid": 0 if e.get("gid", "0") == "0" else 1,
                "ts": (e["start"] - t0) * 1e6,
                "dur": max(e["end"] - e["start"], 0.0) * 1e6,
                "args": {k: e.get(k) for k in ("seq", "gid", "bytes", "dtype", "op", "root", "world", "error")},
            }
        )
    return {"traceEvents": out, "displayTimeUnit": "ms"}


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
        self.server, self.thread = prom.start_http_server(port, addr=host, registry=self.registry)
        self.port = int(self.server.server_address[1])
        OBSERVERS.append(self)

    def __call__(self, record: dict[str, Any]) -> None:
        kind = record["kind"]
        self.collectives.labels(self.role, kind).observe(max(record["end"] - record["start"], 0.0))
        self.payload.labels(self.role, kind).inc(record.get("bytes", 0))
        if not record.get("ok", True):
            self.errors.labels(self.role, "collective").inc()

    def add_traffic(self, sent: int, received: int) -> None:
        self.sent.labels(self.role).inc(max(sent, 0))
        self.received.labels(self.role).inc(max(received, 0))

    def close(self) -> None:
        if self in OBSERVERS:
            OBSERVERS.remove(self)
        self.server.shutdown()
        self.server.server_close()


__all__ = ["FlightRecorder", "Metrics", "process_recorder", "read_events", "to_chrome_trace"]
