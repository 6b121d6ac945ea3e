"""``psring dashboard``: one live web page of a cluster, and a JSON API under it.

It reads the store with the cluster's secret, every ``interval`` seconds: the daemons (a daemon
whose heartbeats stopped shows as ``lost``), the jobs (state, restarts, the reason a job failed),
each running job's progress (step, epoch, loss, accuracy, steps per second: the curves are what
this dashboard saw since it started), each rank's recent seconds per step computing and in the
exchange (which rank is the straggler) and bytes per link, and the stall inspector's verdict where
a job published one.
The page updates itself from server-sent events; ``/api/status`` serves the same snapshot to
scripts, ``/api/events`` the stream. Read only: nothing on the page acts on the cluster.

Served by aiohttp (the ``dashboard`` extra): asyncio-native, so it runs on psring's own event loop
(uvloop) beside the store client; it streams responses (server-sent events) without a framework
on top, and it is maintained by the aio-libs group. The page is one HTML file with its script
inline: no build step, no CDN, it works offline.

Bound to 127.0.0.1 unless ``expose`` is given; exposed, every request must carry the token
(``?token=`` or ``Authorization: Bearer``), printed at start or read from a file.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import secrets
import time
from importlib import resources
from typing import Any

from ..errors import PsringError
from .client import AsyncClient
from .daemons import job_name

HISTORY = 2000  # progress records kept per job (the curves)
LOOPBACK = ("127.0.0.1", "::1", "localhost")


def _aiohttp() -> Any:
    try:
        from aiohttp import web
    except ImportError as exc:
        raise ValueError("psring dashboard needs aiohttp: pip install 'psring[dashboard]'") from exc
    return web


class Dashboard:
    """Polls a cluster's store and serves what it saw (see the module's docstring)."""

    def __init__(
        self,
        store: str,
        secret: str | bytes | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 8265,
        expose: bool = False,
        token: str | None = None,
        interval: float = 1.0,
    ) -> None:
        if host not in LOOPBACK and not expose:
            raise ValueError(
                f"--host {host} would expose the dashboard beyond this machine: pass --expose as well "
                "(every request then needs the token it prints)"
            )
        if not 0.05 <= interval <= 60:
            raise ValueError(f"interval={interval!r}: give 0.05 to 60 seconds")
        self.client = AsyncClient(store, secret=secret, timeout=10.0)
        self.host, self.port, self.interval = host, port, interval
        self.token = (token or secrets.token_urlsafe(24)) if expose else None
        self.snapshot: dict[str, Any] = {"time": None, "workers": [], "servers": [], "jobs": [], "error": None}
        self.history: dict[int, list[dict[str, Any]]] = {}
        self._changed = asyncio.Event()
        self._runner: Any = None
        self._poller: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ the store
    async def start(self) -> None:
        """Read the store once (a store that does not answer, or a wrong secret, fails here), then
        serve and keep polling."""
        web = _aiohttp()
        await self.client.connect()
        await self.poll()
        async def auth(request: Any, handler: Any) -> Any:
            return await self._auth(request, handler)

        app = web.Application(middlewares=[web.middleware(auth)])
        app.router.add_get("/", self._page)
        app.router.add_get("/api/status", self._status)
        app.router.add_get("/api/events", self._events)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        try:
            await site.start()
        except OSError as exc:
            await self._runner.cleanup()
            raise ValueError(f"cannot listen on {self.host}:{self.port}: {exc.strerror or exc}") from exc
        self.port = site._server.sockets[0].getsockname()[1]  # the port given, or the one port 0 chose
        self._poller = asyncio.create_task(self._poll_forever())

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(BaseException):  # cancelled by us: nothing to hear
                await self._poller
        if self._runner is not None:
            await self._runner.cleanup()
        await self.client.close()

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.poll()
            except (PsringError, OSError) as exc:  # shown on the page; the next poll dials afresh
                self.snapshot = {**self.snapshot, "error": f"{type(exc).__name__}: {exc}", "time": time.time()}
                self._notify()
                with contextlib.suppress(Exception):  # cleanup: a close may fail any way (the peer is gone)
                    await self.client.close()

    async def poll(self) -> dict[str, Any]:
        status = await self.client.status()
        jobs = []
        for job in status["jobs"]:
            jid = job.get("id")
            if not isinstance(jid, int):
                continue
            entry = {k: job.get(k) for k in ("id", "state", "topology", "kind", "workers", "servers", "attempt",
                                            "reason", "restarts", "shard_hosts")}  # fmt: skip
            entry["restarts"] = len(job.get("restarts") or []) or int(job.get("attempt") or 0)
            if job.get("topology") != "ps":
                entry["servers"] = None  # a ring job's spec carries the ps default: no shards run
            if job.get("state") in ("running", "restarting", "placing") or jid not in self.history:
                progress = await self.client.progress(jid)
                if progress is not None:
                    seen = self.history.setdefault(jid, [])
                    if not seen or progress.get("step") != seen[-1].get("step"):
                        seen.append({**progress, "t": time.time()})
                        del seen[:-HISTORY]
            if job.get("state") == "running":
                entry["stall"] = await self.client.stall(job_name(jid, int(job.get("attempt") or 0)))
                entry["ranks"] = _straggler(await self.client.rank_reports(jid))
            seen = self.history.get(jid, [])
            entry["progress"] = seen[-1] if seen else None
            entry["history"] = [{k: r.get(k) for k in ("step", "epoch", "loss", "acc", "t")} for r in seen]
            entry["steps_per_s"] = _rate(seen)
            jobs.append(entry)
        self.snapshot = {
            "time": time.time(),
            "store": self.client.store_spec,
            "workers": status["workers"],
            "servers": status["servers"],
            "jobs": jobs,
            "error": None,
        }
        self._notify()
        return self.snapshot

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # ------------------------------------------------------------------ the web
    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/" + (f"?token={self.token}" if self.token else "")

    async def _auth(self, request: Any, handler: Any) -> Any:
        web = _aiohttp()
        if self.token is not None:
            given = request.query.get("token") or request.headers.get("Authorization", "").removeprefix("Bearer ")
            if not hmac.compare_digest(given.encode(), self.token.encode()):
                raise web.HTTPUnauthorized(text="psring dashboard: a token is needed (?token=, Authorization: Bearer)")
        return await handler(request)

    async def _page(self, request: Any) -> Any:
        web = _aiohttp()
        page = resources.files("psring.cluster").joinpath("dashboard.html").read_text()
        return web.Response(text=page, content_type="text/html")

    async def _status(self, request: Any) -> Any:
        return _aiohttp().json_response(self.snapshot)

    async def _events(self, request: Any) -> Any:
        web = _aiohttp()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            while True:
                await response.write(f"data: {json.dumps(self.snapshot)}\n\n".encode())
                changed = self._changed
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(15):  # a comment-only beat keeps proxies open
                        await changed.wait()
        return response


def _rate(seen: list[dict[str, Any]]) -> float | None:
    """Steps per second over the last ten progress records seen, by rank 0's clock (``elapsed``)
    where the records carry it, else by when this dashboard saw them."""
    recent = [r for r in seen[-10:] if isinstance(r.get("step"), int)]
    if len(recent) < 2:
        return None
    clock = "elapsed" if all(isinstance(r.get("elapsed"), (int, float)) for r in recent) else "t"
    span = recent[-1][clock] - recent[0][clock]
    return (recent[-1]["step"] - recent[0]["step"]) / span if span > 0 else None


def _straggler(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mark the straggler: in a synchronous step the others wait for the rank that computes longest
    (their exchange time is its extra compute), so it is the one whose compute per step is
    the largest, by more than a fifth of the fastest rank's step."""
    timed = [r for r in ranks if isinstance(r.get("compute_s"), (int, float))]
    if len(timed) >= 2:
        slow = max(timed, key=lambda r: r["compute_s"])
        fast = min(timed, key=lambda r: r["compute_s"])
        step = fast["compute_s"] + float(fast.get("comm_s") or 0)
        for r in ranks:
            r["straggler"] = r is slow and slow["compute_s"] - fast["compute_s"] > 0.2 * step
    return ranks
