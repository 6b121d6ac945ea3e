"""A ring rank's endpoint: one listening port, links to the other ranks, one mailbox, and what
happens when a rank is lost."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, ClassVar

import msgpack

from ...core.fold import Layout
from ...errors import PeerLostError, ProtocolError, PsringError
from ...rendezvous.scheduler import GroupSettings
from ...rendezvous.store import StoreServer
from ...settings import Settings
from ...transport.connection import Connection
from ...transport.listener import Listener, open_connection
from ...transport.mailbox import Mailbox
from ...transport.samehost import host_key
from ...transport.shmboard import Board, board_possible
from ..group import farewell
from ..stall import StallInspector
from . import frames
from .paths import NEVER, RingPaths
from .plane.dataplane import DataPlane
from .plane.links import PlaneLinks
from .smalllinks import SmallLinks

logger = logging.getLogger(__name__)


def plane_possible(settings: Settings) -> bool:
    """Whether this process can run the threaded data plane (plain TCP, no per-frame checksums)."""
    # a TLS stream cannot leave its transport
    return settings.ring_threads and not settings.tls and settings.checksum is None


class PeerNet:
    """This process's rank endpoint: one listening port, links to other ranks, one mailbox."""

    #: ranks open in this process (tests run several in one event loop)
    live: ClassVar[int] = 0

    def __init__(self, rank: int, world_size: int, settings: GroupSettings, store: Any, prefix: str) -> None:
        self.rank = rank
        self.world_size = world_size
        self.settings = settings
        self.config = settings.config
        #: from this world size on, small calls go through a rotating root (PSRING_RING_ROOTED_MIN)
        self.rooted_min = settings.config.ring_rooted_min or NEVER
        #: what every rank decides paths by (ring.paths), frozen once set-up agreed it (ring.agree.freeze_paths)
        self.paths = RingPaths(rooted_min=self.rooted_min)
        self.store = store
        self.prefix = prefix
        self._counted = False
        self.mailbox = Mailbox()
        try:  # the loop this rank runs on (other threads hand it work: the board's caller-thread path)
            self.loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self.loop = None
        self.mailbox.on_lost = self._on_conn_lost
        self.mailbox.on_control = self._on_control
        self.links: dict[int, Connection] = {}
        self.conns: set[Connection] = set()
        self.groups: dict[str, Any] = {}  # gid -> RingGroup
        self.stopped_at: dict[str, int] = {}  # per group: the first seq this rank did not finish
        self.addresses: dict[int, tuple[str, int]] = {}
        self.lost: dict[int, PeerLostError] = {}
        self._dialing: dict[int, asyncio.Future[Connection]] = {}
        self._seen_controls: set[tuple[Any, ...]] = set()
        self.closing = False
        self.listener: Listener | None = None
        self.embedded_store: StoreServer | None = None
        self.plane: DataPlane | None = None
        self.plane_min = NEVER  # all_reduces of this many bytes or more take the plane (agreed in resolve)
        self.plane_offer = max(self.config.ring_plane_min, 1)  # this rank's own threshold, published for that
        self.plane_shm_offer = max(min(self.config.ring_shm_plane_min, self.plane_offer), 1)  # the same, on one host
        self.plane_tcp_offer = max(min(self.config.ring_tcp_plane_min, self.plane_offer), 1)  # 4+ ranks over TCP
        self.plane_native_offer = 0  # the same, over TCP at any number of ranks, where this rank's jobs run in C
        if world_size > 1 and plane_possible(self.config):
            self.plane = DataPlane(
                rank,
                world_size,
                native=self.config.native,
                send_thread=self.config.ring_send_thread,
                send_thread_buf=self.config.ring_send_thread_buf,
            )
            self.plane.recv_ready = asyncio.Event()
            if self.plane.native is not None:
                self.plane_native_offer = max(min(self.config.ring_native_plane_min, self.plane_offer), 1)
        #: the plane's two data links and their shared memory (set up in open, with the group)
        self.plane_links = PlaneLinks(self)
        #: links for small messages, one to each other rank (same-host Unix, or TCP between hosts)
        self.small = SmallLinks(self)
        #: the same-host posting board for small all_reduces (psring.transport.shmboard), when every rank has one
        self.board: Board | None = None
        #: this rank's PSRING_RING_TWO_HOP, then the one every rank agreed (ring.agree.agree_paths: the smallest)
        self.two_hop_max = self.config.ring_two_hop
        self.two_hop_min = max(self.config.ring_two_hop_min, 1)
        #: the hosts, when all_reduce goes hierarchical (agreed in resolve; see core.fold.host_layout)
        self.hosts: Layout | None = None
        self.mailbox.on_stray = self._on_stray
        self.stalls = StallInspector(self, self._stall_send)
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
            settings=self.config,
        )
        await self.listener.start(self.settings.bind_host, self.settings.port)
        offer = (
            f"{self.plane_offer}/{self.plane_shm_offer}/{self.plane_tcp_offer}/{self.plane_native_offer}"
            if self.plane is not None
            else "-1"
        )
        await self.store.set(f"{self.prefix}/plane/{self.rank}", offer.encode())
        unix = b"-"
        if self.small.unix is not None:
            try:
                record = self.small.unix.bind()
            except OSError as exc:
                logger.info("rank %d: no same-host Unix links (%s): small messages go over TCP", self.rank, exc)
                self.small.drop_unix()
            else:
                if board_possible() and self.config.ring_board > 0:
                    try:
                        config = self.config
                        self.board = Board(config.ring_board, native=config.native, stream=config.ring_stream)
                        record["board"] = self.board.describe()
                    except OSError as exc:
                        logger.info("rank %d: no same-host board (%s): small all_reduces use the links", self.rank, exc)
                        self.board = None
                unix = msgpack.packb(record)
        await self.store.set(f"{self.prefix}/unix/{self.rank}", unix)
        await self.store.set(f"{self.prefix}/paths/{self.rank}", msgpack.packb(self.path_settings()))
        where = [self.config.host_id or host_key(), self.config.hierarchical]
        await self.store.set(f"{self.prefix}/host/{self.rank}", msgpack.packb(where))
        address = f"{self.settings.advertise_host}:{self.listener.port}"
        await self.store.set(f"{self.prefix}/addr/{self.rank}", address.encode())

    def path_settings(self) -> dict[str, int]:
        """This rank's settings that decide which path a call takes or how it is cut into frames:
        ranks that differ would wait on frames the others never send (agreed in ring.agree.resolve)."""
        return {
            "PSRING_RING_ROOTED_MIN": self.config.ring_rooted_min,
            "PSRING_RING_PIECE": self.config.ring_piece,
            "PSRING_RING_PLANE_PIECE": self.config.ring_plane_piece,
            "PSRING_RING_TCP_MESH": self.small.tcp_max,
            "PSRING_RING_TWO_HOP": self.two_hop_max,
            "PSRING_RING_TWO_HOP_MIN": self.two_hop_min,
        }

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
        if conn.peer.get("data") == "mesh":
            self.small.accept(conn, peer_rank)
            return
        if conn.peer.get("data"):
            self.plane_links.accept(conn, peer_rank)
            return
        self._register(conn, peer_rank)

    async def dial(self, rank: int, timeout: float, *, data: bool | str = False) -> Connection:
        """Open an authenticated connection to ``rank`` (a data link for the plane with ``data``, or
        with ``data="mesh"`` a small-message link: no router, detached by the caller) and check that
        rank answered; a wrong answer is a ProtocolError."""
        host, port = self.addresses[rank]
        conn = await open_connection(
            host,
            port,
            secret=self.settings.secret,
            hello={**self.hello(), "data": 1 if data is True else data} if data else self.hello(),
            router=None if data else self.mailbox,
            timeout=timeout,
            name=f"rank {self.rank} data" if data else f"rank {self.rank}",
            settings=self.config,
        )
        if conn.peer.get("rank") != rank:
            conn.abort(ProtocolError("wrong peer"))
            raise ProtocolError(f"{host}:{port} answered as rank {conn.peer.get('rank')}, expected rank {rank}")
        return conn

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
            conn = await self.dial(rank, timeout)
            self._register(conn, rank)
            fut.set_result(conn)
            return conn
        except BaseException as exc:  # every failure, cancellation too, goes to the dial's waiters
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
        if self.closing or type(peer_rank) is not int:
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
                self.peer_lost(peer_rank, err)
            else:
                self.lost.setdefault(peer_rank, err)
            return
        err = PeerLostError(
            f"rank {peer_rank} at {conn.peername} was lost (last heard {ago:.1f}s ago): {error}", rank=peer_rank
        )
        err.__cause__ = error
        self.peer_lost(peer_rank, err)

    def peer_lost(self, peer_rank: int, err: PeerLostError) -> None:
        if peer_rank in self.lost:
            return
        self.lost[peer_rank] = err
        mesh = self.small.active
        if mesh is not None:  # what it sent on its small-message link before it went is in the kernel
            with contextlib.suppress(PsringError):
                mesh.catch_up(peer_rank)
        for group in list(self.groups.values()):
            if peer_rank in group.members:
                group.on_peer_lost(err)
        self.flood(frames.lost(peer_rank, str(err)))

    def flood(self, header: dict[str, Any]) -> None:
        """Send a control frame over every open link (receivers forward it once)."""
        key = (header["reason"], header["tag"][0], header["tag"][1], header.get("lost"))
        self._seen_controls.add(key)
        for conn in list(self.conns):
            if conn.is_open:
                with contextlib.suppress(PsringError):
                    conn.send_frame(dict(header))

    async def _stall_send(self, ranks: list[int], frame: dict[str, Any]) -> None:
        """A stall frame to each of ranks, on a link of its own (dialed now if there is none)."""

        async def one(rank: int) -> None:
            with contextlib.suppress(PsringError, OSError):
                conn = await self.link(rank, min(self.settings.timeout, 5.0))
                conn.send_frame(dict(frame))

        await asyncio.gather(*(one(r) for r in ranks))

    def _on_stray(self, conn: Connection, header: dict[str, Any]) -> bool:
        """A data frame for a collective this rank is not in (see Group.on_stray)."""
        tag = header["tag"]
        group = self.groups.get(tag[0])
        if group is None or type(tag[1]) is not int:
            return True
        return bool(group.on_stray(tag[1], header.get("call"), header.get("src")))

    def _on_control(self, conn: Connection, header: dict[str, Any], payload: Any) -> bool:
        if header["kind"] == "stall":
            self.stalls.on_frame(conn, header)
            return True
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
                self.peer_lost(lost, PeerLostError(message, rank=lost))
            return True
        self.flood(dict(header))
        group = self.groups.get(tag[0])
        if group is not None and type(tag[1]) is int:
            group.on_abort(tag[1], reason, message)
        return True

    async def close(self) -> None:
        self.closing = True
        await self.stalls.close()
        if self._counted:
            self._counted = False
            PeerNet.live -= 1
        goodbye = farewell(self.groups, self.stopped_at)
        conns = list(self.conns)
        await asyncio.gather(*(c.close(farewell=goodbye) for c in conns), return_exceptions=True)
        if self.plane is not None:
            self.plane.close()
        self.small.close()
        if self.board is not None:
            self.board.close()
        if self.listener is not None:
            await self.listener.close()
        with contextlib.suppress(Exception):  # cleanup: a close may fail any way (the peer is gone)
            await self.store.close()
        if self.embedded_store is not None:
            await self.embedded_store.close()

    def stats(self) -> dict[str, int]:
        plane = self.plane
        mesh_sent, mesh_received = self.small.stats()
        if self.board is not None:  # a post is sent once; every peer reads it
            mesh_sent += self.board.bytes_posted
            mesh_received += self.board.bytes_read
        return {
            "bytes_sent": sum(c.bytes_sent for c in self._all_conns()) + (plane.bytes_sent if plane else 0) + mesh_sent,
            "bytes_received": sum(c.bytes_received for c in self._all_conns())
            + (plane.bytes_received if plane else 0)
            + mesh_received,
        }

    def link_stats(self) -> dict[str, list[int]]:
        """Bytes [sent, received] per link: each peer's TCP or Unix connections, the host's shared
        memory plane, Unix mesh and boards (the same-host paths) apart."""
        out: dict[str, list[int]] = {}
        for c in self._all_conns():
            rank = c.peer.get("rank")
            name = f"rank {rank}" if type(rank) is int else "other"
            pair = out.setdefault(name, [0, 0])
            pair[0] += c.bytes_sent
            pair[1] += c.bytes_received
        self.small.link_stats(out)
        if self.plane is not None:  # its pieces through shared memory where it has a pool, else over its TCP pair
            shm = self.plane.shm_out is not None or self.plane.shm_in is not None
            out["shared memory" if shm else "data plane (TCP)"] = [self.plane.bytes_sent, self.plane.bytes_received]
        if self.board is not None:
            out["shared-memory board"] = [self.board.bytes_posted, self.board.bytes_read]
        return out

    def _all_conns(self) -> list[Connection]:
        seen = set(self.conns)
        if self.listener is not None:
            seen |= self.listener.connections
        return list(seen)
