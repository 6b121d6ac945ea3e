"""A ring rank's links for small messages, one to each other rank: same-host Unix links
(transport.unixmesh) when every rank is on this host, else TCP links of their own (transport.tcpmesh)
for jobs of up to PSRING_RING_TCP_MESH ranks; what set-up agreed keeps one kind or neither
(ring.agree). A message for a subgroup not made here yet waits for it; a link that ends is reported
as its peer's loss when the control link has not said why first."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

from ...errors import CollectiveTimeoutError, PeerLostError, ProtocolError
from ...rendezvous.scheduler import GroupSettings
from ...settings import Settings
from ...transport.connection import Connection
from ...transport.samehost import same_host_paths
from ...transport.tcpmesh import TcpMesh
from ...transport.unixmesh import UnixMesh
from .constants import MESH_EARLY_MAX, PLANE_GRACE

logger = logging.getLogger(__name__)


class Endpoint(Protocol):
    """What the small-message links need of the rank's endpoint (ring.net.PeerNet)."""

    rank: int
    world_size: int
    settings: GroupSettings
    config: Settings
    #: gid -> the group (its ``on_mesh``, ``on_mesh_closed``)
    groups: dict[str, Any]
    closing: bool
    lost: dict[int, PeerLostError]

    async def dial(self, rank: int, timeout: float, *, data: bool | str = False) -> Connection: ...

    def peer_lost(self, peer_rank: int, err: PeerLostError) -> None: ...


def tcp_mesh_possible(settings: Settings) -> bool:
    """Whether this process offers TCP small-message links (a detached socket: plain TCP, no per-frame
    checksums, as the data plane's)."""
    return settings.ring_tcp_mesh > 0 and not settings.tls and settings.checksum is None


def mesh_possible(settings: Settings) -> bool:
    """Whether this process offers same-host Unix links (PSRING_SAME_HOST, no per-frame checksums:
    a user who asked for them gets them on every byte)."""
    return same_host_paths(settings) and settings.checksum is None


