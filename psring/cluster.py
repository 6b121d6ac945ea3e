"""The cluster: long-running worker daemons and server daemons, jobs placed through the store.

Everything meets in the rendezvous store, under ``psring-cluster/``:

- ``workers/<id>``: a worker daemon's record (address, state idle|busy, job, version, a
  heartbeat counter and its clock), rewritten every heartbeat; ``servers/<id>`` likewise.
- ``claim/<id>``: who has a daemon (compare-and-set, so two submitters never share one).
- ``assign/<id>``: the job and rank a daemon should run next.
- ``jobs/<n>/spec``, ``state``, ``ack/<rank>``, ``rank/<rank>`` (each rank's outcome),
  ``progress`` (rank 0's latest progress record).

A job is a ``psring train`` run (the main job) or an ``--entrypoint module:function``
importable on the workers, called with a Group (an async Group for ``async def``, a
blocking one otherwise) and returning a dict of metrics. A job's ranks run inside the
daemons (one job at a time each) and form a group of their own (``PSRING_JOB=job<n>``) over
the daemons' declared ports; a ps job's shards run on server daemons when there are any,
else inside rank 0's daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import json
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

from . import __version__, wire
from .connection import Listener, Mailbox, open_connection
from .errors import AuthError, PeerLostError, PsringError
from .store import connect_store, parse_store_address

logger = logging.getLogger(__name__)

ROOT = "psring-cluster/"
HEARTBEAT_S = 1.0


def key(*parts: Any) -> str:
    return ROOT + "/".join(str(p) for p in parts)


class JobError(PsringError):
    """A cluster job could not be placed, or failed (the message names the daemon and rank)."""


def _secret_bytes(secret: str | bytes | None) -> bytes | None:
    if secret is None:
        secret = os.environ.get("PSRING_SECRET") or None
    if isinstance(secret, str):
        secret = secret.encode()
    return secret


# ------------------------------------------------------------------- daemons
class _Daemon:
    """What worker and server daemons share: the store, a record, a heartbeat, SIGTERM."""

    kind = "workers"

    def __init__(
        self,
        store: str,
        *,
        secret: str | bytes | None = None,
        host: str = "0.0.0.0",
        port: int = 0,
        advertise: str | None = None,
        name: str | None = None,
        metrics_port: int | None = None,
        trace_dir: str | None = None,
    ) -> None:
        self.store_spec = store
        self.secret = _secret_bytes(secret)
        self.bind_host = host
        self.port = port
        self.advertise = advertise
        self.id = name or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
        self.metrics_port = metrics_port
        self.trace_dir = trace_dir
        self.state = "idle"
        self.job: int | None = None
        self.beat = 0
        self.jobs_run = 0
        self.stopping = asyncio.Event()
        self.store: Any = None
        self.listener: Listener | None = None
        self.metrics: Any = None

    def record(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "host": self.advertise,
            "port": self.port,
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
            "state": self.state,
            "job": self.job,
            "beat": self.beat,
            "time": time.time(),
            "version": __version__,
            "wire": wire.WIRE_VERSION,
            "jobs_run": self.jobs_run,
            "metrics_port": self.metrics.port if self.metrics is not None else None,
        }

    async def _publish(self) -> None:
        await self.store.set(key(self.kind, self.id), json.dumps(self.record()))

    def _heartbeat_thread(self) -> None:
        """Beat from a thread of its own (own loop, own store connection): a job that holds the
        daemon's event loop for a while (imports, a long computation) is not mistaken for a dead daemon."""
        from .facade import new_event_loop

        async def beat() -> None:
            store = await connect_store(parse_store_address(self.store_spec), secret=self.secret, timeout=30.0)
            try:
                while not self._beat_stop.is_set():
                    self.beat += 1
                    with contextlib.suppress(PsringError, OSError):
                        await store.set(key(self.kind, self.id), json.dumps(self.record()))
                    await asyncio.get_running_loop().run_in_executor(None, self._beat_stop.wait, HEARTBEAT_S)
            finally:
                with contextlib.suppress(Exception):
                    await store.close()

        loop = new_event_loop()
        try:
            loop.run_until_complete(beat())
        except (PsringError, OSError) as exc:
            logger.warning("%s %s: heartbeat stopped: %s", self.kind[:-1], self.id, exc)
        finally:
            loop.close()

    def _start_heartbeat(self) -> threading.Thread:
        self._beat_stop = threading.Event()
        thread = threading.Thread(target=self._heartbeat_thread, name=f"psring-heartbeat-{self.id}", daemon=True)
        thread.start()
        return thread

    def _stop_heartbeat(self, thread: threading.Thread) -> None:
        self._beat_stop.set()
        thread.join(timeout=5)

    async def _open_port(self) -> None:
        """Listen on the declared port while idle: doctor's reachability and secret checks land here."""
        mailbox = Mailbox()
        self.listener = Listener(
            lambda conn: None,
            secret=self.secret,
            info={"role": self.kind[:-1], "id": self.id},
            router_for=lambda conn: mailbox,
            name=f"psring {self.kind[:-1]} {self.id}",
        )
        await self.listener.start(self.bind_host, self.port)
        self.port = self.listener.port

    async def _close_port(self) -> None:
        if self.listener is not None:
            await self.listener.close()
            self.listener = None

    async def start(self) -> None:
        from .config import routable_host_towards

        address = parse_store_address(self.store_spec)
        self.store = await connect_store(address, secret=self.secret, timeout=60.0, role=self.kind[:-1])
        if self.advertise is None:
            self.advertise = os.environ.get("PSRING_ADVERTISE_HOST") or routable_host_towards(address.host or "")
        if self.metrics_port is not None:
            from .observe import Metrics

            self.metrics = Metrics(self.metrics_port, role=self.kind[:-1])
        await self._open_port()
        await self._publish()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.stopping.set)

    async def _new_store(self) -> Any:
        """A store connection of its own (shard servers close theirs when they stop)."""
        return await connect_store(parse_store_address(self.store_spec), secret=self.secret, timeout=30.0)

    async def stop(self) -> None:
        await self._close_port()
        with contextlib.suppress(PsringError, OSError):
            await self.store.delete(key(self.kind, self.id))
            await self.store.delete(key("claim", self.id))
        with contextlib.suppress(PsringError, OSError):
            await self.store.close()
        if self.metrics is not None:
            self.metrics.close()


