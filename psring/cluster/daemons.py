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
import errno
import importlib
import inspect
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
import weakref
from collections.abc import Callable
from typing import Any

from .. import settings as settings_mod
from ..core import wire
from ..errors import PeerLostError, PsringError
from ..rendezvous.client import connect_store, parse_store_address
from ..rendezvous.scheduler import routable_host_towards
from ..topology.api import init_group
from ..topology.blocking import init
from ..topology.ps.shards.server import ShardHost, start_servers
from ..topology.recorder import FlightRecorder
from ..training.checkpoint import StoreCheckpoints
from ..training.job import worker
from ..transport.listener import Listener
from ..transport.loop import new_event_loop
from ..transport.mailbox import Mailbox
from ..version import __version__
from .metrics import Metrics

logger = logging.getLogger(__name__)

ROOT = "psring-cluster/"
HEARTBEAT_S = 1.0
PORT_BACK_S = 10.0  # how long an idle daemon waits for a cancelled job's group to free its port
#: a daemon record nobody refreshes for this long goes away where the store supports it (etcd, a lease);
#: long after it shows as lost (cluster.client.LOST_AFTER_S)
RECORD_TTL_S = 3600.0
#: after SIGTERM, how long a daemon's goodbyes to a reachable store may take before it gives the store up
#: (docker stop and a Kubernetes eviction SIGKILL after 10 s and 30 s; a store that is away is given up at once)
STOP_GRACE_S = 4.0


def key(*parts: Any) -> str:
    return ROOT + "/".join(str(p) for p in parts)


def run_key(jid: int, attempt: int, *parts: Any) -> str:
    """A key of one attempt of a job (its acks and its ranks' outcomes)."""
    return key("jobs", jid, f"a{attempt}", *parts)


def job_name(jid: int, attempt: int) -> str:
    """The job's name in the store for one attempt (PSRING_JOB): every attempt meets afresh."""
    return f"job{jid}" if attempt == 0 else f"job{jid}.r{attempt}"


class JobError(PsringError):
    """A cluster job could not be placed, or failed (the message names the daemon and rank)."""


