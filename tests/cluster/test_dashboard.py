"""``psring dashboard`` (#40) against a live local cluster (a store, worker daemons, running jobs):
the JSON API read by a script, and the page in a real headless Chromium -- daemons and jobs
listed, the step counter advancing without a reload, a SIGKILLed worker shown lost, a stuck job's
stall verdict. Bad input at start: a clear message, exit 2."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from ..conftest import end, run_tree, spawn, until
from ..support.harness import browser
from .test_cluster import Cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
pytest.importorskip("aiohttp", reason="aiohttp is not installed (the dashboard extra; it is in the dev extra)")


def start_dashboard(c: Cluster, *extra: str) -> tuple[subprocess.Popen[str], str]:
    proc = spawn(["-m", "psring", "dashboard", "--store", c.address, "--port", "0", "--interval", "0.2", *extra], c.env)
    c.daemons["dashboard"] = proc  # ended with the cluster, by PID
    assert proc.stdout is not None
    line = proc.stdout.readline()
    m = re.search(r"(http://\S+)", line)
    assert m, line + end(proc)
    return proc, m[1]


def api(url: str, path: str = "api/status") -> dict[str, Any]:
    base, _, query = url.partition("?")
    with urllib.request.urlopen(base + path + (f"?{query}" if query else ""), timeout=10) as resp:
        return json.loads(resp.read())


def submit_train(c: Cluster, epochs: int = 3000) -> subprocess.Popen[str]:
    proc = spawn(["-m", "psring", "submit", "--store", c.address, "--workers", "2", "--epochs", str(epochs)], c.env)
    c.daemons[f"submit-{proc.pid}"] = proc
    return proc


def job_of(snap: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((j for j in snap["jobs"] if j["kind"] == kind), None)


def job_by_id(snap: dict[str, Any], job_id: str) -> dict[str, Any]:
    """The job, or {} while the page's last poll of the store has not seen it yet."""
    return next((j for j in snap["jobs"] if j["id"] == job_id), {})


def test_the_json_api_shows_daemons_progress_a_lost_worker_and_a_stall(tmp_path: Path) -> None:
    c = Cluster(tmp_path)
    c.env["PSRING_STALL_S"] = "0.5"
    try:
        for i in range(5):
            c.worker(f"w{i}")
        _, url = start_dashboard(c)
        assert "token" not in url  # loopback: no token
        submit_train(c)
        running = until("a running train job with progress", lambda: (
            (j := job_of(api(url), "train")) and j["state"] == "running" and j["progress"] and j))  # fmt: skip
        first = running["progress"]["step"]
        later = until("the step advancing", lambda: (
            (j := job_of(api(url), "train"))["progress"]["step"] > first + 10 and j))  # fmt: skip
        assert later["steps_per_s"] and later["steps_per_s"] > 0, later
        assert later["topology"] == "ring" and len(later["workers"]) == 2
        assert len(later["history"]) >= 2 and later["history"][-1]["step"] == later["progress"]["step"]
        # every rank's recent step times and bytes per link (one peer each on a 2-rank ring)
        ranks = until("both ranks' reports", lambda: (
            len(r := job_of(api(url), "train")["ranks"]) == 2 and all(x["step"] > 0 for x in r) and r))  # fmt: skip
        assert [r["rank"] for r in ranks] == [0, 1]
        for r in ranks:
            assert r["compute_s"] > 0 and r["comm_s"] > 0 and "straggler" in r, r
            assert r["bytes_per_step"] > 0 and 0 < r["compute_use"] < 1, r  # what a step sends, its compute share
            assert sum(sent for sent, _ in r["links"].values()) > 0, r
        # a stuck job: its stall verdict, the rank it waits for
        flag = tmp_path / "go"
        with c.client() as client:
            stuck = client.submit("ring", 2, entrypoint="tests.support.jobs.stuck_job:main", args={"flag": str(flag)})
            stalled = until("the stall verdict", lambda: (
                (j := job_by_id(api(url), stuck.id)).get("stall") and j))  # fmt: skip
            assert stalled["stall"]["verdict"] == "stall" and "all_reduce" in stalled["stall"]["message"], stalled
            # an idle worker SIGKILLed: lost within seconds (its heartbeat stops)
            idle = next(w["id"] for w in api(url)["workers"] if w["state"] == "idle")
            os.kill(c.daemons[idle].pid, signal.SIGKILL)
            killed = time.monotonic()
            until("the killed worker shown lost", lambda: any(
                w["id"] == idle and w["state"] == "lost" for w in api(url)["workers"]), timeout=20)  # fmt: skip
            assert time.monotonic() - killed < 15
            flag.write_text("go")
            assert stuck.wait(timeout=60)["sum"] == 2.0
        done = until("the stuck job done, its verdict gone", lambda: (
            (j := job_by_id(api(url), stuck.id)).get("state") == "done" and not j.get("stall")
            and j))  # fmt: skip
        assert done["reason"] is None
        # the stream: one snapshot per poll, the same data
        base = url.split("?")[0]
        with urllib.request.urlopen(base + "api/events", timeout=10) as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            line = resp.readline().decode()
        assert line.startswith("data: ") and {"workers", "servers", "jobs"} <= set(json.loads(line[6:]))
    finally:
        c.close()


