"""What a ring's ranks agree at set-up, through the store, so that every rank takes the same path for
the same call: every rank's address; the thresholds (the largest minimum, the smallest maximum: a path
only where every rank would take it), a piece size that differs named; the data plane's thresholds, or
no plane where a rank offers none; the host layout for two levels; the same-host Unix links and boards
only where every rank is on one host and mapped every other's; the TCP small-message links otherwise.
``freeze_paths`` fixes the outcome as the job's :class:`~psring.topology.ring.paths.RingPaths`.
"""

from __future__ import annotations

import collections
import logging
from typing import TYPE_CHECKING, Any

import msgpack

from ...core.fold import host_layout
from ...errors import CollectiveTimeoutError, MismatchError, StoreError
from ...transport.samehost import host_key
from .paths import NEVER, RingPaths

if TYPE_CHECKING:
    from .net import PeerNet

logger = logging.getLogger(__name__)


async def agree_paths(net: PeerNet) -> None:
    """The same path on every rank: thresholds are agreed (the largest, so a path is taken only
    when every rank would take it); a piece size that differs is named, since no value is right."""
    offers: dict[int, dict[str, int]] = {}
    for r in range(net.world_size):
        raw = await net.store.get(f"{net.prefix}/paths/{r}")
        try:
            offer = msgpack.unpackb(raw) if raw else None
        except (TypeError, ValueError):
            offer = None
        if isinstance(offer, dict):
            offers[r] = offer
    rooted = [o.get("PSRING_RING_ROOTED_MIN") or NEVER for o in offers.values()]
    net.rooted_min = max([*rooted, net.rooted_min])
    tcp_mesh = [o.get("PSRING_RING_TCP_MESH") for o in offers.values()]  # a rank that has none: never
    net.small.tcp_max = min(v if type(v) is int else 0 for v in [*tcp_mesh, net.small.tcp_max])
    two_hop = [o.get("PSRING_RING_TWO_HOP") for o in offers.values()]  # a rank that has none: never
    net.two_hop_max = min(v if type(v) is int and v > 0 else 0 for v in [*two_hop, net.two_hop_max])
    two_hop_min = [o.get("PSRING_RING_TWO_HOP_MIN") for o in offers.values()]
    net.two_hop_min = max(v if type(v) is int and v > 0 else NEVER for v in [*two_hop_min, net.two_hop_min])
    if len(offers) < net.world_size:
        net.small.tcp_max = net.two_hop_max = 0
    for name in ("PSRING_RING_PIECE", "PSRING_RING_PLANE_PIECE"):
        values = {r: o.get(name) for r, o in offers.items()}
        if len(set(values.values())) > 1:
            mine = values.get(net.rank)
            others = ", ".join(f"rank {r} has {v}" for r, v in sorted(values.items()) if v != mine)
            raise MismatchError(
                f"rank {net.rank}: {name} differs across the ranks of job {net.settings.job!r}: "
                f"rank {net.rank} has {mine}, {others}; set it to the same value for every rank"
            )


def freeze_paths(net: PeerNet) -> None:
    """Fix the thresholds the ranks agreed (resolve) and the links they opened as this job's RingPaths."""
    net.paths = RingPaths(
        # with the TCP small-message links every rank sends to every other (ring.tcpdirect): one hop, not two
        rooted_min=net.rooted_min if net.small.tcp is None else NEVER,
        plane_min=net.plane_min if net.plane is not None else NEVER,
        hierarchical=net.hosts is not None,
        two_hop_min=net.two_hop_min,
        two_hop_max=net.two_hop_max if net.small.tcp is not None else 0,
    )