def _secret_bytes(secret: str | bytes | None) -> bytes | None:
    if secret is None:
        secret = settings_mod.current().secret
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
        #: the signal that told this daemon to stop (SIGTERM, SIGINT), if one did
        self.signalled_by: str | None = None
        #: the specs of the jobs this daemon takes part in now, by id (put back into a store that lost them)
        self.owned: dict[int, dict[str, Any]] = {}
        #: a server daemon's hosting records, by job (likewise)
        self.hosting: dict[int, bytes] = {}
        self.store: Any = None
        #: store clients of its own a job's part opened (a ps job's shards), given up with the daemon's own
        self.side_stores: weakref.WeakSet[Any] = weakref.WeakSet()
        self.listener: Listener | None = None
        self.metrics: Any = None
        #: the heartbeat thread's loop and store client, while it runs (given up from that loop at stop)
        self._beat_loop: asyncio.AbstractEventLoop | None = None
        self._beat_store: Any = None
        self._beat_task: asyncio.Task[None] | None = None

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
        await self.store.set(key(self.kind, self.id), json.dumps(self.record()), ttl=RECORD_TTL_S)

    def _heartbeat_thread(self) -> None:
        """Beat from a thread of its own (own loop, own store connection): a job that holds the
        daemon's event loop for a while (imports, a long computation) is not mistaken for a dead daemon."""

        async def beat() -> None:
            if self._beat_stop.is_set():
                return
            store = await connect_store(parse_store_address(self.store_spec), secret=self.secret, timeout=30.0)
            self._beat_store = store
            try:
                while not self._beat_stop.is_set():
                    self.beat += 1
                    with contextlib.suppress(PsringError, OSError):
                        await store.set(key(self.kind, self.id), json.dumps(self.record()), ttl=RECORD_TTL_S)
                    await asyncio.get_running_loop().run_in_executor(None, self._beat_stop.wait, HEARTBEAT_S)
            finally:
                with contextlib.suppress(Exception):  # cleanup: a close may fail any way (the peer is gone)
                    await store.close()

        loop = new_event_loop()
        task = loop.create_task(beat())
        self._beat_loop, self._beat_task = loop, task
        try:
            loop.run_until_complete(task)
        except asyncio.CancelledError:  # stopped before its store connection was made (_stop_heartbeat)
            pass
        except (PsringError, OSError) as exc:
            logger.warning("%s %s: heartbeat stopped: %s", self.kind[:-1], self.id, exc)
        finally:
            self._beat_loop = self._beat_task = None
            loop.close()

    def _start_heartbeat(self) -> threading.Thread:
        self._beat_stop = threading.Event()
        thread = threading.Thread(target=self._heartbeat_thread, name=f"psring-heartbeat-{self.id}", daemon=True)
        thread.start()
        return thread

    def _stop_heartbeat(self, thread: threading.Thread) -> None:
        """End the heartbeat thread before the process ends. Its store connection may be reconnecting
        (the store is gone): it is given up from the thread's own loop, so the beat in flight raises at
        once. Left running into interpreter shutdown, that thread's event loop crashed the process now
        and then (SIGSEGV at exit, after "stopped" was logged: CI, #59's test of SIGTERM without a store)."""
        self._beat_stop.set()
        loop, store, task = self._beat_loop, self._beat_store, self._beat_task
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: the thread is ending anyway
            if loop is not None and store is not None and hasattr(store, "give_up"):
                loop.call_soon_threadsafe(store.give_up, f"{self.kind[:-1]} {self.id} stopping")
            elif loop is not None and task is not None and store is None:
                # still making its first connection (a store gone since the daemon started: up to 30 s)
                loop.call_soon_threadsafe(task.cancel)
        thread.join(timeout=1.0)  # (given up, it ends in milliseconds; the store's goodbyes need the grace)
        if thread.is_alive():
            frame = sys._current_frames().get(thread.ident or -1)
            where = "".join(traceback.format_stack(frame)[-6:]) if frame is not None else "(no frame)"
            logger.warning("%s %s: heartbeat thread still running at stop, in:\n%s", self.kind[:-1], self.id, where)

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
        deadline = time.monotonic() + PORT_BACK_S
        while True:
            try:
                await self.listener.start(self.bind_host, self.port)
                break
            except OSError as exc:  # a job's group that was just cancelled may still hold the port
                if exc.errno != errno.EADDRINUSE or not self.port or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
        self.port = self.listener.port

    async def _close_port(self) -> None:
        if self.listener is not None:
            await self.listener.close()
            self.listener = None

    async def start(self) -> None:

        address = parse_store_address(self.store_spec)
        self.store = await connect_store(address, secret=self.secret, timeout=60.0, role=self.kind[:-1])
        if hasattr(self.store, "disk_retry_s"):  # a store whose disk refuses changes: wait, as for a lost one
            self.store.disk_retry_s = self.store.reconnect_s
        if self.advertise is None:
            self.advertise = settings_mod.current().advertise_host or routable_host_towards(address.host or "")
        if self.metrics_port is not None:
            self.metrics = Metrics(self.metrics_port, role=self.kind[:-1])
        await self._open_port()
        # a daemon that starts holds no job: a claim on its name is a previous life's (SIGKILLed mid-job and
        # started again under its name by a restart policy), which would keep it out of every job after
        await self.store.delete(key("claim", self.id))
        await self._publish()
        if hasattr(self.store, "on_reconnect"):
            self.store.on_reconnect.append(self._reregister)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.signalled, sig.name)

    async def _take(
        self, record: str, raw: bytes, parse: Callable[[bytes], dict[str, Any]], what: str
    ) -> dict[str, Any] | None:
        """A record a submitter left under this daemon's name (``record``/<id>), taken (deleted) and checked
        by ``parse``; one that is not ``what`` it claims is said and dropped (None), not a crash."""
        await self.store.delete(key(record, self.id))
        try:
            return parse(raw)
        except ValueError as exc:
            logger.warning("%s %s: dropped %s: %s", self.kind[:-1], self.id, what, exc)
            print(f"psring {self.kind[:-1]} {self.id}: dropped {what}: {exc}", flush=True)
            return None

    def signalled(self, name: str = "SIGTERM") -> None:
        """Stop within docker's grace in any state: the serve loop and a job in flight see ``stopping``;
        the store's goodbyes (this daemon's records, a job's outcome) get STOP_GRACE_S, and a store that
        is away now (reconnecting), or whose disk refuses changes (a call waits to try again), is given
        up at once -- waiting out its reconnect window is what a SIGKILL would end, and a full disk
        would refuse the goodbyes too."""
        if self.stopping.is_set():
            return
        self.signalled_by = name
        self.stopping.set()
        reason = f"{self.kind[:-1]} {self.id} stopped ({name}) while the store was unreachable"
        for store in [self.store, *self.side_stores]:  # (a job's shards hold clients of their own)
            if store is None or not hasattr(store, "give_up"):
                continue
            if getattr(store, "waiting_for_disk", 0):
                logger.warning("%s %s: %s; not waiting for the store (its disk refuses changes)", self.kind[:-1],
                               self.id, name)  # fmt: skip
                store.give_up(f"{self.kind[:-1]} {self.id} stopped ({name}) while the store's disk refused changes")
            elif getattr(store, "reconnecting", False):
                logger.warning("%s %s: %s; not waiting for the store", self.kind[:-1], self.id, name)
                store.give_up(reason)
            else:
                asyncio.get_running_loop().call_later(STOP_GRACE_S, store.give_up, reason)

    async def _reregister(self, restarted: bool) -> None:
        """After reconnecting to a store that restarted: put back what this daemon owns. A store with a
        data dir has it all already (each write here is a no-op then); one without lost it: this
        daemon's record, the jobs it runs (spec, state, the job counter past them) and, for a server
        daemon, its hosting records."""
        if not restarted:
            return
        await self._publish()
        for jid, spec in list(self.owned.items()):
            if await self.store.get(key("jobs", jid, "spec")) is None:
                await self.store.set(key("jobs", jid, "spec"), json.dumps(spec))
                await self.store.compare_set(key("jobs", jid, "state"), None, b"running")
                while True:  # a new job must not take this one's id (every rank of it may do this at once)
                    raw = await self.store.get(key("next-job"))
                    if raw is not None and int(raw) >= jid:
                        break
                    if (await self.store.compare_set(key("next-job"), raw, str(jid).encode()))[0]:
                        break
        for jid, order in list(self.hosting.items()):
            await self.store.set(key("hosting", self.id, jid), order)
        logger.warning("%s %s: re-registered with the restarted store at %s", self.kind[:-1], self.id, self.store_spec)

    async def _new_store(self) -> Any:
        """A store connection of its own (shard servers close theirs when they stop)."""
        store = await connect_store(parse_store_address(self.store_spec), secret=self.secret, timeout=30.0)
        if hasattr(store, "disk_retry_s"):  # a store whose disk refuses changes: wait, as the daemon's own does
            store.disk_retry_s = store.reconnect_s
        self.side_stores.add(store)
        return store

    async def stop(self) -> None:
        await self._close_port()
        with contextlib.suppress(PsringError, OSError):
            await self.store.delete(key(self.kind, self.id))
            await self.store.delete(key("claim", self.id))
        with contextlib.suppress(PsringError, OSError):
            await self.store.close()
        if self.metrics is not None:
            self.metrics.close()