class WorkerDaemon(_Daemon):
    """``psring worker``: waits for jobs, runs its rank of each, reports, waits again."""

    kind = "workers"

    async def serve(self) -> None:
        await self.start()
        print(f"psring worker {self.id}: ready on {self.advertise}:{self.port}, store {self.store_spec}", flush=True)
        beat = self._start_heartbeat()
        try:
            while not self.stopping.is_set():
                get = asyncio.create_task(self.store.get(key("assign", self.id), timeout=1.0))
                stop = asyncio.create_task(self.stopping.wait())
                done, _ = await asyncio.wait({get, stop}, return_when=asyncio.FIRST_COMPLETED)
                stop.cancel()
                if get not in done:
                    get.cancel()
                    with contextlib.suppress(BaseException):
                        await get
                    break
                raw = get.result()
                if raw is None:
                    continue
                await self.store.delete(key("assign", self.id))
                await self._run_job(json.loads(raw))
        finally:
            self.stopping.set()
            self._stop_heartbeat(beat)
            await self.stop()
            print(f"psring worker {self.id}: stopped after {self.jobs_run} job(s)", flush=True)

    async def _run_job(self, assignment: dict[str, Any]) -> None:
        jid, rank = int(assignment["job"]), int(assignment["rank"])
        raw = await self.store.get(key("jobs", jid, "spec"))
        if raw is None:
            logger.warning("worker %s: job %s has no spec; ignored", self.id, jid)
            return
        spec = json.loads(raw)
        self.state, self.job = "busy", jid
        await self._publish()
        await self.store.set(key("jobs", jid, "ack", rank), self.id)
        outcome: dict[str, Any] = {"ok": False, "worker": self.id}
        body = asyncio.create_task(self._job_body(spec, rank))
        watch = asyncio.create_task(self._watch(jid))
        stop = asyncio.create_task(self.stopping.wait())
        t0 = time.monotonic()
        try:
            done, _ = await asyncio.wait({body, watch, stop}, return_when=asyncio.FIRST_COMPLETED)
            if body in done:
                exc = body.exception()
                if exc is not None:
                    outcome["error"] = f"{type(exc).__name__}: {exc}"
                    if isinstance(exc, PeerLostError) and exc.rank is not None:
                        outcome["lost_rank"] = exc.rank
                else:
                    outcome.update(ok=True, result=body.result())
            else:
                why = (
                    f"worker {self.id} was stopped (SIGTERM) and abandoned the job"
                    if stop in done
                    else f"job {jid} was {watch.result()} elsewhere"
                )
                body.cancel()
                with contextlib.suppress(BaseException):
                    await body
                outcome["error"] = why
        except Exception as exc:
            outcome["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            for t in (watch, stop):
                t.cancel()
            outcome["seconds"] = time.monotonic() - t0
            with contextlib.suppress(PsringError, OSError):
                await self.store.set(key("jobs", jid, "rank", rank), json.dumps(outcome, default=str))
            if self.metrics is not None:
                self.metrics.jobs.labels("worker", "ok" if outcome["ok"] else "failed").inc()
            self.jobs_run += 1
            self.state, self.job = "idle", None
            if not self.stopping.is_set():
                await self._open_port()
            with contextlib.suppress(PsringError, OSError):
                await self.store.delete(key("claim", self.id))
                await self._publish()

    async def _watch(self, jid: int) -> str:
        """Returns when the job is failed or cancelled elsewhere (so this rank stops at once)."""
        while True:
            state = await self.store.get(key("jobs", jid, "state"))
            if state in (b"failed", b"cancelled"):
                return state.decode()
            await asyncio.sleep(0.5)

    async def _job_body(self, spec: dict[str, Any], rank: int) -> Any:
        jid = spec["id"]
        job = f"job{jid}"
        world = len(spec["workers"])
        await self._close_port()  # the job's group listens on this daemon's declared port now
        env = {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": "0",
            "PSRING_JOB": job,
            "PSRING_TOPOLOGY": spec["topology"],
            "PSRING_PORT": str(self.port),
            "PSRING_ADVERTISE_HOST": str(self.advertise),
            "PSRING_STORE": self.store_spec,
            "MASTER_ADDR": "",
            "MASTER_PORT": "",
        }
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        servers = None
        recorder = None
        try:
            if spec["topology"] == "ps" and rank == 0 and not spec.get("shard_hosts"):
                from .server import start_servers

                servers = await start_servers(
                    await self._new_store(),
                    spec["servers"],
                    job=job,
                    secret=self.secret,
                    host=self.bind_host,
                    advertise=self.advertise,
                )
            if self.trace_dir:
                from .observe import FlightRecorder

                recorder = FlightRecorder(self.trace_dir, job)
            if spec["kind"] == "train":
                result = await self._train(spec, rank)
            else:
                result = await self._entrypoint(spec)
            return result
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            if recorder is not None:
                recorder.close()
            if servers is not None:
                await servers.drain(timeout=10.0)
                await servers.close()

    async def _train(self, spec: dict[str, Any], rank: int) -> Any:
        from .train import worker

        jid = spec["id"]
        last = [0.0]

        def progress(record: dict[str, Any]) -> None:
            now = time.monotonic()
            if now - last[0] > 0.2 or "acc" in record:
                last[0] = now
                asyncio.get_running_loop().create_task(self.store.set(key("jobs", jid, "progress"), json.dumps(record)))

        train_spec = {**spec["train"], "timeout": spec.get("timeout", 300.0)}
        summary = await worker(train_spec, progress=progress)
        if self.metrics is not None and summary is not None:
            self.metrics.steps.labels("worker").inc(summary["steps"])
        return summary

    async def _entrypoint(self, spec: dict[str, Any]) -> Any:
        import psring

        module_name, _, attr = spec["entrypoint"].partition(":")
        try:
            fn = getattr(importlib.import_module(module_name), attr or "main")
        except (ImportError, AttributeError) as exc:
            raise JobError(f"entrypoint {spec['entrypoint']!r} cannot be loaded on worker {self.id}: {exc}") from exc
        kwargs = spec.get("args") or {}
        timeout = spec.get("timeout", 300.0)
        if inspect.iscoroutinefunction(fn):
            group = await psring.init_group(timeout=timeout)
            try:
                result = await fn(group, **kwargs)
            finally:
                stats = group.stats()
                await group.close()
        else:

            def run_sync() -> Any:
                g = psring.init(timeout=timeout)
                try:
                    return fn(g, **kwargs), g.stats()
                finally:
                    g.close()

            result, stats = await asyncio.to_thread(run_sync)
        if self.metrics is not None:
            self.metrics.add_traffic(stats.get("bytes_sent", 0), stats.get("bytes_received", 0))
        return json.loads(json.dumps(result, default=str))


class ServerDaemon(_Daemon):
    """``psring server --cluster``: hosts the shards of ps jobs the submitters give it."""

    kind = "servers"

    def __init__(self, store: str, *, checkpoint_dir: str | None = None, **kwargs: Any) -> None:
        super().__init__(store, **kwargs)
        self.checkpoint_dir = checkpoint_dir

    async def serve(self) -> None:
        from .server import start_servers

        await self.start()
        print(f"psring server {self.id}: ready for ps jobs, store {self.store_spec}", flush=True)
        beat = self._start_heartbeat()
        running: dict[int, Any] = {}
        try:
            while not self.stopping.is_set():
                raw = await self.store.get(key("serve", self.id), timeout=1.0)
                if raw is not None:
                    await self.store.delete(key("serve", self.id))
                    order = json.loads(raw)
                    jid = int(order["job"])
                    port = 0
                    if not running:  # the declared port serves the shards (one job's at a time)
                        await self._close_port()
                        port = self.port
                    running[jid] = await start_servers(
                        await self._new_store(),
                        order["num_shards"],
                        job=f"job{jid}",
                        secret=self.secret,
                        host=self.bind_host,
                        port=port,
                        advertise=self.advertise,
                        shard_ids=order["shards"],
                        checkpoint_dir=os.path.join(self.checkpoint_dir, f"job{jid}") if self.checkpoint_dir else None,
                    )
                    self.state, self.job = "busy", jid
                for jid in list(running):
                    state = await self.store.get(key("jobs", jid, "state"))
                    if state in (b"done", b"failed", b"cancelled"):
                        srv = running.pop(jid)
                        await srv.close()
                        self.jobs_run += 1
                if not running and self.state == "busy":
                    self.state, self.job = "idle", None
                    await self._open_port()
        finally:
            self.stopping.set()
            self._stop_heartbeat(beat)
            for srv in running.values():
                with contextlib.suppress(Exception):
                    await srv.close()
            await self.stop()


# -------------------------------------------------------------------- client
class AsyncClient:
    """Submit jobs and read the cluster's state (async; :class:`Client` is the blocking one)."""

    def __init__(self, store: str, secret: str | bytes | None = None, timeout: float = 30.0) -> None:
        self.store_spec = store
        self.secret = _secret_bytes(secret)
        self.timeout = timeout
        self.store: Any = None

    async def connect(self) -> AsyncClient:
        if self.store is None:
            self.store = await connect_store(
                parse_store_address(self.store_spec), secret=self.secret, timeout=self.timeout, role="client"
            )
        return self

    async def close(self) -> None:
        if self.store is not None:
            await self.store.close()
            self.store = None

    async def _records(self, kind: str) -> list[dict[str, Any]]:
        out = []
        for k in await self.store.list(key(kind) + "/"):
            raw = await self.store.get(k)
            if raw:
                with contextlib.suppress(ValueError):
                    out.append(json.loads(raw))
        return out

    async def status(self) -> dict[str, Any]:
        await self.connect()
        jobs = []
        for k in await self.store.list(key("jobs") + "/"):
            if k.endswith("/spec"):
                spec = json.loads(await self.store.get(k) or b"{}")
                state = await self.store.get(key("jobs", spec.get("id"), "state"))
                jobs.append({**spec, "state": (state or b"?").decode()})
        return {
            "workers": await self._records("workers"),
            "servers": await self._records("servers"),
            "jobs": sorted(jobs, key=lambda j: j.get("id", 0)),
        }

    async def submit(
        self,
        topology: str = "ring",
        workers: int = 2,
        *,
        servers: int | None = None,
        entrypoint: str | None = None,
        args: dict[str, Any] | None = None,
        train: dict[str, Any] | None = None,
        wait_for_workers: bool = True,
        place_timeout: float = 600.0,
        timeout: float = 300.0,
    ) -> int:
        """Place a job on ``workers`` idle daemons; returns its id once every rank took it."""
        if topology not in ("ring", "ps"):
            raise ValueError(f"topology={topology!r} is not ring or ps")
        if type(workers) is not int or workers < 1:
            raise ValueError(f"workers={workers!r} must be a positive integer")
        if servers is not None and (topology != "ps" or servers < 1):
            raise ValueError("servers applies to topology='ps', and must be at least 1")
        await self.connect()
        jid = await self.store.add(key("next-job"), 1)
        spec: dict[str, Any] = {
            "id": jid,
            "topology": topology,
            "servers": servers or workers,
            "kind": "entrypoint" if entrypoint else "train",
            "entrypoint": entrypoint,
            "args": args or {},
            "train": _train_spec(train or {}),
            "timeout": timeout,
            "workers": [],
            "submitted": time.time(),
        }
        await self.store.set(key("jobs", jid, "state"), b"queued")
        await self.store.set(key("jobs", jid, "spec"), json.dumps(spec))
        try:
            chosen = await self._claim(jid, workers, wait_for_workers, place_timeout)
            spec["workers"] = chosen
            if topology == "ps":
                spec["shard_hosts"] = await self._place_shards(jid, spec["servers"])
            await self.store.set(key("jobs", jid, "spec"), json.dumps(spec))
            await self.store.set(key("jobs", jid, "state"), b"running")
            for rank, wid in enumerate(chosen):
                await self.store.set(key("assign", wid), json.dumps({"job": jid, "rank": rank}))
            await self._wait_acks(jid, chosen)
        except BaseException:
            await self.store.set(key("jobs", jid, "state"), b"cancelled")
            raise
        return jid

    async def _claim(self, jid: int, n: int, wait: bool, place_timeout: float) -> list[str]:
        deadline = time.monotonic() + place_timeout
        while True:
            records = await self._records("workers")
            idle = sorted(r["id"] for r in records if r.get("state") == "idle")
            if len(idle) >= n:
                got: list[str] = []
                for wid in idle:
                    ok, _ = await self.store.compare_set(key("claim", wid), None, str(jid).encode())
                    if ok:
                        got.append(wid)
                        if len(got) == n:
                            return got
                for wid in got:  # someone else was faster: give them back and try again
                    await self.store.delete(key("claim", wid))
            elif not wait:
                raise JobError(
                    f"job {jid} needs {n} worker daemon(s); {len(records)} registered, {len(idle)} idle "
                    "(start more with 'psring worker --store ...', or submit with waiting on)"
                )
            if time.monotonic() > deadline:
                raise JobError(
                    f"job {jid} waited {place_timeout:g}s for {n} idle worker daemon(s); "
                    f"{len(records)} registered, {len(idle)} idle"
                )
            await asyncio.sleep(0.3)

    async def _place_shards(self, jid: int, num_shards: int) -> dict[str, list[int]] | None:
        hosts = sorted(r["id"] for r in await self._records("servers"))
        if not hosts:
            return None  # rank 0's daemon hosts the shards
        plan: dict[str, list[int]] = {}
        for i in range(num_shards):
            plan.setdefault(hosts[i % len(hosts)], []).append(i)
        for sid, shards in plan.items():
            await self.store.set(
                key("serve", sid), json.dumps({"job": jid, "shards": shards, "num_shards": num_shards})
            )
        return plan

    async def _wait_acks(self, jid: int, chosen: list[str], ack_timeout: float = 15.0) -> None:
        deadline = time.monotonic() + ack_timeout
        while True:
            missing = [
                (r, wid) for r, wid in enumerate(chosen) if await self.store.get(key("jobs", jid, "ack", r)) is None
            ]
            if not missing:
                return
            if time.monotonic() > deadline:
                for _r, wid in missing:  # a stale record of a daemon that is gone
                    await self.store.delete(key("workers", wid))
                    await self.store.delete(key("assign", wid))
                for wid in chosen:
                    await self.store.delete(key("claim", wid))
                names = ", ".join(f"{wid} (rank {r})" for r, wid in missing)
                raise JobError(f"job {jid}: worker daemon(s) {names} did not take the job within {ack_timeout:g}s")
            await asyncio.sleep(0.1)

    async def progress(self, jid: int) -> dict[str, Any] | None:
        raw = await self.store.get(key("jobs", jid, "progress"))
        return json.loads(raw) if raw else None

    async def poll(self, jid: int, beats: dict[str, tuple[int, float]], dead_after: float) -> dict[str, Any] | None:
        """None while running; else {"ok": bool, "result"|"error": ...} for the whole job."""
        spec = json.loads(await self.store.get(key("jobs", jid, "spec")) or b"{}")
        chosen: list[str] = spec.get("workers", [])
        outcomes = {}
        for r in range(len(chosen)):
            raw = await self.store.get(key("jobs", jid, "rank", r))
            if raw:
                outcomes[r] = json.loads(raw)
        now = time.monotonic()
        dead = []
        for r, wid in enumerate(chosen):
            if r in outcomes:
                continue
            raw = await self.store.get(key("workers", wid))
            rec = json.loads(raw) if raw else None
            beat = rec["beat"] if rec else -1
            seen = beats.get(wid)
            if seen is None or seen[0] != beat:
                beats[wid] = (beat, now)
            elif now - seen[1] > dead_after:
                dead.append((r, wid, now - seen[1]))
        if dead:
            r, wid, ago = dead[0]
            await self.store.set(key("jobs", jid, "state"), b"failed")
            return {
                "ok": False,
                "error": f"job {jid} failed: worker daemon {wid} (rank {r}) stopped heartbeating "
                f"{ago:.1f}s ago -- it died or hung",
            }
        failed = {r: o for r, o in outcomes.items() if not o.get("ok")}
        if failed and len(outcomes) < len(chosen):
            # give the other ranks a moment to report: the rank whose own error started it all
            # usually reports a little after the peers that merely lost it
            first = beats.setdefault("\0failed", (0, now))[1]  # type: ignore[arg-type]
            if now - first < 2.0:
                return None
        causes = {
            r: o for r, o in failed.items() if "lost_rank" not in o and "PeerLostError" not in str(o.get("error"))
        }
        if causes:
            r = min(causes)
            await self.store.set(key("jobs", jid, "state"), b"failed")
            return {
                "ok": False,
                "error": f"job {jid} failed: rank {r} on worker {causes[r].get('worker')}: {causes[r].get('error')}",
                "ranks": failed,
            }
        lost = sorted({o["lost_rank"] for o in failed.values() if type(o.get("lost_rank")) is int})
        lost = [r for r in lost if 0 <= r < len(chosen) and r not in failed]
        if lost:  # survivors name the rank they lost: that daemon is the culprit
            await self.store.set(key("jobs", jid, "state"), b"failed")
            r = lost[0]
            first = next(o for o in failed.values() if o.get("lost_rank") == r)
            return {
                "ok": False,
                "error": f"job {jid} failed: worker daemon {chosen[r]} (rank {r}) was lost mid-job "
                f"({first.get('error')})",
                "ranks": failed,
            }
        if failed:
            await self.store.set(key("jobs", jid, "state"), b"failed")
            # the first rank to fail is usually the cause; a lost peer names the rank it lost
            r = min(failed)
            return {
                "ok": False,
                "error": f"job {jid} failed: rank {r} on worker {failed[r].get('worker')}: {failed[r].get('error')}",
                "ranks": failed,
            }
        if len(outcomes) == len(chosen):
            await self.store.set(key("jobs", jid, "state"), b"done")
            return {"ok": True, "result": outcomes[0].get("result"), "ranks": outcomes}
        return None

    async def wait(self, jid: int, timeout: float | None = None, dead_after: float = 5.0) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        beats: dict[str, tuple[int, float]] = {}
        while True:
            out = await self.poll(jid, beats, dead_after)
            if out is not None:
                if not out["ok"]:
                    raise JobError(out["error"])
                return out["result"]
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {jid} not finished within {timeout:g}s")
            await asyncio.sleep(0.2)


def _train_spec(overrides: dict[str, Any]) -> dict[str, Any]:
    spec = {
        "epochs": 20,
        "batch_size": 32,
        "lr": 0.1,
        "momentum": 0.9,
        "optimizer": "sgd",
        "compression": None,
        "accumulate": 1,
        "device": "cpu",
        "seed": 0,
        "out": None,
    }
    unknown = set(overrides) - set(spec)
    if unknown:
        raise ValueError(f"unknown train settings {sorted(unknown)} (known: {sorted(spec)})")
    spec.update(overrides)
    return spec


class Job:
    """A submitted job: ``wait()``, ``stream()``, ``id``."""

    def __init__(self, client: Client, jid: int) -> None:
        self.client, self.id = client, jid

    def wait(self, timeout: float | None = None) -> Any:
        """The job's result (rank 0's summary or metrics); raises JobError naming the failed daemon."""
        return self.client._portal.call(self.client._inner.wait(self.id, timeout))

    def stream(self, interval: float = 0.2) -> Iterator[dict[str, Any]]:
        """Progress records as they change, until the job ends (then wait() gives the outcome)."""
        beats: dict[str, tuple[int, float]] = {}
        last = None
        while True:
            rec = self.client._portal.call(self.client._inner.progress(self.id))
            if rec is not None and rec != last:
                last = rec
                yield rec
            done = self.client._portal.call(self.client._inner.poll(self.id, beats, 5.0))
            if done is not None:
                return
            time.sleep(interval)


class Client:
    """Blocking cluster client: ``Client("host:29500").submit(topology="ps", workers=4).wait()``."""

    def __init__(self, store: str, secret: str | bytes | None = None, timeout: float = 30.0) -> None:
        from .facade import Portal

        self._portal = Portal(name="psring-client")
        self._inner = AsyncClient(store, secret, timeout)
        try:
            self._portal.call(self._inner.connect())
        except BaseException:
            self._portal.stop()
            raise

    def submit(self, topology: str = "ring", workers: int = 2, **kwargs: Any) -> Job:
        return Job(self, self._portal.call(self._inner.submit(topology, workers, **kwargs)))

    def status(self) -> dict[str, Any]:
        return self._portal.call(self._inner.status())  # type: ignore[no-any-return]

    def close(self) -> None:
        try:
            self._portal.call(self._inner.close(), timeout=10)
        finally:
            self._portal.stop()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------- doctor
async def doctor(store: str, secret: str | bytes | None = None, timeout: float = 5.0) -> list[str]:
    """Problems found (one line each, with the fix); empty when all is well."""
    problems: list[str] = []
    client = AsyncClient(store, secret, timeout)
    try:
        await client.connect()
    except AuthError as exc:
        return [f"the store at {store} rejected this secret ({exc}): set the same PSRING_SECRET everywhere"]
    except (PsringError, OSError) as exc:
        return [f"the store at {store} is unreachable ({exc}): start 'psring store' or fix --store"]
    try:
        status = await client.status()
        daemons = [("worker", r) for r in status["workers"]] + [("server", r) for r in status["servers"]]
        if not status["workers"]:
            problems.append("no worker daemon is registered: start 'psring worker --store ...' on each machine")
        hosts = {r.get("host") for _, r in daemons}
        for role, rec in daemons:
            who = f"{role} {rec.get('id')} ({rec.get('host')}:{rec.get('port')})"
            host = str(rec.get("host"))
            if host.startswith("127.0.1.") or host.startswith("172.17."):
                problems.append(
                    f"{who} advertises {host}, which other hosts cannot reach (a hosts-file or docker0 address): "
                    "set PSRING_ADVERTISE_HOST to its routable address"
                )
            elif host.startswith("127.") and any(not str(h).startswith("127.") for h in hosts):
                problems.append(f"{who} advertises loopback while others do not: set PSRING_ADVERTISE_HOST")
            if rec.get("version") != __version__ or rec.get("wire") != wire.WIRE_VERSION:
                problems.append(
                    f"{who} runs psring {rec.get('version')} (wire {rec.get('wire')}), this is {__version__} "
                    f"(wire {wire.WIRE_VERSION}): install the same version everywhere"
                )
            skew = abs(float(rec.get("time", 0)) - time.time())
            if skew > 30 + HEARTBEAT_S * 3:
                problems.append(f"{who}: its clock is {skew:.0f}s off this one (or it stopped heartbeating): check NTP")
            if rec.get("state") == "idle":
                problems += await _probe(who, rec, client.secret, timeout)
        for rec in status["workers"]:
            for other, result in (rec.get("probes") or {}).items():
                if result != "ok":
                    problems.append(f"worker {rec['id']} cannot reach {other}: {result}")
    finally:
        await client.close()
    return problems


async def _probe(who: str, rec: dict[str, Any], secret: bytes | None, timeout: float) -> list[str]:
    try:
        conn = await open_connection(
            str(rec.get("host")),
            int(rec.get("port") or 0),
            secret=secret,
            hello={"role": "doctor"},
            router=Mailbox(),
            timeout=timeout,
            name="doctor",
        )
    except AuthError as exc:
        return [f"{who} rejects this secret ({exc}): the secrets disagree; set the same PSRING_SECRET everywhere"]
    except (PsringError, OSError) as exc:
        return [f"{who} is unreachable on its declared port ({exc}): open the port or fix PSRING_ADVERTISE_HOST"]
    await conn.close()
    return []


# ------------------------------------------------------------------------ CLI
def _run(coro: Any) -> Any:
    from .facade import new_event_loop

    loop = new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


def _serve(daemon: _Daemon, label: str) -> int:
    try:
        _run(daemon.serve())  # type: ignore[attr-defined]
    except (PsringError, OSError) as exc:
        print(f"psring {label}: {exc}", flush=True)
        return 1
    return 0


def _daemon_args(args: Any) -> dict[str, Any]:
    return {
        "secret": args.secret,
        "host": args.host,
        "port": args.port,
        "advertise": args.advertise,
        "name": args.name,
        "metrics_port": args.metrics_port,
    }


def cli_worker(args: Any) -> int:
    return _serve(WorkerDaemon(args.store, trace_dir=args.trace_dir, **_daemon_args(args)), "worker")


def cli_server_daemon(args: Any) -> int:
    return _serve(ServerDaemon(args.store, checkpoint_dir=args.checkpoint_dir, **_daemon_args(args)), "server")


def cli_submit(args: Any) -> int:
    from .train import print_summary

    train = {
        "epochs": args.epochs,
        "batch_size": args.batch_size,
        "lr": args.lr,
        "momentum": args.momentum,
        "optimizer": args.optimizer,
        "compression": None if args.compression == "none" else args.compression,
        "seed": args.seed,
    }
    try:
        extra = json.loads(args.args) if args.args else {}
    except ValueError as exc:
        print(f"psring submit: --args is not JSON: {exc}", flush=True)
        return 2
    try:
        client = Client(args.store, secret=args.secret)
    except (PsringError, OSError) as exc:
        print(f"psring submit: {exc}", flush=True)
        return 1
    try:
        job = client.submit(
            args.topology,
            args.workers,
            servers=args.servers,
            entrypoint=args.entrypoint,
            args=extra,
            train=train,
            wait_for_workers=not args.no_wait,
            timeout=args.timeout,
        )
        print(f"psring submit: job {job.id} placed ({args.topology}, {args.workers} workers)", flush=True)
        for rec in job.stream():
            text = f"epoch {rec.get('epoch')} step {rec.get('step')}/{rec.get('total')} loss {rec.get('loss', 0):.4f}"
            if "acc" in rec:
                text += f" acc {rec['acc']:.4f}"
            print(f"[job {job.id}] {text}", flush=True)
        result = job.wait()
    except (PsringError, ValueError) as exc:
        print(f"psring submit: {exc}", flush=True)
        return 1
    finally:
        client.close()
    if args.entrypoint is None and isinstance(result, dict) and "test_accuracy" in result:
        print_summary(result)
    else:
        print(json.dumps(result))
    if args.json:
        print(json.dumps(result))
    return 0


def cli_status(args: Any) -> int:
    try:
        client = Client(args.store, secret=args.secret)
    except (PsringError, OSError) as exc:
        print(f"psring status: {exc}", flush=True)
        return 1
    try:
        status = client.status()
    finally:
        client.close()
    if args.json:
        print(json.dumps(status))
        return 0
    print(f"{'role':8} {'id':40} {'address':24} {'state':6} job")
    for role in ("workers", "servers"):
        for r in status[role]:
            print(
                f"{role[:-1]:8} {r['id']:40} {str(r['host']) + ':' + str(r['port']):24} {r['state']:6} {r.get('job')}"
            )
    for j in status["jobs"]:
        print(f"job {j['id']}: {j['state']} {j['topology']} {len(j.get('workers', []))} workers {j.get('kind')}")
    return 0


def cli_doctor(args: Any) -> int:
    problems = _run(doctor(args.store, args.secret, timeout=args.timeout))
    for p in problems:
        print(f"problem: {p}", flush=True)
    if not problems:
        print("psring doctor: no problems found", flush=True)
    return 1 if problems else 0


def cli_trace(args: Any) -> int:
    from .observe import read_events, to_chrome_trace

    events = read_events(args.dir)
    if not events:
        print(f"psring trace: no event logs (*.jsonl) in {args.dir}", flush=True)
        return 1
    with open(args.output, "w") as fh:
        json.dump(to_chrome_trace(events), fh)
    ranks = {(e.get("job"), e["rank"]) for e in events}
    print(f"psring trace: {len(events)} collectives of {len(ranks)} rank(s) -> {args.output}", flush=True)
    return 0


def register(sub: Any) -> None:
    import argparse

    fmt = argparse.ArgumentDefaultsHelpFormatter

    def common(p: Any) -> None:
        p.add_argument("--store", default=os.environ.get("PSRING_STORE"), required="PSRING_STORE" not in os.environ)
        p.add_argument("--secret", default=os.environ.get("PSRING_SECRET"), help="shared secret (PSRING_SECRET)")

    p = sub.add_parser("worker", help="worker daemon: registers, waits for jobs, runs them", formatter_class=fmt)
    common(p)
    p.add_argument("--host", default=os.environ.get("PSRING_BIND_HOST", "0.0.0.0"), help="bind address")
    p.add_argument("--port", type=int, default=int(os.environ.get("PSRING_PORT") or 0), help="declared port")
    p.add_argument("--advertise", default=os.environ.get("PSRING_ADVERTISE_HOST"), help="address others use")
    p.add_argument("--name", default=os.environ.get("PSRING_NAME"), help="daemon id (default host-pid-random)")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    p.add_argument("--trace-dir", default=os.environ.get("PSRING_TRACE_DIR"), help="write per-collective event logs")
    p.set_defaults(func=cli_worker)

    p = sub.add_parser("submit", help="run a training job on a running cluster", formatter_class=fmt)
    common(p)
    p.add_argument("--topology", choices=("ring", "ps"), default="ring")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--servers", type=int, default=None, help="parameter-server shards (ps)")
    p.add_argument("--model", choices=("mlp",), default="mlp")
    p.add_argument("--dataset", choices=("digits",), default="digits")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    p.add_argument("--compression", choices=("none", "fp16"), default="none")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--entrypoint", default=None, help="package.module:function run on every worker with a Group")
    p.add_argument("--args", default=None, help="JSON keyword arguments for the entrypoint")
    p.add_argument("--no-wait", action="store_true", help="fail at once if not enough idle daemons")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for any one collective")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cli_submit)

    p = sub.add_parser("status", help="daemons and jobs of a cluster", formatter_class=fmt)
    common(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cli_status)

    p = sub.add_parser("doctor", help="pre-flight checks of a cluster", formatter_class=fmt)
    common(p)
    p.add_argument("--timeout", type=float, default=5.0)
    p.set_defaults(func=cli_doctor)

    p = sub.add_parser("trace", help="turn event logs into a Chrome trace", formatter_class=fmt)
    p.add_argument("dir", help="directory of *.jsonl event logs (PSRING_TRACE_DIR, --trace-dir)")
    p.add_argument("-o", "--output", default="psring-trace.json")
    p.set_defaults(func=cli_trace)


__all__ = ["AsyncClient", "Client", "Job", "JobError", "ServerDaemon", "WorkerDaemon", "doctor", "register"]