def test_exposed_it_asks_for_the_token_and_bad_input_exits_2(tmp_path: Path) -> None:
    c = Cluster(tmp_path, secret="s3cret")
    try:
        c.worker("w0")
        token_file = tmp_path / "token"
        token_file.write_text("let-me-in\n")
        _, url = start_dashboard(c, "--expose", "--token-file", str(token_file))
        assert url.endswith("?token=let-me-in"), url
        base = url.split("?")[0]
        for path in ("", "api/status", "api/events"):
            with pytest.raises(urllib.error.HTTPError) as denied:
                urllib.request.urlopen(base + path, timeout=10)
            assert denied.value.code == 401
            denied.value.close()
        assert [w["id"] for w in api(url)["workers"]] == ["w0"]
        request = urllib.request.Request(base + "api/status", headers={"Authorization": "Bearer let-me-in"})
        with urllib.request.urlopen(request, timeout=10) as resp:
            assert resp.status == 200
        with urllib.request.urlopen(url, timeout=10) as resp:
            page = resp.read().decode()
        assert "<title>psring dashboard</title>" in page
        assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page) and "@import" not in page  # no CDN

        def dashboard(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
            cmd = [sys.executable, "-m", "psring", "dashboard", *args]
            return run_tree(cmd, timeout=60, env={**os.environ, **(env if env is not None else c.env)})

        free = socket.socket()
        free.bind(("127.0.0.1", 0))
        nobody = f"127.0.0.1:{free.getsockname()[1]}"
        free.close()
        held = socket.socket()
        held.bind(("127.0.0.1", 0))
        held.listen()
        try:
            cases = {
                "no store answers": (dashboard("--store", nobody), nobody),
                "a wrong secret": (dashboard("--store", c.address, env={"PSRING_SECRET": "wrong"}), "secret"),
                "a port in use": (
                    dashboard("--store", c.address, "--port", str(held.getsockname()[1])),
                    f"cannot listen on 127.0.0.1:{held.getsockname()[1]}",
                ),
                "a public host without --expose": (dashboard("--store", c.address, "--host", "0.0.0.0"), "--expose"),
            }
            for name, (res, says) in cases.items():
                assert res.returncode == 2, (name, res.returncode, res.stdout, res.stderr)
                assert says in res.stderr and "Traceback" not in res.stderr, (name, res.stderr)
        finally:
            held.close()
    finally:
        c.close()


def test_the_page_in_a_real_browser(tmp_path: Path) -> None:
    why = browser.why_not()
    if why:
        pytest.skip(why)
    c = Cluster(tmp_path)
    c.env["PSRING_STALL_S"] = "0.5"
    shot = Path(os.environ.get("PSRING_DASHBOARD_SCREENSHOT", tmp_path / "dashboard.png"))
    try:
        for i in range(5):
            c.worker(f"w{i}")
        _, url = start_dashboard(c)
        flag = tmp_path / "go"
        with c.client() as client:
            stuck = client.submit("ring", 2, entrypoint="tests.support.jobs.stuck_job:main", args={"flag": str(flag)})

            async def look() -> None:
                b = browser.Browser()
                try:
                    await b.start()
                    await b.goto(url)
                    rows = "document.querySelectorAll('#daemons tbody tr').length"
                    await b.wait_for(f"{rows} === 5", what="five daemons listed")
                    box = f"document.querySelector('.job[data-job=\"{stuck.id}\"] .stall')"
                    await b.wait_for(f"{box} !== null", timeout=60, what="the stall verdict")
                    verdict = await b.evaluate(f"{box}.innerText")
                    assert "stall" in verdict and "all_reduce" in verdict, verdict
                    loaded = await b.evaluate("performance.timeOrigin")
                    await asyncio.to_thread(submit_train, c)  # a job that starts after the page loaded
                    train = "document.querySelector('.job[data-state=running] .step')"
                    await b.wait_for(f"{train} && /\\d+ \\/ \\d+/.test({train}.textContent)", what="a running job")
                    first = browser.number(await b.evaluate(f"{train}.textContent"))
                    await b.wait_for(f"parseInt({train}.textContent) > {first}", what="the step advancing")
                    await b.wait_for("document.querySelectorAll('.job polyline').length > 0", what="a loss curve")
                    await b.wait_for("document.querySelectorAll('table.ranks tr.rank').length === 2", what="rank times")
                    # each rank's bytes a step and compute use, as numbers the page shows
                    cells = await b.evaluate("[...document.querySelectorAll('table.ranks tr.rank')].map(r => "
                                             "[r.querySelector('.bytes-per-step').textContent, "
                                             "r.querySelector('.compute-use').textContent])")  # fmt: skip
                    assert all(float(kb) > 0 and 0 <= float(use.rstrip("%")) <= 100 for kb, use in cells), cells
                    assert await b.evaluate("performance.timeOrigin") == loaded  # no reload
                    idle_row = "document.querySelector('#daemons tr[data-state=idle]')"
                    idle = await b.wait_for(f"{idle_row} && {idle_row}.dataset.id", what="an idle worker")
                    os.kill(c.daemons[idle].pid, signal.SIGKILL)
                    await b.wait_for(
                        f"document.querySelector('#daemons tr[data-id=\"{idle}\"]').dataset.state === 'lost'",
                        timeout=20,
                        what="the killed worker shown lost",
                    )
                    await b.screenshot(str(shot))
                finally:
                    await b.close()

            asyncio.run(look())
            assert shot.stat().st_size > 10_000
            flag.write_text("go")
            assert stuck.wait(timeout=60)["sum"] == 2.0
    finally:
        c.close()