def _progress_sent(task: asyncio.Task[None]) -> None:
    """Progress is best effort: a store that is away (or gone past the bound) costs a report, and the
    daemon hears of it from its own calls."""
    if not task.cancelled() and task.exception() is not None:
        logger.debug("progress report not stored: %s", task.exception())


class WorkerDaemon(_Daemon):
    """``psring worker``: waits for jobs, runs its rank of each, reports, waits again."""

    kind = "workers"

    async def serve(self) -> None:
        await self.start()
        beat = self._start_heartbeat()  # before "ready": a daemon said ready is whole (a SIGUSR1 dump shows its beat)
        try:
            ready = f"psring worker {self.id}: ready on {self.advertise}:{self.port}, store {self.store_spec}"
            print(ready, flush=True)
            while not self.stopping.is_set():
                get = asyncio.create_task(self.store.get(key("assign", self.id), timeout=1.0))
                stop = asyncio.create_task(self.stopping.wait())
                done, _ = await asyncio.wait({get, stop}, return_when=asyncio.FIRST_COMPLETED)
                stop.cancel()
                if get not in done:
                    get.cancel()
                    with contextlib.suppress(BaseException):  # cancelled by us: nothing to hear
                        await get
                    break
                raw = get.result()
                if raw is None:
                    continue
                assignment = await self._take("assign", raw, _assignment, "an assignment")
                if assignment is not None:
                    await self._run_job(assignment)
        finally:
            self.stopping.set()
            self._stop_heartbeat(beat)
            await self.stop()
            print(f"psring worker {self.id}: stopped after {self.jobs_run} job(s)", flush=True)

    async def _run_job(self, assignment: dict[str, Any]) -> None:
        jid, rank, attempt = int(assignment["job"]), int(assignment["rank"]), int(assignment.get("attempt", 0))
        raw = await self.store.get(key("jobs", jid, "spec"))
        try:
            spec = json.loads(raw) if raw is not None else None
        except (ValueError, UnicodeDecodeError):
            spec = None  # (not a spec a submitter writes: as if there were none)
        if not isinstance(spec, dict) or spec.get("attempt", 0) != attempt:
            logger.warning("worker %s: job %s attempt %s is not current; ignored", self.id, jid, attempt)
            return
        self.state, self.job = "busy", jid
        self.owned[jid] = spec
        print(f"psring worker {self.id}: taking rank {rank} of job {jid} (attempt {attempt})", flush=True)
        if self.metrics is not None:
            self.metrics.job.labels("worker").set(jid)
            if attempt:
                self.metrics.restarts.labels("worker").inc()
        await self._publish()
        await self.store.set(run_key(jid, attempt, "ack", rank), self.id)
        outcome: dict[str, Any] = {"ok": False, "worker": self.id}
        body = asyncio.create_task(self._job_body(spec, rank))
        watch = asyncio.create_task(self._watch(jid, attempt))
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
                if stop in done:
                    why = f"worker {self.id} was stopped (SIGTERM) and abandoned the job"
                elif watch.exception() is not None:  # the store stayed away past the bound
                    why = f"worker {self.id} lost the store and abandoned the job: {watch.exception()}"
                    # the daemon goes at its next store call, which says the same
                else:
                    why = f"job {jid} was {watch.result()} elsewhere"
                await self._abandon(body)
                outcome["error"] = why
                # a consequence (the job ended elsewhere) only when the watch saw it so; a rank that
                # lost the store or was signalled is a cause of its own
                outcome["stopped"] = watch in done and watch.exception() is None
        except Exception as exc:  # any failure of the job's body is its outcome, reported
            outcome["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            for t in (watch, stop):
                t.cancel()
            outcome["seconds"] = time.monotonic() - t0
            outcome["at"] = time.time()  # which rank failed first, when every failure names another
            if self.metrics is not None:
                self.metrics.jobs.labels("worker", "ok" if outcome["ok"] else "failed").inc()
                self.metrics.job.labels("worker").set(0)
            self.jobs_run += 1
            self.state, self.job = "idle", None
            self.owned.pop(jid, None)
            if not self.stopping.is_set():
                await self._open_port()
            # idle is published before this rank's outcome, so whoever sees the job's ranks finished (a
            # submitter's wait) or the job done (the last rank marks it) sees its workers idle again
            with contextlib.suppress(PsringError, OSError):
                await self.store.delete(key("claim", self.id))
                await self._publish()
            with contextlib.suppress(PsringError, OSError):
                await self.store.set(run_key(jid, attempt, "rank", rank), json.dumps(outcome, default=str))
                await self._settle(spec, rank, outcome)

    async def _abandon(self, body: asyncio.Task[Any]) -> None:
        """Cancel a job's body and wait for it, at most STOP_GRACE_S / 2: its outcome must reach the store
        within the stop's grace. Cancelled again every 0.1 s meanwhile: a rank SIGTERMed as its group was
        being set up swallowed the one cancellation and trained on to the job's end (the fault campaign's
        ring/worker/wire/rendezvous: the outcome came after the store was given up, and the submitter
        waited on a rank nobody ran). A body still running after the bound is left to the process's end."""
        deadline = time.monotonic() + STOP_GRACE_S / 2
        while not body.done():
            body.cancel()
            if time.monotonic() > deadline:
                logger.warning("worker %s: the job's rank did not stop within %gs; leaving it", self.id,
                               STOP_GRACE_S / 2)  # fmt: skip
                return
            await asyncio.wait({body}, timeout=0.1)
        if not body.cancelled():
            body.exception()  # (retrieved: cancelled, its outcome is why)

    async def _settle(self, spec: dict[str, Any], rank: int, outcome: dict[str, Any]) -> None:
        """Keep the job's state true without a submitter watching: a rank that failed of itself
        fails the job (with its reason); the last rank to finish well marks it done."""
        jid = spec["id"]
        state_key = key("jobs", jid, "state")
        if not outcome["ok"]:
            if outcome.get("stopped"):
                return  # it was told to stop: whoever failed the job gave the reason
            if spec.get("elastic"):
                return  # an elastic job goes on without this rank (its submitter judges the whole)
            reason = f"job {jid} failed: rank {rank} on worker {self.id}: {outcome.get('error')}"
            ok, _ = await self.store.compare_set(state_key, b"running", b"failed")
            if ok:
                await self.store.set(key("jobs", jid, "reason"), reason)
            return
        for r in range(len(spec["workers"])):
            raw = await self.store.get(run_key(jid, spec["attempt"], "rank", r))
            if raw is None or not json.loads(raw).get("ok"):
                return
        await self.store.compare_set(state_key, b"running", b"done")

    async def _watch(self, jid: int, attempt: int) -> str:
        """Returns when the job is failed, cancelled or restarted elsewhere (so this rank stops at once)."""
        while True:
            try:
                state = await self.store.get(key("jobs", jid, "state"))
                if state in (b"failed", b"cancelled", b"restarting"):
                    return state.decode()
                spec = json.loads(await self.store.get(key("jobs", jid, "spec")) or b"{}")
            except PeerLostError:
                raise  # the store stayed away past PSRING_STORE_RECONNECT_S: this rank abandons the job
            except (PsringError, ValueError) as exc:  # one refused or garbled answer costs no job
                logger.warning("worker %s: watching job %s: %s; watching on", self.id, jid, exc)
                spec = {}
            if spec.get("attempt", attempt) != attempt:
                return "restarted"
            await asyncio.sleep(0.5)

    async def _job_body(self, spec: dict[str, Any], rank: int) -> Any:
        jid, attempt = spec["id"], spec.get("attempt", 0)
        job = job_name(jid, attempt)
        await self._close_port()  # the job's group listens on this daemon's declared port now
        env = rank_env(spec, rank, store=self.store_spec, port=self.port, advertise=str(self.advertise))
        servers = None
        recorder = None
        try:
            if spec["topology"] == "ps" and rank == 0 and not spec.get("shard_hosts"):
                servers = await start_servers(  # a ps worker listens on nothing: they take the declared port
                    await self._new_store(),
                    spec["servers"],
                    job=job,
                    secret=self.secret,
                    host=self.bind_host,
                    port=self.port,
                    advertise=self.advertise,
                )
            if self.trace_dir:
                recorder = FlightRecorder(self.trace_dir, job)
            if spec["kind"] == "train":
                return await self._train(spec, env)
            return await self._entrypoint(spec, env)
        finally:
            if recorder is not None:
                recorder.close()
            if servers is not None:
                await servers.drain(timeout=10.0)
                await servers.close()

    def _store_later(self, k: str, record: dict[str, Any]) -> None:
        """Write a report to the store without waiting: best effort (see _progress_sent)."""
        task = asyncio.get_running_loop().create_task(self.store.set(k, json.dumps(record)))
        task.add_done_callback(_progress_sent)

    async def _train(self, spec: dict[str, Any], env: dict[str, str]) -> Any:

        jid = spec["id"]
        last = [0.0]

        def progress(record: dict[str, Any]) -> None:
            now = time.monotonic()
            if now - last[0] > 0.2 or "acc" in record:
                last[0] = now
                self._store_later(key("jobs", jid, "progress"), record)

        counted = [0]

        def report(record: dict[str, Any]) -> None:  # each rank's step times, for the dashboard
            if self.metrics is not None:
                self.metrics.steps.labels("worker").inc(max(record["step"] - counted[0], 0))
                counted[0] = max(counted[0], record["step"])
                self.metrics.compute.labels("worker").set(record["compute_s"])
                self.metrics.comm.labels("worker").set(record["comm_s"])
            self._store_later(key("jobs", jid, "ranks", record["rank"]), record)

        checkpoints = StoreCheckpoints(self.store, key("jobs", jid, "checkpoint"))
        summary = await worker(spec["train"], progress=progress, checkpoints=checkpoints, env=env, report=report)
        return summary

    async def _entrypoint(self, spec: dict[str, Any], env: dict[str, str]) -> Any:
        module_name, _, attr = spec["entrypoint"].partition(":")
        try:
            fn = getattr(importlib.import_module(module_name), attr or "main")
        except (ImportError, AttributeError) as exc:
            raise JobError(f"entrypoint {spec['entrypoint']!r} cannot be loaded on worker {self.id}: {exc}") from exc
        kwargs = spec.get("args") or {}
        if inspect.iscoroutinefunction(fn):
            group = await init_group(env=env)  # its timeout is the job's: PSRING_TIMEOUT in env
            try:
                result = await fn(group, **kwargs)
            finally:
                stats = group.stats()
                await group.close()
        else:

            def run_sync() -> Any:
                g = init(env=env)
                try:
                    return fn(g, **kwargs), g.stats()
                finally:
                    g.close()

            result, stats = await asyncio.to_thread(run_sync)
        if self.metrics is not None:
            self.metrics.add_traffic(stats.get("bytes_sent", 0), stats.get("bytes_received", 0))
        return json.loads(json.dumps(result, default=str))


def rank_env(spec: dict[str, Any], rank: int, *, store: str, port: int, advertise: str) -> dict[str, str]:
    """What a job's rank on a worker daemon resolves its settings from: the daemon's own environment,
    then the job's. The store is the cluster's: rank 0 never serves one of its own at that address
    (PSRING_STORE_SERVE=0), even while the cluster's restarts -- it waits for it, as every client does."""
    env = settings_mod.child_env(
        settings_mod.process_env(),
        job=job_name(spec["id"], spec.get("attempt", 0)),
        topology=spec["topology"],
        timeout=spec.get("timeout"),
        port=port,
        advertise_host=advertise,
        store=store,
        store_serve=False,
    )
    env.update(RANK=str(rank), WORLD_SIZE=str(len(spec["workers"])), LOCAL_RANK="0", MASTER_ADDR="", MASTER_PORT="")
    return env


class ServerDaemon(_Daemon):
    """``psring server --cluster``: hosts the shards of ps jobs the submitters give it.

    With ``--checkpoint-dir`` (a volume that outlives the process) it keeps its identity there
    and records each job it hosts in the store, so that, restarted after a crash (a restart
    policy brings the container back), it resumes the shards of those jobs from their
    checkpoints on its declared port; the workers reconnect and re-send the step in flight.
    """

    kind = "servers"

    def __init__(self, store: str, *, checkpoint_dir: str | None = None, **kwargs: Any) -> None:
        super().__init__(store, **kwargs)
        self.checkpoint_dir = checkpoint_dir
        self.host: ShardHost | None = None
        if checkpoint_dir is not None:
            self.id = self._persistent_id(checkpoint_dir, explicit=kwargs.get("name") is not None)

    def _persistent_id(self, directory: str, explicit: bool) -> str:
        """The id kept in the checkpoint directory: the same daemon after a restart (a --name given
        is kept there too, so a restart without it is still the same daemon)."""
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, "daemon-id")
        if not explicit:
            with contextlib.suppress(FileNotFoundError), open(path) as fh:
                kept = fh.read().strip()
                if kept:
                    return kept
        with open(f"{path}.tmp", "w") as fh:
            fh.write(self.id)
        os.replace(f"{path}.tmp", path)
        return self.id

    async def _open_port(self) -> None:
        """One port for the daemon's whole life: doctor's probes while idle, every job's shards while
        busy. Bound here but accepting only once :meth:`serve` has resumed the shards it hosted before
        a restart: a worker reconnecting at once waits in the backlog instead of being turned away."""
        if self.host is None:
            self.host = ShardHost(secret=self.secret, name=f"psring server {self.id}")
            await self.host.start(self.bind_host, self.port, serving=False)
            self.port = self.host.port

    async def _close_port(self) -> None:
        if self.host is not None:
            await self.host.close()
            self.host = None

    async def _serve_order(self, order: dict[str, Any], restore: bool) -> Any:
        jid, attempt = int(order["job"]), int(order.get("attempt", 0))
        directory = os.path.join(self.checkpoint_dir, f"job{jid}") if self.checkpoint_dir else None
        store = await self._new_store()
        try:
            return await start_servers(
                store,
                order["num_shards"],
                job=job_name(jid, attempt),
                secret=self.secret,
                advertise=self.advertise,
                shard_ids=order["shards"],
                checkpoint_dir=directory,
                restore=restore and directory is not None,
                checkpoint_name=f"job{jid}",  # one name for every attempt: a restart resumes from it
                shard_host=self.host,
            )
        except (Exception, asyncio.CancelledError):  # cleanup, then the error stands
            self.side_stores.discard(store)
            with contextlib.suppress(PsringError, OSError):
                await store.close()
            raise

    async def _order_failed(self, jid: int, exc: BaseException) -> None:
        """A job's shards could not start here (its store refused them, the job's port is taken, ...): said,
        and forgotten; the daemon goes on serving. The job's workers meet no shards at its address and fail
        or restart by their own timeout, as for a server lost before it registered."""
        logger.warning("server %s: the shards of job %d did not start: %s", self.id, jid, exc)
        print(f"psring server {self.id}: the shards of job {jid} did not start: {exc}", flush=True)
        self.hosting.pop(jid, None)
        with contextlib.suppress(PsringError, OSError):  # best effort: a restart must not resume it either
            await self.store.delete(key("hosting", self.id, jid))

    async def _resume(self, running: dict[int, tuple[int, Any]]) -> None:
        """After a restart: the shards of the jobs this daemon hosted that still run, from their checkpoints."""
        for k in await self.store.list(key("hosting", self.id) + "/"):
            order = json.loads(await self.store.get(k) or b"{}")
            jid = int(order.get("job", -1))
            state = await self.store.get(key("jobs", jid, "state"))
            spec = json.loads(await self.store.get(key("jobs", jid, "spec")) or b"{}")
            if state != b"running" or spec.get("attempt") != order.get("attempt"):
                await self.store.delete(k)
                continue
            running[jid] = (order.get("attempt", 0), await self._serve_order(order, restore=True))
            self.hosting[jid] = json.dumps(order).encode()
            print(
                f"psring server {self.id}: resumed shards {order['shards']} of job {jid} from their checkpoints",
                flush=True,
            )

    async def serve(self) -> None:
        await self.start()
        running: dict[int, tuple[int, Any]] = {}  # job -> (attempt, its shards)
        await self._resume(running)
        assert self.host is not None
        await self.host.start_serving()
        if running:
            self.state, self.job = "busy", max(running)
            await self._publish()
        beat = self._start_heartbeat()
        try:
            print(
                f"psring server {self.id}: ready for ps jobs on {self.advertise}:{self.port}, store {self.store_spec}",
                flush=True,
            )
            while not self.stopping.is_set():
                raw = await self.store.get(key("serve", self.id), timeout=1.0)
                if raw is not None:
                    order = await self._take("serve", raw, _order, "an order")
                    if order is None:
                        continue
                    jid = int(order["job"])
                    if jid in running:  # a restart of the job replaces its earlier attempt
                        await running.pop(jid)[1].close()
                    await self.store.set(key("hosting", self.id, jid), raw)  # outlives this process
                    self.hosting[jid] = raw
                    try:
                        shards = await self._serve_order(order, restore=order.get("attempt", 0) > 0)
                    except (PsringError, OSError, ValueError) as exc:  # one job's: the daemon serves the next
                        await self._order_failed(jid, exc)
                        continue
                    running[jid] = (order.get("attempt", 0), shards)
                    self.state, self.job = "busy", jid
                for jid in list(running):
                    state = await self.store.get(key("jobs", jid, "state"))
                    if state in (b"done", b"failed", b"cancelled"):
                        await running.pop(jid)[1].close()
                        await self.store.delete(key("hosting", self.id, jid))
                        self.hosting.pop(jid, None)
                        self.jobs_run += 1
                if not running and self.state == "busy":
                    self.state, self.job = "idle", None
        finally:
            self.stopping.set()
            self._stop_heartbeat(beat)
            for _attempt, srv in running.values():
                with contextlib.suppress(Exception):  # cleanup: a close may fail any way (the peer is gone)
                    await srv.close()
            await self.stop()


