"""The flight recorder: one record per collective, to every observer registered.

Every collective hands ``OBSERVERS`` a record (seq, rank, kind, bytes, start, end, ok,
error, ...). :class:`FlightRecorder` appends them as JSON lines to
``DIR/<job>-<pid>.jsonl``: ``PSRING_TRACE_DIR`` turns it on for any process that calls
``init_group``, ``psring worker --trace-dir`` for a daemon's jobs. ``psring trace``
(psring.cluster.trace) turns a directory of them into a Chrome trace, and the cluster's
Prometheus metrics (psring.cluster.metrics) are another observer.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

#: callables called with a record (seq, rank, kind, bytes, start, end, ok, ...) after every
#: collective: the flight recorder (psring.topology.recorder) and the metrics use them; empty by default
OBSERVERS: list[Any] = []


class FlightRecorder:
    """Append every collective of this process to a JSON-lines file."""

    def __init__(self, directory: str, job: str) -> None:
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"{job}-{os.getpid()}.jsonl")
        self.job = job
        self._fh = open(self.path, "a", buffering=1)
        self._lock = threading.Lock()
        OBSERVERS.append(self)

    @property
    def closed(self) -> bool:
        """Whether its file was closed (the process's recorder for the directory is then made anew)."""
        return self._fh.closed

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
    if rec is None or rec.closed:
        rec = _process_recorders[directory] = FlightRecorder(directory, job)
    return rec


__all__ = ["OBSERVERS", "FlightRecorder", "process_recorder"]