async def resolve(net: PeerNet, timeout: float) -> None:
    """Every rank's address, and what the ranks agree: the thresholds, the data plane's, the host
    layout, the same-host links and boards, the TCP small-message links (the same answers on every rank)."""
    keys = [f"{net.prefix}/addr/{r}" for r in range(net.world_size)]
    try:
        await net.store.wait(keys, timeout)
    except StoreError:
        present = [r for r in range(net.world_size) if await net.store.get(keys[r]) is not None]
        missing = sorted(set(range(net.world_size)) - set(present))
        raise CollectiveTimeoutError(
            f"rendezvous: rank(s) {missing} did not join within {timeout:g}s "
            f"({len(present)} of {net.world_size} ranks joined at {net.store.address})",
            missing=tuple(missing),
        ) from None
    for r in range(net.world_size):
        raw = await net.store.get(keys[r])
        assert raw is not None
        host, _, port = raw.decode().rpartition(":")
        net.addresses[r] = (host, int(port))
    await agree_paths(net)
    shm_min = tcp_min = native_min = NEVER
    if net.plane is not None:  # every rank must take the same path: the plane only if all can
        offers: list[tuple[int, int, int]] = []
        natives: list[int] = []
        for r in range(net.world_size):
            text = (await net.store.get(f"{net.prefix}/plane/{r}") or b"-1").decode()
            try:
                parts = [int(p) for p in text.split("/")]
                plane = parts[0]  # plane/shm/tcp; a rank that offers one number offers it for all three
                offers.append((plane, parts[1] if len(parts) > 1 else plane, parts[2] if len(parts) > 2 else plane))
                natives.append(parts[3] if len(parts) > 3 else 0)  # 0: its jobs do not run in C
            except ValueError:
                offers.append((-1, -1, -1))
                natives.append(0)
        if min(natives) >= 1:  # the lower threshold only where every rank runs the plane in C
            native_min = max(natives)
        if any(min(o) < 1 for o in offers):
            without = [r for r, o in enumerate(offers) if min(o) < 1]
            logger.info("rank(s) %s run without the threaded data plane: all_reduce stays on asyncio", without)
            net.plane = None
        else:  # the same threshold on every rank, or they would take different paths
            net.plane_min = max(o[0] for o in offers)
            shm_min = max(o[1] for o in offers)
            tcp_min = max(o[2] for o in offers)
    await agree_hierarchy(net)
    if net.small.unix is not None:  # likewise: Unix links only if every rank is on this host and offers them
        peers: dict[int, dict[str, Any]] = {}
        mine = host_key()
        for r in range(net.world_size):
            raw = await net.store.get(f"{net.prefix}/unix/{r}")
            try:
                info = msgpack.unpackb(raw) if raw and raw != b"-" else None
            except Exception:  # a peer's bytes: any failure = no info
                info = None
            if isinstance(info, dict) and info.get("key") == mine:
                peers[r] = info
        if len(peers) == net.world_size:
            net.small.peers = {r: info for r, info in peers.items() if r != net.rank}
            if net.world_size >= 3:  # the plane's links will be shared memory (see PSRING_RING_SHM_MIN)
                net.plane_min = min(net.plane_min, shm_min)
        else:
            others = sorted(set(range(net.world_size)) - set(peers))
            logger.info("rank(s) %s are on another host or run without Unix links: small messages use TCP", others)
            net.small.drop_unix()
    if net.small.unix is None and net.plane is not None:  # TCP links (see the settings)
        if net.world_size >= 4:
            net.plane_min = min(net.plane_min, tcp_min)
        net.plane_min = min(net.plane_min, native_min)
    await agree_board(net, timeout)
    if net.small.tcp is not None and (net.small.unix is not None or net.world_size > net.small.tcp_max):
        net.small.drop_tcp()  # the same answer on every rank: one host (Unix links), or a rank said no


async def agree_board(net: PeerNet, timeout: float) -> None:
    """Small all_reduces go through the boards only if every rank mapped every other's (the
    same answer on every rank, or some would post where others wait on the links); up to the
    smallest board's room (each rank's limit is that already, from the boards it mapped)."""
    board = net.board
    ok = False
    if board is not None and net.small.unix is not None:
        try:
            board.attach({r: info.get("board") for r, info in net.small.peers.items()})
            ok = True
        except (OSError, ValueError) as exc:
            logger.info("rank %d: cannot map a peer's same-host board (%s)", net.rank, exc)
    await net.store.set(f"{net.prefix}/board/{net.rank}", str(board.limit if ok and board else 0).encode())
    keys = [f"{net.prefix}/board/{r}" for r in range(net.world_size)]
    try:
        await net.store.wait(keys, timeout)
    except StoreError:
        raise CollectiveTimeoutError(
            f"rendezvous: not every rank said within {timeout:g}s whether it can use the same-host board"
        ) from None
    for key in keys:
        try:
            room = int(await net.store.get(key) or b"0")
        except ValueError:
            room = 0
        if room < 1:
            ok = False
    if not ok and board is not None:
        board.close()
        net.board = None


async def agree_hierarchy(net: PeerNet) -> None:
    """Whether all_reduce goes hierarchical, the same answer on every rank: only if no rank turned
    it off and the ranks' hosts make a layout for it (several hosts, as many ranks on each)."""
    keys: list[str | None] = []
    modes: set[str] = set()
    for r in range(net.world_size):
        try:
            key, mode = msgpack.unpackb(await net.store.get(f"{net.prefix}/host/{r}") or b"\xc0")
        except (TypeError, ValueError):
            key, mode = None, "off"  # a rank of another version: it folds in the flat order only
        keys.append(key if isinstance(key, str) else None)
        modes.add(str(mode))
    layout = host_layout(keys)
    if "off" in modes:
        if layout is not None and net.rank == 0:
            logger.info("ranks on %d hosts, but PSRING_HIERARCHICAL=off: all_reduce stays a flat ring", len(layout))
        return
    if layout is None and "on" in modes and net.rank == 0 and net.world_size > 1:
        counts = sorted(collections.Counter(keys).values())
        logger.warning(
            "PSRING_HIERARCHICAL=on, but the ranks' hosts hold %s ranks: hierarchical all_reduce needs two "
            "hosts or more with the same number (two or more) on each; all_reduce stays a flat ring",
            counts,
        )
    net.hosts = layout
