"""What a store restart costs a running cluster (#34): the store SIGKILLed mid-job and started again.

A store (with ``--data-dir``, or without: ``--no-data-dir``), one server daemon, N worker daemons on
loopback; a job submitted; at a quarter of its steps the store is SIGKILLed and started again on its
port ``--down`` seconds later. Reported per trial: seconds from the new store listening to every
daemon having written its record to it again (its heartbeat counter moved), whether the job finished
(jobs lost), and its steps against an uninterrupted run's (steps lost), and whether its parameters
are the uninterrupted run's.

    python benchmarks/store_restart.py --topology ps --trials 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "psring", *args],
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )


def _wait_line(proc: subprocess.Popen[str], text: str) -> str:
    assert proc.stdout is not None
    for line in proc.stdout:
        if text in line:
            return line
    raise RuntimeError(f"{text!r} never appeared (exit {proc.poll()})")


def _status(address: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "psring", "status", "--store", address, "--json"],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    return json.loads(out.stdout)


def _summary(out: str) -> dict[str, Any]:
    return json.loads([line for line in out.splitlines() if line.startswith("{") and "param_digest" in line][-1])


def trial(args: argparse.Namespace, data: str) -> dict[str, Any]:
    keep = [] if args.no_data_dir else ["--data-dir", data]
    store = _spawn("store", "--host", "127.0.0.1", "--port", "0", *keep)
    port = int(re.search(r":(\d+)", _wait_line(store, "listening on"))[1])  # type: ignore[index]
    address = f"127.0.0.1:{port}"
    procs = [store]
    try:
        for i in range(args.workers):
            procs.append(_spawn("worker", "--store", address, "--host", "127.0.0.1", "--name", f"w{i}"))
            _wait_line(procs[-1], "ready on")
        if args.topology == "ps":
            procs.append(_spawn("server", "--cluster", "--store", address, "--host", "127.0.0.1", "--name", "s0"))
            _wait_line(procs[-1], "ready for ps jobs")
        job = ["submit", "--store", address, "--topology", args.topology, "--workers", str(args.workers),
               "--epochs", str(args.epochs), "--json"]  # fmt: skip
        reference = subprocess.run(
            [sys.executable, "-m", "psring", *job], capture_output=True, text=True, timeout=600, cwd=ROOT
        )
        submit = _spawn(*job)
        assert submit.stdout is not None
        for line in submit.stdout:
            m = re.search(r"step (\d+)/(\d+)", line)
            if m and int(m[1]) >= int(m[2]) // 4:
                break
        beats = {r["id"]: r["beat"] for role in ("workers", "servers") for r in _status(address)[role]}
        os.kill(store.pid, signal.SIGKILL)
        store.wait()
        time.sleep(args.down)
        store = _spawn("store", "--host", "127.0.0.1", "--port", str(port), *keep)
        procs[0] = store
        _wait_line(store, "listening on")
        back = time.monotonic()
        registered = None
        while time.monotonic() - back < 120:
            now = {r["id"]: r["beat"] for role in ("workers", "servers") for r in _status(address)[role]}
            if set(now) == set(beats) and all(now[d] > beats[d] for d in beats):
                registered = time.monotonic() - back
                break
            time.sleep(0.05)
        out, _ = submit.communicate(timeout=600)
        ok = submit.returncode == 0
        got = _summary(out) if ok else {}
        want = _summary(reference.stdout)
        return {
            "reregistered_s": registered,
            "job_lost": not ok,
            "steps_lost": want["steps"] - got.get("steps", 0),
            "same_parameters": got.get("param_digest") == want["param_digest"],
        }
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=30)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--topology", choices=("ring", "ps"), default="ps")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--down", type=float, default=3.0, help="seconds the store stays down")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--no-data-dir", action="store_true", help="a store that forgets: the daemons re-register")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    rows = []
    for _ in range(args.trials):
        with tempfile.TemporaryDirectory(prefix="psring-store-") as data:
            rows.append(trial(args, data))
    if args.json:
        print(json.dumps(rows))
    else:
        for r in rows:
            print(
                f"every daemon re-registered {r['reregistered_s']:.2f} s after the store was back; "
                f"jobs lost {int(r['job_lost'])}, steps lost {r['steps_lost']}, same parameters {r['same_parameters']}"
            )
    return 0 if all(not r["job_lost"] and r["same_parameters"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