class SmallLinks:
    """A rank's small-message links: ``unix`` (same host) or ``tcp`` (between hosts), ``active`` the one
    kept. Held by the rank's endpoint (ring.net.PeerNet) as ``net.small``; its groups take their
    messages (``group.on_mesh``), its loss handling hears of a link that ended."""

    def __init__(self, net: Endpoint) -> None:
        self.net = net
        self.rank = net.rank
        self.world_size = net.world_size
        config = net.config
        #: same-host Unix links, when every rank can use them (bound in PeerNet.start, agreed in resolve)
        self.unix: UnixMesh | None = None
        #: the other ranks' Unix link records (their pid, paths, board), as the store had them
        self.peers: dict[int, dict[str, Any]] = {}
        #: messages for subgroups this rank has not made yet, per gid (the group takes them when made)
        self.orphans: dict[str, list[tuple[int, tuple[Any, ...], bytes]]] = {}
        if net.world_size > 1 and mesh_possible(config):
            self.unix = UnixMesh(net.rank, net.settings.job, self._on_message, self._on_closed)
        #: this rank's PSRING_RING_TCP_MESH, then the one every rank agreed (ring.agree: the smallest)
        self.tcp_max = config.ring_tcp_mesh if tcp_mesh_possible(config) else 0
        self.tcp: TcpMesh | None = None
        if 2 <= net.world_size <= self.tcp_max:  # made now: a lower rank may dial before this one agreed
            self.tcp = TcpMesh(net.rank, net.world_size - 1, self._on_message, self._on_closed, native=config.native)

    @property
    def active(self) -> UnixMesh | TcpMesh | None:
        """The links one-hop messages take: the same-host Unix links, or the TCP ones between hosts."""
        return self.unix if self.unix is not None else self.tcp

    async def open(self, timeout: float) -> None:
        """Open the kind that set-up kept (each link checked: a Unix one by its pid, a TCP one
        authenticated as any connection)."""
        if self.unix is not None:
            await self.unix.connect(self.peers, timeout)
        if self.tcp is not None:
            await self._open_tcp(self.tcp, timeout)

    async def _open_tcp(self, mesh: TcpMesh, timeout: float) -> None:
        """Dial the link to every higher rank, wait for the lower ranks' (each taken out of the event loop)."""

        async def dial(r: int) -> None:
            # out of the event loop as soon as it is open: a connection left there while another dial
            # takes longer (a lost SYN is retried after 1 s) pings, and the peer, which took its end
            # out at once, would read the ping as a message
            conn = await self.net.dial(r, timeout, data="mesh")
            mesh.add(r, conn.detach())

        await asyncio.gather(*(dial(r) for r in range(self.rank + 1, self.world_size)))
        try:
            async with asyncio.timeout(timeout):
                await mesh.all_in.wait()
        except TimeoutError:
            missing = sorted(set(range(self.rank)) - set(mesh.links))
            raise CollectiveTimeoutError(
                f"rank(s) {missing} did not open their small-message links to rank {self.rank} within {timeout:g}s",
                missing=tuple(missing),
            ) from None

    def accept(self, conn: Connection, peer_rank: int) -> None:
        """A lower rank dialed its TCP small-message link to this one."""
        mesh = self.tcp
        if mesh is None or peer_rank >= self.rank:
            raise ProtocolError(
                f"rank {peer_rank} offered a small-message link to rank {self.rank}: only lower ranks may, "
                "and only when every rank agreed to them"
            )
        mesh.add(peer_rank, conn.detach())

    def _on_message(self, peer: int, head: tuple[Any, ...], payload: memoryview) -> None:
        gid = head[0]
        group = self.net.groups.get(gid)
        if group is not None:
            group.on_mesh(peer, head[1], head[2], head[3], payload)
            return
        orphans = self.orphans.setdefault(gid, [])  # its subgroup is not made here yet
        if len(orphans) >= MESH_EARLY_MAX:
            raise ProtocolError(f"over {MESH_EARLY_MAX} messages for subgroup {gid!r}, which this rank never made")
        orphans.append((peer, head, bytes(payload)))

    def _on_closed(self, peer: int, error: BaseException | None) -> None:
        """A small-message link ended. Everything the peer sent before it has been read, so a
        collective still waiting on the peer will not get its data. The control link usually
        says why (a goodbye, a crash) at once; if it has not after PLANE_GRACE, report this."""
        net = self.net

        def check() -> None:
            if net.closing:
                return
            gone = net.lost.get(peer)
            if gone is None:
                how = f"broke: {error}" if error is not None else "closed"
                kind = "same-host" if self.unix is not None else "small-message"
                net.peer_lost(peer, PeerLostError(f"the {kind} link from rank {peer} {how}", rank=peer))
                return
            for group in list(net.groups.values()):
                if peer in group.members:
                    group.on_mesh_closed(group.members.index(peer), gone)

        if not net.closing:
            asyncio.get_running_loop().call_later(0 if peer in net.lost else PLANE_GRACE, check)

    def drop_unix(self) -> None:
        """Set-up found the Unix links unusable here or on another rank: small messages go over TCP."""
        if self.unix is not None:
            self.unix.close()
            self.unix = None

    def drop_tcp(self) -> None:
        """Set-up kept no TCP links (one host, or a rank offered none, or too many ranks)."""
        if self.tcp is not None:
            self.tcp.close()
            self.tcp = None

    def close(self) -> None:
        self.drop_unix()
        self.drop_tcp()

    def stats(self) -> tuple[int, int]:
        """Bytes (sent, received) over both kinds."""
        sent, received = self.unix.stats() if self.unix is not None else (0, 0)
        if self.tcp is not None:
            tcp_sent, tcp_received = self.tcp.stats()
            sent += tcp_sent
            received += tcp_received
        return sent, received

    def link_stats(self, out: dict[str, list[int]]) -> None:
        """Add bytes [sent, received] to ``out``: a TCP link counted with its rank's connections, the
        Unix links apart."""
        if self.tcp is not None:
            for rank, link in self.tcp.links.items():
                pair = out.setdefault(f"rank {rank}", [0, 0])
                pair[0] += link.bytes_sent
                pair[1] += link.bytes_received
        if self.unix is not None:
            out["unix mesh"] = list(self.unix.stats())
