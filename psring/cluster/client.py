"""Submitting jobs to a cluster of daemons and following them (``Client``, ``Job``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from .. import settings as settings_mod
from ..rendezvous.client import connect_store, parse_store_address
from ..training.job import train_spec
from ..transport.loop import Portal
from .daemons import HEARTBEAT_S, JobError, _secret_bytes, key, run_key

logger = logging.getLogger(__name__)


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
        """Every daemon's record, with ``age``: seconds since it was last rewritten, by the store's clock."""
        out = []
        for k in await self.store.list(key(kind) + "/"):
            raw, age = await self.store.get_aged(k)
            if raw:
                with contextlib.suppress(ValueError):
                    out.append({**json.loads(raw), "age": age})
        return out

    async def status(self) -> dict[str, Any]:
        """Daemons (a daemon whose heartbeats stopped is shown as ``lost``) and jobs (a failed job
        with its reason)."""
        await self.connect()
        jobs = []
        for k in await self.store.list(key("jobs") + "/"):
            if k.endswith("/spec"):
                spec = json.loads(await self.store.get(k) or b"{}")
                state = await self.store.get(key("jobs", spec.get("id"), "state"))
                reason = await self.store.get(key("jobs", spec.get("id"), "reason"))
                job = {**spec, "state": (state or b"?").decode()}
                if reason is not None and job["state"] in ("failed", "restarting"):
                    job["reason"] = reason.decode(errors="replace")
                jobs.append(job)
        return {
            "workers": [_liveness(r) for r in await self._records("workers")],
            "servers": [_liveness(r) for r in await self._records("servers")],
            "jobs": sorted(jobs, key=lambda j: j.get("id", 0)),
        }

    async def rank_reports(self, jid: int) -> list[dict[str, Any]]:
        """Each rank's latest report of a running main job: seconds per step computing and in the
        exchange over its recent steps, bytes per link so far (the worker daemons write them)."""
        await self.connect()
        out = []
        for k in await self.store.list(key("jobs", jid, "ranks") + "/"):
            raw, age = await self.store.get_aged(k)
            with contextlib.suppress(ValueError, TypeError):
                if raw:
                    out.append({**json.loads(raw), "age": age})
        return sorted(out, key=lambda r: r.get("rank", 0))

    async def stall(self, job: str) -> dict[str, Any] | None:
        """The stall inspector's picture of the running job named ``job`` (its PSRING_JOB), if it
        published one: the verdict, its message, each rank's view, the ranks that said nothing."""
        await self.connect()
        raw = await self.store.get(f"psring/{job}/stall")
        with contextlib.suppress(ValueError, TypeError):
            return json.loads(raw) if raw else None
        return None

    async def submit(
        self,
        topology: str | None = None,
        workers: int = 2,
        *,
        servers: int | None = None,
        entrypoint: str | None = None,
        args: dict[str, Any] | None = None,
        train: dict[str, Any] | None = None,
        wait_for_workers: bool = True,
        place_timeout: float = 600.0,
        timeout: float | None = None,
        max_restarts: int = 0,
        elastic: bool = False,
    ) -> int:
        """Place a job on ``workers`` idle daemons; returns its id once every rank took it.

        ``max_restarts``: when a rank fails (a daemon lost, a rank raising), every rank is
        stopped and the job placed again on the daemons idle then, up to this many times, as
        long as someone waits on it; the main job resumes from its latest checkpoint.
        ``elastic``: a rank that fails or whose daemon is lost does not stop the others (the main job
        trains on with SyncSGD(elastic=True), on either topology); the job is done when every rank
        still there finished, and failed only if none did.
        ``topology`` and ``timeout`` (seconds for any one collective of the job): ``None`` means this
        process's PSRING_TOPOLOGY and PSRING_TIMEOUT.
        """
        config = settings_mod.current()
        topology = topology or config.topology
        if timeout is None:
            timeout = config.timeout
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout={timeout!r} must be a positive number of seconds")
        if topology not in settings_mod.TOPOLOGY_NAMES:
            raise ValueError(f"topology={topology!r} is not one of {', '.join(settings_mod.TOPOLOGY_NAMES)}")
        if type(workers) is not int or workers < 1:
            raise ValueError(f"workers={workers!r} must be a positive integer")
        if servers is not None and (topology != "ps" or servers < 1):
            raise ValueError("servers applies to topology='ps', and must be at least 1")
        if type(max_restarts) is not int or max_restarts < 0:
            raise ValueError(f"max_restarts={max_restarts!r} must be a whole number")
        if elastic and max_restarts:
            raise ValueError("elastic goes on without a lost worker; max_restarts starts every rank again: choose one")
        await self.connect()
        if elastic and topology == "ps" and not [r for r in await self._records("servers") if not _lost(r)]:
            raise ValueError(
                "elastic over ps needs a server daemon (psring server --cluster): without one rank 0's worker "
                "daemon hosts the shards, and losing it would lose the model"
            )
        jid = await self.store.add(key("next-job"), 1)
        spec: dict[str, Any] = {
            "id": jid,
            "topology": topology,
            "servers": servers or workers,
            "size": workers,
            "kind": "entrypoint" if entrypoint else "train",
            "entrypoint": entrypoint,
            "args": args or {},
            "train": {**train_spec(train or {}), **({"elastic": True} if elastic else {})},
            "elastic": bool(elastic),
            "timeout": timeout,
            "workers": [],
            "attempt": 0,
            "max_restarts": max_restarts,
            "restarts": [],
            "submitted": time.time(),
        }
        await self.store.set(key("jobs", jid, "state"), b"queued")
        await self.store.set(key("jobs", jid, "spec"), json.dumps(spec))
        await self._place(spec, wait_for_workers, place_timeout)
        return jid

    async def _place(self, spec: dict[str, Any], wait: bool, place_timeout: float) -> None:
        """Claim idle workers and servers for the job's current attempt and hand out its ranks."""
        jid = spec["id"]
        try:
            chosen = await self._claim(jid, spec["size"], wait, place_timeout)
            spec["workers"] = chosen
            if spec["topology"] == "ps":
                spec["shard_hosts"] = await self._place_shards(spec)
            await self.store.set(key("jobs", jid, "spec"), json.dumps(spec))
            await self.store.set(key("jobs", jid, "state"), b"running")
            for rank, wid in enumerate(chosen):
                assignment = {"job": jid, "rank": rank, "attempt": spec["attempt"]}
                await self.store.set(key("assign", wid), json.dumps(assignment))
            await self._wait_acks(spec, chosen)
        except BaseException:
            await self.store.set(key("jobs", jid, "state"), b"cancelled")
            raise

    async def _claim(self, jid: int, n: int, wait: bool, place_timeout: float) -> list[str]:
        deadline = time.monotonic() + place_timeout
        while True:
            records = await self._records("workers")
            idle = sorted(r["id"] for r in records if r.get("state") == "idle" and not _lost(r))
            if len(idle) >= n:
                got: list[str] = []
                for wid in idle:
                    mine = str(jid).encode()
                    ok, held = await self.store.compare_set(key("claim", wid), None, mine)
                    if not ok and held is not None and (held == mine or await self._stale_claim(wid)):
                        ok, _ = await self.store.compare_set(key("claim", wid), held, mine)
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

    async def _stale_claim(self, wid: str) -> bool:
        """Whether the claim on an idle daemon is older than STALE_CLAIM_S: a placement that never finished
        (its submitter died, or the store's disk refused the rest of it) -- a live one is acked within
        seconds, and its daemon is busy from then on."""
        _, age = await self.store.get_aged(key("claim", wid))
        return age is not None and age > STALE_CLAIM_S

    async def _place_shards(self, spec: dict[str, Any]) -> dict[str, list[int]] | None:
        hosts = sorted(r["id"] for r in await self._records("servers") if not _lost(r))
        if not hosts:
            return None  # rank 0's daemon hosts the shards
        num_shards = spec["servers"]
        plan: dict[str, list[int]] = {}
        for i in range(num_shards):
            plan.setdefault(hosts[i % len(hosts)], []).append(i)
        for sid, shards in plan.items():
            order = {"job": spec["id"], "attempt": spec["attempt"], "shards": shards, "num_shards": num_shards}
            await self.store.set(key("serve", sid), json.dumps(order))
        return plan

    async def _wait_acks(self, spec: dict[str, Any], chosen: list[str], ack_timeout: float = 15.0) -> None:
        jid, attempt = spec["id"], spec["attempt"]
        deadline = time.monotonic() + ack_timeout
        while True:
            missing = [
                (r, wid)
                for r, wid in enumerate(chosen)
                if await self.store.get(run_key(jid, attempt, "ack", r)) is None
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

    async def spec(self, jid: int) -> dict[str, Any]:
        return json.loads(await self.store.get(key("jobs", jid, "spec")) or b"{}")

    async def progress(self, jid: int) -> dict[str, Any] | None:
        raw = await self.store.get(key("jobs", jid, "progress"))
        return json.loads(raw) if raw else None

    async def _outcomes(self, spec: dict[str, Any]) -> dict[int, dict[str, Any]]:
        out = {}
        for r in range(len(spec.get("workers", []))):
            raw = await self.store.get(run_key(spec["id"], spec.get("attempt", 0), "rank", r))
            if raw:
                out[r] = json.loads(raw)
        return out

    async def _fail(self, jid: int, error: str) -> None:
        """Mark the job failed, with the reason (the daemons stop its ranks within a second)."""
        await self.store.set(key("jobs", jid, "reason"), error)
        await self.store.set(key("jobs", jid, "state"), b"failed")

    async def poll(self, jid: int, beats: dict[str, tuple[int, float]], dead_after: float) -> dict[str, Any] | None:
        """None while the current attempt runs; else {"ok": bool, "result"|"error": ...}."""
        spec = json.loads(await self.store.get(key("jobs", jid, "spec")) or b"{}")
        chosen: list[str] = spec.get("workers", [])
        verdict_key = run_key(jid, spec.get("attempt", 0), "verdict")
        verdict = await self.store.get(verdict_key)
        if verdict is not None:  # this attempt was judged failed already (by stream(), say): the same words
            return {"ok": False, "error": verdict.decode(errors="replace")}
        outcomes = await self._outcomes(spec)
        now = time.monotonic()
        reconnects = getattr(self.store, "reconnects", 0)
        if beats.get("\0reconnects", (0, 0.0))[0] != reconnects:
            # this client was cut off from the store (a store restart): no beat could be seen meanwhile,
            # so a daemon's silence counts from now, not from before the outage
            for wid in chosen:
                if wid in beats:
                    beats[wid] = (beats[wid][0], now)
            beats["\0reconnects"] = (reconnects, now)
        dead = []
        for r, wid in enumerate(chosen):
            if r in outcomes:
                continue
            raw = await self.store.get(key("workers", wid))
            rec = json.loads(raw) if raw else None
            beat = rec["beat"] if rec else -1
            pid = rec.get("pid") if rec else None
            if pid and beats.setdefault(f"\0pid {wid}", (pid, now))[0] != pid:
                dead.append((r, wid, -1.0))  # started again under its name: its rank of this job is gone
                continue
            seen = beats.get(wid)
            if seen is None or seen[0] != beat:
                beats[wid] = (beat, now)
            elif now - seen[1] > dead_after:
                dead.append((r, wid, now - seen[1]))
        if spec.get("elastic"):
            return await self._elastic_poll(jid, spec, outcomes, dead, beats)
        if dead:
            r, wid, ago = dead[0]
            error = (
                f"job {jid} failed: worker daemon {wid} (rank {r}) "
                + ("was started again (another process under its name): its rank of the job is gone"
                   if ago < 0 else f"stopped heartbeating {ago:.1f}s ago -- it died or hung")
            )  # fmt: skip
            await self.store.set(verdict_key, error)
            await self._fail(jid, error)
            return {"ok": False, "error": error}
        failed = {r: o for r, o in outcomes.items() if not o.get("ok")}
        if failed and len(outcomes) < len(chosen):
            # give the other ranks a moment to report: the rank whose own error started it all
            # usually reports a little after the peers that merely lost it
            first = beats.setdefault("\0failed", (0, now))[1]
            # when every failure only followed another (a rank lost a peer, a server shard that lived in
            # a silent rank's process, say, or was stopped for it), wait until that rank's daemon is
            # known dead and name it instead
            only_lost = all(_consequence(o) for o in failed.values())
            if now - first < (dead_after + 1.0 if only_lost else 2.0):
                return None
        if failed:
            error = _blame(jid, chosen, failed)
            await self.store.set(verdict_key, error)  # later polls (wait() after stream()) say the same
            await self._fail(jid, error)
            return {"ok": False, "error": error, "ranks": failed}
        if chosen and len(outcomes) == len(chosen):
            await self.store.set(key("jobs", jid, "state"), b"done")
            return {"ok": True, "result": outcomes[0].get("result"), "ranks": outcomes}
        return None

    async def _elastic_poll(
        self, jid: int, spec: dict[str, Any], outcomes: dict[int, dict[str, Any]], dead: list[tuple[int, str, float]],
        beats: dict[str, tuple[int, float]],
    ) -> dict[str, Any] | None:  # fmt: skip
        """An elastic job: a rank whose daemon was lost, or that failed, has left (logged once); the
        job is done once every rank finished or left, with the result of the first that finished
        (the main job's live rank 0 returns the summary), and failed only if none finished."""
        chosen: list[str] = spec["workers"]
        for r, wid, ago in dead:
            if f"\0left {r}" not in beats:
                beats[f"\0left {r}"] = (1, 0.0)
                logger.warning("job %d: worker daemon %s (rank %d) %s; elastic: the others go on", jid, wid, r,
                               "was started again" if ago < 0 else f"stopped heartbeating {ago:.1f}s ago")  # fmt: skip
        left = {r for r, _w, _a in dead} | {int(k.split()[1]) for k in beats if k.startswith("\0left ")}
        left |= {r for r, o in outcomes.items() if not o.get("ok")}
        if len(set(outcomes) | left) < len(chosen):
            return None
        finished = {r: o for r, o in outcomes.items() if o.get("ok")}
        if not finished:
            failed = {r: o for r, o in outcomes.items() if not o.get("ok")}
            error = _blame(jid, chosen, failed) if failed else f"job {jid} failed: every worker daemon was lost"
            await self._fail(jid, error)
            return {"ok": False, "error": error, "ranks": failed}
        await self.store.set(key("jobs", jid, "state"), b"done")
        result = next((o.get("result") for _r, o in sorted(finished.items()) if o.get("result") is not None), None)
        return {"ok": True, "result": result, "ranks": outcomes, "left": sorted(left)}

    async def restart(self, jid: int, why: str, place_timeout: float = 600.0) -> int:
        """Stop the job's current attempt everywhere and place the next one; returns its number."""
        spec = json.loads(await self.store.get(key("jobs", jid, "spec")) or b"{}")
        await self._fail(jid, why)  # every rank still running stops (the daemons watch the state)
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:  # until each rank reported, or its daemon is gone
            outcomes = await self._outcomes(spec)
            pending = [wid for r, wid in enumerate(spec["workers"]) if r not in outcomes]
            records = {r["id"]: r for r in await self._records("workers")}
            if all(wid not in records or _lost(records[wid]) for wid in pending):
                break
            await asyncio.sleep(0.2)
        spec["attempt"] += 1
        spec["restarts"].append({"attempt": spec["attempt"], "why": why, "at": time.time()})
        await self.store.set(key("jobs", jid, "spec"), json.dumps(spec))
        await self.store.set(key("jobs", jid, "state"), b"restarting")
        logger.warning("job %d: restart %d of %d: %s", jid, spec["attempt"], spec["max_restarts"], why)
        await self._place(spec, True, place_timeout)
        return int(spec["attempt"])

    async def wait(self, jid: int, timeout: float | None = None, dead_after: float = 5.0) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        beats: dict[str, tuple[int, float]] = {}
        while True:
            out = await self.poll(jid, beats, dead_after)
            if out is not None:
                if out["ok"]:
                    return out["result"]
                spec = json.loads(await self.store.get(key("jobs", jid, "spec")) or b"{}")
                if spec.get("attempt", 0) >= spec.get("max_restarts", 0):
                    raise JobError(out["error"])
                await self.restart(jid, out["error"])
                beats.clear()
                continue
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {jid} not finished within {timeout:g}s")
            await asyncio.sleep(0.2)


#: a claim on an idle daemon this old is a placement that never finished (acks take at most 15 s)
STALE_CLAIM_S = 30.0

#: a daemon whose record was not rewritten for this long (by the store's clock) stopped heartbeating
LOST_AFTER_S = 5 * HEARTBEAT_S


def _lost(record: dict[str, Any]) -> bool:
    age = record.get("age")
    return age is not None and float(age) > LOST_AFTER_S


def _liveness(record: dict[str, Any]) -> dict[str, Any]:
    return {**record, "state": "lost"} if _lost(record) else record


def _consequence(outcome: dict[str, Any]) -> bool:
    """A rank's failure that followed another's: it lost a peer, or it was stopped because the job had
    already failed elsewhere."""
    return bool(outcome.get("stopped")) or "lost_rank" in outcome or "PeerLostError" in str(outcome.get("error"))


def _blame(jid: int, chosen: list[str], failed: dict[int, dict[str, Any]]) -> str:
    """Which rank's failure started it: one that failed of its own accord, else the rank the
    others lost, else the first to fail."""
    causes = {r: o for r, o in failed.items() if not _consequence(o)}
    if causes:
        r = min(causes)
        return f"job {jid} failed: rank {r} on worker {causes[r].get('worker')}: {causes[r].get('error')}"
    lost = sorted({o["lost_rank"] for o in failed.values() if type(o.get("lost_rank")) is int})
    lost = [r for r in lost if 0 <= r < len(chosen) and r not in failed]
    if lost:  # survivors name the rank they lost: that daemon is the culprit
        r = lost[0]
        first = next(o for o in failed.values() if o.get("lost_rank") == r)
        return f"job {jid} failed: worker daemon {chosen[r]} (rank {r}) was lost mid-job ({first.get('error')})"
    # every failure followed another's (a circle of lost peers, say): the first to fail, by the time
    # each rank's daemon gave, and what the others said, so the message still holds the story
    own = {r: o for r, o in failed.items() if not o.get("stopped")} or failed
    r = min(own, key=lambda q: (float(own[q].get("at") or float("inf")), q))
    message = f"job {jid} failed: rank {r} on worker {failed[r].get('worker')}: {failed[r].get('error')}"
    others = [f"rank {q}: {str(o.get('error'))[:200]}" for q, o in sorted(own.items()) if q != r]
    return message + (f" (first to fail; then {'; '.join(others)})" if others else "")


class Job:
    """A submitted job: ``wait()``, ``stream()``, ``id``."""

    def __init__(self, call: Callable[[Any], Any], inner: AsyncClient, jid: int) -> None:
        #: the client's way to run a coroutine (its portal's call) and its async client
        self._call, self._inner, self.id = call, inner, jid

    def wait(self, timeout: float | None = None) -> Any:
        """The job's result (rank 0's summary or metrics); raises JobError naming the failed daemon."""
        return self._call(self._inner.wait(self.id, timeout))

    def stream(self, interval: float = 0.2) -> Iterator[dict[str, Any]]:
        """Progress records as they change, until the job ends (then wait() gives the outcome).

        A job submitted with ``max_restarts`` is restarted from here when a rank fails, with a
        record ``{"restart": attempt, "of": max_restarts, "why": ...}`` first."""
        call, inner = self._call, self._inner
        beats: dict[str, tuple[int, float]] = {}
        last = None
        while True:
            rec = call(inner.progress(self.id))
            if rec is not None and rec != last:
                last = rec
                yield rec
            done = call(inner.poll(self.id, beats, 5.0))
            if done is not None:
                spec = call(inner.spec(self.id))
                if done["ok"] or spec.get("attempt", 0) >= spec.get("max_restarts", 0):
                    return
                yield {"restart": spec["attempt"] + 1, "of": spec["max_restarts"], "why": done["error"]}
                call(inner.restart(self.id, done["error"]))
                beats.clear()
                continue
            time.sleep(interval)


class Client:
    """Blocking cluster client: ``Client("host:29500").submit(topology="ps", workers=4).wait()``."""

    def __init__(self, store: str, secret: str | bytes | None = None, timeout: float = 30.0) -> None:

        self._portal = Portal(name="psring-client")
        self._inner = AsyncClient(store, secret, timeout)
        try:
            self._portal.call(self._inner.connect())
        except BaseException:
            self._portal.stop()
            raise

    def submit(self, topology: str | None = None, workers: int = 2, **kwargs: Any) -> Job:
        return Job(self._portal.call, self._inner, self._portal.call(self._inner.submit(topology, workers, **kwargs)))

    def status(self) -> dict[str, Any]:
        return self._portal.call(self._inner.status())

    def close(self) -> None:
        try:
            self._portal.call(self._inner.close(), timeout=10)
        finally:
            self._portal.stop()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
