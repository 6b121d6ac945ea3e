"""Ring topology: every collective over peer-to-peer links between the ranks.

``all_reduce`` is a pipelined ring reduce-scatter then all-gather: the tensor is
split into N ring chunks, each chunk into pieces of ``PSRING_RING_PIECE`` bytes
(1 MiB), and each piece is reduced and forwarded the moment it arrives. Each rank
sends 2(N-1)/N of the tensor. From ``PLANE_MIN_BYTES`` (8 MiB) up this runs on the
threaded data plane (:mod:`psring.dataplane`); below it, in a callback in the
connection's receive path, straight into the output array (no scratch buffers, no
per-piece tasks). Small tensors take a one-hop path (every rank sends its tensor
to every other and folds locally) in the same canonical order, so the bits do not
depend on the path.

Each process listens on exactly one port; peers dial it (no back-connections)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any, ClassVar

import msgpack
import numpy as np

from . import wire
from .arrays import DTYPES, byte_view, dtype_name, env_bytes, prod, result_empty
from .compress import dequantize, fold_fp16, quantize
from .config import GroupSettings
from .connection import Connection, Listener, Mailbox, checksum_from_env, open_connection
from .dataplane import DataPlane, PlaneLinkError, PlaneMismatch, ShmSegment
from .errors import CollectiveTimeoutError, PeerLostError, ProtocolError, PsringError, StoreError
from .group import (
    SMALL_BYTES,
    Collective,
    Group,
    canonical_fold,
    farewell,
    finish_avg,
    reduce_op,
    ring_chunk_bounds,
)
from .rendezvous import assign_rank, open_store_for
from .store import StoreClient, StoreServer
from .unixnet import UnixMesh, host_key, same_host_from_env

logger = logging.getLogger(__name__)

PIECE_BYTES = env_bytes("PSRING_RING_PIECE", 1 << 20)

# phases in data tags: (gid, seq, phase, ...)
_RS, _AG, _DIRECT, _BCAST, _GATHER_RING, _TO_ROOT, _SCATTER, _RESULT = range(8)

#: from this world size on, a small all_reduce goes through one rank (rotating with the sequence
#: number) that folds and sends the result back: 2(N-1) frames instead of N(N-1), which is what
#: a small call costs when ranks share cores (PSRING_RING_ROOTED_MIN; 0: never, always all-to-all)
ROOTED_SMALL_MIN = env_bytes("PSRING_RING_ROOTED_MIN", 3, "ranks") or 1 << 30
#: seconds a rank that waits only on the root of a rooted call gives the root to name the silent
#: rank before its own timeout names the root
ROOT_REPORT_GRACE = 1.0


#: all_reduces of at least this many bytes take the threaded data plane: measured here, below
#: ~8 MiB the event loop is as fast or faster (fewer thread wake-ups per byte), above it slower
PLANE_MIN_BYTES = env_bytes("PSRING_RING_PLANE_MIN", 8 << 20)
#: ... and from this many when the ranks share a host and there are 3 or more: with shared-memory
#: links the plane beat the event loop from ~512 KiB at 4 ranks here (2 MiB: 5.7-6.7 against
#: 8.6-9.1 ms), but not at 2 ranks (PSRING_RING_SHM_MIN; defaults to PSRING_RING_PLANE_MIN if set)
PLANE_SHM_MIN_BYTES = env_bytes("PSRING_RING_SHM_MIN", env_bytes("PSRING_RING_PLANE_MIN", 1 << 20))
#: the plane's piece: the unit sent, received and folded at a time. Measured here side by side,
#: 4 MiB beat 1 MiB by ~12% at N=4 (fewer thread hand-offs) and matched it at N=2; 8 MiB was worse
PLANE_PIECE_BYTES = env_bytes("PSRING_RING_PLANE_PIECE", 4 << 20)

#: the largest payload that takes the same-host links (the rest of a message is its header)
MESH_MAX_BYTES = 64 << 10
#: microseconds a rank alone in its process polls its same-host links for a small call's
#: messages (yielding the core between polls) before it sleeps in the event loop. Waking a
#: sleeping process costs more than the wait on a VM; measured here at 4 ranks, 100 us cut the
#: back-to-back 4-byte time by 10-20%, and 500 us another 10-15% (medians of 5 alternating runs
#: after a barrier: 100 us 636, 300 us 566, 500 us 544, 1000 us 628) (PSRING_SPIN_US; 0: never)
MESH_SPIN_S = env_bytes("PSRING_SPIN_US", 500, "microseconds") / 1e6
#: messages that may wait for a collective (or subgroup) this rank has not reached yet
MESH_EARLY_MAX = 100_000

#: shared-memory slots per data link between same-host neighbours, each a plane piece. Measured
#: here at 4 ranks, 64 MiB: 8 slots 110-113 ms, 6 slots 117, 4 slots 127-131; 2 MiB pieces were
#: slower at any count (PSRING_RING_SHM_SLOTS, 1 to 256)
PLANE_SHM_SLOTS = min(env_bytes("PSRING_RING_SHM_SLOTS", 8, "slots") or 1, 256)

#: seconds a broken data link waits for the control plane to report the same loss (with its reason)
PLANE_GRACE = 1.0


def plane_possible() -> bool:
    """Whether this process can run the threaded data plane (plain TCP, no per-frame checksums)."""
    if os.environ.get("PSRING_RING_THREADS", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if os.environ.get("PSRING_TLS_CERT") or os.environ.get("PSRING_TLS_CA"):
        return False  # a TLS stream cannot leave its transport
    return checksum_from_env() is None


def mesh_possible() -> bool:
    """Whether this process offers same-host Unix links (PSRING_SAME_HOST, no per-frame checksums:
    a user who asked for them gets them on every byte)."""
    return same_host_from_env() and checksum_from_env() is None and host_key() is not None


def pieces(a: int, b: int, per_piece: int) -> list[tuple[int, int]]:
    """Split [a, b) into pieces of at most per_piece elements."""
    return [(s, min(s + per_piece, b)) for s in range(a, b, per_piece)]


class PeerNet:
    """This process's rank endpoint: one listening port, links to other ranks, one mailbox."""

    #: ranks open in this process (tests run several in one event loop)
    live: ClassVar[int] = 0

    def __init__(self, rank: int, world_size: int, settings: GroupSettings, store: Any, prefix: str) -> None:
        self.rank = rank
        self.world_size = world_size
        self.settings = settings
        self.store = store
        self.prefix = prefix
        self._counted = False
        self.mailbox = Mailbox()
        self.mailbox.on_lost = self._on_conn_lost
        self.mailbox.on_control = self._on_control
        self.links: dict[int, Connection] = {}
        self.conns: set[Connection] = set()
        self.groups: dict[str, RingGroup] = {}
        self.stopped_at: dict[str, int] = {}  # per group: the first seq this rank did not finish
        self.addresses: dict[int, tuple[str, int]] = {}
        self.lost: dict[int, PeerLostError] = {}
        self._dialing: dict[int, asyncio.Future[Connection]] = {}
        self._seen_controls: set[tuple[Any, ...]] = set()
        self._closing = False
        self.listener: Listener | None = None
        self.embedded_store: StoreServer | None = None
        self.plane: DataPlane | None = None
        self.plane_min = 1 << 62  # all_reduces of this many bytes or more take the plane (agreed in resolve)
        self.plane_offer = max(PLANE_MIN_BYTES, 1)  # this rank's own threshold, published for that
        self.plane_shm_offer = max(min(PLANE_SHM_MIN_BYTES, self.plane_offer), 1)  # the same, on one host
        if world_size > 1 and plane_possible():
            self.plane = DataPlane(rank, world_size)
            self.plane.recv_ready = asyncio.Event()
        #: same-host Unix links for small messages (psring.unixnet), when every rank can use them
        self.mesh: UnixMesh | None = None
        self.mesh_peers: dict[int, dict[str, Any]] = {}
        self._mesh_orphans: dict[str, list[tuple[int, tuple[Any, ...], bytes]]] = {}
        if world_size > 1 and mesh_possible():
            self.mesh = UnixMesh(rank, settings.job, self._on_mesh_message, self._on_mesh_closed)
        PeerNet.live += 1
        self._counted = True

    def hello(self) -> dict[str, Any]:
        return {"role": "rank", "rank": self.rank, "job": self.settings.job}

    async def start(self) -> None:
        self.listener = Listener(
            self._accepted,
            secret=self.settings.secret,
            info=self.hello(),
            router_for=lambda conn: self.mailbox,
            name=f"rank {self.rank}",
        )
        await self.listener.start(self.settings.bind_host, self.settings.port)
        offer = f"{self.plane_offer}/{self.plane_shm_offer}" if self.plane is not None else "-1"
        await self.store.set(f"{self.prefix}/plane/{self.rank}", offer.encode())
        unix = b"-"
        if self.mesh is not None:
            try:
                unix = msgpack.packb(self.mesh.bind())
            except OSError as exc:
                logger.info("rank %d: no same-host Unix links (%s): small messages go over TCP", self.rank, exc)
                self.mesh = None
        await self.store.set(f"{self.prefix}/unix/{self.rank}", unix)
        address = f"{self.settings.advertise_host}:{self.listener.port}"
        await self.store.set(f"{self.prefix}/addr/{self.rank}", address.encode())

    async def resolve(self, timeout: float) -> None:
        keys = [f"{self.prefix}/addr/{r}" for r in range(self.world_size)]
        try:
            await self.store.wait(keys, timeout)
        except StoreError:
            present = [r for r in range(self.world_size) if await self.store.get(keys[r]) is not None]
            missing = sorted(set(range(self.world_size)) - set(present))
            raise CollectiveTimeoutError(
                f"rendezvous: rank(s) {missing} did not join within {timeout:g}s "
                f"({len(present)} of {self.world_size} ranks joined at {self.store.address})",
                missing=tuple(missing),
            ) from None
        for r in range(self.world_size):
            raw = await self.store.get(keys[r])
            assert raw is not None
            host, _, port = raw.decode().rpartition(":")
            self.addresses[r] = (host, int(port))
        shm_min = 1 << 62
        if self.plane is not None:  # every rank must take the same path: the plane only if all can
            offers: list[tuple[int, int]] = []
            for r in range(self.world_size):
                text = (await self.store.get(f"{self.prefix}/plane/{r}") or b"-1").decode()
                try:
                    tcp, _, shm = text.partition("/")
                    offers.append((int(tcp), int(shm or tcp)))
                except ValueError:
                    offers.append((-1, -1))
            if any(min(o) < 1 for o in offers):
                without = [r for r, o in enumerate(offers) if min(o) < 1]
                logger.info("rank(s) %s run without the threaded data plane: all_reduce stays on asyncio", without)
                self.plane = None
            else:  # the same threshold on every rank, or they would take different paths
                self.plane_min = max(o[0] for o in offers)
                shm_min = max(o[1] for o in offers)
        if self.mesh is not None:  # likewise: Unix links only if every rank is on this host and offers them
            peers: dict[int, dict[str, Any]] = {}
            mine = host_key()
            for r in range(self.world_size):
                raw = await self.store.get(f"{self.prefix}/unix/{r}")
                try:
                    info = msgpack.unpackb(raw) if raw and raw != b"-" else None
                except Exception:
                    info = None
                if isinstance(info, dict) and info.get("key") == mine:
                    peers[r] = info
            if len(peers) == self.world_size:
                self.mesh_peers = {r: info for r, info in peers.items() if r != self.rank}
                if self.world_size >= 3:  # the plane's links will be shared memory (see PLANE_SHM_MIN_BYTES)
                    self.plane_min = min(self.plane_min, shm_min)
            else:
                others = sorted(set(range(self.world_size)) - set(peers))
                logger.info("rank(s) %s are on another host or run without Unix links: small messages use TCP", others)
                self.mesh.close()
                self.mesh = None

    async def open_mesh(self, timeout: float) -> None:
        """Open the same-host links to every other rank (each checked by its pid)."""
        assert self.mesh is not None
        await self.mesh.connect(self.mesh_peers, timeout)

    def _on_mesh_message(self, peer: int, head: tuple[Any, ...], payload: memoryview) -> None:
        gid = head[0]
        group = self.groups.get(gid)
        if group is not None:
            group.on_mesh(peer, head[1], head[2], head[3], payload)
            return
        orphans = self._mesh_orphans.setdefault(gid, [])  # its subgroup is not made here yet
        if len(orphans) >= MESH_EARLY_MAX:
            raise ProtocolError(f"over {MESH_EARLY_MAX} messages for subgroup {gid!r}, which this rank never made")
        orphans.append((peer, head, bytes(payload)))

    def _on_mesh_closed(self, peer: int, error: BaseException | None) -> None:
        """A same-host link ended. Everything the peer sent before it has been read, so a
        collective still waiting on the peer will not get its data. The control link usually
        says why (a goodbye, a crash) at once; if it has not after PLANE_GRACE, report this."""

        def check() -> None:
            if self._closing:
                return
            gone = self.lost.get(peer)
            if gone is None:
                how = f"broke: {error}" if error is not None else "closed"
                self._peer_lost(peer, PeerLostError(f"the same-host link from rank {peer} {how}", rank=peer))
                return
            for group in list(self.groups.values()):
                if peer in group.members:
                    group.on_mesh_closed(group.members.index(peer), gone)

        if not self._closing:
            asyncio.get_running_loop().call_later(0 if peer in self.lost else PLANE_GRACE, check)

    async def open_plane(self, timeout: float) -> None:
        """Dial the data link to the right neighbour, wait for the left's, start the threads.
        Between same-host ranks (the mesh was agreed) each link also gets a shared segment."""
        plane = self.plane
        assert plane is not None and plane.recv_ready is not None
        right, left = (self.rank + 1) % self.world_size, (self.rank - 1) % self.world_size
        shm_out: ShmSegment | None = None
        if self.mesh is not None:
            try:
                shm_out = ShmSegment.create(PLANE_SHM_SLOTS, PLANE_PIECE_BYTES)
            except OSError as exc:
                logger.info("rank %d: no shared memory for the data link to rank %d (%s)", self.rank, right, exc)
            plane.shm_out = shm_out  # closed (and unlinked) with the plane, whatever happens next
            offer = [shm_out.path, shm_out.slots, shm_out.slot_bytes] if shm_out is not None else None
            await self.store.set(f"{self.prefix}/shm/{self.rank}", msgpack.packb(offer))
        host, port = self.addresses[right]
        conn = await open_connection(
            host,
            port,
            secret=self.settings.secret,
            hello={**self.hello(), "data": 1},
            router=None,
            timeout=timeout,
            name=f"rank {self.rank} data",
        )
        if conn.peer.get("rank") != right:
            conn.abort(ProtocolError("wrong peer"))
            raise ProtocolError(f"{host}:{port} answered as rank {conn.peer.get('rank')}, expected rank {right}")
        plane.set_send(conn.detach())
        try:
            await asyncio.wait_for(plane.recv_ready.wait(), timeout)
        except TimeoutError:
            raise CollectiveTimeoutError(
                f"rank {left} did not open its data link to rank {self.rank} within {timeout:g}s", missing=(left,)
            ) from None
        if self.mesh is not None:
            shm_in = await self._map_left_segment(left, timeout)
            mapped = shm_out is not None and await self._right_mapped(right, shm_out, timeout)
            plane.use_shm(shm_out if mapped else None, shm_in)
            if shm_out is not None:
                shm_out.unlink()  # both ends have it mapped (or never will): the name is not needed
                if plane.shm_out is None:
                    shm_out.close()
        plane.start()

    async def _map_left_segment(self, left: int, timeout: float) -> ShmSegment | None:
        """Map the segment the left neighbour offered for its link to this rank, and say whether."""
        key = f"{self.prefix}/shm/{left}"
        await self._wait_key(key, left, timeout)
        segment = offer = None
        try:
            offer = msgpack.unpackb(await self.store.get(key) or b"\xc0")
            if offer is not None:
                path, slots, slot_bytes = offer
                segment = ShmSegment.open(path, slots, slot_bytes)
        except (OSError, ValueError, TypeError) as exc:
            logger.info("rank %d: cannot map rank %d's shared memory (%s): its link stays on TCP", self.rank, left, exc)
        await self.store.set(f"{self.prefix}/shm-ok/{self.rank}", msgpack.packb(segment and offer[0]))
        return segment

    async def _right_mapped(self, right: int, segment: ShmSegment, timeout: float) -> bool:
        """Whether the right neighbour mapped this very segment (its answer names the file)."""
        key = f"{self.prefix}/shm-ok/{right}"
        await self._wait_key(key, right, timeout)
        with contextlib.suppress(Exception):
            return bool(msgpack.unpackb(await self.store.get(key) or b"\xc0") == segment.path)
        return False

    async def _wait_key(self, key: str, rank: int, timeout: float) -> None:
        try:
            await self.store.wait([key], timeout)
        except StoreError:
            raise CollectiveTimeoutError(
                f"rank {rank} did not set up its data link within {timeout:g}s", missing=(rank,)
            ) from None

    def _accept_data_link(self, conn: Connection, peer_rank: int) -> None:
        left = (self.rank - 1) % self.world_size
        plane = self.plane
        if plane is None or peer_rank != left:
            raise ProtocolError(
                f"rank {peer_rank} offered a data link to rank {self.rank}: only its left neighbour "
                f"(rank {left}) may, and only when every rank runs the data plane"
            )
        if plane.recv_sock is not None:
            raise ProtocolError(f"rank {self.rank} already has a data link from rank {left}")
        plane.set_recv(conn.detach())

    def plane_broken(self, peer_rank: int, exc: PlaneLinkError, coll: Collective) -> None:
        """A data link failed mid-collective. The control plane usually reports the same loss with
        its reason (a crash, a goodbye) at once; if it has not after PLANE_GRACE, report this."""

        def check() -> None:
            if self._closing or coll.done.done():
                return
            err = PeerLostError(
                f"the data link {'to' if exc.side == 'send' else 'from'} rank {peer_rank} at "
                f"{self.addresses.get(peer_rank)} broke: {exc}",
                rank=peer_rank,
            )
            if peer_rank in self.lost:  # it left cleanly earlier; this collective needed it
                coll.fail(err)
            else:
                self._peer_lost(peer_rank, err)

        # a peer that said goodbye has no more to say: fail now; else give the control plane time
        asyncio.get_running_loop().call_later(0 if peer_rank in self.lost else PLANE_GRACE, check)

    def _register(self, conn: Connection, peer_rank: int) -> None:
        self.conns.add(conn)
        current = self.links.get(peer_rank)
        if current is None or not current.is_open:
            self.links[peer_rank] = conn

    def _accepted(self, conn: Connection) -> None:
        peer_rank = conn.peer.get("rank")
        if conn.peer.get("job") != self.settings.job:
            raise ProtocolError(f"peer from job {conn.peer.get('job')!r} dialed job {self.settings.job!r}")
        if type(peer_rank) is not int or not 0 <= peer_rank < self.world_size:
            raise ProtocolError(f"peer claims rank {peer_rank!r}, outside 0..{self.world_size - 1}")
        if conn.peer.get("data"):
            self._accept_data_link(conn, peer_rank)
            return
        self._register(conn, peer_rank)

    async def link(self, rank: int, timeout: float) -> Connection:
        conn = self.links.get(rank)
        if conn is not None and conn.is_open:
            return conn
        if rank in self.lost:
            raise self.lost[rank]
        pending = self._dialing.get(rank)
        if pending is not None:
            return await asyncio.shield(pending)
        fut: asyncio.Future[Connection] = asyncio.get_running_loop().create_future()
        self._dialing[rank] = fut
        try:
            host, port = self.addresses[rank]
            conn = await open_connection(
                host,
                port,
                secret=self.settings.secret,
                hello=self.hello(),
                router=self.mailbox,
                timeout=timeout,
                name=f"rank {self.rank}",
            )
            if conn.peer.get("rank") != rank:
                conn.abort(ProtocolError("wrong peer"))
                raise ProtocolError(f"{host}:{port} answered as rank {conn.peer.get('rank')}, expected rank {rank}")
            self._register(conn, rank)
            fut.set_result(conn)
            return conn
        except BaseException as exc:
            if isinstance(exc, PeerLostError):
                exc = PeerLostError(f"rank {rank} at {self.addresses.get(rank)} is unreachable: {exc}", rank=rank)
            fut.set_exception(exc)
            fut.exception()
            raise exc from None
        finally:
            del self._dialing[rank]

    # -------------------------------------------------------------- failures
    def _on_conn_lost(self, conn: Connection, error: PeerLostError | None) -> None:
        if conn not in self.conns:
            return  # never accepted (wrong job, impossible rank): it was no link to anyone
        self.conns.discard(conn)
        peer_rank = conn.peer.get("rank")
        if self._closing or type(peer_rank) is not int:
            return
        if self.links.get(peer_rank) is conn:
            del self.links[peer_rank]
        if error is None and any(c.peer.get("rank") == peer_rank and c.is_open for c in self.conns):
            return  # closed cleanly while another link to that rank is up (a dropped one may have lost frames)
        ago = time.monotonic() - conn.last_heard
        if error is None:  # a clean goodbye: the peer finished, it did not crash
            err = PeerLostError(f"rank {peer_rank} at {conn.peername} closed its connections", rank=peer_rank)
            hurt = False
            seqs = (conn.farewell or {}).get("seqs")
            seqs = seqs if isinstance(seqs, dict) else {}
            for group in list(self.groups.values()):
                if peer_rank in group.members:
                    at = seqs.get(group.gid)
                    at = at if type(at) is int else None
                    hurt |= group.on_peer_departed(group.members.index(peer_rank), err, at)
            if hurt:  # it left in the middle of a collective: everyone must give up on it
                self._peer_lost(peer_rank, err)
            else:
                self.lost.setdefault(peer_rank, err)
            return
        err = PeerLostError(
            f"rank {peer_rank} at {conn.peername} was lost (last heard {ago:.1f}s ago): {error}", rank=peer_rank
        )
        err.__cause__ = error
        self._peer_lost(peer_rank, err)

    def _peer_lost(self, peer_rank: int, err: PeerLostError) -> None:
        if peer_rank in self.lost:
            return
        self.lost[peer_rank] = err
        for group in list(self.groups.values()):
            if peer_rank in group.members:
                group.on_peer_lost(err)
        self.flood({"kind": "abort", "tag": ("*", -1), "reason": "lost", "lost": peer_rank, "message": str(err)})

    def flood(self, header: dict[str, Any]) -> None:
        """Send a control frame over every open link (receivers forward it once)."""
        key = (header["reason"], header["tag"][0], header["tag"][1], header.get("lost"))
        self._seen_controls.add(key)
        for conn in list(self.conns):
            if conn.is_open:
                with contextlib.suppress(PsringError):
                    conn.send_frame(dict(header))

    def _on_control(self, conn: Connection, header: dict[str, Any], payload: Any) -> bool:
        if header["kind"] != "abort":
            return False
        tag = header.get("tag")
        reason = header.get("reason")
        if not isinstance(tag, tuple) or len(tag) != 2 or reason not in ("lost", "mismatch", "timeout"):
            raise ProtocolError(f"malformed abort frame from {conn.peername}")
        key = (reason, tag[0], tag[1], header.get("lost"))
        if key in self._seen_controls:
            return True
        message = str(header.get("message", ""))[:2000]
        if reason == "lost":
            lost = header.get("lost")
            if type(lost) is int and lost != self.rank:
                self._peer_lost(lost, PeerLostError(message, rank=lost))
            return True
        self.flood(dict(header))
        group = self.groups.get(tag[0])
        if group is not None and type(tag[1]) is int:
            group.on_abort(tag[1], reason, message)
        return True

    async def close(self) -> None:
        self._closing = True
        if self._counted:
            self._counted = False
            PeerNet.live -= 1
        goodbye = farewell(self.groups, self.stopped_at)
        conns = list(self.conns)
        await asyncio.gather(*(c.close(farewell=goodbye) for c in conns), return_exceptions=True)
        if self.plane is not None:
            self.plane.close()
        if self.mesh is not None:
            self.mesh.close()
        if self.listener is not None:
            await self.listener.close()
        with contextlib.suppress(Exception):
            await self.store.close()
        if self.embedded_store is not None:
            await self.embedded_store.close()

    def stats(self) -> dict[str, int]:
        plane = self.plane
        mesh_sent, mesh_received = self.mesh.stats() if self.mesh is not None else (0, 0)
        return {
            "bytes_sent": sum(c.bytes_sent for c in self._all_conns()) + (plane.bytes_sent if plane else 0) + mesh_sent,
            "bytes_received": sum(c.bytes_received for c in self._all_conns())
            + (plane.bytes_received if plane else 0)
            + mesh_received,
        }

    def _all_conns(self) -> list[Connection]:
        seen = set(self.conns)
        if self.listener is not None:
            seen |= self.listener.connections
        return list(seen)


