"""Submitting jobs to a cluster of daemons and following them (``Client``, ``Job``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Iterator
from typing import Any

from ..rendezvous.client import connect_store, parse_store_address
from ..transport.loop import Portal
from .daemons import JobError, _secret_bytes, key

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