def _parsed(raw: bytes) -> dict[str, Any]:
    try:
        record = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"not JSON ({exc}): {bytes(raw)[:80]!r}") from None
    if not isinstance(record, dict):
        raise ValueError(f"not an object: {bytes(raw)[:80]!r}")
    return record


def _assignment(raw: bytes) -> dict[str, Any]:
    """A worker daemon's assignment (``assign/<id>``, written by a submitter), checked: job, rank, attempt."""
    a = _parsed(raw)
    job, rank, attempt = a.get("job"), a.get("rank"), a.get("attempt", 0)
    if not all(type(v) is int and v >= 0 for v in (job, rank, attempt)):
        raise ValueError(f"expected job, rank and attempt (numbers), got {bytes(raw)[:200]!r}")
    return a


def _order(raw: bytes) -> dict[str, Any]:
    """A server daemon's order (``serve/<id>``, written by a submitter), checked: the job, its shard count,
    this daemon's shards among them, the attempt."""
    order = _parsed(raw)
    job, num, shards, attempt = order.get("job"), order.get("num_shards"), order.get("shards"), order.get("attempt", 0)
    ok = (
        type(job) is int and job >= 0 and type(num) is int and num >= 1 and type(attempt) is int and attempt >= 0
        and isinstance(shards, list) and shards and all(type(i) is int and 0 <= i < num for i in shards)
    )  # fmt: skip
    if not ok:
        raise ValueError(
            f"expected job (a number), num_shards (at least 1), shards (numbers below num_shards) and attempt, "
            f"got {bytes(raw)[:200]!r}"
        )
    return order


__all__ = ["JobError", "ServerDaemon", "WorkerDaemon"]