class RingGroup(Group):
    """Collectives over a ring of peer links."""

    topology = "ring"

    def __init__(self, net: PeerNet, rank: int, world_size: int, members: list[int], gid: str, timeout: float):
        super().__init__(rank, world_size, timeout=timeout, gid=gid, mailbox=net.mailbox)
        self.net = net
        self.members = members
        self._owns_resources = gid == "0"
        self._local = {g: r for r, g in enumerate(members)}
        #: receives posted on the same-host links, by (seq, phase); and messages that came first
        self._mesh_slots: dict[tuple[int, int], _MeshSlot] = {}
        self._mesh_early: dict[tuple[int, int, int], tuple[tuple[Any, ...], bytes]] = {}
        net.groups[gid] = self
        for peer, head, payload in net._mesh_orphans.pop(gid, ()):
            self.on_mesh(peer, head[1], head[2], head[3], memoryview(payload))

    @classmethod
    async def create(cls, settings: GroupSettings, **options: Any) -> RingGroup:
        if options:
            raise TypeError(f"init_group(topology='ring') got unexpected options {sorted(options)}")
        assert settings.world_size is not None
        world = settings.world_size
        prefix = f"psring/{settings.job}"
        store, embedded = await open_store_for(settings, settings.rank)
        net: PeerNet | None = None
        try:
            rank = await assign_rank(store, prefix, settings.rank, world)
            net = PeerNet(rank, world, settings, store, prefix)
            net.embedded_store = embedded
            await net.start()
            await net.resolve(settings.timeout)
            group = cls(net, rank, world, list(range(world)), "0", settings.timeout)
            if world > 1:
                await net.link((rank + 1) % world, settings.timeout)
            if net.plane is not None:
                await net.open_plane(settings.timeout)
            if net.mesh is not None:
                await net.open_mesh(settings.timeout)
            await store.barrier(f"{prefix}/ready", world, settings.timeout)
            logger.info("%r ready (store %s)", group, store.address)
            return group
        except (Exception, asyncio.CancelledError):
            if net is not None:
                await net.close()
            else:
                with contextlib.suppress(Exception):
                    await store.close()
                if embedded is not None:
                    await embedded.close()
            raise

    # ---------------------------------------------------------------- plumbing
    async def _link(self, local_rank: int) -> Connection:
        conn = self.net.links.get(self.members[local_rank])
        if conn is not None and conn.is_open:
            return conn  # the common case, without a dial
        return await self.net.link(self.members[local_rank], self.timeout)

    async def _links(self, local_ranks: list[int]) -> list[Connection]:
        links, members = self.net.links, self.members
        conns = [links.get(members[r]) for r in local_ranks]
        if all(c is not None and c.is_open for c in conns):
            return conns  # type: ignore[return-value]
        return list(await asyncio.gather(*(self._link(r) for r in local_ranks)))

    def _header(self, coll: Collective, *tag: Any) -> dict[str, Any]:
        return {"kind": "data", "tag": (self.gid, coll.seq, *tag), "call": coll.desc, "src": self.rank}

    def _send_abort(self, seq: int, err: PsringError, reason: str) -> None:
        self.net.flood({"kind": "abort", "tag": (self.gid, seq), "reason": reason, "message": str(err)})

    def _make_subgroup(self, gid: str, ranks: list[int]) -> RingGroup:
        return RingGroup(
            self.net, ranks.index(self.rank), len(ranks), [self.members[r] for r in ranks], gid, self.timeout
        )

    def on_peer_lost(self, err: PeerLostError) -> None:
        if err.rank is not None and err.rank in self.members and self.members != list(range(self.world_size)):
            local = self.members.index(err.rank)
            err = PeerLostError(f"{err} [rank {local} of subgroup {self.gid}]", rank=err.rank)
        super().on_peer_lost(err)

    def stats(self) -> dict[str, int]:
        return self.net.stats()

    def _layer(self) -> Any:
        return self.net

    async def _flush_all(self, conns: list[Connection]) -> None:
        for conn in conns:
            await conn.flush()

    def _wait_piece(self, coll: Collective, conn_count: int) -> tuple[asyncio.Future[None], Callable[[], None]]:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        remaining = [conn_count]

        def one_done() -> None:
            remaining[0] -= 1
            if remaining[0] == 0 and not done.done():
                coll.waiting_on.clear()  # every frame is in: a peer leaving now costs nothing
                done.set_result(None)

        if conn_count == 0:
            done.set_result(None)
        return done, one_done

    def _guard(self, coll: Collective, fn: Callable[..., None]) -> Callable[..., None]:
        """Wrap a receive callback: any error in it fails the collective, not the connection."""

        def callback(conn: Connection, header: dict[str, Any], payload: Any) -> None:
            try:
                fn(conn, header, payload)
            except PsringError as exc:
                coll.fail(exc)
            except Exception as exc:  # pragma: no cover - a bug; surface it on the collective
                logger.exception("%r: receive callback failed", self)
                coll.fail(exc)

        return callback

    # ---------------------------------------------------------- same-host links
    async def all_reduce(self, x: Any, op: str = "sum", compression: str | None = None) -> Any:
        # The latency path: a small, contiguous numpy array between ranks of one host goes
        # straight to the one-hop exchange, past the generic staging and dispatch. The same
        # checks hold (the pair (op, dtype) was validated once); the same bits come out.
        if (
            compression is None
            and self.net.mesh is not None
            and type(x) is np.ndarray
            and x.nbytes <= SMALL_BYTES
            and x.flags.c_contiguous
            and (op, x.dtype) in _VALID_OPS
        ):
            coll = self._begin("all_reduce", x, op)
            out = await self._run(coll, self._gather_and_fold(coll, x.reshape(-1), op))
            return out.reshape(x.shape)
        out = await super().all_reduce(x, op, compression)
        if type(x) is np.ndarray:
            _VALID_OPS.add((op, x.dtype))  # it passed the checks: next time take the short way
        return out

    def on_mesh(self, peer: int, seq: int, phase: int, call: tuple[Any, ...], payload: memoryview) -> None:
        """A message from a same-host link (psring.unixnet): into its posted receive, or kept."""
        src = self._local.get(peer)
        if src is None:
            return  # not a member of this group: nothing of ours
        slot = self._mesh_slots.get((seq, phase))
        if slot is not None:
            self._mesh_deliver(slot, src, call, payload)
            return
        coll = self._active.get(seq)
        if coll is None:
            if seq < self.stopped_at():
                return  # a collective this rank finished or gave up on: a leftover
            # else one not begun yet (its number may be reserved already: fp16's scale agreement)
        elif call != coll.desc:  # a different call (whose messages this one will never ask for)
            if not coll.done.done():
                self._abort_everywhere(coll, self._mismatch_error(coll, src, call), "mismatch")
            return
        early = self._mesh_early
        if len(early) >= MESH_EARLY_MAX:
            early.pop(next(iter(early)))
            logger.warning(
                "%r: over %d same-host messages ahead of this rank; dropped the oldest", self, MESH_EARLY_MAX
            )
        early[(seq, phase, src)] = (call, bytes(payload))

    def _mesh_deliver(self, slot: _MeshSlot, src: int, call: tuple[Any, ...], payload: Any) -> None:
        coll = slot.coll
        if coll.done.done():
            return
        if call != coll.desc:
            self._abort_everywhere(coll, self._mismatch_error(coll, src, call), "mismatch")
            return
        expect = slot.expect
        if src not in expect:
            coll.fail(ProtocolError(f"rank {src} sent {coll.label} twice, or was not asked to"))
            return
        row = slot.row
        if len(payload) != row:
            coll.fail(ProtocolError(f"rank {src} sent {len(payload)} bytes for {coll.label}, expected {row}"))
            return
        if row:
            at = slot.at if slot.at >= 0 else src * row
            slot.dest[at : at + row] = payload
        expect.discard(src)
        if expect:
            coll.waiting_on.discard(src)
        else:
            coll.waiting_on.clear()  # every message is in: a peer leaving now costs nothing
            if not slot.done.done():
                slot.done.set_result(None)

    def on_mesh_closed(self, local_rank: int, gone: PeerLostError) -> None:
        """A departed peer's same-host link ended: a receive still waiting on it will not get it."""
        for slot in list(self._mesh_slots.values()):
            if local_rank in slot.expect:
                coll = slot.coll
                coll.fail(PeerLostError(f"{gone} (while {coll.label} was pending on rank {self.rank})", rank=gone.rank))

    def _end(self, coll: Collective) -> None:
        super()._end(coll)
        if self._mesh_early:
            self._forget_early(coll.seq)

    def on_abort(self, seq: int, reason: str, message: str, missing: Any = ()) -> None:
        super().on_abort(seq, reason, message, missing)
        if self._mesh_early:
            self._forget_early(seq)

    def _check_early(self, coll: Collective) -> None:
        """Messages that came before this rank began ``coll``, for a phase it will not ask
        for, are another call's: a mismatch to name now, not a receive to wait on forever."""
        for (seq, _phase, src), (call, _payload) in list(self._mesh_early.items()):
            if seq == coll.seq and call != coll.desc and not coll.done.done():
                self._abort_everywhere(coll, self._mismatch_error(coll, src, call), "mismatch")
                return

    def _forget_early(self, seq: int) -> None:
        """Drop kept messages of collective seq, and of any collective this rank is done with."""
        done_below = self.stopped_at()
        for key in [k for k in self._mesh_early if k[0] == seq or k[0] < done_below]:
            del self._mesh_early[key]

    async def _mesh_exchange(
        self,
        coll: Collective,
        x: np.ndarray | None,
        phase: int,
        out: Any,
        senders: list[int],
        receivers: list[int],
        recv_phase: int,
    ) -> None:
        """_direct_exchange over the same-host links: one message per receiver, one per sender.

        ``out`` is None (no payloads), an array with one row per rank, or {src: array}."""
        me, seq, mesh = self.rank, coll.seq, self.net.mesh
        assert mesh is not None
        slot: _MeshSlot | None = None
        if len(senders) > (me in senders):
            expect = set(senders)
            expect.discard(me)
            if out is None:
                dest, row, at = None, 0, 0
            elif isinstance(out, dict):
                (target,) = out.values()
                dest, row, at = byte_view(target), target.nbytes, 0
            else:
                dest, row, at = byte_view(out), out.nbytes // len(out), -1
            slot = _MeshSlot(coll, dest, row, at, expect, coll.done.get_loop().create_future())
            self._mesh_slots[(seq, recv_phase)] = slot
            coll.waiting_on = set(expect)
            coll.data_elsewhere = True  # a goodbye on the control link may overtake our messages
            if self._mesh_early:
                for src in list(expect):
                    item = self._mesh_early.pop((seq, recv_phase, src), None)
                    if item is not None:
                        self._mesh_deliver(slot, src, *item)
        if self._mesh_early:
            self._check_early(coll)
        try:
            if len(receivers) > (me in receivers):
                payload = byte_view(x) if x is not None and x.nbytes else None
                msg = wire.encode_message((self.gid, seq, phase, coll.desc), payload)
                members, send = self.members, mesh.send
                for d in receivers:
                    if d != me:
                        send(members[d], msg)
            if slot is not None:
                if MESH_SPIN_S > 0.0 and PeerNet.live == 1 and not slot.done.done():
                    self._mesh_spin(slot)  # not with other ranks in this process: they could not run
                await slot.done
        finally:
            if slot is not None:
                del self._mesh_slots[(seq, recv_phase)]
        if mesh.backlog:
            await mesh.drain()

    def _mesh_spin(self, slot: _MeshSlot) -> None:
        """Poll the links slot waits on for up to MESH_SPIN_S (the messages are usually close)."""
        mesh, members = self.net.mesh, self.members
        assert mesh is not None
        peers = [members[s] for s in slot.expect]
        end = time.perf_counter() + MESH_SPIN_S
        done = slot.done
        while not done.done() and time.perf_counter() < end:
            if not mesh.poll(peers):
                os.sched_yield()

    async def _direct_exchange(
        self,
        coll: Collective,
        x: np.ndarray | None,
        phase: int,
        out: Any,
        senders: list[int],
        receivers: list[int],
        recv_phase: int | None = None,
    ) -> None:
        """Send x to every rank in receivers; receive one frame from every rank in senders into
        out[src] (frames of ``recv_phase``, default ``phase``).

        The small-message path: one callback for every sender, the header built once, and no
        flush round when the kernel took every byte at once (the usual case for small frames).
        """
        me, gid, seq = self.rank, self.gid, coll.seq
        recv_phase = phase if recv_phase is None else recv_phase
        if self.net.mesh is not None and _call_bytes(coll.desc) <= MESH_MAX_BYTES:  # alike on every rank
            return await self._mesh_exchange(coll, x, phase, out, senders, receivers, recv_phase)
        expect = [s for s in senders if s != me]
        left = len(expect)
        done: asyncio.Future[None] | None = None
        if left:
            done = asyncio.get_running_loop().create_future()
            coll.waiting_on = set(expect)

            def arrived(conn: Connection, header: dict[str, Any], payload: Any) -> None:
                nonlocal left
                src = header["tag"][3]
                if out is not None and header["nbytes"] != out[src].nbytes:
                    coll.fail(ProtocolError(f"rank {src} sent {header['nbytes']} bytes, expected {out[src].nbytes}"))
                    return
                coll.waiting_on.discard(src)
                left -= 1
                if left == 0 and not done.done():
                    coll.waiting_on.clear()  # every frame is in: a peer leaving now costs nothing
                    done.set_result(None)

            post = self.mailbox.post
            for src in expect:
                dest = byte_view(out[src]) if out is not None and out[src].nbytes else None
                post((gid, seq, recv_phase, src), dest, arrived)
        targets = [d for d in receivers if d != me]
        conns = await self._links(targets) if targets else []
        if conns:
            header: dict[str, Any] = {"kind": "data", "tag": (gid, seq, phase, me), "call": coll.desc, "src": me}
            payload = None
            if x is not None:
                header["dtype"], header["shape"] = dtype_name(x.dtype), list(x.shape)
                payload = byte_view(x) if x.nbytes else None
            last = len(conns) - 1
            for i, conn in enumerate(conns):
                conn.send_frame(header if i == last else dict(header), payload)
        if done is not None:
            await done
        for conn in conns:
            transport = conn.transport
            if transport is None or transport.get_write_buffer_size():
                await conn.flush()

    # -------------------------------------------------------------- collectives
    async def _gather_and_fold(self, coll: Collective, x: np.ndarray, op: str, dst: int | None = None) -> Any:
        """One-hop path: every rank's x goes to dst (None: to every rank), folded there in canonical order."""
        n_ranks, me = self.world_size, self.rank
        if dst is None and n_ranks >= ROOTED_SMALL_MIN:
            return await self._rooted(coll, x, lambda bufs: canonical_fold(bufs, op, np.empty_like(x)))
        ranks = list(range(n_ranks))
        receives = dst is None or me == dst
        bufs = np.empty((n_ranks, x.size), x.dtype) if receives else None
        if bufs is not None:
            bufs[me] = x
        if n_ranks > 1:
            await self._direct_exchange(
                coll, x, _DIRECT, bufs, ranks if receives else [], ranks if dst is None else [dst]
            )
        return None if bufs is None else canonical_fold(bufs, op, np.empty_like(x))

    async def _rooted(self, coll: Collective, x: np.ndarray, fold: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """Small all_reduce through one root (``seq % N``): it gathers every rank's x (rows in
        rank order), applies ``fold`` (the canonical order) and sends the result to all. The
        root sees every rank's call, so a mismatch anywhere is caught there; the others check
        the root's."""
        n_ranks, me = self.world_size, self.rank
        root = coll.seq % n_ranks
        if me == root:
            bufs = np.empty((n_ranks, x.size), x.dtype)
            bufs[me] = x
            await self._direct_exchange(coll, None, _DIRECT, bufs, list(range(n_ranks)), [])
            out = fold(bufs)
            await self._direct_exchange(coll, out, _RESULT, None, [], list(range(n_ranks)))
            return out
        out = np.empty_like(x)
        coll.report_grace = ROOT_REPORT_GRACE  # a silent rank is the root's to name
        await self._direct_exchange(coll, x, _DIRECT, {root: out}, [root], [root], recv_phase=_RESULT)
        return out

    def _plane_for(self, nbytes: int) -> DataPlane | None:
        plane = self.net.plane
        if plane is not None and self.gid == "0" and plane.ready and nbytes >= self.net.plane_min:
            return plane
        return None

    def _input_order(self, count: int, nbytes: int) -> list[tuple[int, int]] | None:
        """On the data plane this rank reads its input chunk by chunk: its own chunk first
        (sent as is), then the chunks it folds, in ring order."""
        if self.world_size == 1 or self._plane_for(nbytes) is None:
            return None
        n_ranks, me = self.world_size, self.rank
        bounds = ring_chunk_bounds(count, n_ranks)
        return [bounds[(me - k) % n_ranks] for k in range(n_ranks)]

    async def _all_reduce(self, coll: Collective, x: np.ndarray, op: str) -> np.ndarray:
        plane = self._plane_for(x.nbytes)
        if plane is not None:
            return await self._plane_all_reduce(coll, x, op, plane)
        if coll.input_wait is not None:  # the input is still coming off the device: this path needs all of it
            coll.input_wait(0, x.size)
        if self.world_size == 1 or x.nbytes <= SMALL_BYTES:
            return await self._gather_and_fold(coll, x, op)  # type: ignore[no-any-return]
        return await self._ring_reduce(coll, x, op, mode="all")

    async def _plane_all_reduce(self, coll: Collective, x: np.ndarray, op: str, plane: DataPlane) -> np.ndarray:
        """all_reduce on the threaded data plane (psring.dataplane). Queued before the first
        await, so concurrent calls reach the plane in call order, the same on every rank."""
        n_ranks, me = self.world_size, self.rank
        per_piece = max(1, PLANE_PIECE_BYTES // x.itemsize)
        parts = [pieces(a, b, per_piece) for a, b in ring_chunk_bounds(x.size, n_ranks)]
        on_error = functools.partial(self._plane_failed, coll)  # no cycle through the job: out is freed at once
        job = plane.all_reduce(
            coll.seq, msgpack.packb(coll.desc), x, parts, reduce_op(op), op == "avg", on_error, coll.input_wait
        )
        coll.waiting_on = {(me - 1) % n_ranks}
        coll.data_elsewhere = True
        finished = False
        try:
            await job.done
            finished = True
        finally:
            if not finished:
                job.cancel()  # failed from elsewhere (which also cancelled job.done): the threads drop it
        return job.out

    def _plane_failed(self, coll: Collective, exc: BaseException) -> None:
        if coll.done.done():
            return
        n_ranks, me = self.world_size, self.rank
        if isinstance(exc, PlaneMismatch):
            self._abort_everywhere(coll, self._mismatch_error(coll, (me - 1) % n_ranks, exc.call), "mismatch")
        elif isinstance(exc, PlaneLinkError):
            self.net.plane_broken((me + 1) % n_ranks if exc.side == "send" else (me - 1) % n_ranks, exc, coll)
        else:
            coll.fail(exc)

    async def _reduce_scatter(self, coll: Collective, x: np.ndarray, op: str) -> np.ndarray:
        a, b = ring_chunk_bounds(x.size, self.world_size)[self.rank]
        if self.world_size == 1 or x.nbytes <= SMALL_BYTES:
            out = await self._gather_and_fold(coll, x, op)
        else:
            out = await self._ring_reduce(coll, x, op, mode="scatter")
        return out[a:b].copy()  # type: ignore[no-any-return]

    async def _reduce(self, coll: Collective, x: np.ndarray, op: str, dst: int) -> np.ndarray | None:
        if self.world_size == 1 or x.nbytes <= SMALL_BYTES:
            return await self._gather_and_fold(coll, x, op, dst)  # type: ignore[no-any-return]
        out = await self._ring_reduce(coll, x, op, mode="reduce", dst=dst)
        return out if self.rank == dst else None

    async def _ring_reduce(self, coll: Collective, x: np.ndarray, op: str, mode: str, dst: int = 0) -> np.ndarray:
        """Pipelined ring reduce-scatter, then (mode) all-gather / hand chunk to owner / gather to dst."""
        n_ranks, me = self.world_size, self.rank
        right_rank, left_rank = (me + 1) % n_ranks, (me - 1) % n_ranks
        per_piece = max(1, PIECE_BYTES // x.itemsize)
        bounds = ring_chunk_bounds(x.size, n_ranks)
        chunk_pieces = [pieces(a, b, per_piece) for a, b in bounds]
        out = result_empty(x)
        ufunc = reduce_op(op)
        final_chunk = right_rank  # the chunk whose fold completes here
        right = await self._link(right_rank)
        to_dst = await self._link(dst) if mode == "reduce" and me != dst else None
        coll.waiting_on = {left_rank}
        gid, seq = self.gid, coll.seq

        # every posted receive calls one_done once: done means all forwarding duties are met too
        ag_chunks = [
            c
            for c in range(n_ranks)
            if c != final_chunk
            and (mode == "all" or (mode == "scatter" and c == me) or (mode == "reduce" and me == dst))
        ]
        needed = sum(len(chunk_pieces[c]) for c in range(n_ranks) if c != me)
        needed += sum(len(chunk_pieces[c]) for c in ag_chunks)
        done, one_done = self._wait_piece(coll, needed)
        header = self._header

        def rs_arrived(c: int, j: int, a: int, b: int) -> Callable[..., None]:
            def cb(conn: Connection, hdr: dict[str, Any], payload: Any) -> None:
                seg = out[a:b]
                if payload is not None and hdr["nbytes"] != seg.nbytes:
                    raise ProtocolError(f"ring piece {c}.{j} from rank {left_rank} has {hdr['nbytes']} bytes")
                ufunc(seg, x[a:b], out=seg)  # canonical: (fold so far) op own
                if c != final_chunk:
                    right.send_tensor(header(coll, _RS, c, j), seg)
                else:
                    if op == "avg":
                        finish_avg(seg, n_ranks)
                    if mode in ("all", "scatter"):  # to the next rank (in scatter mode: c's owner)
                        right.send_tensor(header(coll, _AG, c, j), seg)
                    elif to_dst is not None:
                        to_dst.send_tensor(header(coll, _AG, c, j), seg)
                one_done()

            return cb

        def ag_arrived(c: int, j: int, a: int, b: int) -> Callable[..., None]:
            forward = mode == "all" and right_rank != (c - 1) % n_ranks

            def cb(conn: Connection, hdr: dict[str, Any], payload: Any) -> None:
                if forward:
                    right.send_tensor(header(coll, _AG, c, j), out[a:b])
                one_done()

            return cb

        post = self.mailbox.post
        for c in range(n_ranks):
            if c != me:
                for j, (a, b) in enumerate(chunk_pieces[c]):
                    post((gid, seq, _RS, c, j), byte_view(out[a:b]), self._guard(coll, rs_arrived(c, j, a, b)))
        for c in ag_chunks:
            for j, (a, b) in enumerate(chunk_pieces[c]):
                post((gid, seq, _AG, c, j), byte_view(out[a:b]), self._guard(coll, ag_arrived(c, j, a, b)))
        for j, (a, b) in enumerate(chunk_pieces[me]):
            right.send_tensor(header(coll, _RS, me, j), x[a:b])
        await done
        await right.flush()
        if to_dst is not None:
            await to_dst.flush()
        return out

    async def _all_reduce_fp16(self, coll: Collective, x: np.ndarray, op: str, e: int) -> np.ndarray:
        n_ranks = self.world_size
        q = quantize(x, e)
        if x.nbytes <= SMALL_BYTES and n_ranks >= ROOTED_SMALL_MIN:  # the result travels as float16 too
            return dequantize(await self._rooted(coll, q, lambda b: fold_fp16(b, op, e, np.empty_like(q))), e)
        if n_ranks == 1 or x.nbytes <= SMALL_BYTES:
            bufs = np.empty((n_ranks, x.size), np.float16)
            bufs[self.rank] = q
            if n_ranks > 1:
                ranks = list(range(n_ranks))
                await self._direct_exchange(coll, q, _DIRECT, bufs, ranks, ranks)
            return dequantize(fold_fp16(bufs, op, e, np.empty(x.size, np.float16)), e)
        return await self._ring_fp16(coll, q, op, e)

    async def _ring_fp16(self, coll: Collective, q: np.ndarray, op: str, e: int) -> np.ndarray:
        """The pipelined ring all_reduce with float16 on the wire (psring.compress gives the rules)."""
        n_ranks, me = self.world_size, self.rank
        right_rank, left_rank = (me + 1) % n_ranks, (me - 1) % n_ranks
        chunk_pieces = [pieces(a, b, PIECE_BYTES // 2) for a, b in ring_chunk_bounds(q.size, n_ranks)]
        own = dequantize(q, e)  # what this rank contributes
        out = np.empty(q.size, np.float32)
        rs16, ag16 = np.empty_like(q), np.empty_like(q)  # partial sums in, final values in and out
        final_chunk = right_rank
        right = await self._link(right_rank)
        coll.waiting_on = {left_rank}
        ag_chunks = [c for c in range(n_ranks) if c != final_chunk]
        needed = sum(len(chunk_pieces[c]) for c in range(n_ranks) if c != me)
        needed += sum(len(chunk_pieces[c]) for c in ag_chunks)
        done, one_done = self._wait_piece(coll, needed)
        header = self._header

        def rs_arrived(c: int, j: int, a: int, b: int) -> Callable[..., None]:
            def cb(conn: Connection, hdr: dict[str, Any], payload: Any) -> None:
                if hdr["nbytes"] != 2 * (b - a):
                    raise ProtocolError(f"ring piece {c}.{j} from rank {left_rank} has {hdr['nbytes']} bytes")
                seg = out[a:b]
                dequantize(rs16[a:b], e, out=seg)
                np.add(seg, own[a:b], out=seg)
                if c != final_chunk:
                    right.send_tensor(header(coll, _RS, c, j), quantize(seg, e, out=rs16[a:b]))
                else:
                    if op == "avg":
                        finish_avg(seg, n_ranks)
                    dequantize(quantize(seg, e, out=ag16[a:b]), e, out=seg)
                    right.send_tensor(header(coll, _AG, c, j), ag16[a:b])
                one_done()

            return cb

        def ag_arrived(c: int, j: int, a: int, b: int) -> Callable[..., None]:
            forward = right_rank != (c - 1) % n_ranks

            def cb(conn: Connection, hdr: dict[str, Any], payload: Any) -> None:
                if hdr["nbytes"] != 2 * (b - a):
                    raise ProtocolError(f"ring piece {c}.{j} from rank {left_rank} has {hdr['nbytes']} bytes")
                dequantize(ag16[a:b], e, out=out[a:b])
                if forward:
                    right.send_tensor(header(coll, _AG, c, j), ag16[a:b])
                one_done()

            return cb

        post, gid, seq = self.mailbox.post, self.gid, coll.seq
        for c in range(n_ranks):
            if c != me:
                for j, (a, b) in enumerate(chunk_pieces[c]):
                    post((gid, seq, _RS, c, j), byte_view(rs16[a:b]), self._guard(coll, rs_arrived(c, j, a, b)))
        for c in ag_chunks:
            for j, (a, b) in enumerate(chunk_pieces[c]):
                post((gid, seq, _AG, c, j), byte_view(ag16[a:b]), self._guard(coll, ag_arrived(c, j, a, b)))
        for j, (a, b) in enumerate(chunk_pieces[me]):
            right.send_tensor(header(coll, _RS, me, j), q[a:b])
        await done
        await right.flush()
        return out

    async def _broadcast(self, coll: Collective, x: np.ndarray, src: int) -> np.ndarray:
        n_ranks, me = self.world_size, self.rank
        out = x.copy() if me == src else np.empty_like(x)
        if n_ranks == 1:
            return out
        if x.nbytes <= SMALL_BYTES:
            if me == src:
                await self._direct_exchange(coll, x, _BCAST, None, [], list(range(n_ranks)))
            else:
                await self._direct_exchange(coll, None, _BCAST, {src: out}, [src], [])
            return out
        # pipelined chain src -> src+1 -> ... -> src-1
        right_rank = (me + 1) % n_ranks
        forward = right_rank != src
        right = await self._link(right_rank) if (forward or me == src) else None
        per_piece = max(1, PIECE_BYTES // x.itemsize)
        parts = pieces(0, x.size, per_piece)
        if me == src:
            assert right is not None
            for j, (a, b) in enumerate(parts):
                right.send_tensor(self._header(coll, _BCAST, "p", j), x[a:b])
            await right.flush()
            return out
        done, one_done = self._wait_piece(coll, len(parts))
        coll.waiting_on = {(me - 1) % n_ranks}

        def arrived(a: int, b: int) -> Callable[..., None]:
            def cb(conn: Connection, hdr: dict[str, Any], payload: Any) -> None:
                if forward and right is not None:
                    right.send_tensor(self._header(coll, *hdr["tag"][2:]), out[a:b])
                one_done()

            return cb

        for j, (a, b) in enumerate(parts):
            self.mailbox.post(
                (self.gid, coll.seq, _BCAST, "p", j), byte_view(out[a:b]), self._guard(coll, arrived(a, b))
            )
        await done
        if right is not None:
            await right.flush()
        return out

    async def _recv_into(self, coll: Collective, tag: tuple[Any, ...], out: np.ndarray, src: int) -> None:
        done, one_done = self._wait_piece(coll, 1)
        coll.waiting_on = {src}

        def cb(conn: Connection, hdr: dict[str, Any], payload: Any) -> None:
            if hdr["nbytes"] != out.nbytes:
                raise ProtocolError(f"rank {src} sent {hdr['nbytes']} bytes, expected {out.nbytes}")
            if payload is not None and out.nbytes and not _same_memory(payload, out):
                out.reshape(-1).view(np.uint8)[:] = np.frombuffer(payload, np.uint8)
            one_done()

        self.mailbox.post(tag, byte_view(out) if out.nbytes else None, self._guard(coll, cb))
        await done

    async def _barrier(self, coll: Collective) -> None:
        n_ranks, me = self.world_size, self.rank
        ranks = list(range(n_ranks))
        if n_ranks >= ROOTED_SMALL_MIN:  # through a rotating root, as a small all_reduce: 2(N-1) frames
            root = coll.seq % n_ranks
            if me == root:
                await self._direct_exchange(coll, None, _DIRECT, None, ranks, [])
                await self._direct_exchange(coll, None, _RESULT, None, [], ranks)
            else:
                coll.report_grace = ROOT_REPORT_GRACE
                await self._direct_exchange(coll, None, _DIRECT, None, [root], [root], recv_phase=_RESULT)
        elif n_ranks > 1:
            await self._direct_exchange(coll, None, _DIRECT, None, ranks, ranks)

    async def _all_gather(self, coll: Collective, x: np.ndarray) -> np.ndarray:
        n_ranks, me = self.world_size, self.rank
        out = np.empty((n_ranks, x.size), x.dtype)
        out[me] = x
        if n_ranks == 1:
            return out
        ranks = list(range(n_ranks))
        if x.nbytes <= SMALL_BYTES:
            await self._direct_exchange(coll, x, _DIRECT, out, ranks, ranks)
            return out
        right_rank = (me + 1) % n_ranks
        right = await self._link(right_rank)
        per_piece = max(1, PIECE_BYTES // x.itemsize)
        parts = pieces(0, x.size, per_piece)
        done, one_done = self._wait_piece(coll, (n_ranks - 1) * len(parts))
        coll.waiting_on = {(me - 1) % n_ranks}

        def arrived(c: int, a: int, b: int) -> Callable[..., None]:
            forward = right_rank != c

            def cb(conn: Connection, hdr: dict[str, Any], payload: Any) -> None:
                if forward:
                    right.send_tensor(self._header(coll, _GATHER_RING, c, hdr["tag"][4]), out[c, a:b])
                one_done()

            return cb

        for c in ranks:
            if c == me:
                continue
            for j, (a, b) in enumerate(parts):
                self.mailbox.post(
                    (self.gid, coll.seq, _GATHER_RING, c, j),
                    byte_view(out[c, a:b]),
                    self._guard(coll, arrived(c, a, b)),
                )
        for j, (a, b) in enumerate(parts):
            right.send_tensor(self._header(coll, _GATHER_RING, me, j), x[a:b])
        await done
        await right.flush()
        return out

    async def _gather(self, coll: Collective, x: np.ndarray, dst: int) -> np.ndarray | None:
        n_ranks, me = self.world_size, self.rank
        if me == dst:
            out = np.empty((n_ranks, x.size), x.dtype)
            out[me] = x
            if n_ranks > 1:
                await self._direct_exchange(coll, None, _TO_ROOT, out, list(range(n_ranks)), [])
            return out
        await self._direct_exchange(coll, x, _TO_ROOT, None, [], [dst])
        return None

    async def _scatter(
        self, coll: Collective, xs: np.ndarray | None, src: int, meta: np.ndarray | None
    ) -> tuple[np.ndarray, tuple[str, tuple[int, ...]], str]:
        me = self.rank
        if me == src:
            assert xs is not None and meta is not None
            targets = [r for r in range(self.world_size) if r != me]
            conns = await self._links(targets)
            for r, conn in zip(targets, conns, strict=True):
                conn.send_tensor(self._header(coll, _SCATTER, 0), xs[r])
            await self._flush_all(list(conns))
            return xs[me].copy(), (str(meta.dtype), meta.shape), "cpu"
        coll.waiting_on = {src}
        fut = self.mailbox.expect((self.gid, coll.seq, _SCATTER, 0))
        try:
            _conn, hdr, payload = await fut
        finally:
            self.mailbox.unpost((self.gid, coll.seq, _SCATTER, 0))
        if "dtype" not in hdr:
            raise ProtocolError(f"scatter frame from rank {src} carries no array")
        y = wire.decode_tensor(hdr, payload)
        return y, (hdr["dtype"], tuple(hdr["shape"])), str(hdr.get("dev", "cpu"))

    async def _send(self, x: np.ndarray, dst: int, n: int, device: str) -> None:
        conn = await self._link(dst)
        conn.send_tensor({"kind": "data", "tag": (self.gid, "p2p", self.rank, n), "dev": device}, x)
        await conn.flush()


def _call_bytes(desc: tuple[Any, ...]) -> int:
    """The size of a collective's input, from its descriptor (the same on every rank)."""
    dtype, shape = desc[1], desc[2]
    if dtype is None:
        return 0
    return prod(shape) * DTYPES[dtype].itemsize


#: (op, dtype) pairs that passed Group.all_reduce's checks (a valid op for a supported dtype)
_VALID_OPS: set[tuple[str, np.dtype]] = set()


class _MeshSlot:
    """A receive posted on the same-host links: the ranks still to hear from, and where their
    payloads go (``row`` bytes each, at ``at`` in ``dest``, or at src * row when ``at`` is -1)."""

    __slots__ = ("at", "coll", "dest", "done", "expect", "row")

    def __init__(
        self, coll: Collective, dest: Any, row: int, at: int, expect: set[int], done: asyncio.Future[None]
    ) -> None:
        self.coll = coll
        self.dest = dest
        self.row = row
        self.at = at
        self.expect = expect
        self.done = done


def _same_memory(payload: Any, out: np.ndarray) -> bool:
    try:
        return np.shares_memory(np.frombuffer(payload, np.uint8), out)
    except (TypeError, ValueError):
        return False


# keep a reference for type checkers: StoreClient is the tcp store client
__all__ = ["PeerNet", "RingGroup", "StoreClient"]
