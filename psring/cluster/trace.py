"""Chrome traces from flight-recorder event logs (``psring trace``)."""

from __future__ import annotations

import glob
import json
import os
from typing import Any


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
